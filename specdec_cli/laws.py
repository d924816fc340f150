"""The law helpers the built-in verifiers are made of, public for plugin authors.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.plugins.laws`
"""

from __future__ import annotations

from .plugins.laws import (
    TINY,
    commit_after,
    commit_following,
    commit_known,
    commit_with_uniform,
    excess_or,
    excess_weights,
    first_accepted,
    first_rejection,
    normalized_excess,
    normalized_or,
    one_hot_mass,
    ratio_acceptance,
    row_at,
    sample,
    sample_with,
    single_draft_block,
    single_draft_draws,
    uniforms_like,
)

__all__ = [
    "TINY",
    "commit_after",
    "commit_following",
    "commit_known",
    "commit_with_uniform",
    "excess_or",
    "excess_weights",
    "first_accepted",
    "first_rejection",
    "normalized_excess",
    "normalized_or",
    "one_hot_mass",
    "ratio_acceptance",
    "row_at",
    "sample",
    "sample_with",
    "single_draft_block",
    "single_draft_draws",
    "uniforms_like",
]
