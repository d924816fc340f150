"""The plugin author's kit: tiny models, exact laws, statistical checks and the conformance checks.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.kit.testing`
- :mod:`specdec_cli.kit.conformance`
"""

from __future__ import annotations

from .kit.conformance import (
    ConformanceError,
    check_drafter,
    check_verifier,
)
from .kit.testing import (
    EOS_ID,
    PAD_ID,
    TINY_VOCAB,
    SequenceLaw,
    adversarial_distribution_pairs,
    candidate_acceptance,
    chi_square_p_value,
    committed_block_law,
    decision_outcomes,
    enumerate_block_law,
    enumerate_output_law,
    exact_sequence_law,
    expected_committed_tokens,
    optimal_acceptance,
    optimal_acceptance_two_drafts,
    random_distributions,
    random_sequence_laws,
    save_tiny_model,
    target_sequence_law,
    tiny_model,
    tiny_tokenizer,
)

__all__ = [
    "ConformanceError",
    "EOS_ID",
    "PAD_ID",
    "SequenceLaw",
    "TINY_VOCAB",
    "adversarial_distribution_pairs",
    "candidate_acceptance",
    "check_drafter",
    "check_verifier",
    "chi_square_p_value",
    "committed_block_law",
    "decision_outcomes",
    "enumerate_block_law",
    "enumerate_output_law",
    "exact_sequence_law",
    "expected_committed_tokens",
    "optimal_acceptance",
    "optimal_acceptance_two_drafts",
    "random_distributions",
    "random_sequence_laws",
    "save_tiny_model",
    "target_sequence_law",
    "tiny_model",
    "tiny_tokenizer",
]
