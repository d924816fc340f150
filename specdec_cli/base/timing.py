"""Time spent in named regions of the decoding loop, without synchronising inside it.

On the CPU a region's time is its wall time. On CUDA, work is queued asynchronously, so a
region records a pair of events and their elapsed times are read once, when :meth:`seconds` is
called after the sample (one synchronisation per sample instead of two per region).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from time import perf_counter  # read through this module: a test gives the timer a clock of its own

import torch


class RegionTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def region(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((name, start, end))
        else:
            began = perf_counter()
            yield
            self.totals[name] += perf_counter() - began

    def seconds(self, name: str) -> float:
        """Total seconds in regions called ``name`` so far (reads pending CUDA events first)."""
        if self.pending:
            torch.cuda.synchronize()
            for region, start, end in self.pending:
                self.totals[region] += start.elapsed_time(end) / 1000
            self.pending.clear()
        return self.totals[name]
