"""Keyed randomness (Draws, streams), public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.randomness`
"""

from __future__ import annotations

from .base.randomness import (
    SCHEME,
    BatchRandomness,
    Draws,
    Randomness,
    Stream,
    at,
    block_generator,
    mix64,
    sample_key,
    stream_table_from,
    uniforms_from,
    uniforms_of,
)

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
