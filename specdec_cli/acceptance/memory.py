"""The memory check of an acceptance run: a prompt's draft laws must fit the device, refused before they are
allocated."""

from __future__ import annotations

import os

import torch

from ..base.errors import UsageError


def _check_memory(positions: int, num_drafts: int, vocab_size: int, device: torch.device) -> None:
    """A prompt's K draft laws, ``[T, K, V]`` in float64, must fit the device's memory: refuse a
    ``--num-drafts`` or ``--max-new-tokens`` too large for it in one line, before allocating."""
    needed = positions * num_drafts * vocab_size * 8
    available = _device_memory(device)
    if available is not None and needed > available:
        raise UsageError(
            f"--num-drafts {num_drafts} with --max-new-tokens {positions} needs {needed / 2**30:.3g} GiB "
            "for the draft laws "
            f"alone ({positions} positions × {num_drafts} drafts × {vocab_size} tokens × 8 bytes) and this device has "
            f"{available / 2**30:.3g} GiB; lower --num-drafts or --max-new-tokens"
        )


def _device_memory(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes (None where it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
