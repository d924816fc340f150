"""How many tokens a sequence's next block drafts (``speculation.draft_length_schedule``, one of
:data:`~specdec_cli.base.recipe.DRAFT_LENGTH_SCHEDULES`).

``constant``: always L (``speculation.draft_length``). ``heuristic``: transformers' schedule for assisted generation
(``num_assistant_tokens_schedule="heuristic"``): two more after a block whose every proposed token was accepted, one
fewer otherwise. Here it starts at L and stays between 1 and L, so L keeps bounding what a block holds (the static
cache's headroom, the context check). The length is a function of the sequence's past blocks only, never of the
block it sizes, so every exact verifier stays exact under it.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["next_draft_length"]

_GROWTH, _SHRINK = 2, 1
"""transformers' steps: +2 after a block accepted whole, −1 after a rejection."""


def next_draft_length(
    schedule: Literal["constant", "heuristic"], current: int, ceiling: int, drafted: int, accepted: int
) -> int:
    """The draft length of a sequence's next block, after a block that drafted ``drafted`` tokens (0: none was
    proposed, which says nothing of the draft) and accepted ``accepted`` of them, at ``current``."""
    if schedule == "constant" or drafted == 0:
        return current
    if accepted >= drafted:
        return min(current + _GROWTH, ceiling)
    return max(current - _SHRINK, 1)
