"""A verifier's capabilities as the author's kit measures them, beside what its class declares.

What can be measured is measured, on the device path the engine takes on a GPU, and a declared flag the measurement
contradicts fails the kit: whether the rule maps over a batch with ``torch.func.vmap`` (``batches_by_vmap``) and the
mapped decisions equal each block decided alone; how many host reads a block makes (the engine counts them too, on
the first block of each shape, and runs a block that reads compiled instead of from a CUDA graph); and whether its
operation count depends on the data (it must not for a ``capturable`` rule on a path without reads). A capability
the class does not declare but has is said, so the author can claim it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.randomness import Draws
from ..engine.device_path import count_block
from ..plugins.block_verifier import BlockVerifier, decide_blocks, device_path
from ..plugins.decisions import Decision

__all__ = ["Capabilities", "measure_capabilities"]

BATCH = 3
"""Sequences in the measured batch: more than one, so that a mix-up between sequences shows."""


class CapabilityError(AssertionError):
    """A declared capability that the measurement contradicts (the kit raises it as a ConformanceError)."""


@dataclass(frozen=True)
class Capabilities:
    """What :func:`measure_capabilities` found of one verifier instance on one block shape."""

    maps_by_vmap: bool
    """``torch.func.vmap`` maps its block rule over a batch, and the mapped decisions are each block's alone."""
    reads_per_block: int
    """Host reads one block makes on the device path."""
    operations: tuple[int, int]
    """Operations one block dispatches on the device path, on two different sets of laws."""

    def line(self, cls: type[BlockVerifier]) -> str:
        """The kit's report line: each capability measured, and the flags the class could claim but does not."""
        mapping = "maps over a batch with vmap" if self.maps_by_vmap else "does not map with vmap (looped per block)"
        fixed = "the same for any data" if len(set(self.operations)) == 1 else "depending on the data"
        unclaimed = [flag for flag, held in self._claimable().items() if held and not getattr(cls, flag)]
        claim = f"; it could declare {', '.join(unclaimed)}" if unclaimed else ""
        return (
            f"capabilities measured: {mapping}; {self.reads_per_block} host read(s) per block on the device path; "
            f"{self.operations[0]} operations per block, {fixed}; a batch of {BATCH} decided as each block alone"
            f"{claim}"
        )

    def _claimable(self) -> dict[str, bool]:
        return {"batches_by_vmap": self.maps_by_vmap, "capturable": self.maps_by_vmap and self.reads_per_block == 0}


def measure_capabilities(
    cls: type[BlockVerifier], verifier: BlockVerifier, blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> Capabilities:
    """Measure ``verifier`` (an instance of ``cls``) on two ``blocks`` of one shape (target ``[K, L+1, V]``, draft
    ``[K, L, V]``, tokens ``[K, L]``), with keyed draws where it takes them. Raises :class:`CapabilityError` where a
    declared flag is contradicted or a batch's decisions are not each block's alone."""
    first = blocks[0]
    batch = tuple(torch.stack([tensor] * BATCH) for tensor in first)  # [B, K, L+1, V], [B, K, L, V], [B, K, L]
    draws = Draws.batch(list(range(BATCH)))
    _check_batch_is_each_alone(cls, verifier, verifier.verify(*batch, draws), first, draws)
    maps = _maps_by_vmap(verifier, batch, draws, first)
    if cls.batches_by_vmap and not maps:
        raise CapabilityError(f"{cls.name}: it declares batches_by_vmap, but vmap cannot map its block rule")
    counts = [count_block(verifier, *block, Draws.create(1) if cls.keyed_randomness else None) for block in blocks]
    operations = (counts[0].ops, counts[-1].ops)
    if cls.capturable and not counts[0].reads and len(set(operations)) > 1:
        raise CapabilityError(f"{cls.name}: it declares capturable, but its operation count depends on the data")
    return Capabilities(maps, counts[0].reads, operations)


def _check_batch_is_each_alone(cls, verifier, decision: Decision, block, draws: Draws) -> None:
    """Each sequence's decision in a batch of identical blocks with different keys is its block decided alone."""
    for b in range(BATCH):
        alone = verifier.verify(*(tensor.unsqueeze(0) for tensor in block), _row_as_batch(draws, b))
        for field in ("tokens", "num_accepted", "row"):
            if not torch.equal(getattr(decision, field)[b].long(), getattr(alone, field)[0].long()):
                raise CapabilityError(
                    f"{cls.name}: in a batch of {BATCH}, sequence {b}'s {field} is not the one it gets decided alone"
                )


def _maps_by_vmap(verifier: BlockVerifier, batch, draws: Draws, block) -> bool:
    """Whether vmap maps the block rule and its decisions equal the looped ones (a rule that writes ``verify`` for the
    batch itself is not mapped by the adapter: False)."""
    if not getattr(verifier, "keyed_randomness", False):
        return False
    mapped_class = type("Mapped", (type(verifier),), {"batches_by_vmap": True, "reading_cpu_path": False})
    mapped = object.__new__(mapped_class)
    mapped.__dict__.update(verifier.__dict__)
    looped = object.__new__(type("Looped", (type(verifier),), {"batches_by_vmap": False}))
    looped.__dict__.update(verifier.__dict__)
    try:
        by_vmap = decide_blocks(mapped, *batch, draws)
    except Exception:  # noqa: BLE001 - any failure of vmap's tracing means: not mappable
        return False
    with device_path():  # the path the mapped blocks take (a CPU path that reads may decide otherwise)
        by_loop = decide_blocks(looped, *batch, draws)
    return all(torch.equal(getattr(by_vmap, f), getattr(by_loop, f)) for f in ("tokens", "num_accepted", "row"))


def _row_as_batch(draws: Draws, index: int) -> Draws:
    return Draws(draws.key[index : index + 1], draws.block_start[index : index + 1], draws.offset)
