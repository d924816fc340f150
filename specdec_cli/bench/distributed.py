"""bench's data-parallel set-up: under torchrun (or accelerate launch) each process runs its share of the grid's
samples, and rank 0 writes the one results folder a single-process run writes."""

from __future__ import annotations

import os

from ..base.errors import UsageError
from ..results.store import ResultsStore


def init_distributed() -> tuple[int, int]:
    """Rank and world size under torchrun / accelerate launch (gloo on CPU, nccl on GPUs)."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(f"WORLD_SIZE must be a number, got '{os.environ['WORLD_SIZE']}'") from None
    if world_size == 1:
        return 0, 1
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UsageError(
            f"WORLD_SIZE={world_size} is set without {', '.join(missing)}; launch a data-parallel "
            "run with torchrun (it sets them), or unset WORLD_SIZE"
        )
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world_size


def gather(store: ResultsStore, rank: int, failures: dict[str, str]) -> dict[str, str]:
    """Every process's samples to rank 0, which writes the one samples.jsonl of a single-process run;
    every process's failed cells (cell key → why) to all."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (list(store.records.values()), failures))
    if rank == 0:
        store.merge([record for records, _ in gathered for record in records])
    dist.barrier()
    dist.destroy_process_group()
    return {key: why for _, theirs in gathered for key, why in theirs.items()}
