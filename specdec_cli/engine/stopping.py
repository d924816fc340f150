"""Stop strings (``generation.stop``, ``--stop``): where a sequence's decoded text first contains one.

A sequence stops after the token whose text completes the first occurrence of any stop string, as transformers'
``stop_strings`` does: its ``token_ids`` end with that token. Its ``text`` ends just before the stop string, as
vLLM's ``stop`` leaves it by default. Each block decodes only the sequence's last tokens and the block's new ones,
so a long output costs no more per block than a short one; a stop string can only begin in those tokens, since an
earlier occurrence would have stopped the sequence at an earlier block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["cut_at_stop", "tokens_through_stop"]

Decode = Callable[[list[int]], str]
"""Token ids → text (the target tokenizer's ``decode``, as the results decode)."""

_TOKENS_PER_CHARACTER = 4
"""At most this many tokens make one character (byte-level tokenizers spell a character in up to four bytes), so the
last ``4 × longest stop string`` tokens hold any stop string's start that reaches into the new tokens."""


def tokens_through_stop(
    decode: Decode, before: Sequence[int], new_tokens: Sequence[int], stops: Sequence[str]
) -> int | None:
    """How many of ``new_tokens`` the sequence keeps when their text completes a stop string: through the token that
    completes its first occurrence in the text of ``before`` (the tokens generated earlier) followed by
    ``new_tokens``. None when it completes none."""
    if not stops or not new_tokens:
        return None
    tail = list(before[max(0, len(before) - _TOKENS_PER_CHARACTER * max(map(len, stops))) :])
    if _first_stop(decode(tail + list(new_tokens)), stops) is None:
        return None
    return next(
        k for k in range(1, len(new_tokens) + 1) if _first_stop(decode(tail + list(new_tokens[:k])), stops) is not None
    )


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of ``stops`` (all of it when none occurs)."""
    start = _first_stop(text, stops)
    return text if start is None else text[:start]


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest occurrence of any of ``stops`` begins in ``text``; None when none occurs."""
    starts = [start for start in (text.find(stop) for stop in stops) if start >= 0]
    return min(starts) if starts else None
