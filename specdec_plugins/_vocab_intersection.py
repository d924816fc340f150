"""The token-level intersection of two vocabularies: draft tokens whose string is one target token.

Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies" (ICML 2025), token-level intersection (TLI), as transformers 5.24 builds it
(``transformers/generation/candidate_generator.py``, ``AssistantToTargetTranslator._get_assistant_to_target_input_ids``
and ``get_target_logits``): a draft token belongs to the intersection where its vocabulary string, its space marker
written as the target's (``Ġ`` and ``▁``), is a string of the target's vocabulary; the draft's logits are laid over
the target's vocabulary at those ids, -inf elsewhere. Two things differ from transformers, and neither changes a law
the verifier is told: the map is one-to-one (a second draft string of one target token is left out, so that a target
token names one draft id to read back), and the draft's end-of-sequence token stands for the target's where their
strings differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class VocabularyIntersection:
    """Draft ids and the target ids they stand for, one to one."""

    draft_ids: torch.Tensor
    """int64 ``[I]``, on the draft model's device: the draft tokens of the intersection."""
    target_ids: torch.Tensor
    """int64 ``[I]``, on the draft model's device: the target token each of them stands for (all different, all below
    the laws' V)."""
    draft_of_target: dict[int, int]
    """Target id → the draft id that stands for it: how a committed target token is read back."""
    draft_by_target: torch.Tensor
    """int64 ``[V]``, on the block's device: the same, 0 for a target id outside the intersection (never drawn: its
    law is 0)."""
    vocab_size: int
    """V: the laws' vocabulary."""

    @classmethod
    def build(
        cls,
        target_tokenizer: Any,
        draft_tokenizer: Any,
        vocab_size: int,
        draft_vocab_size: int,
        draft_device: torch.device,
        device: torch.device,
    ) -> VocabularyIntersection:
        """The intersection of the draft's first ``draft_vocab_size`` ids (its logits) with the target's first
        ``vocab_size`` (the laws' V); ``draft_by_target`` on the block's ``device``."""
        target_vocab = target_tokenizer.get_vocab()
        marker, draft_marker = _space_marker(target_tokenizer), _space_marker(draft_tokenizer)
        pairs: dict[int, int] = {}  # target id → draft id
        for string, draft_id in sorted(draft_tokenizer.get_vocab().items(), key=lambda item: item[1]):
            if draft_marker and marker and draft_marker != marker and string.startswith(draft_marker):
                string = marker + string[len(draft_marker) :]
            target_id = target_vocab.get(string)
            if target_id is not None and target_id < vocab_size and draft_id < draft_vocab_size:
                pairs.setdefault(target_id, draft_id)
        target_eos, draft_eos = target_tokenizer.eos_token_id, draft_tokenizer.eos_token_id
        if None not in (target_eos, draft_eos) and target_eos < vocab_size and draft_eos not in pairs.values():
            pairs.setdefault(target_eos, draft_eos)
        targets = sorted(pairs)
        draft_by_target = torch.zeros(vocab_size, dtype=torch.long)  # [V]
        draft_by_target[targets] = torch.tensor([pairs[t] for t in targets], dtype=torch.long)
        return cls(
            torch.tensor([pairs[t] for t in targets], dtype=torch.long, device=draft_device),
            torch.tensor(targets, dtype=torch.long, device=draft_device),
            pairs,
            draft_by_target.to(device),
            vocab_size,
        )

    def __len__(self) -> int:
        return len(self.draft_of_target)

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V_draft]`` laid over the target's vocabulary → ``[..., V]``, -inf outside the
        intersection: their softmax is the draft's law restricted to the intersection and renormalised."""
        logits = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        logits[..., self.target_ids] = draft_logits[..., self.draft_ids]
        return logits


def _space_marker(tokenizer: Any) -> str:
    """The character a tokenizer's vocabulary writes a leading space as (``Ġ``, ``▁``), or "" where a space encodes
    to no token (a whitespace-splitting tokenizer): transformers' ``space_sign``."""
    ids = tokenizer(" ", add_special_tokens=False).input_ids
    return tokenizer.convert_ids_to_tokens(ids)[0][:1] if ids else ""
