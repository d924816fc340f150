"""The verifier contract, where plugin authors import it.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.plugins.verifiers`
- :mod:`specdec_cli.plugins.registry`
- :mod:`specdec_cli.plugins.parameters`
"""

from __future__ import annotations

from .plugins.parameters import (
    parameter_defaults,
)
from .plugins.registry import (
    VerifierFault,
    VerifierParameterError,
    VerifierParameterValueError,
    VerifierRegistry,
    load_verifier,
)
from .plugins.verifiers import (
    BatchDecision,
    BlockDecision,
    BlockVerifier,
    Verifier,
    batch_decision_problem,
    batch_departs_from_drafts,
    commit_following,
    commit_with_uniform,
    decide_problems,
    decision_problem,
    decision_value_problem,
    departs_from_drafts,
    device_path,
    first_rejection,
    prefix_agreement,
    problem_members,
    reads_are_free,
    shared_prefix_length,
    walk_alive_rows,
    walk_reading,
)

__all__ = [
    "BatchDecision",
    "BlockDecision",
    "BlockVerifier",
    "Verifier",
    "VerifierFault",
    "VerifierParameterError",
    "VerifierParameterValueError",
    "VerifierRegistry",
    "batch_decision_problem",
    "batch_departs_from_drafts",
    "commit_following",
    "commit_with_uniform",
    "decide_problems",
    "decision_problem",
    "decision_value_problem",
    "departs_from_drafts",
    "device_path",
    "first_rejection",
    "load_verifier",
    "parameter_defaults",
    "prefix_agreement",
    "problem_members",
    "reads_are_free",
    "shared_prefix_length",
    "walk_alive_rows",
    "walk_reading",
]
