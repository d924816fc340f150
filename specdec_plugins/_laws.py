"""Small pieces of probability shared by the built-in verifiers (pure tensor functions, no host reads)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec_cli.sampling import sample
from specdec_cli.verifiers import BlockDecision

TINY = torch.finfo(torch.float64).tiny


def normalized_or(excess: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``excess`` ``[..., V]`` normalised; ``fallback`` in the rows where it has no mass.

    A residual with no mass belongs to a candidate accepted with probability 1, so that row is
    never sampled; the fallback only keeps it a valid law without a division by zero.
    """
    mass = excess.sum(-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, excess / mass.clamp_min(TINY), fallback)


def normalized_excess(target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """(target - proposal)+ normalised ``[..., V]``; ``target`` itself where the excess is empty."""
    return normalized_or((target - proposal).clamp_min(0), target)


def ratio_acceptance(target: torch.Tensor, proposal: torch.Tensor, x: torch.Tensor, scale=1.0) -> torch.Tensor:
    """min(1, target(x) / (scale · proposal(x))) for candidates ``x`` ``[..., k]`` → ``[..., k]``.

    proposal(x) > 0 for a candidate drawn from it; the floor only guards unused rows.
    """
    target_x, proposal_x = target.gather(-1, x), proposal.gather(-1, x)  # [..., k]
    return (target_x / (scale * proposal_x).clamp_min(TINY)).clamp(max=1.0)


def one_hot_mass(law: torch.Tensor, x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``law`` plus ``mass`` ``[..., 1]`` on token ``x`` ``[..., 1]``."""
    return law.scatter_add(-1, x, mass)


def first_accepted(
    uniforms: torch.Tensor,
    accepts: torch.Tensor,
    draft_tokens: torch.Tensor,
    residual: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate k is accepted when ``uniforms[..., k] < accepts[..., k]``; the first accepted one is
    the output, otherwise a draw from ``residual`` ``[..., V]`` → (token ``[...]``, accepted ``[...]``).
    """
    taken = uniforms < accepts  # [..., K]
    first = taken.long().argmax(-1, keepdim=True)  # [..., 1]
    accepted = taken.any(-1)  # [...]
    token = torch.where(accepted, draft_tokens.gather(-1, first).squeeze(-1), sample(residual, generator))
    return token, accepted


def uniforms_like(accepts: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(accepts.shape, generator=generator, device=accepts.device, dtype=accepts.dtype)


def row_at(laws: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``laws[index]`` for a 0-dim device index, without turning the index into a Python int."""
    return laws.index_select(0, index.view(1)).squeeze(0)


def single_draft_block(
    accept: torch.Tensor,
    residual_at: Callable[[torch.Tensor], torch.Tensor],
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None,
) -> BlockDecision:
    """A single-draft token-level block decided at once (gpt-fast's and vLLM's rejection sampler).

    accept ``[L]``: each draft token's acceptance probability; one uniform per position, the
    first rejection by a cumulative product, and one draw: from ``residual_at(n)`` ``[V]`` at the
    first rejected position n, or the bonus token (see :func:`commit_after`). draft_tokens ``[L]``.
    """
    draft_length = draft_tokens.shape[0]
    accepted = uniforms_like(accept, generator) < accept  # [L]
    num_accepted = accepted.long().cumprod(0).sum()  # []
    rejected_at = num_accepted.clamp(max=draft_length - 1)  # []: a valid row even when none was rejected
    return commit_after(num_accepted, residual_at(rejected_at), target_probs, draft_tokens, generator)


def commit_after(
    num_accepted: torch.Tensor,
    residual: torch.Tensor,
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None,
) -> BlockDecision:
    """The single-draft decision once ``num_accepted`` ``[]`` draft tokens are kept.

    The next token is drawn from ``residual`` ``[V]`` (weights, after a rejection) or, when all
    L were accepted, from q after the whole block (target_probs ``[L+1, V]``: the bonus token),
    and placed after the accepted prefix of draft_tokens ``[L]``.
    """
    law = torch.where(num_accepted < draft_tokens.shape[0], residual, row_at(target_probs, num_accepted))  # [V]
    token = sample(law, generator).view(1)  # [1]
    tokens = torch.cat([draft_tokens, token]).scatter(0, num_accepted.view(1), token)  # [L+1]
    return BlockDecision(tokens, num_accepted, torch.zeros_like(num_accepted))
