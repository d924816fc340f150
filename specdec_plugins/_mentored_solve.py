"""Mentored decoding's KL rule, solved: the thresholds α ≤ 1 ≤ β of the most accepting rule whose output law π
keeps KL(q ‖ π) ≤ D at each position (the rule itself: :mod:`specdec_plugins.mentored`, docs/verifiers.md §2).

Solving KL = D exactly (this project's derivation from the proof's closed form). Parametrised by
the rejected mass ρ = 1 - R, α(ρ) = Q_≤α / (P_≤α - ρ) and β(ρ) = Q_≥β / (P_≥β + ρ) are monotone, and

    dKL/dρ = α - β ≤ 0,   d²KL/dρ² = α²/Q_≤α + β²/Q_≥β > 0  between breakpoints,

where a breakpoint is a ρ at which a token crosses α or β. dKL/dρ is continuous and rising, so KL(ρ)
is convex and falls from KL(q ‖ p) at ρ = 0 to 0 at ρ_max = Σ (p - q)+ (α = β = 1: speculative
sampling): KL = D has one root, and inside its segment KL has the closed form above in five sums.

Two exact solvers give that root; both end in :class:`_Segment`'s closed forms.

- On a GPU (:func:`_solve_by_sorting`): one sort of q/p per position, prefix sums, and KL at every
  breakpoint and on two grids of ρ (even, and geometric down to float64's smallest number, for the
  ρ ~ 1e-100 that p = 0 < q can call for) at once (two ``searchsorted``) give the bracket that holds
  the root inside one segment; there KL on a fine grid across the bracket and two Newton steps from
  its left end (which on a convex falling KL never overshoot) give the root to rounding. A fixed
  number of operations, no host read, one graph (issue #20 §2). Rows with KL(q ‖ p) ≤ D (q = p,
  one-token laws) are masked, never branched on.
- On the CPU, where a read is free (:func:`_solve_by_sets`): one pass for KL(q ‖ p); rows within D
  are accepted outright. The others iterate on the sets: start from speculative sampling's
  (t < 1, t > 1), solve that segment's equation (in Python floats), move α and β there, regroup
  (one pass over V) and repeat until the groups repeat exactly; such α and β give back their own
  groups, so they are the root's (KL = D has one root). The first steps run on float32 copies (half
  the bytes) until α and β stand still; the float64 steps then start near the root, and a step whose
  new thresholds have no token between them and the old ones (read on the float32 ratios, with a
  margin) has settled, without a second float64 pass. A row that does not settle falls back to
  the sorted solve. No O(V log V) sort on the CPU, where it costs more than a speculative block.
  A block (:func:`_verify_lazily`) solves only the positions speculative sampling's test cannot
  decide (mentored accepts whatever speculative sampling accepts: α ≤ 1), up to the first rejection.

Draft mass on tokens the target rules out (q = 0 < p, e.g. target top-p): the threshold form
rejects them whole for every α > 0, but at α = 0+ their acceptance is free. So for ρ below their
draft mass, α = 0, they share the rejection, and KL = band + Q_≥β ln β(ρ). The proof's Algorithm 1
bisected into a band [(1-γ)D, (1+γ)D]; here KL(q ‖ π) = D to rounding. Tran-Thien & Nock (arXiv
2609.30474) build the same O(sort(n)) breakpoint structure for every f-divergence; their text was not
reachable from this project's machines, so nothing here is taken from it.

"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.nn.functional import pad

from specdec_cli.plugins.laws import (
    commit_known,
    excess_or,
    normalized_or,
    row_at,
    single_draft_block,
    single_draft_draws,
)
from specdec_cli.plugins.verifiers import BlockDecision

from ._workspace import per_thread

TINY, _LARGEST = torch.finfo(torch.float64).tiny, torch.finfo(torch.float64).max
# Device path: KL at the breakpoints, at ρ_max/8191 steps and at ρ_max times 2^-1074 ... 2^0 in 8192 geometric
# steps (ratio 1.095) brackets the root; KL at 8192 points across that bracket narrows it to 2⁻²⁶ ρ_max, or
# 1e-5 of ρ, and two Newton steps take it to rounding (D from 1e-6 to 3 nats, V from 2 up:
# tests/test_mentored_solve.py; one step, or 2⁻²⁰, leaves 1e-7 relative error on KL).
_GRID_POINTS, _NEWTON_STEPS = 8192, 2
_SMALLEST_EXPONENT = -1074  # float64's smallest positive number is 2^-1074
_MAX_SET_STEPS = 16  # CPU path: set steps before a row falls back to the sorted solve
_RATIO_ROUNDING = 1e-6  # CPU path: a margin far wider than float32's rounding of a float64 ratio (2^-24)
_FLOAT32_NORMAL = (torch.finfo(torch.float32).tiny * 2, torch.finfo(torch.float32).max / 2)
_COARSE_TOLERANCE = 1e-6  # CPU path: float32 set steps stop when α and β move less than this, relatively
_SCALAR_NEWTON_STEPS = 200  # CPU path: Newton from the left on one segment stops earlier, when it stands still


def verify(q, p, x, bound: float, randomness, lazy: bool) -> BlockDecision:
    """One block: q ``[L+1, V]``, p ``[L, V]``, draft tokens x ``[L]``.

    ``lazy`` (the CPU, where reads are free) solves only the positions that need it, reading the
    device as it goes; otherwise every position is solved with a fixed number of operations.
    Either way the draws are the same (ACCEPT at offsets 0..L-1, then RESIDUAL at the first
    rejection or BONUS at L), and so is the decision.
    """
    if lazy:
        return _verify_lazily(q, p, x, bound, randomness)
    solution = solve(q[:-1], p, bound, lazy=False)
    accept = solution.acceptance_of(x.unsqueeze(-1)).squeeze(-1)  # [L]: r_x
    return single_draft_block(accept, solution.residual_row, q, x, randomness)


def _verify_lazily(q, p, x, bound: float, randomness) -> BlockDecision:
    """The block position by position on the CPU, stopping at the first rejection.

    A position whose uniform passes speculative sampling's test u < q(x)/p(x) is accepted without a
    solve (r_x = min(1, q(x)/(α p(x))) ≥ q(x)/p(x), as α ≤ 1); the others are solved one at a time.
    The test first uses the position's sums of q and p in their own precision (float32: 5× faster than in float64),
    which any summation order gets within γ = V u / (1 - V u) of the exact ones (u the unit roundoff;
    Higham, "Accuracy and Stability of Numerical Algorithms", 2002, §4.2), and computes the float64
    sums only where that margin cannot decide.
    """
    draft_length, vocab = p.shape
    tokens = x.unsqueeze(-1)  # [L, 1]
    draws = single_draft_draws(randomness, draft_length, q.device)  # [L+1, 3]: those single_draft_block makes
    uniforms = draws[:-1, 0].tolist()  # [L]: the acceptance tests
    roundoff = vocab * max(torch.finfo(q.dtype).eps, torch.finfo(p.dtype).eps) / 2
    spread = roundoff / (1 - roundoff) + 1e-12 if roundoff < 0.5 else math.inf  # γ, and room for float64 rounding
    margin = (1 - spread) / (1 + spread)
    ratios = (
        (q[:-1].gather(-1, tokens).double() / p.gather(-1, tokens).double()).squeeze(-1).tolist()
    )  # [L]: unnormalised
    for position, (u, ratio) in enumerate(zip(uniforms, ratios)):
        rows = slice(position, position + 1)
        if u < ratio * float(p[position].sum()) / float(q[position].sum()) * margin:  # surely accepted
            continue
        masses = [law[rows].sum(-1, keepdim=True, dtype=torch.float64) for law in (q, p)]  # [1, 1] each: Σq, Σp
        if u < ratio * float(masses[1]) / float(masses[0]):  # accepted by speculative sampling's exact test
            continue
        solution = solve(q[rows], p[rows], bound, lazy=True, masses=masses, buffers=per_thread(_Buffers, 1, vocab))
        if not u < solution.acceptance_of(tokens[rows]):
            return commit_known(position, solution.residual_on_host(), x, draws)
    return commit_known(draft_length, q[-1], x, draws)


def solve(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    bound: float,
    lazy: bool,
    masses=None,
    buffers: "_Buffers | None" = None,
) -> "_Solution":
    """The exact optimum for q and p ``[..., V]`` (any probabilities; renormalised in float64; ``masses``: their
    float64 sums ``[..., 1]`` where the caller has them; ``buffers``: the CPU path's arrays, which the solution
    then shares: it is valid until their next use)."""
    if bound == 0:  # speculative sampling (α = β = 1), a double root that Newton only approaches
        return _Solution.speculative(_normalised(target_probs), _normalised(draft_probs))
    if lazy:
        return _solve_by_sets(target_probs, draft_probs, bound, masses, buffers)
    return _solve_by_sorting(_normalised(target_probs), _normalised(draft_probs), bound)


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


_BELOW_ONE, _ABOVE_ONE = math.nextafter(1.0, 0.0), math.nextafter(1.0, 2.0)  # speculative sampling's α and β
_ACCEPT_ALL = (0.0, 1.0, 1.0, 0.0, 0.0, 0.0)  # (Q_low, Q_high, P_low, P_high, band, ρ): a row with no root to solve


class _Buffers:
    """The CPU path's arrays for rows ``[N, V]``; a block reuses one set per thread (:func:`._workspace.per_thread`)."""

    def __init__(self, rows: int, vocab: int):
        self.weights = torch.empty(rows, 3, vocab, dtype=torch.float64)  # [N, 3, V]: q, p, q ln(q/p)
        self.ratio = torch.empty(rows, vocab, dtype=torch.float64)  # [N, V]: q/p
        self.masks = torch.empty(rows, 2, vocab, dtype=torch.float64)  # [N, 2, V]: below α, above β
        # float32 copies for the first set steps, which only have to come near the root: a float32 step costs
        # half a float64 one, and the float64 steps that follow settle the groups exactly.
        self.coarse = (torch.empty(rows, 3, vocab), torch.empty(rows, vocab), torch.empty(rows, 2, vocab))


class _Groups:
    """Q, P and Σ q ln(q/p) below α and above β, from one comparison pass and one matrix product over V
    per set step (the CPU path; rows ``[N, V]`` of any probabilities, renormalised in float64 as
    :func:`_normalised` does). Every array is filled in place in ``buffers``."""

    def __init__(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, masses=None, buffers=None):
        rows, vocab = target_probs.shape
        buffers = buffers or _Buffers(rows, vocab)
        self.weights, self._masks = buffers.weights, buffers.masks  # [N, 3, V], [N, 2, V]
        self.q, self.p, log_ratio = self.weights.unbind(-2)  # [N, V] views
        masses = masses or [probs.sum(-1, keepdim=True, dtype=torch.float64) for probs in (target_probs, draft_probs)]
        for law, probs, mass in zip((self.q, self.p), (target_probs, draft_probs), masses):
            torch.div(probs, mass.view(rows, 1), out=law)
        self.t = torch.div(self.q, self.p, out=buffers.ratio).nan_to_num_(
            nan=0.0, posinf=math.inf
        )  # [N, V]: :func:`_ratio`
        # q ln t, 0 where q = 0: xlogy, and log at 0, take a slow path per element (4× and 10× slower at V = 128k).
        torch.clamp_min(self.t, TINY, out=log_ratio).log_().mul_(self.q)
        self.full_kl = log_ratio.sum(-1, keepdim=True)  # [N, 1]: KL(q ‖ p)
        self.total_log_ratio = self.full_kl.squeeze(-1).tolist()  # [N]: Σ q ln t over the tokens with t < ∞
        if math.inf in self.total_log_ratio:  # p misses q's support
            self._count_missing_support(log_ratio)
        self._coarse = buffers.coarse  # [N, 3, V], [N, V], [N, 2, V] float32
        self._coarse[0].copy_(self.weights)
        self._coarse[1].copy_(self.t)

    def _count_missing_support(self, log_ratio: torch.Tensor):
        """Where p = 0 < q (t = ∞): those tokens are always above β, never between α and β, so they stay out of
        the band's sums; and KL(q ‖ p) counts them at t = float64's largest number (p = 2^-1024 q there), so a
        row that is still within D has its root ρ below float64's range (the device path's floor) and is
        accepted outright, without set steps that would not settle."""
        missing = self.q.where(self.t == math.inf, 0.0).sum(-1, keepdim=True)  # [N, 1]: q's mass where p = 0
        finite = log_ratio.nan_to_num_(posinf=0.0).sum(-1, keepdim=True)  # [N, 1]
        self.total_log_ratio = finite.squeeze(-1).tolist()
        self.full_kl = finite + math.log(_LARGEST) * missing

    def same_groups(self, row: int, old: list, new: list) -> bool:
        """Whether ``row``'s groups at thresholds ``new`` (α, β) are those at ``old``: no token's float64 ratio
        lies between them. Read on the float32 ratios (within 2^-24 of the float64 ones) over the interval
        widened by 1e-6 (three float32 passes: a tenth of a float64 step); a token inside, or a threshold outside
        float32's normal range, answers no."""
        for old_threshold, new_threshold in zip(old, new):
            low, high = sorted((old_threshold, new_threshold))
            low, high = low * (1 - _RATIO_ROUNDING), high * (1 + _RATIO_ROUNDING)
            if not _FLOAT32_NORMAL[0] < low <= high < _FLOAT32_NORMAL[1]:
                return False
            ratio, distance = self._coarse[1][row], self._coarse[2][row, 0]  # [V] each; the masks' buffer is free
            if not float(torch.sub(ratio, (low + high) / 2, out=distance).abs_().amin()) > (high - low) / 2:
                return False
        return True

    def segments(self, thresholds: list, coarse: bool = False) -> list:
        """The segment (Q_low, Q_high, P_low, P_high, band) of each row's [α, β] → a list [N] of 5-tuples;
        ``coarse``: from the float32 copies (equal groups still give equal sums)."""
        weights, ratio, masks = self._coarse if coarse else (self.weights, self.t, self._masks)
        limits = torch.tensor(thresholds, dtype=ratio.dtype).unsqueeze(-1)  # [N, 2, 1]
        torch.le(ratio, limits[:, 0], out=masks[:, 0])
        torch.ge(ratio, limits[:, 1], out=masks[:, 1])
        sums = torch.bmm(weights, masks.transpose(-1, -2)).tolist()  # [N][3][2]: (q, p, q ln t) × groups
        return [
            (q_low, q_high, p_low, p_high, total - w_low - w_high)
            for ((q_low, q_high), (p_low, p_high), (w_low, w_high)), total in zip(sums, self.total_log_ratio)
        ]


def _solve_by_sets(target_probs, draft_probs, bound: float, masses=None, buffers=None) -> _Solution:
    """Every row of q, p ``[..., V]`` on the CPU, reading as it goes; a row whose sets do not settle by sorting."""
    batch, vocab = target_probs.shape[:-1], target_probs.shape[-1]
    groups = _Groups(target_probs.reshape(-1, vocab), draft_probs.reshape(-1, vocab), masses, buffers)
    outright = groups.full_kl <= bound  # [N, 1]: accept every draft token
    pending = (~outright).squeeze(-1).tolist()  # [N]
    found = _settle_sets(groups, pending, bound)
    roots = torch.tensor([root or _ACCEPT_ALL for root in found], dtype=torch.float64).T.unsqueeze(-1)  # [6, N, 1]
    segment, rho = _Segment.of_sums(roots[0:2], roots[2:4], roots[4:5], bound), roots[5:]  # [2, N, 1], [1, N, 1]
    unsettled = [row for row, (waiting, root) in enumerate(zip(pending, found)) if waiting and root is None]
    if unsettled:  # rarely
        sorted_segment, sorted_rho, _ = _SortedTable(groups.q[unsettled], groups.p[unsettled], bound).root()
        for field, value in zip(
            (segment.q, segment.p, segment.offset, rho),
            (sorted_segment.q, sorted_segment.p, sorted_segment.offset, sorted_rho),
        ):
            field[:, unsettled] = value

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # [..., N, k] → [..., *batch, k]
        return tensor.reshape(*tensor.shape[:-2], *batch, tensor.shape[-1])

    rho = rows(rho)  # [1, *batch, 1]
    segment = _Segment(*(rows(field) for field in (segment.q, segment.p, segment.offset)), _pair_direction(rho))
    return _solution_at(rows(groups.q), rows(groups.p), rows(groups.t), segment, rho, rows(outright[None]), bound)


def _settle_sets(groups: _Groups, pending: list, bound: float) -> list:
    """Each pending row's settled (Q_low, Q_high, P_low, P_high, band, ρ), or None (not pending, or not
    settled within ``_MAX_SET_STEPS`` float64 steps). A row has settled when its float64 sums repeat
    exactly: its α and β then give back their own groups. Float32 steps first bring the thresholds near
    the root (at V = 128k five of them cost what two float64 steps do); the float64 steps start there."""
    thresholds = [[_BELOW_ONE, _ABOVE_ONE] for _ in pending]  # [N][2]: speculative sampling's groups first
    _iterate_sets(groups, list(pending), thresholds, bound, coarse=True)
    return _iterate_sets(groups, list(pending), thresholds, bound, coarse=False)


def _iterate_sets(groups: _Groups, waiting: list, thresholds: list, bound: float, coarse: bool) -> list:
    """Set steps from ``thresholds`` ``[N][2]`` (moved in place) for at most ``_MAX_SET_STEPS`` steps → each
    waiting row's (*sums, ρ) where its groups repeat, else None. They repeat when a step's sums are the last
    step's, or, a step earlier, when no token lies between its old and new thresholds (a token near the root
    may keep that check from answering). Coarse steps stop instead when α and β stand still to
    ``_COARSE_TOLERANCE``."""
    previous, found, rho = [None] * len(waiting), [None] * len(waiting), [0.0] * len(waiting)
    for _ in range(_MAX_SET_STEPS):
        if not any(waiting):
            break
        for row, segment in enumerate(groups.segments(thresholds, coarse)):
            if not waiting[row]:
                continue
            if not coarse and segment == previous[row]:
                found[row], waiting[row] = (*segment, rho[row]), False
                continue
            previous[row] = segment
            rho[row], *moved = _scalar_root(*segment, bound)
            if coarse:
                waiting[row] = not all(
                    math.isclose(*pair, rel_tol=_COARSE_TOLERANCE) for pair in zip(moved, thresholds[row])
                )
            elif groups.same_groups(row, thresholds[row], moved):
                found[row], waiting[row] = (*segment, rho[row]), False
            thresholds[row] = moved
    return found


def _scalar_root(q_low, q_high, p_low, p_high, band, bound: float) -> tuple[float, float, float]:
    """(ρ, α, β) at the root of one segment's KL(ρ) = D in [0, turn] (the end nearest to it when it has
    none there), in Python floats: the CPU path's set steps make thousands of these, and a float
    operation costs a hundred times less than a torch operation on one number.

    The same closed form as :class:`_Segment`; Newton from :meth:`_Segment.lower_root`'s start, on a
    convex decreasing KL, climbs to the root without overshooting, so it stops when it stands still.
    At the turn (α = β, KL's minimum) α is moved up to β: more tokens belong below it.
    """

    def at(rho: float) -> tuple[float, float, float]:
        alpha, beta = q_low / max(p_low - rho, TINY), q_high / max(p_high + rho, TINY)
        return alpha, beta, band + _xlogy(q_low, alpha) + _xlogy(q_high, beta)

    turn = min(max((q_high * p_low - q_low * p_high) / max(q_low + q_high, TINY), 0.0), p_low)
    frozen = band + _xlogy(q_low, q_low / max(p_low, TINY)) + _xlogy(q_high, q_high)
    rho = min(max(math.exp(min((frozen - bound) / max(q_high, TINY), 700.0)) - p_high, 0.0), turn)
    for _ in range(_SCALAR_NEWTON_STEPS):
        alpha, beta, kl = at(rho)
        step = rho + (kl - bound) / (beta - alpha) if kl > bound and beta > alpha else rho
        if not step > rho:
            break
        rho = min(step, turn)
    alpha, beta, _ = at(rho)
    return rho, beta if rho >= turn else alpha, beta


def _xlogy(x: float, y: float) -> float:
    return x * math.log(y) if x > 0 else 0.0
