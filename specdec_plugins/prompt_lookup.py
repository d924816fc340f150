"""The prompt-lookup drafter: the tokens that followed the latest earlier occurrence of the context's last n-gram.

Saxena, "Prompt Lookup Decoding" (2023; transformers' ``prompt_lookup_num_tokens``): on input-grounded
tasks (summarising, editing, answering over a document) the output copies spans of the prompt, so the
tokens after an earlier occurrence of the last n tokens are likely next. It needs no model: its draft
is a function of the context, reported as one-hot laws, so every lossless verifier stays exact. It tries
n = ``max_ngram`` down to ``min_ngram`` and takes the most recent occurrence of the longest n-gram that
has one; on a miss it proposes nothing, and the block costs one target forward, as the target alone.

Each n-gram's latest end position is kept in a dictionary, extended by the tokens committed since the
last block: matching costs O(new tokens × n-gram sizes), not a scan of the context.
"""

from __future__ import annotations

from typing import Annotated

import torch

from specdec_cli.plugins.drafting import SequenceDrafter, SequenceProposal, SequenceRequest, one_hot_laws

_JOIN = -1
"""Between an encoder-decoder's prompt and its decoder ids in the searched sequence: no token's id."""


class PromptLookup(SequenceDrafter):
    """Copies what followed the latest earlier occurrence of the last n-gram of prompt and output (no model)."""

    name = "prompt-lookup"
    deterministic = True

    def __init__(
        self,
        *,
        min_ngram: Annotated[int, "the shortest n-gram looked up"] = 1,
        max_ngram: Annotated[int, "the longest n-gram looked up (tried first)"] = 3,
        num_tokens: Annotated[int | None, "tokens proposed at most (None: the block's draft length)"] = None,
    ):
        for parameter, value in (("min_ngram", min_ngram), ("max_ngram", max_ngram), ("num_tokens", num_tokens)):
            if value is not None and value < 1:  # a whole number: the base class checked the types
                raise ValueError(f"prompt-lookup: {parameter} must be >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"prompt-lookup: min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # longest first
        self.num_tokens = num_tokens
        self._prompt: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram → end position of its latest occurrence
        self._indexed = 0  # n-grams ending before this position of the haystack are in the index

    def start(self, prompt_ids: list[int]) -> None:
        # An encoder-decoder's context holds only the decoder's ids: the prompt is searched too, followed by an id
        # no token has, so that no n-gram and no copied span runs from the prompt's end into the decoder's start.
        self._prompt = [*prompt_ids, _JOIN] if self.draft_setup.target.is_encoder_decoder else []
        self._index, self._indexed = {}, 0

    def propose_sequence(self, request: SequenceRequest) -> SequenceProposal:
        haystack = self._prompt + request.context if self._prompt else request.context
        limit = min(request.max_length, self.num_tokens or request.max_length)
        end = self._latest_match(haystack)
        found = haystack[end + 1 : end + 1 + limit] if end is not None else []
        found = found[: found.index(_JOIN)] if _JOIN in found else found
        tokens = torch.tensor([found], dtype=torch.long, device=self.draft_setup.device).view(1, -1)  # [1, n]
        return SequenceProposal(
            tokens,
            one_hot_laws(tokens, self.draft_setup.vocab_size),
            torch.ones((), dtype=torch.bool, device=self.draft_setup.device),
        )

    def _latest_match(self, haystack: list[int]) -> int | None:
        """The end position of the latest occurrence, before the last position, of the haystack's final n-gram
        (the longest n that has one), or None."""
        last = len(haystack) - 1
        for end in range(self._indexed, last):  # every n-gram that ends before the last position
            for size in self.sizes:
                if end + 1 >= size:
                    self._index[tuple(haystack[end + 1 - size : end + 1])] = end
        self._indexed = max(self._indexed, last)
        for size in self.sizes:
            if last + 1 >= size:
                end = self._index.get(tuple(haystack[last + 1 - size :]))
                if end is not None:
                    return end
        return None
