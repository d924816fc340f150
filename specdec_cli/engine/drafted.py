"""A step's draft rows for every sequence of a batch, and what the step's one device read folds in from them.

The engine asks every drafter for every sequence (:class:`~specdec_cli.drafting.Proposal`, leading dimension B) and
puts their rows side by side (:class:`Drafted`): sequence b's block is as long as its shortest non-empty proposal,
and rows whose drafter proposed nothing for it leave its block. After the verifier's decision, :func:`count_to_eos`
and :func:`longest_matches` say on the device how many tokens each block commits and which row of each drafter
agrees longest with them, so that one read gives the host everything it needs to commit and crop the caches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..plugins.drafting import Proposal, empty_proposal
from ..plugins.verifiers import BatchDecision
from .session import pad_to


@dataclass
class Drafted:
    """A step's draft rows for every sequence: all drafters' rows side by side, cut to each sequence's length."""

    tokens: torch.Tensor  # [B, K, n]: every drafter's rows (filler where a drafter proposed nothing or less)
    laws: torch.Tensor  # [B, K, n, V]
    finite: torch.Tensor  # [drafters] bool: each drafter's laws came from finite logits
    in_vocab: torch.Tensor  # [drafters] bool: each drafter's tokens are ids of the vocabulary
    lengths: list[int]  # [B]: each sequence's block length
    present: list[tuple[int, ...]]  # [B]: the rows (of K) whose drafter proposed for the sequence
    proposed: list[list[bool]]  # [drafters][B]: the drafter proposed something for the sequence
    judged: torch.Tensor | None = None  # [B, K, n, V]: the laws the verifier judges drafts by, where it asked

    @classmethod
    def of(
        cls, proposals: list[Proposal], batch: int, vocab_size: int, device: torch.device, judged: bool = False
    ) -> Drafted:
        """The rows of every drafter's proposal. A sequence's block is as long as its shortest non-empty proposal,
        and the step's tensors as long as its longest block. Token ids outside the vocabulary are told by
        ``in_vocab`` in the step's read and clamped until then: on a GPU such an id in the target's embedding is a
        device-side assert, which no message could follow. ``judged``: the verifier judges drafts by other laws,
        which the sampling drafters reported (:attr:`Proposal.judged_laws`) and a deterministic one's one-hot laws
        stand for."""
        lengths = [min((p.lengths[b] for p in proposals if p.lengths[b]), default=0) for b in range(batch)]  # [B]
        width = max(lengths, default=0)
        blocks = proposals or [empty_proposal(batch, 1, vocab_size, device)]  # the target alone: an empty row
        tokens = torch.cat([pad_to(p.tokens[:, :, :width], width, 2) for p in blocks], 1)  # [B, K, n]
        laws = torch.cat([pad_to(p.laws[:, :, :width], width, 2) for p in blocks], 1)  # [B, K, n, V]
        judged_laws = None
        if judged:
            reported = [p.laws if p.judged_laws is None else p.judged_laws for p in blocks]
            judged_laws = torch.cat([pad_to(law[:, :, :width], width, 2) for law in reported], 1)  # [B, K, n, V]
        flags = [torch.stack([p.finite, ((p.tokens >= 0) & (p.tokens < vocab_size)).all()]) for p in proposals]
        finite, in_vocab = torch.stack(flags, 1) if flags else torch.ones(2, 0, dtype=torch.bool, device=device)
        proposed = [[n > 0 for n in p.lengths] for p in proposals]  # [drafters][B]
        ends = list(itertools.accumulate([0] + [p.tokens.shape[1] for p in proposals]))  # drafter j: ends[j]..
        present = [
            tuple(row for j, of_j in enumerate(proposed) if of_j[b] for row in range(ends[j], ends[j + 1])) or (0,)
            for b in range(batch)
        ]
        return cls(tokens.clamp(0, vocab_size - 1), laws, finite, in_vocab, lengths, present, proposed, judged_laws)

    def groups(self, exact: list[bool]) -> dict[tuple[int, tuple[int, ...], bool], list[int]]:
        """Sequences by block shape and rule (length, rows that proposed, whether the exact rule decides it: ``exact``
        ``[B]``), in order: one verify call each."""
        grouped: dict[tuple[int, tuple[int, ...], bool], list[int]] = {}
        for b, (length, present) in enumerate(zip(self.lengths, self.present)):
            # A block without draft tokens is the engine's own draw from q, whichever rule it would have had.
            grouped.setdefault((length, present, exact[b] and length > 0), []).append(b)
        return grouped


def count_to_eos(decision: BatchDecision, eos: torch.Tensor) -> torch.Tensor:
    """How many tokens each block commits ``[B]``: through its first EOS (of ``eos`` ``[ids]``), if one comes before
    its end."""
    count = decision.num_accepted + 1  # [B]
    if eos.numel() == 0:
        return count
    positions = torch.arange(decision.tokens.shape[1], device=eos.device)  # [n+1]
    is_eos = torch.isin(decision.tokens, eos) & (positions < count.view(-1, 1))  # [B, n+1]
    return torch.where(is_eos.any(1), is_eos.to(torch.uint8).argmax(1) + 1, count)


def longest_matches(
    rows: torch.Tensor, block_tokens: torch.Tensor, count: torch.Tensor, verified: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each block, the row of ``rows`` ``[B, K_j, n]`` that agrees longest with its first ``count`` ``[B]``
    committed tokens (``block_tokens`` ``[B, n+1]``), within its ``verified`` positions ``[B, n]``
    → (rows ``[B]``, lengths ``[B]``)."""
    width = rows.shape[2]
    if rows.shape[1] == 0 or width == 0:
        zeros = count * 0
        return zeros, zeros
    positions = torch.arange(width, device=rows.device)  # [n]
    committed = (positions < count.view(-1, 1, 1)) & verified[:, None]  # [B, 1, n]
    agrees = (rows == block_tokens[:, None, :width]) & committed  # [B, K_j, n]
    length = agrees.long().cumprod(-1).sum(-1)  # [B, K_j]
    best = length.argmax(1)  # [B]
    return best, length.gather(1, best.view(-1, 1)).squeeze(1)
