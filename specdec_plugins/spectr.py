"""SpecTr's K-SEQ selection (Sun et al. 2023, Algorithm 2 and Theorem 2), lossless.

The rule in the project's notation: docs/verifiers.md §4.

For K i.i.d. candidates from one draft law p, with β(ρ) = Σ_x min(p(x), q(x)/ρ) and
p_acc(ρ) = 1 - (1 - β(ρ))^K, ρ ∈ [1, K] solves p_acc(ρ) = ρ β(ρ) (bisection, rounded up so
that p_acc ≤ ρ β, which keeps the residual non-negative)::

    for k = 1..K:  accept x_k with probability min(1, q(x_k) / (ρ p(x_k))); return the first accepted
    none:          sample p_res = (q - min(p, q/ρ) · p_acc/β)+ / (1 - p_acc)

Acceptance = p_acc(ρ); K = 1 gives ρ = 1, i.e. speculative sampling. Defined for identical
drafts only: different draft laws are an error.
"""

from __future__ import annotations

import torch

from specdec_cli.errors import UsageError
from specdec_cli.verifiers import Verifier

from ._laws import TINY, first_accepted, normalized_or, one_hot_mass, ratio_acceptance, uniforms_like

_BISECTION_STEPS = 60


class SpecTr(Verifier):
    name = "spectr"
    lossless = True
    max_drafts = None
    identical_drafts = True

    def conditional(self, target_probs, draft_probs, draft_tokens):
        p = _identical_law(draft_probs)  # [..., V]
        rho, p_acc, beta = _solve_rho(target_probs, p, draft_probs.shape[-2])  # [..., 1] each
        law = torch.zeros_like(target_probs)  # [..., V]
        reach = torch.ones_like(rho)  # [..., 1]
        for k in range(draft_tokens.shape[-1]):
            x = draft_tokens[..., k : k + 1]  # [..., 1]
            accept = ratio_acceptance(target_probs, p, x, rho)  # [..., 1]
            law = one_hot_mass(law, x, reach * accept)
            reach = reach * (1 - accept)
        return law + reach * _residual(target_probs, p, rho, p_acc, beta)

    def select(self, target_probs, draft_probs, draft_tokens, generator=None):
        p = _identical_law(draft_probs)  # [..., V]
        rho, p_acc, beta = _solve_rho(target_probs, p, draft_probs.shape[-2])
        accepts = ratio_acceptance(target_probs, p, draft_tokens, rho)  # [..., K]
        residual = _residual(target_probs, p, rho, p_acc, beta)  # [..., V]
        return first_accepted(uniforms_like(accepts, generator), accepts, draft_tokens, residual, generator)

    def select_alive(self, target_probs, draft_probs, draft_tokens, alive, generator=None):
        # Alive rows share their prefix, so their laws are equal (the engine checked the drafts are
        # identical): read the first alive row's, and solve for ρ with K' = the alive count.
        p = draft_probs.index_select(0, alive.to(torch.uint8).argmax().view(1)).squeeze(0)  # [V]
        count = alive.sum().clamp(min=1).to(target_probs.dtype)  # []
        rho, p_acc, beta = _solve_rho(target_probs, p, count.view(1))  # [1] each
        accepts = torch.where(alive, ratio_acceptance(target_probs, p, draft_tokens, rho), 0.0)  # [K]
        residual = _residual(target_probs, p, rho, p_acc, beta)  # [V]
        return first_accepted(uniforms_like(accepts, generator), accepts, draft_tokens, residual, generator)[0]

    def acceptance_probability(self, target_probs, draft_probs):
        _, p_acc, _ = _solve_rho(target_probs, _identical_law(draft_probs), draft_probs.shape[-2])
        return p_acc.squeeze(-1)


def _identical_law(draft_probs: torch.Tensor) -> torch.Tensor:
    """The common law of the K drafts ``[..., K, V]`` → ``[..., V]``; an error if they differ.

    On a GPU the check would cost a host synchronisation per call, so there the engine's recipe
    check (``identical_drafts``) is what guards it.
    """
    first = draft_probs[..., 0, :]  # [..., V]
    if draft_probs.shape[-2] > 1 and not draft_probs.is_cuda:
        if not torch.allclose(draft_probs, first.unsqueeze(-2).expand_as(draft_probs), rtol=1e-5, atol=1e-8):
            raise UsageError(
                "spectr needs identical drafts (one draft config sampled K times); these drafts follow different "
                "laws: use specinfer, is-lp or is-truncated for different drafts"
            )
    return first


def _beta(target_probs: torch.Tensor, p: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    return torch.minimum(p, target_probs / rho).sum(-1, keepdim=True)  # [..., 1]


def _solve_rho(target_probs: torch.Tensor, p: torch.Tensor, num_drafts):
    """ρ ∈ [1, K] with p_acc(ρ) ≤ ρ β(ρ) as tight as bisection gets → (ρ, p_acc, β), each ``[..., 1]``.

    ``num_drafts`` is an int, or a tensor broadcastable to ``[..., 1]`` (a count known only on the device).
    """
    lo = torch.ones_like(target_probs[..., :1])  # p_acc >= ρ β here
    hi = lo * num_drafts  # p_acc <= ρ β here (union bound)
    several = hi > 1  # [..., 1]: K = 1 is speculative sampling, ρ = 1
    for _ in range(_BISECTION_STEPS if (not isinstance(num_drafts, int) or num_drafts > 1) else 0):
        mid = (lo + hi) / 2
        beta = _beta(target_probs, p, mid)
        feasible = 1 - (1 - beta) ** num_drafts <= mid * beta  # [..., 1]
        hi = torch.where(feasible, mid, hi)
        lo = torch.where(feasible, lo, mid)
    rho = torch.where(several, hi, lo)
    beta = _beta(target_probs, p, rho)
    return rho, 1 - (1 - beta) ** num_drafts, beta


def _residual(target_probs, p, rho, p_acc, beta):
    """p_res ``[..., V]``; target_probs where nothing is left (then it is never sampled)."""
    excess = (target_probs - torch.minimum(p, target_probs / rho) * (p_acc / beta.clamp_min(TINY))).clamp_min(0)
    return normalized_or(excess, target_probs)
