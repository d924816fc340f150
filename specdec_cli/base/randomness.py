"""Keyed randomness: every uniform the engine and the verifiers use is a pure function of what it is for.

A draw is named by (run seed, prompt index, sample index) — folded into one 64-bit *key* per
sample on the host — and, on the device, by (block start, offset in the block, stream, lane):

- the block start is the absolute output position of the block's first draft token; every
  block commits at least one token, so no two blocks of a sample share it;
- the offset is the position inside the block (0..L), the lane a draft row or candidate;
- the stream says what the draw is for (:class:`Stream`): drafting, acceptance, the correction
  after a rejection, the bonus token, a scheme's own selection.

Keying by block rather than by absolute position matters: block verification's accepted length
depends on the uniforms of every position of the block, so a later block that reused the
uniforms of a position the earlier block had looked at would be biased.

The generator is SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014): the 64-bit state ``key + counter · γ`` through the MurmurHash3-style
finaliser, in int64 arithmetic that wraps, then the top 52 bits as ``(m + ½) · 2⁻⁵²``. So a
uniform has 52 bits of resolution, lies in [2⁻⁵³, 1 - 2⁻⁵³] (never exactly 0 or 1, safe before a
division or a log), and is computed with about twenty elementwise operations on the tensors'
device for any number of draws: no ``torch.Generator`` (which no compiler can trace), no state,
no host read. A sample's draws therefore do not depend on which other samples, prompts or
configurations ran before it or beside it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import IntEnum

import torch

__all__ = [
    "BatchRandomness",
    "Draws",
    "Randomness",
    "SCHEME",
    "Stream",
    "at",
    "block_generator",
    "mix64",
    "sample_key",
    "stream_table_from",
    "uniforms_from",
    "uniforms_of",
]

SCHEME = "splitmix64-block-v1"
"""Recorded in results folders: a folder written under another scheme cannot be resumed into."""


class Stream(IntEnum):
    """What a draw is for; each is an independent sequence of uniforms."""

    DRAFT = 0
    """The engine's draft tokens (lane = draft row)."""
    TARGET = 1
    """The engine's own token when a block has no draft tokens (the target alone)."""
    ACCEPT = 2
    """Acceptance tests of draft tokens (lane = candidate)."""
    RESIDUAL = 3
    """The correction drawn after a rejection."""
    BONUS = 4
    """The bonus token after a block whose L draft tokens were all accepted."""
    SELECT = 5
    """A scheme's own choice among candidates (importance sampling's selection, block verification's stops)."""
    OUTSIDE = 6
    """A scheme's second-level draws (importance sampling's alphabet coin and its outside token)."""
    OUTSIDE_TOKEN = 7


_OFFSETS = 1 << 12  # positions inside a block (draft lengths up to 4095)
_STREAMS = 1 << 4
_LANES = 1 << 12  # draft rows or candidates per position
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / the golden ratio, odd
_MIX_1, _MIX_2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_UNIT = 2.0**-52


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic on signed integers)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def mix64(state: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bit patterns ``[...]`` → ``[...]`` (multiplications wrap mod 2^64)."""
    state = (state ^ _shift_right(state, 30)) * _signed(_MIX_1)
    state = (state ^ _shift_right(state, 27)) * _signed(_MIX_2)
    return state ^ _shift_right(state, 31)


def uniforms_of(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The uniform of each ``counter`` ``[...]`` int64 under ``key`` ``[]`` int64 → float64 ``[...]`` in ]0, 1[:
    SplitMix64 of the state key + counter · γ, its top 52 bits as (m + ½) · 2⁻⁵²."""
    bits = mix64(key + counter * _signed(_GAMMA))  # [...]
    return (_shift_right(bits, 12).double() + 0.5) * _UNIT


def _steps(positions: int, columns: int, column_stride: int, device: torch.device) -> torch.Tensor:
    """i · streams · lanes + j · column_stride for position i and column j → int64 ``[positions, columns]``."""
    if columns == 1:
        return torch.arange(0, positions * _STREAMS * _LANES, _STREAMS * _LANES, device=device).unsqueeze_(-1)
    column = torch.arange(0, columns * column_stride, column_stride, device=device)  # [columns]
    if positions == 1:
        return column.unsqueeze_(0)
    return torch.arange(0, positions * _STREAMS * _LANES, _STREAMS * _LANES, device=device).unsqueeze_(-1) + column


def sample_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 64-bit key (as an int64 value) of one sample of one prompt under a run's seed."""
    digest = hashlib.sha256(f"specdec:{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return _signed(int.from_bytes(digest[:8], "little"))


@dataclass(frozen=True)
class Draws:
    """The keyed uniforms of one block, on the block's device (pass it where a verifier takes randomness).

    key ``[]`` int64: the sample's key; block_start ``[]`` int64: the output position of the block's
    first draft token. Both are device tensors, so a compiled verifier is not specialised to a sample
    or a block, and the engine updates ``block_start`` in place (no host → device copy, no sync).
    """

    key: torch.Tensor
    block_start: torch.Tensor
    offset: torch.Tensor | int = 0
    """Added to every offset asked for: :meth:`at` hands a position's draws to code that asks for offset 0."""

    @classmethod
    def create(cls, key: int, block_start: int = 0, device: torch.device | str = "cpu") -> "Draws":
        """The draws of the sample ``key`` (any integer: it is mixed first, so neighbouring keys such as a
        test's 0, 1, 2 are as unrelated as any two)."""
        mixed = int(mix64(torch.tensor(_signed(key))))
        return cls(
            torch.tensor(mixed, dtype=torch.long, device=device),
            torch.tensor(block_start, dtype=torch.long, device=device),
        )

    @classmethod
    def batch(cls, keys: list[int], device: torch.device | str = "cpu") -> "Draws":
        """The draws of several samples at once (``key`` and ``block_start`` ``[B]``), one per sequence of a batch:
        :meth:`row` is sequence b's, and :meth:`batch_uniforms` tables every sequence's draws in one evaluation."""
        mixed = mix64(torch.tensor([_signed(key) for key in keys], dtype=torch.long))  # [B]
        return cls(mixed.to(device), torch.zeros(len(keys), dtype=torch.long, device=device))

    def row(self, index: int) -> "Draws":
        """Sequence ``index``'s draws of a batch (:meth:`batch`): the draws :meth:`create` gives its key."""
        return Draws(self.key[index], self.block_start[index], self.offset)

    def batch_uniforms(self, stream: Stream, positions: int, lanes: int) -> torch.Tensor:
        """float64 ``[B, positions, lanes]``: entry b is ``row(b).uniforms(stream, positions, lanes)``."""
        shaped = Draws(self.key.view(-1, 1, 1), self.block_start.view(-1, 1, 1), self.offset)
        return shaped.uniforms(stream, positions, lanes)

    def at(self, offset: torch.Tensor | int) -> "Draws":
        """The draws seen from ``offset`` positions further into the block."""
        return Draws(self.key, self.block_start, self.offset + offset)

    def uniforms(
        self, stream: Stream | torch.Tensor, positions: int = 1, lanes: int = 1, offset: torch.Tensor | int = 0
    ) -> torch.Tensor:
        """float64 ``[positions, lanes]``: entry (i, k) is the uniform of (stream, offset + i, lane k).

        ``offset`` and ``stream`` may be 0-dim device tensors (the first rejected position, known only on
        the device, and the stream that depends on it); a ``stream`` of shape ``[S, 1, 1]`` gives ``[S,
        positions, lanes]``, one table per stream.
        """
        return self._table(stream, positions, lanes, 1, offset)

    def stream_table(self, first: Stream, streams: int, positions: int) -> torch.Tensor:
        """float64 ``[positions, streams]``: entry (i, j) is the uniform of (stream first + j, offset i, lane 0);
        several streams' draws in one evaluation (a single-draft block's acceptance, correction and bonus)."""
        return self._table(first, positions, streams, _LANES, 0)

    def _table(self, stream, positions: int, columns: int, column_stride: int, offset) -> torch.Tensor:
        """``[positions, columns]``: the uniforms of counters (start + i · streams · lanes + j · column_stride)."""
        # The counter ((block start · offsets + offset + i) · streams + stream) · lanes + k, its constant part
        # folded in Python. The steps stay small integers: torch.compile's inductor turns an arange times a
        # constant into index arithmetic that must not overflow (times γ there, a compiled kernel failed).
        stream = stream if isinstance(stream, torch.Tensor) else int(stream)
        start = (self.offset + offset) * (_STREAMS * _LANES) + stream * _LANES  # int, or a device tensor
        first = self.block_start * (_OFFSETS * _STREAMS * _LANES) + start  # [] (or [S, 1, 1])
        return uniforms_of(self.key, first + _steps(positions, columns, column_stride, self.key.device))

    def uniform(self, stream: Stream, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """One uniform ``[]`` float64: (stream, offset, lane 0)."""
        return self.uniforms(stream, offset=offset).view(())


Randomness = Draws | torch.Generator | None
"""What a verifier is handed: keyed :class:`Draws` (verifiers that set ``keyed_randomness``) or, for
plugins written against a stateful generator, a ``torch.Generator`` seeded for the block (or None)."""


BatchRandomness = Draws | list[torch.Generator]
"""What :meth:`~specdec_cli.verifiers.BlockVerifier.verify_batch` is handed: keyed :class:`Draws` of the batch
(:meth:`Draws.batch`), or one seeded generator per sequence for a verifier without keyed randomness."""


def uniforms_from(
    randomness: Randomness,
    stream: Stream | torch.Tensor,
    shape: tuple[int, ...],
    device: torch.device,
    offset: torch.Tensor | int = 0,
    lanes_last: bool = False,
) -> torch.Tensor:
    """float64 uniforms of ``shape`` from either kind of randomness.

    With :class:`Draws` the leading dimensions are positions (offset + i, flattened) and, with
    ``lanes_last``, the last dimension is lanes (candidates at one position); with a generator (or
    None: torch's global one) they are its next draws in ]0, 1[, and stream and offset are unused.
    """
    if isinstance(randomness, Draws):
        lanes = shape[-1] if lanes_last else 1
        positions = math.prod(shape) // lanes if lanes else 0
        return randomness.uniforms(stream, positions, lanes, offset).view(shape)
    drawn = torch.rand(shape, generator=randomness, device=device, dtype=torch.float64)  # [*shape]
    return drawn.clamp_min(_UNIT / 2)  # torch.rand can return exactly 0


def stream_table_from(
    randomness: Randomness, first: Stream, streams: int, positions: int, device: torch.device
) -> torch.Tensor:
    """float64 ``[positions, streams]`` from either kind of randomness (:meth:`Draws.stream_table`; a
    generator's next draws)."""
    if isinstance(randomness, Draws):
        return randomness.stream_table(first, streams, positions)
    return uniforms_from(randomness, first, (positions, streams), device)


def at(randomness: Randomness, offset: torch.Tensor | int) -> Randomness:
    """``randomness`` seen from ``offset`` positions into the block (a generator is its own next draws)."""
    return randomness.at(offset) if isinstance(randomness, Draws) else randomness


def block_generator(key: int, block_start: int, device: torch.device | str) -> torch.Generator:
    """A ``torch.Generator`` seeded from (key, block start), for a verifier that draws from one: its
    draws too are a pure function of the sample and the block, not of what ran before."""
    seed = int(mix64(torch.tensor(key ^ _signed(block_start * _GAMMA))).item()) & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(seed)
