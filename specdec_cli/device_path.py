"""Counting a verifier's device reads and capturing it in a CUDA graph, public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.engine.device_path`
"""

from __future__ import annotations

from .engine.device_path import (
    HOST_CONVERSIONS,
    READ_OPERATIONS,
    BlockCount,
    OperationCount,
    T,
    capture_cuda_graph,
    count_block,
    is_host_copy,
)

__all__ = [
    "BlockCount",
    "HOST_CONVERSIONS",
    "OperationCount",
    "READ_OPERATIONS",
    "T",
    "capture_cuda_graph",
    "count_block",
    "is_host_copy",
]
