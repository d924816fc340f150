"""Mentored decoding: the most accepting rule whose output stays within KL D of the target (lossy).

Source: "Mentored decoding" proof, §4 and Algorithm 1. With q = target, p = draft and
the ratio q_i/p_i, the optimum of  max R = Σ p_i r_i  s.t.  KL(q ‖ π) ≤ D  has two thresholds
α ≤ 1 ≤ β:

    q_i/p_i ≤ α:      r_i = q_i/(α p_i),  π_i = q_i/α
    α < q_i/p_i < β:  r_i = 1,            π_i = p_i
    q_i/p_i ≥ β:      r_i = 1,            π_i = q_i/β,  s_i ∝ q_i/β - p_i

with 1 - R = Σ (p_i - q_i/α)+ = Σ (q_i/β - p_i)+ fixing β from α (eq. 24, 27-28) and

    KL(α) = ln α Σ_{≤α} q_i + Σ_{]α,β[} q_i ln(q_i/p_i) + ln β Σ_{≥β} q_i.

KL decreases in α from KL(q‖p) (α → min q/p, R = 1) to 0 (α = 1: speculative sampling).
α is found by bisection until KL ∈ [(1-γ)D, (1+γ)D] (Algorithm 1), vectorised over the batch
with sorted cumulative sums; when KL(q‖p) ≤ D every draft token is accepted outright.
"""

from __future__ import annotations

import torch

from specdec_cli.verifiers import Verifier

from ._laws import first_accepted, normalized_or, row_at, single_draft_block

_BISECTION_STEPS = 64  # float64 bisection on ]0, 1] is exhausted well before this


class MentoredDecoding(Verifier):
    name = "mentored"
    lossless = False
    max_drafts = 1

    def __init__(self, *, kl: float = 0.0, tolerance: float = 1e-3):
        if not kl >= 0:
            raise ValueError(f"mentored: kl must be >= 0 (nats), got {kl}")
        if not 0 < tolerance < 1:
            raise ValueError(f"mentored: tolerance must be in ]0, 1[, got {tolerance}")
        self.kl = float(kl)
        self.tolerance = float(tolerance)

    def conditional(self, target_probs, draft_probs, draft_tokens):
        solution = _solve(target_probs, draft_probs[..., 0, :], self.kl, self.tolerance)
        x = draft_tokens[..., :1]  # [..., 1]
        r_x = solution.acceptance_of(x)  # [..., 1]
        law = (1 - r_x) * solution.residual()  # [..., V]
        return law.scatter_add(-1, x, r_x).to(target_probs.dtype)

    def select(self, target_probs, draft_probs, draft_tokens, generator=None):
        q, p = target_probs, draft_probs[..., 0, :]  # [..., V]
        x = draft_tokens[..., :1]  # [..., 1]
        u = torch.rand(x.shape, generator=generator, device=q.device, dtype=torch.float64)  # [..., 1]
        solution = _solve(q, p, self.kl, self.tolerance)
        return first_accepted(u, solution.acceptance_of(x), x, solution.residual(), generator)

    def verify_block(self, target_probs, draft_probs, draft_tokens, generator=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        solution = _solve(q[:-1], p, self.kl, self.tolerance)  # every position's α and β in one call
        accept = solution.acceptance_of(x.unsqueeze(-1)).squeeze(-1)  # [L]: r_x
        return single_draft_block(accept, lambda n: solution.residual_row(n).to(q.dtype), q, x, generator)

    def acceptance_probability(self, target_probs, draft_probs):
        """R = 1 - Σ (p_i - q_i/α)+ : exact, since the residual never returns a rejected token."""
        solution = _solve(target_probs, draft_probs[..., 0, :], self.kl, self.tolerance)
        return (1 - solution.rejected_mass.squeeze(-1)).to(target_probs.dtype)

    def output_kl(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """KL(q ‖ π) of the output law π, in nats → ``[...]`` (the quantity bounded by D(1+γ))."""
        solution = _solve(target_probs, draft_probs[..., 0, :], self.kl, self.tolerance)
        return solution.kl.squeeze(-1).to(target_probs.dtype)


class _Solution:
    """α, β and 1 - R for each row, and the laws they define (all float64)."""

    def __init__(self, q, p, alpha, beta, rejected_mass, kl):
        self.q, self.p = q, p  # [..., V]
        self.alpha, self.beta = alpha, beta  # [..., 1]; alpha = 0: accept everything
        self.rejected_mass = rejected_mass  # [..., 1]: 1 - R
        self.kl = kl  # [..., 1]

    def acceptance_of(self, x: torch.Tensor) -> torch.Tensor:
        """r_x = min(1, q_x/(α p_x)) for candidates ``x`` ``[..., 1]``."""
        q_x, p_x = self.q.gather(-1, x), self.p.gather(-1, x)  # [..., 1]
        ratio_over_alpha = q_x / (self.alpha * p_x)  # [..., 1]; inf where α = 0
        return torch.where(self.alpha > 0, ratio_over_alpha.clamp(max=1.0), torch.ones_like(q_x)).nan_to_num(1.0)

    def residual(self) -> torch.Tensor:
        """s = (q/β - p)+ / (1 - R) ``[..., V]``; unused (and set to q) where nothing is rejected."""
        return _residual(self.q, self.p, self.beta)

    def residual_row(self, index: torch.Tensor) -> torch.Tensor:
        """The residual of row ``index`` (a 0-dim device index) of a ``[N, V]`` solution → ``[V]``."""
        q, p, beta = (row_at(values, index) for values in (self.q, self.p, self.beta))  # [V], [V], [1]
        return _residual(q, p, beta)


def _residual(q: torch.Tensor, p: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return normalized_or((q / beta - p).clamp_min(0), q)


def _solve(target_probs: torch.Tensor, draft_probs: torch.Tensor, bound: float, tolerance: float) -> _Solution:
    q, p = target_probs.double(), draft_probs.double()  # [..., V]
    ratio = torch.where(q > 0, q / p, torch.zeros_like(q))  # [..., V]: inf where p = 0 < q
    order = ratio.argsort(-1)
    t = ratio.gather(-1, order)  # [..., V] ascending
    q_sorted, p_sorted = q.gather(-1, order), p.gather(-1, order)  # [..., V]
    zero = torch.zeros_like(q[..., :1])  # [..., 1]
    q_prefix = torch.cat([zero, q_sorted.cumsum(-1)], -1)  # [..., V+1]
    p_prefix = torch.cat([zero, p_sorted.cumsum(-1)], -1)  # [..., V+1]
    q_suffix = q_prefix[..., -1:] - q_prefix  # [..., V+1]: Σ_{i >= k}
    p_suffix = p_prefix[..., -1:] - p_prefix  # [..., V+1]
    q_log_ratio = torch.where(q_sorted > 0, q_sorted * (q_sorted / p_sorted).log(), torch.zeros_like(q_sorted))
    kl_prefix = torch.cat([zero, q_log_ratio.cumsum(-1)], -1)  # [..., V+1]

    def evaluate(alpha: torch.Tensor):
        """(β, 1 - R, KL) at α ``[..., 1]`` (α > 0)."""
        low = torch.searchsorted(t.contiguous(), alpha, right=True)  # [..., 1]: #{q/p <= α}
        q_low, p_low = q_prefix.gather(-1, low), p_prefix.gather(-1, low)  # [..., 1]
        rejected = (p_low - q_low / alpha).clamp_min(0)  # [..., 1]: 1 - R  (eq. 24)
        # β = max over suffixes S of q(S) / (p(S) + 1 - R)  (eq. 27-28: Σ (q_i - β p_i)+ = β (1 - R)).
        candidates = q_suffix[..., :-1] / (p_suffix[..., :-1] + rejected)  # [..., V]
        candidates = torch.where(q_suffix[..., :-1] > 0, candidates, torch.zeros_like(candidates))
        beta, start = candidates.max(-1, keepdim=True)  # [..., 1]
        beta = beta.clamp_min(1.0)
        start = torch.maximum(start, low)  # tokens with q/p >= β start here
        kl = (
            alpha.log() * q_low
            + (kl_prefix.gather(-1, start) - kl_prefix.gather(-1, low))
            + beta.log() * q_suffix.gather(-1, start)
        )  # [..., 1]
        return beta, rejected, kl

    full_kl = kl_prefix[..., -1:]  # [..., 1]: KL(q ‖ p), inf where p misses q's support
    ones = torch.ones_like(zero)
    lo, hi = zero.clone(), ones.clone()  # KL(lo) > D(1+γ) side, KL(hi) < D(1-γ) side
    found = torch.zeros_like(zero, dtype=torch.bool)
    alpha = ones.clone()
    if bound > 0:
        for _ in range(_BISECTION_STEPS):
            mid = (lo + hi) / 2
            _, _, kl = evaluate(mid)
            in_band = ~found & (kl >= (1 - tolerance) * bound) & (kl <= (1 + tolerance) * bound)
            alpha = torch.where(in_band, mid, alpha)
            found = found | in_band
            hi = torch.where(kl < (1 - tolerance) * bound, mid, hi)
            lo = torch.where(kl > (1 + tolerance) * bound, mid, lo)
        # A row that never entered the band (D beyond reach, or D = 0) keeps its safe end: KL < D.
        alpha = torch.where(found, alpha, hi)
    beta, rejected, kl = evaluate(alpha)
    outright = full_kl <= bound  # accept every draft token: π = p
    alpha = torch.where(outright, zero, alpha)
    beta = torch.where(outright, torch.full_like(beta, float("inf")), beta)
    rejected = torch.where(outright, zero, rejected)
    kl = torch.where(outright, full_kl, kl)
    return _Solution(q, p, alpha, beta, rejected, kl)
