"""Mentored decoding's KL rule on the device path: the closed form inside one segment (:class:`_Segment`),
the solution it defines (:class:`_Solution`), and the sorted solve (:func:`_solve_by_sorting`), which the CPU
path's set steps (:mod:`._mentored_sets`) fall back to. The derivation: :mod:`._mentored_solve`."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.nn.functional import pad

from specdec_cli.plugins.laws import excess_or, normalized_or, row_at

TINY, _LARGEST = torch.finfo(torch.float64).tiny, torch.finfo(torch.float64).max
# Device path: KL at the breakpoints, at ρ_max/8191 steps and at ρ_max times 2^-1074 ... 2^0 in 8192 geometric
# steps (ratio 1.095) brackets the root; KL at 8192 points across that bracket narrows it to 2⁻²⁶ ρ_max, or
# 1e-5 of ρ, and two Newton steps take it to rounding (D from 1e-6 to 3 nats, V from 2 up:
# tests/test_mentored_solve.py; one step, or 2⁻²⁰, leaves 1e-7 relative error on KL).
_GRID_POINTS, _NEWTON_STEPS = 8192, 2
_SMALLEST_EXPONENT = -1074  # float64's smallest positive number is 2^-1074


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` ``[..., V]`` in float64 summing to 1: float32 laws sum to 1 only within 1e-7, and the closed
    form relies on Σq = Σp (e.g. Σ (p - q/α)+ = Σ (q/β - p)+) far more tightly than that. (A float32 law
    divided by a float64 sum is divided in float64.)"""
    return probs / probs.sum(-1, keepdim=True, dtype=torch.float64)


def _ratio(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """t = q/p ``[..., V]``: 0 where q = 0 (also where p = 0 too), ∞ where p = 0 < q."""
    return (q / p).nan_to_num(0.0, posinf=math.inf)


def _pair_direction(like: torch.Tensor) -> torch.Tensor:
    """(-1, 1) shaped ``[2, 1, ...]``, as many dimensions as ``like``, to broadcast over pairs ``[2, ..., M]``:
    ρ's sign in the denominators (P_low - ρ, P_high + ρ)."""
    return torch.linspace(-1.0, 1.0, 2, dtype=like.dtype, device=like.device).view(2, *[1] * (like.dim() - 1))


class _Solution:
    """α, β and 1 - R for each row, and the laws they define (all float64)."""

    def __init__(self, q, p, ratio, thresholds, rejected_mass, zero_q_acceptance, kl_of: Callable[[], torch.Tensor]):
        self.q, self.p, self.ratio = q, p, ratio  # [..., V] each; ratio = q/p (:func:`_ratio`)
        self.alpha, self.beta = thresholds  # [..., 1] each: α (0: no positive-q token is cut), β
        self.rejected_mass = rejected_mass  # [..., 1]: 1 - R
        # Where α = 0 the zero-q tokens are the only ones cut: they share the rejected mass.
        self.zero_q_acceptance = zero_q_acceptance  # [..., 1]; unused where α > 0
        self._kl_of = kl_of

    @functools.cached_property
    def kl(self) -> torch.Tensor:
        """KL(q ‖ π) ``[..., 1]``, computed when asked: a block's decision never needs it."""
        return self._kl_of()

    @property
    def thresholds(self) -> torch.Tensor:
        return torch.cat([self.alpha, self.beta], -1)  # [..., 2]

    @classmethod
    def speculative(cls, q, p) -> "_Solution":
        rejected_mass = (p - q).clamp_min(0).sum(-1, keepdim=True)  # [..., 1]
        one = torch.ones_like(rejected_mass)
        return cls(q, p, _ratio(q, p), (one, one), rejected_mass, one, lambda: torch.zeros_like(rejected_mass))

    def output_law(self) -> torch.Tensor:
        """π ``[..., V]``: q/α where t ≤ α, p where α < t < β, q/β where t ≥ β, i.e. p clipped to [q/β, q/α]
        (π_i = q_i / clip(t_i, α, β)). A token with q = 0 < p gets 0 where α > 0, and p times the zero-q tokens'
        shared acceptance where α = 0 (0/0); a row within the bound (α = 0, β = ∞, that acceptance 1) gets p."""
        below = self.q / self.alpha  # [..., V]: q/α; ∞ where α = 0 < q, NaN where α = q = 0
        below = torch.where(below.isnan(), self.zero_q_acceptance * self.p, below)
        return self.p.clamp(self.q / self.beta, below)  # q/β ≤ q/α, as β ≥ α

    def acceptance_of(self, x: torch.Tensor) -> torch.Tensor:
        """r_x = min(1, t_x/α) for candidates ``x`` ``[..., 1]``: 1 where α = 0 < q_x, 0 where q_x = 0 < α,
        and the zero-q tokens' shared acceptance where both are 0 (0/0)."""
        ratio_over_alpha = self.ratio.gather(-1, x) / self.alpha  # [..., 1]
        return torch.where(ratio_over_alpha.isnan(), self.zero_q_acceptance, ratio_over_alpha.clamp(max=1.0))

    def _excess(self) -> torch.Tensor:
        """(q - β p)+ = β (q/β - p)+ ``[..., V]``, the residual up to its scale (NaN where β = ∞ meets p = 0:
        in rows that accept every draft token, whose residual is never drawn from and falls back to q)."""
        return torch.addcmul(self.q, self.beta, self.p, value=-1).clamp_min(0)

    def residual(self) -> torch.Tensor:
        """s = (q/β - p)+ / (1 - R) ``[..., V]``; unused (and set to q) where nothing is rejected."""
        return normalized_or(self._excess(), self.q)

    def residual_weights(self) -> torch.Tensor:
        """The residual's weights (:func:`excess_or`) ``[..., V]``: (q/β - p)+, q where nothing is rejected."""
        return excess_or(self._excess(), self.q)

    def residual_row(self, index: torch.Tensor) -> torch.Tensor:
        """:meth:`residual_weights` at row ``index`` (a 0-dim device index) of a ``[N, V]`` solution → ``[V]``: what
        a block draws its correction from."""
        return row_at(self.residual_weights(), index)

    def residual_on_host(self) -> torch.Tensor:
        """:meth:`residual_row` of a one-row solution ``[1, V]`` → ``[V]``, its fallback chosen on the host."""
        excess = torch.addcmul(self.q[0], self.beta[0], self.p[0], value=-1).clamp_min_(
            0
        )  # [V]: :meth:`_excess`, in place
        return excess if float(excess.sum()) > 0 else self.q[0]


def _solution_at(q, p, ratio, segment: "_Segment", rho, outright, bound: float) -> _Solution:
    """The solution at the root ρ ``[1, ..., 1]`` of ``segment`` ``[2, ..., 1]``, or π = p (α = 0, β = ∞,
    1 - R = 0) where ``outright`` ``[1, ..., 1]`` (there ρ must be 0)."""
    denominators = segment.denominators(rho)  # [2, ..., 1]: (P_low - ρ, P_high + ρ)
    accept_all = torch.where(segment.direction > 0, math.inf, 0.0)  # [2, 1, ...]: α = 0, β = ∞
    thresholds = torch.where(outright, accept_all, segment.q / denominators).unbind()  # ([..., 1],) * 2
    # Where α = 0: 1 - ρ/P_low, with P_low = p(q = 0); 1 where ρ = 0.
    zero_q_acceptance = (denominators / segment.p.clamp_min(TINY))[0]  # [..., 1]

    def kl() -> torch.Tensor:
        root_kl = segment.excess(rho)[1][0] + bound  # [..., 1]
        return torch.where(outright[0], torch.xlogy(q, ratio).sum(-1, keepdim=True), root_kl)

    return _Solution(q, p, ratio, thresholds, rho[0], zero_q_acceptance, kl)


class _Segment:
    """The sums that stay fixed while ρ moves inside one segment (eq. 24, 27-28), for a batch ``[..., M]``,
    as pairs (below α, above β) along dim 0: ``q`` = (Q_low, Q_high) and ``p`` = (P_low, P_high)
    ``[2, ..., M]``, and ``offset`` ``[2, ..., M]``, whose pair sums to the band's Σ q ln(q/p) + Q_low ln Q_low
    + Q_high ln Q_high - D, so that

        KL(ρ) - D = Σ offset - Q_low ln(P_low - ρ) - Q_high ln(P_high + ρ),
        α = Q_low/(P_low - ρ),  β = Q_high/(P_high + ρ).

    α = 0 where only zero-q tokens are below it (Q_low = 0). ρ is ``[1, ..., M]``.
    """

    def __init__(self, q: torch.Tensor, p: torch.Tensor, offset: torch.Tensor, direction: torch.Tensor):
        self.q, self.p, self.offset = q, p, offset
        self.direction = direction  # [2, 1, ...]: :func:`_pair_direction`

    @classmethod
    def of_sums(cls, q, p, band, bound: float) -> "_Segment":
        """From (Q_low, Q_high), (P_low, P_high) ``[2, ..., M]`` and the band's Σ q ln(q/p) ``[1, ..., M]``."""
        return cls(q, p, torch.xlogy(q, q) + (band - bound) / 2, _pair_direction(q))

    def denominators(self, rho: torch.Tensor) -> torch.Tensor:
        """(P_low - ρ, P_high + ρ) ``[2, ..., M]`` at ρ ``[1, ..., M]``, at least float64's smallest normal
        number: P_high + ρ = 0 < Q_high at ρ = 0 where p misses part of q's support (then KL ≥ D there
        exactly when the root is at least that number), and P_low - ρ = 0 < Q_low by rounding at the
        turn (α = 1) where Q_low is below Σ p's rounding (e.g. 6e-18): a finite KL there, not ∞ ≥ D."""
        return torch.addcmul(self.p, self.direction, rho).clamp_min(TINY)

    def excess(self, rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(denominators ``[2, ..., M]``, KL - D ``[1, ..., M]``) at ρ ``[1, ..., M]``, finite everywhere."""
        denominators = self.denominators(rho)
        return denominators, (self.offset - torch.xlogy(self.q, denominators)).sum(0, keepdim=True)

    def pick(self, index: torch.Tensor) -> "_Segment":
        """The segments at ``index`` ``[1, ..., 1]`` along M → a ``[2, ..., 1]`` segment."""
        pair_index = index.expand(2, *index.shape[1:])  # [2, ..., 1]
        return _Segment(*(field.gather(-1, pair_index) for field in (self.q, self.p, self.offset)), self.direction)

    def root_between(self, low: torch.Tensor, high: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The root of KL(ρ) = D in [low, high] ``[1, ..., 1]`` (KL ≥ D at low, < D at high).

        KL at the points of ``grid`` ``[K]`` (0 to 1) across the bracket at once narrows it (robust where
        Newton is slow: at the double root ρ_max when D is small, or near a log singularity), then
        ``_NEWTON_STEPS`` Newton steps from its left end, which on a convex falling KL climb to the
        root without overshooting it.
        """
        points = torch.addcmul(low, high - low, grid)  # [1, ..., K]
        above = self.excess(points)[1] >= 0  # [1, ..., K]; low itself counts as above even if rounding says no
        low = torch.where(above, points, low).amax(-1, keepdim=True)  # [1, ..., 1]
        high = torch.where(above, math.inf, points).amin(-1, keepdim=True)
        rho = low
        for _ in range(_NEWTON_STEPS):
            denominators, excess = self.excess(rho)
            rho = torch.addcdiv(rho, excess, (self.q / denominators).diff(dim=0))  # ÷ (β - α) = -dKL/dρ
        return rho.clamp(low, high)


class _SortedTable:
    """q and p sorted by t = q/p, with the prefix sums every KL evaluation needs (float64, rows ``[..., V]``).

    Zero-q tokens sort first (t = 0, always below α), p = 0 < q tokens last (t = ∞, always above β).
    A segment is (l, h): tokens [0, l) have t ≤ α, tokens [h, V) have t ≥ β.
    """

    def __init__(self, q: torch.Tensor, p: torch.Tensor, bound: float):
        self.bound = bound
        self.ratio = _ratio(q, p)  # [..., V]
        t, order = self.ratio.sort(-1)  # [..., V] ascending
        q_sorted, p_sorted = q.gather(-1, order), p.gather(-1, order)  # [..., V]
        prefix = pad(torch.stack([q_sorted, p_sorted, torch.xlogy(q_sorted, t)]).cumsum(-1), (1, 0))  # [3, ..., V+1]
        # [2, ..., 1]: Σ q, Σ p; [1, ..., 1]: KL(q ‖ p), ∞ where p misses q's support
        totals, self.full_kl = prefix[..., -1:].split(2)
        # (Σ q, Σ p, Σ q ln t) over [0, k) below each k, and (Σ q, Σ p over [k, V); D - Σ q ln t over [0, k)) from
        # it on (exact 0 over a tail of p = 0): one gather at (l, h) gives a segment's sums, and its last pair sums
        # to minus its band plus D. No sum of q ln t over [k, V), which is ∞ where p misses q's support.
        suffix = pad(totals, (0, 0) * q.dim() + (0, 1), value=bound) - prefix  # [3, ..., V+1]
        self.sums = torch.stack([prefix, suffix], 1)  # [3, 2, ..., V+1]
        q_sums, p_sums, _ = self.sums[..., :-1].unbind()  # [2, ..., V] each
        # ρ at which α reaches t_k, and minus the ρ at which β reaches t_k, both non-decreasing in k:
        # Σ p - Σ q/t_k below k, and from k on. Where t_k > 1 (< 1) they lie past ρ_max, which α ≤ 1 (β ≥ 1)
        # never reaches.
        # Zero-q tokens are below any α > 0, so all are in from ρ = 0 on (0/0 → 0; α = 0 until ρ = p(q = 0)).
        self.breakpoints = torch.addcdiv(p_sums, q_sums, t, value=-1).nan_to_num(0.0)  # [2, ..., V]
        self.rho_max = (p_sums - q_sums).amax((0, -1), keepdim=True)  # [1, ..., 1]: Σ (p - q)+, α = β = 1
        self.direction = _pair_direction(self.rho_max)

    def segments(self, alpha_rho, minus_beta_rho, rho: torch.Tensor) -> _Segment:
        """The segments just right of ρ ``[1, ..., M]`` (at a breakpoint: the one it opens) → ``[2, ..., M]``,
        from the breakpoints ``[1, ..., V]`` each."""
        low = torch.searchsorted(alpha_rho, rho, right=True)  # [1, ..., M]
        high = torch.searchsorted(minus_beta_rho, -rho)
        index = torch.cat([low, high]).clamp_max(self.ratio.shape[-1] - 1)  # [2, ..., M]; the largest t is above β
        q, p, weights = self.sums.gather(-1, index.unsqueeze(0).expand(3, *index.shape)).unbind()  # [2, ..., M] each
        return _Segment(q, p, torch.xlogy(q, q) - weights, self.direction)

    def root(self) -> tuple[_Segment, torch.Tensor, torch.Tensor]:
        """(the segment ``[2, ..., 1]`` that holds KL = D, the root ρ ``[1, ..., 1]`` in it, and ``[1, ..., 1]``
        whether KL(q ‖ p) ≤ D: every draft token accepted, ρ = 0).

        KL is evaluated at every breakpoint and on two grids from 0 to ρ_max at once; it falls with ρ, so
        the root lies between the last of these with KL ≥ D and the first with KL < D, inside one segment.
        Outright acceptance is decided on KL(q ‖ p), not on KL at ρ = 0 from these sums: a tail of draft mass
        below the rounding of Σ p (e.g. 4e-17) has P_high = 0 there, as if p missed q's support.
        """
        grid = torch.linspace(0.0, 1.0, _GRID_POINTS, dtype=self.rho_max.dtype, device=self.rho_max.device)  # [K]
        geometric = torch.logspace(_SMALLEST_EXPONENT, 0, _GRID_POINTS, base=2.0, dtype=grid.dtype, device=grid.device)
        # contiguous: searchsorted copies (and warns about) a strided boundary, which a split under vmap is
        alpha_rho, minus_beta_rho = (
            half.clone(memory_format=torch.contiguous_format) for half in self.breakpoints.split(1)
        )  # [1, ..., V] each
        candidates = torch.cat([alpha_rho, -minus_beta_rho, grid * self.rho_max, geometric * self.rho_max], -1)
        candidates = candidates.clamp_min(0).minimum(self.rho_max)  # [1, ..., C]
        segments = self.segments(alpha_rho, minus_beta_rho, candidates)  # [2, ..., C]
        above = segments.excess(candidates)[1] >= 0  # [1, ..., C]
        low, index = torch.where(above, candidates, 0.0).max(-1, keepdim=True)  # [1, ..., 1]
        high = torch.where(above, math.inf, candidates).amin(-1, keepdim=True)
        outright = self.full_kl <= self.bound  # [1, ..., 1]
        segment = segments.pick(index)
        return segment, torch.where(outright, 0.0, segment.root_between(low, high, grid)), outright


def _solve_by_sorting(q: torch.Tensor, p: torch.Tensor, bound: float) -> _Solution:
    """Every row at once with a fixed number of operations and no host read (the device path)."""
    table = _SortedTable(q, p, bound)
    return _solution_at(q, p, table.ratio, *table.root(), bound)
