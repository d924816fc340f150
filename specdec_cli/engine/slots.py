"""A static KV cache with a slot per position of each row: preallocated, written in place at absolute positions.

Row r holds its ids at slots ``0 .. lengths[r] - 1``; a forward writes each row's inputs at the slots after them,
each row where its own ids end (gpt-fast's ``input_pos``, vLLM's slot mapping), so rows of different lengths need
no padding between their ids and no realignment when a block accepts different numbers of tokens per row. A
rejected suffix is not cropped: the attention mask hides the slots past a row's length until the next block writes
over them. The buffers keep their shape across forwards, which is what a compiled or captured step needs.

The last slot of every row is scratch: a row with fewer inputs than the widest (left-padded) writes its padding
there, and nothing attends to it but that padding itself.

Selecting rows (a block fanning each sequence out to its K drafts, then keeping the accepted one) is composed and
applied before the next forward, in place when the number of rows stays: so the buffers keep their addresses from
block to block, which CUDA graphs replaying compiled steps (:mod:`.steps`) need.

:class:`SlotCache` is a transformers :class:`~transformers.cache_utils.Cache` (models call its ``update`` per
layer); the session sets :attr:`SlotCache.write_slots` before each forward.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["SlotCache"]


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values ``[rows, heads, capacity, d]``, written at the owner's :attr:`write_slots`."""

    is_compileable = True

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any) -> None:
        """Buffers for the rows of the first forward, zero: an unwritten slot is never attended."""
        rows, _, _, _ = key_states.shape
        self.keys = key_states.new_zeros(rows, key_states.shape[1], self.owner.capacity, key_states.shape[3])
        self.values = value_states.new_zeros(rows, value_states.shape[1], self.owner.capacity, value_states.shape[3])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._hold()

    def _hold(self) -> None:
        """Tell compiled steps on a GPU that the buffers keep their addresses (their CUDA graphs write them in place
        rather than copying them in and out); a new buffer makes the graphs record again, not recompile."""
        if self.device.type == "cuda":
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        """Write ``key_states``/``value_states`` ``[rows, heads, m, d]`` at each row's slots ``[rows, m]``; the whole
        buffers are what the layer attends over (the mask hides what a row does not hold)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, _, new, _ = key_states.shape
        slots = self.owner.write_slots.view(rows, 1, new, 1)  # [rows, 1, m, 1]
        self.keys.scatter_(2, slots.expand_as(key_states), key_states)  # [rows, heads, capacity, d]
        self.values.scatter_(2, slots.expand_as(value_states), value_states)
        return self.keys, self.values

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.owner.capacity

    def get_max_length(self) -> int:
        return self.owner.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Row r becomes row ``indices[r]``: in place when the number of rows stays."""
        if not self.is_initialized:
            return
        if indices.shape[0] == self.keys.shape[0]:
            self.keys.copy_(self.keys.index_select(0, indices))  # [rows, heads, capacity, d]
            self.values.copy_(self.values.index_select(0, indices))
        else:
            self.keys = self.keys.index_select(0, indices)  # [rows', heads, capacity, d]
            self.values = self.values.index_select(0, indices)
            self._hold()

    def widen(self, capacity: int) -> None:
        """Zero slots appended to ``capacity`` (the old scratch slot becomes an ordinary, unheld one)."""
        if self.is_initialized:
            self.keys = _padded(self.keys, capacity)
            self.values = _padded(self.values, capacity)
            self._hold()

    def join(self, other: _SlotLayer, rows: int, other_rows: int) -> None:
        """``other``'s ``other_rows`` rows after these ``rows`` (both at the owner's capacity); a side no forward
        has written yet is zero rows."""
        if not (self.is_initialized or other.is_initialized):
            return
        written = self if self.is_initialized else other
        for name in ("keys", "values"):
            like = getattr(written, name)  # [rows, heads, capacity, d]
            sides = ((self, rows), (other, other_rows))
            parts = [
                getattr(side, name) if side.is_initialized else like.new_zeros(count, *like.shape[1:])
                for side, count in sides
            ]
            setattr(self, name, torch.cat(parts))  # [rows + other_rows, heads, capacity, d]
        self.dtype, self.device, self.is_initialized = written.dtype, written.device, True
        self._hold()


class SlotCache(Cache):
    """The static cache of one model for a batch's rows (see the module's docstring)."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        """Slots per row, the last one scratch."""
        self.write_slots: torch.Tensor | None = None  # [rows, m]: where this forward's inputs go
        self.selected: torch.Tensor | None = None  # [rows']: the rows selected since the last forward, not yet moved
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` ``[rows']``, composed with the selections before it and applied by :meth:`settle`:
        a fan-out after a keep then moves each buffer once, in place."""
        self.selected = indices if self.selected is None else self.selected.index_select(0, indices)

    def settle(self) -> None:
        """Apply the pending selection of rows (before a forward, a widening or a join)."""
        if self.selected is not None:
            for layer in self.layers:
                layer.batch_select_indices(self.selected)
            self.selected = None

    def widen(self, capacity: int) -> None:
        """At least ``capacity`` slots per row (the held slots keep their place)."""
        self.settle()
        if capacity > self.capacity:
            for layer in self.layers:
                layer.widen(capacity)
            self.capacity = capacity

    def join(self, other: SlotCache, rows: int, other_rows: int) -> None:
        """``other``'s ``other_rows`` rows after this cache's ``rows``, both widened to the larger capacity."""
        self.widen(other.capacity)
        other.widen(self.capacity)  # both settled
        for own, joining in zip(self.layers, other.layers):
            own.join(joining, rows, other_rows)


def _padded(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """``tensor`` ``[rows, heads, slots, d]`` with zero slots appended up to ``capacity``."""
    missing = capacity - tensor.shape[2]
    return torch.cat([tensor, tensor.new_zeros(*tensor.shape[:2], missing, tensor.shape[3])], dim=2)
