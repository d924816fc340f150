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
When KL(q‖p) ≤ D every draft token is accepted outright.

Solving KL = D exactly, in O(V log V) per position (this project's derivation from the proof's
closed form): write everything as a function of the rejected mass ρ = 1 - R. Then
α(ρ) = Q_≤α / (P_≤α - ρ) and β(ρ) = Q_≥β / (P_≥β + ρ) are monotone, and

    dKL/dρ = α - β ≤ 0,   d²KL/dρ² = α²/Q_≤α + β²/Q_≥β > 0  inside a segment,

so KL(ρ) is decreasing and, between two breakpoints (a token crossing α or β), smooth and convex.
One sort by q/p gives prefix sums of q, p and q ln(q/p); every breakpoint's KL is evaluated at
once; the bracketing segment's equation is solved by Newton's method from its left end (monotone
for a convex decreasing function). KL(q ‖ π) = D to rounding; the proof's Algorithm 1 bisected
into a band [(1-γ)D, (1+γ)D] instead, and ``tolerance`` (γ) is now accepted and ignored.
Tran-Thien & Nock (arXiv 2609.30474) treat this structure for every f-divergence; their text
was not reachable from this project's machines, so nothing here is taken from it.
"""

from __future__ import annotations

import functools
import math

import torch

from specdec_cli.verifiers import Verifier

from ._laws import first_accepted, normalized_or, row_at, single_draft_block

_NEWTON_STEPS = 24  # safeguarded Newton: quadratic once close
TINY = torch.finfo(torch.float64).tiny


class MentoredDecoding(Verifier):
    name = "mentored"
    lossless = False
    max_drafts = 1

    def __init__(self, *, kl: float = 0.0, tolerance: float | None = None):
        """``tolerance`` is accepted and ignored: the bound is now met exactly (kept so recipes still load)."""
        if not kl >= 0:
            raise ValueError(f"mentored: kl must be >= 0 (nats), got {kl}")
        if tolerance is not None and not 0 < tolerance < 1:
            raise ValueError(f"mentored: tolerance must be in ]0, 1[, got {tolerance}")
        self.kl = float(kl)

    def conditional(self, target_probs, draft_probs, draft_tokens):
        solution = self.solve(target_probs, draft_probs)
        x = draft_tokens[..., :1]  # [..., 1]
        r_x = solution.acceptance_of(x)  # [..., 1]
        law = (1 - r_x) * solution.residual()  # [..., V]
        return law.scatter_add(-1, x, r_x).to(target_probs.dtype)

    def select(self, target_probs, draft_probs, draft_tokens, generator=None):
        x = draft_tokens[..., :1]  # [..., 1]
        u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float64)  # [..., 1]
        solution = self.solve(target_probs, draft_probs)
        return first_accepted(u, solution.acceptance_of(x), x, solution.residual(), generator)

    def verify_block(self, target_probs, draft_probs, draft_tokens, generator=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        solution = _solve(q[:-1], p, self.kl)  # every position's α and β in one call
        accept = solution.acceptance_of(x.unsqueeze(-1)).squeeze(-1)  # [L]: r_x
        return single_draft_block(accept, lambda n: solution.residual_row(n).to(q.dtype), q, x, generator)

    def acceptance_probability(self, target_probs, draft_probs):
        """R = 1 - Σ (p_i - q_i/α)+ : exact, since the residual never returns a rejected token."""
        solution = self.solve(target_probs, draft_probs)
        return (1 - solution.rejected_mass.squeeze(-1)).to(target_probs.dtype)

    def solve(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> "_Solution":
        """α, β, 1 - R and KL for q ``[..., V]`` and one draft's p ``[..., 1, V]`` (float64)."""
        return _solve(target_probs, draft_probs[..., 0, :], self.kl)

    def output_kl(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """KL(q ‖ π) of the output law π, in nats → ``[...]``: D itself whenever D < KL(q ‖ p)."""
        solution = self.solve(target_probs, draft_probs)
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


def _solve(target_probs: torch.Tensor, draft_probs: torch.Tensor, bound: float) -> _Solution:
    """The exact optimum for every row: one sort by q/p, then a Newton solve inside one segment.

    Parametrised by the rejected mass ρ = 1 - R, α(ρ) and β(ρ) are both monotone and
    dKL/dρ = α - β ≤ 0, so KL(ρ) = D has one root. A binary search over the breakpoints (ρ where
    a token crosses α or β) finds the segment that holds it; inside, KL(ρ) is smooth and convex
    and a safeguarded Newton iteration finds the root to rounding.
    """
    # Renormalised in float64: float32 laws sum to 1 only within 1e-7, and the closed form relies on
    # Σq = Σp (e.g. Σ (p - q/α)+ = Σ (q/β - p)+) far more tightly than that.
    q, p = (probs.double() / probs.double().sum(-1, keepdim=True) for probs in (target_probs, draft_probs))
    table = _SortedTable(q, p)
    low, high = table.bracket(bound)  # [..., 1] each
    # D = 0 is speculative sampling (α = β = 1), a double root that Newton only approaches.
    rho = table.newton(low, high, bound) if bound > 0 else table.rho_max  # [..., 1]
    alpha, beta, divergence = table.at(rho, *table.segment(low))
    outright = table.full_kl <= bound  # accept every draft token: π = p
    zero = torch.zeros_like(rho)
    return _Solution(
        table.q, table.p,
        alpha=torch.where(outright, zero, alpha),
        beta=torch.where(outright, torch.full_like(beta, float("inf")), beta),
        rejected_mass=torch.where(outright, zero, rho),
        kl=torch.where(outright, table.full_kl, divergence),
    )  # fmt: skip


class _SortedTable:
    """q and p sorted by t = q/p, with the prefix sums every KL evaluation needs (float64).

    Zero-q tokens sort first (t = 0, always rejected), p = 0 < q tokens last (t = ∞, always in β's
    group). A segment is (l, h): tokens [0, l) have t ≤ α, tokens [h, V) have t ≥ β.
    """

    def __init__(self, q: torch.Tensor, p: torch.Tensor):
        self.q, self.p = q, p  # [..., V]
        ratio = torch.where(q > 0, q / p, torch.zeros_like(q))  # [..., V]
        self.t, order = ratio.sort(-1)  # [..., V] ascending
        q_sorted, p_sorted = q.gather(-1, order), p.gather(-1, order)  # [..., V]
        q_log_ratio = torch.where(q_sorted > 0, q_sorted * self.t.log(), torch.zeros_like(q_sorted))  # [..., V]
        self.q_prefix, self.p_prefix, self.kl_prefix = (
            torch.nn.functional.pad(values.cumsum(-1), (1, 0)) for values in (q_sorted, p_sorted, q_log_ratio)
        )  # [..., V+1] each: Σ over tokens [0, k)
        self.q_suffix = self.q_prefix[..., -1:] - self.q_prefix  # [..., V+1]: Σ over [k, V)
        self.p_suffix = self.p_prefix[..., -1:] - self.p_prefix  # [..., V+1]
        self.full_kl = self.kl_prefix[..., -1:]  # [..., 1]: KL(q ‖ p), inf where p misses q's support
        # ρ at which α reaches t_k (tokens with t > 1 are never below α ≤ 1): non-decreasing in k.
        alpha_rho = self.p_prefix[..., 1:] - self.q_prefix[..., 1:] / self.t.clamp_min(TINY)  # [..., V]
        self.alpha_rho = torch.where(self.t <= 1, alpha_rho, torch.full_like(alpha_rho, float("inf")))
        # -ρ at which β reaches t_j (β ≥ 1, so only tokens with t ≥ 1): non-decreasing in j.
        beta_rho = (self.p_suffix[..., :-1] - self.q_suffix[..., :-1] / self.t).clamp_max(0)  # [..., V]
        self.minus_beta_rho = torch.where(self.t >= 1, beta_rho, torch.full_like(beta_rho, -float("inf")))
        self.rho_min = self.p_prefix.gather(-1, (self.t == 0).sum(-1, keepdim=True))  # [..., 1]: p(q = 0)
        self.rho_max = (self.p - self.q).clamp_min(0).sum(-1, keepdim=True)  # [..., 1]: α = 1, speculative

    def bracket(self, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The two consecutive breakpoints ρ (a token crossing α or β) with KL ≥ D at the first and
        KL < D at the second (ρ_min and ρ_max at the ends) → ``[..., 1]`` each."""
        clip = functools.partial(_clip, low=self.rho_min, high=self.rho_max)
        low, high = self.rho_min, self.rho_max
        # α's breakpoints ascend with the token index, β's descend: flipped so both ascend.
        for points in (clip(self.alpha_rho), clip(-self.minus_beta_rho).flip(-1)):  # [..., V] each
            count = self._count_at_or_above(points, bound)  # [..., 1]
            last = points.gather(-1, (count - 1).clamp_min(0))
            following = points.gather(-1, count.clamp(max=points.shape[-1] - 1))
            low = torch.maximum(low, torch.where(count > 0, last, self.rho_min))
            high = torch.minimum(high, torch.where(count < points.shape[-1], following, self.rho_max))
        return low, high.clamp_min(low)

    def _count_at_or_above(self, points: torch.Tensor, bound: float) -> torch.Tensor:
        """How many of the ascending ``points`` ``[..., V]`` have KL ≥ D (a prefix: KL falls with ρ),
        by binary search: O(log V) evaluations of KL, each O(log V)."""
        size = points.shape[-1]
        low = torch.zeros_like(points[..., :1], dtype=torch.long)  # [..., 1]
        high = torch.full_like(low, size)
        for _ in range(size.bit_length()):
            middle = (low + high) // 2
            above = (self.kl_at(points.gather(-1, middle.clamp(max=size - 1))) >= bound) & (middle < high)
            low = torch.where(above, middle + 1, low)
            high = torch.where(above, high, middle)
        return low

    def segment(self, rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(l, h) for ρ ``[..., M]`` (the segment just right of ρ at a breakpoint) → two ``[..., M]``."""
        low = torch.searchsorted(self.alpha_rho.contiguous(), rho.contiguous(), right=True)
        high = torch.searchsorted(self.minus_beta_rho.contiguous(), (-rho).contiguous(), right=False)
        return low, high

    def at(self, rho: torch.Tensor, low: torch.Tensor, high: torch.Tensor):
        """α, β and KL(ρ) ``[..., M]`` each, for ρ inside segment (l, h) (eq. 24, 27-28)."""
        return _Segment(self, low, high).at(rho)

    def kl_at(self, rho: torch.Tensor) -> torch.Tensor:
        return self.at(rho, *self.segment(rho))[2]

    def newton(self, low: torch.Tensor, high: torch.Tensor, bound: float) -> torch.Tensor:
        """The root of KL(ρ) = D in [low, high] ``[..., 1]`` (KL ≥ D at low, < D at high).

        Two Newton steps are on offer each iteration. On √KL - √D: fast near ρ_max, where KL
        vanishes quadratically (α and β both reach 1) and Newton on KL would only halve the error
        per step; but it may overshoot. On KL from the bracket's left end: never overshoots (KL is
        convex and decreasing), so it is the fallback whenever the first leaves the bracket.
        """
        segment = _Segment(self, *self.segment(low))
        rho = safe = low  # the first iteration evaluates at low and sets the first safe step
        for _ in range(_NEWTON_STEPS):
            alpha, beta, kl = segment.at(rho)
            above = kl >= bound  # [..., 1]
            slope = (alpha - beta).clamp(max=-TINY)  # [..., 1]: dKL/dρ
            low = torch.where(above, rho, low)
            high = torch.where(above, high, rho)
            safe = torch.where(above, rho - (kl - bound) / slope, safe).clamp(min=low, max=high)
            root = kl.clamp_min(0).sqrt()
            fast = rho - (root - math.sqrt(bound)) * 2 * root / slope  # Newton on √KL: d√KL = dKL / 2√KL
            # KL = ∞ at ρ = 0 when p misses q's support: no step from there, so bisect once.
            fallback = torch.where(safe.isfinite(), safe, (low + high) / 2)
            rho = torch.where((fast > low) & (fast < high), fast, fallback)
        return rho


class _Segment:
    """The sums that stay fixed while ρ moves inside one segment (l, h): KL(ρ) in O(1)."""

    def __init__(self, table: _SortedTable, low: torch.Tensor, high: torch.Tensor):
        high = high.clamp(max=table.t.shape[-1] - 1)  # the largest ratio is always in β's group
        self.q_low, self.p_low = table.q_prefix.gather(-1, low), table.p_prefix.gather(-1, low)  # [..., M]
        self.q_high, self.p_high = table.q_suffix.gather(-1, high), table.p_suffix.gather(-1, high)  # [..., M]
        self.band = table.kl_prefix.gather(-1, high) - table.kl_prefix.gather(-1, low)  # [..., M]

    def at(self, rho: torch.Tensor):
        """α, β and KL at ρ ``[..., M]``."""
        # Only zero-q tokens below α: any α below the smallest positive ratio; TINY stands for it.
        alpha = torch.where(self.q_low > 0, self.q_low / (self.p_low - rho).clamp_min(TINY), TINY)
        beta = self.q_high / (self.p_high + rho)  # [..., M]
        return alpha, beta, self.q_low * alpha.log() + self.band + self.q_high * beta.log()


def _clip(values: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return torch.maximum(torch.minimum(values, high), low)
