"""The block decision SpecInfer and SpecTr share: one rule, three paths.

A block of one row is speculative sampling's. On the CPU, where reads are free, the walk reads as it goes
(:func:`walk_reading`, one position's problem at a time). On a device every (first alive row, position)
problem is solved at once and the walk only looks results up (:func:`decide_problems`). Each verifier
gives the two pieces that are its own rule: how one position is decided on the host, and how every
problem is solved at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec_cli.base.randomness import Randomness
from specdec_cli.plugins.verifiers import (
    BlockDecision,
    decide_problems,
    prefix_agreement,
    problem_members,
    reads_are_free,
    walk_reading,
)

from .speculative import SpeculativeSampling

_ONE_DRAFT = SpeculativeSampling()  # built once: torch.compile cannot trace a verifier's construction

HostStep = Callable[[int, list[int], list[list[int]], list[list[float]]], tuple[int | None, torch.Tensor | None]]
"""``decide(t, alive, tokens, uniforms)`` of :func:`walk_reading`."""

ProblemSolver = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(target_probs, draft_probs, draft_tokens, members ``[K, L, K]``) → (accepts ``[K, L, K]``, residuals
``[K, L, V]``), as :func:`decide_problems` takes them."""


def verify_by_problems(
    target_probs: torch.Tensor,  # [K, L+1, V]
    draft_probs: torch.Tensor,  # [K, L, V]
    draft_tokens: torch.Tensor,  # [K, L]
    randomness: Randomness,
    host_step: Callable[[torch.Tensor, torch.Tensor], HostStep],
    solve_problems: ProblemSolver,
) -> BlockDecision:
    """One block of a multi-draft rule: speculative sampling for one row; on the CPU the walk with
    ``host_step(target_probs, draft_probs)`` deciding each position; on a device every problem (k, t) solved by
    ``solve_problems`` and decided by look-ups. Both test candidate j at offset t with the uniform (ACCEPT, t, j)
    and draw the residual or bonus token alike."""
    if draft_tokens.shape[0] == 1:
        return _ONE_DRAFT.verify_block(target_probs, draft_probs, draft_tokens, randomness)
    if reads_are_free(target_probs):
        return walk_reading(host_step(target_probs, draft_probs), target_probs, draft_tokens, randomness)
    agreement = prefix_agreement(draft_tokens)  # [K, K, L+1]
    accepts, residuals = solve_problems(target_probs, draft_probs, draft_tokens, problem_members(agreement))
    return decide_problems(accepts, residuals, agreement, target_probs, draft_tokens, randomness)
