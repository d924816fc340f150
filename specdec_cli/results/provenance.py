"""Where a result came from: the one provenance record every results file carries."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from pathlib import Path

import torch

from .. import __version__


def run_conditions(device: torch.device) -> dict:
    """What a speed figure depends on besides the recipe and the data: torch's CPU threads (read now,
    so after ``--threads`` or ``OMP_NUM_THREADS`` took effect), the device's name and the versions that
    run it. ``bench`` keeps them on every sample: a resume under others is refused or flagged."""
    import transformers

    return {
        "threads": torch.get_num_threads(),
        "device": _device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdec": __version__,
    }


def provenance(device: torch.device) -> dict:
    """:func:`run_conditions` and the rest of the record: Python, git hash, date, peak memory, world size.

    Peak memory is the process's resident peak on the CPU and the allocator's peak on a GPU,
    in MiB, at the time of the call.
    """
    return {
        **run_conditions(device),
        "python": platform.python_version(),
        "git": _git_hash(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "peak_memory_mib": _peak_memory(device),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }


def _git_hash() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model()}"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), with whether it has native bfloat16 instructions."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    bfloat16 = "native bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "no native bfloat16"
    return f"{names[0] if names else platform.machine()} ({bfloat16})"


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB
