"""What a verifier decides, and the checks the engine makes of it before committing a token.

:class:`Decision` is the one decision type of the verifier contract: the committed tokens, the accepted count and
the row followed, each with a leading batch dimension (B = 1 for one sequence). :class:`BlockDecision` is the same
for one block without that dimension: what a rule written for one block (``verify_block``) returns, which the base
class maps over a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "BatchDecision",
    "BlockDecision",
    "Decision",
    "DecisionError",
    "batch_decision_problem",
    "batch_departs_from_drafts",
    "decision_problem",
    "decision_value_problem",
    "departs_from_drafts",
]


class DecisionError(ValueError):
    """A rule written for one block returned a decision of the wrong form (:func:`decision_problem` says what):
    raised by the adapter that maps it over a batch, before stacking would hide the form (a float or bool field
    cast to int64)."""


@dataclass(frozen=True)
class BlockDecision:
    """What a verifier decided for one block; every field is a tensor on the block's device.

    The committed tokens are ``tokens[: num_accepted + 1]``: the accepted draft tokens of row
    ``row`` followed by one token from the target's side (a correction after a rejection, or a
    bonus token when all L were accepted). The engine reads these once per block.
    """

    tokens: torch.Tensor
    """[L+1] int64; entries past ``num_accepted`` are filler."""
    num_accepted: torch.Tensor
    """[] int64 in 0..L: accepted draft tokens, which equal ``draft_tokens[row, :num_accepted]``."""
    row: torch.Tensor
    """[] int64: the draft row the committed tokens follow (its KV caches are kept)."""

    def as_long(self) -> "BlockDecision":
        """The same decision in int64 (itself when it is already, as every built-in's is)."""
        if self.tokens.dtype == self.num_accepted.dtype == self.row.dtype == torch.long:
            return self
        return BlockDecision(self.tokens.long(), self.num_accepted.long(), self.row.long())


@dataclass(frozen=True)
class Decision:
    """What a verifier decided for a batch of blocks, one block per sequence (:meth:`BlockVerifier.verify`): each
    field is :class:`BlockDecision`'s with a leading batch dimension B (1 for one sequence), on the blocks' device."""

    tokens: torch.Tensor
    """[B, L+1] int64: sequence b commits ``tokens[b, : num_accepted[b] + 1]``."""
    num_accepted: torch.Tensor
    """[B] int64 in 0..L."""
    row: torch.Tensor
    """[B] int64: the draft row each sequence's committed tokens follow."""

    @classmethod
    def stack(cls, decisions: Sequence[BlockDecision]) -> "Decision":
        """One decision per sequence, in order, as a batch."""
        decisions = [decision.as_long() for decision in decisions]
        fields = ("tokens", "num_accepted", "row")
        return cls(*(torch.stack([getattr(decision, field) for decision in decisions]) for field in fields))

    @classmethod
    def of_block(cls, decision: BlockDecision) -> "Decision":
        """One block's decision as a batch of one (views, no copy)."""
        return cls(decision.tokens.unsqueeze(0), decision.num_accepted.view(1), decision.row.view(1))

    def as_long(self) -> "Decision":
        if self.tokens.dtype == self.num_accepted.dtype == self.row.dtype == torch.long:
            return self
        return Decision(self.tokens.long(), self.num_accepted.long(), self.row.long())


def decision_problem(decision: object, block_size: int, device: torch.device) -> str | None:
    """What makes ``decision`` (a verifier's return value) unusable, judged on the host without reading
    a value from the device: its type, and each field's type, shape, dtype and device; or None.

    ``block_size``: L + 1 tokens; ``device``: the block's. Completes "verifier 'x' ..." in an error.
    """
    if not isinstance(decision, BlockDecision):
        return f"returned {_kind(decision)} instead of a BlockDecision"
    return _fields_problem(decision, {"tokens": [block_size], "num_accepted": [], "row": []}, block_size, device)


def batch_decision_problem(decision: object, batch: int, block_size: int, device: torch.device) -> str | None:
    """As :func:`decision_problem`, for a batch's :class:`Decision` (``verify``'s) of ``batch`` blocks."""
    if not isinstance(decision, Decision):
        return f"returned {_kind(decision)} from verify instead of a Decision"
    shapes = {"tokens": [batch, block_size], "num_accepted": [batch], "row": [batch]}
    return _fields_problem(decision, shapes, block_size, device)


def _fields_problem(decision, shapes: dict[str, list[int]], block_size: int, device: torch.device) -> str | None:
    """The first field of ``decision`` whose type, dtype, shape (``shapes``) or device is wrong, said; or None."""
    for field, shape in shapes.items():
        value = getattr(decision, field)
        if not isinstance(value, torch.Tensor):
            return f"returned {field} as {type(value).__name__}, not as a tensor"
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            return f"returned {field} of dtype {value.dtype}, not of an integer dtype"
        if list(value.shape) != shape:
            return (
                f"returned {field} of shape {list(value.shape)}, not {shape} (for a block of {block_size - 1} "
                "draft tokens)"
            )
        if value.device != device:
            return f"returned {field} on {value.device}, not on the block's device {device}"
    return None


def departs_from_drafts(decision: BlockDecision, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[]`` bool, on the device: the decision's accepted tokens are not its row's draft tokens
    (``tokens[:num_accepted] != draft_tokens[row, :num_accepted]``), which no verifier may commit.

    draft_tokens ``[K, L]``: :func:`batch_departs_from_drafts` for a batch of one block.
    """
    return batch_departs_from_drafts(Decision.of_block(decision), draft_tokens.unsqueeze(0))[0]


def batch_departs_from_drafts(decision: Decision, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: :func:`departs_from_drafts` for each block of a batch (draft_tokens ``[B, K, L]``).

    The row is clamped so that indexing cannot fail on the device: a row out of range is reported by
    :func:`decision_value_problem` from the values read anyway.
    """
    batch, rows, width = draft_tokens.shape
    index = decision.row.clamp(0, rows - 1).view(batch, 1, 1).expand(-1, 1, width)  # [B, 1, L]
    drafted = draft_tokens.gather(1, index)[:, 0]  # [B, L]: each block's decided row
    positions = torch.arange(width, device=draft_tokens.device)  # [L]
    accepted = positions < decision.num_accepted.view(-1, 1)  # [B, L]
    return ((decision.tokens[:, :width] != drafted) & accepted).any(1)


def decision_value_problem(
    tokens: list[int], num_accepted: int, row: int, departs: bool, num_rows: int, vocab_size: int
) -> str | None:
    """What is wrong with a decision's values, once the block's one read has brought them to the host, or None.

    tokens: all L + 1 of them; departs: :func:`departs_from_drafts`'s flag. Only committed tokens
    (the first num_accepted + 1) must be in the vocabulary: the rest are filler.
    """
    draft_length = len(tokens) - 1
    if not 0 <= num_accepted <= draft_length:
        return f"returned num_accepted {num_accepted} for a block of {draft_length} draft tokens (0 to {draft_length})"
    if not 0 <= row < num_rows:
        return f"returned row {row} for a block of {num_rows} draft row(s) (0 to {num_rows - 1})"
    outside = [token for token in tokens[: num_accepted + 1] if not 0 <= token < vocab_size]
    if outside:
        return f"returned token {outside[0]}, outside the vocabulary of {vocab_size} ids (0 to {vocab_size - 1})"
    if departs:
        return (
            f"returned num_accepted {num_accepted} with tokens {tokens[:num_accepted]}, which are not row "
            f"{row}'s first {num_accepted} draft tokens"
        )
    return None


def _kind(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


BatchDecision = Decision
"""The name :class:`Decision` had while the contract had two calls (``verify_batch`` beside ``verify_block``)."""
