"""The verifier contract (the registry that finds verifiers as entry-point plugins is :mod:`.registry`).

Notation (q = target law, p = draft law): after each block the engine hands a verifier the target's laws at every
position of every draft row of every sequence of the batch, the draft laws the tokens were sampled from, and the
draft tokens; the verifier decides, on the tensors' device, which draft prefix each sequence commits and which token
follows it, in one call (:meth:`BlockVerifier.verify`, ``[B, K, L+1, V]``, returning a :class:`Decision`).

- :class:`BlockVerifier` (:mod:`.block_verifier`) is the block-level contract. Schemes that decide a block jointly
  (block verification) implement ``verify`` for the batch or ``verify_block`` for one block, which the base class
  maps over the batch (the one adapter, :func:`decide_blocks`).
- :class:`Verifier` (:mod:`.token_level`) is the token-level contract (a selection rule at one position, given the K
  candidates there): plugins implement ``conditional`` and ``acceptance_probability``, and the base class builds
  the block call from ``select``.
- :mod:`.decisions`: the decision types and the engine's checks of them; :mod:`.walks`: the block walks the
  built-in rules are made of.

Plugins register a subclass of either under the entry-point group ``specdec.verifiers``; its constructor's keyword
arguments are its parameters. This module keeps the contract's one import path.
"""

from __future__ import annotations

from .block_verifier import (
    JUDGED_VIEWS,
    BlockVerifier,
    JudgedLaws,
    decide_blocks,
    device_path,
    judged_argument,
    reads_are_free,
)
from .decisions import (
    BatchDecision,
    BlockDecision,
    Decision,
    DecisionError,
    batch_decision_problem,
    batch_departs_from_drafts,
    decision_problem,
    decision_value_problem,
    departs_from_drafts,
)
from .token_level import Verifier
from .walks import (
    commit_following,
    commit_with_uniform,
    decide_problems,
    first_rejection,
    prefix_agreement,
    problem_members,
    shared_prefix_length,
    walk_alive_rows,
    walk_reading,
)

__all__ = [
    "JUDGED_VIEWS",
    "BatchDecision",
    "BlockDecision",
    "BlockVerifier",
    "Decision",
    "DecisionError",
    "JudgedLaws",
    "Verifier",
    "batch_decision_problem",
    "batch_departs_from_drafts",
    "commit_following",
    "commit_with_uniform",
    "decide_blocks",
    "decide_problems",
    "decision_problem",
    "decision_value_problem",
    "departs_from_drafts",
    "device_path",
    "first_rejection",
    "judged_argument",
    "prefix_agreement",
    "problem_members",
    "reads_are_free",
    "shared_prefix_length",
    "walk_alive_rows",
    "walk_reading",
]
