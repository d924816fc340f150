"""Logits to law and the sampler, public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.base.sampling`
"""

from __future__ import annotations

from .base.sampling import (
    SamplingParams,
    non_finite_message,
    probs_from_logits,
    sample,
    sample_with,
    sampling_law,
)

__all__ = [
    "SamplingParams",
    "non_finite_message",
    "probs_from_logits",
    "sample",
    "sample_with",
    "sampling_law",
]
