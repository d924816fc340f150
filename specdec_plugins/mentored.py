"""Mentored decoding: the most accepting rule whose output stays within KL D of the target (lossy).

The rule in the project's notation: docs/verifiers.md §2.

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

Solving KL = D exactly (this project's derivation from the proof's closed form): write
everything as a function of the rejected mass ρ = 1 - R. Then α(ρ) = Q_≤α / (P_≤α - ρ) and
β(ρ) = Q_≥β / (P_≥β + ρ) are monotone, and

    dKL/dρ = α - β ≤ 0,   d²KL/dρ² = α²/Q_≤α + β²/Q_≥β > 0  inside a segment,

so KL(ρ) is decreasing and, between two breakpoints (a token crossing α or β), smooth and convex.
The segment that holds the root is found without sorting: start from speculative sampling's sets
(q/p < 1, q/p > 1), solve that segment's equation, move α and β there, recompute the sets (one
pass over the vocabulary, sums as one batched matmul) and repeat until the sets and ρ stand
still (6-7 passes at V = 128k; the first check of that comes after ``_SET_STEPS``, and each check
is one device read). A settled row is exact: its α and β give back its own sets, and KL = D has
one root. Rows that have not settled after ``_MAX_SET_STEPS`` fall back to one sort by q/p with
prefix sums and a binary search over the breakpoints. Inside the segment a safeguarded Newton
iteration finds the root to rounding. KL(q ‖ π) = D to rounding; the proof's Algorithm 1
bisected into a band [(1-γ)D, (1+γ)D] instead, and ``tolerance`` (γ) is now accepted and ignored.

Draft mass on tokens the target rules out (q = 0 < p, e.g. target top-p): the threshold form
rejects them whole for every α > 0, but at α = 0+ their acceptance is free. So for ρ below their
draft mass p(q = 0), α = 0, they share the rejection, and KL = band + Q_≥β ln β(ρ) is solved in
closed form (this also reaches the ρ ~ 1e-100 that p = 0 < q can call for).
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
_STEP_NEWTON_STEPS = 4  # per set step, warm-started: the sets only need ρ roughly
_SET_STEPS = 8  # set steps before the first check that they settled (each check reads the device)
_MAX_SET_STEPS = 32  # rows still moving then are solved from the sorted table
_RHO_SETTLED = 1e-14  # relative move of ρ over a set step below which Newton has converged
TINY = torch.finfo(torch.float64).tiny


class MentoredDecoding(Verifier):
    name = "mentored"
    lossless = False
    max_drafts = 1
    kl_bound_parameter = "kl"

    def __init__(self, *, kl: float = 0.0, tolerance: float | None = None):
        """``tolerance`` is accepted and ignored: the bound is now met exactly (kept so recipes still load)."""
        if not 0 <= kl < math.inf:
            raise ValueError(f"mentored: kl must be a finite number >= 0 (nats), got {kl}")
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

    def __init__(self, q, p, segment: "_Segment", rho, kl):
        self.q, self.p = q, p  # [..., V]
        self.alpha, self.beta, _ = segment.at(rho)  # [..., 1] each; α = 0: no positive-q token is cut
        self.rejected_mass = rho  # [..., 1]: 1 - R
        self.kl = kl  # [..., 1]
        # α = 0 leaves the zero-q tokens' common acceptance free: they are the only ones rejected.
        self.zero_q_acceptance = torch.where(
            self.alpha > 0, torch.zeros_like(rho), 1 - rho / segment.p_low.clamp_min(TINY)
        )  # [..., 1]

    def acceptance_of(self, x: torch.Tensor) -> torch.Tensor:
        """r_x = min(1, q_x/(α p_x)) for candidates ``x`` ``[..., 1]``."""
        q_x, p_x = self.q.gather(-1, x), self.p.gather(-1, x)  # [..., 1]
        ratio_over_alpha = (q_x / (self.alpha * p_x)).clamp(max=1.0)  # [..., 1]; 1 where α = 0 < q_x
        return torch.where(q_x > 0, ratio_over_alpha, self.zero_q_acceptance)

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
    """The exact optimum for every row: the segment that holds KL = D, then a Newton solve inside it.

    Parametrised by the rejected mass ρ = 1 - R, α(ρ) and β(ρ) are both monotone and
    dKL/dρ = α - β ≤ 0, so KL(ρ) = D has one root. Its segment (which tokens sit below α and
    above β) is found by iterating on the sets (:func:`_settle_sets`, a few O(V) passes); rows that
    do not settle are solved from a sort by q/p (:class:`_SortedTable`). Inside the segment KL(ρ)
    is smooth and convex and a safeguarded Newton iteration finds the root to rounding.
    """
    rows = _Rows(target_probs, draft_probs)
    speculative = rows.speculative()
    rho_max = speculative.p_low - speculative.q_low  # [..., 1]: Σ (p - q)+, the rejected mass at α = 1
    if bound == 0:  # speculative sampling (α = β = 1), a double root that Newton only approaches
        segment, rho = speculative, rho_max
    else:
        segment, rho = _root_segment(rows, speculative, rho_max, bound)
    divergence = segment.at(rho)[2]
    outright = rows.full_kl <= bound  # accept every draft token: π = p
    segment = _Segment.where(outright, _Segment.accept_all(rho), segment)
    return _Solution(rows.q, rows.p, segment, torch.where(outright, torch.zeros_like(rho), rho),
                     torch.where(outright, rows.full_kl, divergence))  # fmt: skip


def _root_segment(rows: "_Rows", speculative: "_Segment", rho_max: torch.Tensor, bound: float):
    """The segment that holds KL = D and the root ρ in it → (``_Segment`` [N, 1], ρ ``[N, 1]``)."""
    segment, rho, settled = _settle_sets(rows, speculative, rho_max, bound)
    if settled is None:
        return segment, rho
    table = _SortedTable(rows.q, rows.p, rho_max)  # the rare rows whose sets still move
    low, high = table.bracket(bound)
    table_segment = _Segment.of_table(table, *table.segment(low))
    table_rho = _segment_root(table_segment, low, low, high, bound, _NEWTON_STEPS)
    return _Segment.where(settled, segment, table_segment), torch.where(settled, rho, table_rho)


def _settle_sets(rows: "_Rows", speculative: "_Segment", rho_max: torch.Tensor, bound: float):
    """Iterate: the sets below α and above β → that segment's root ρ → its α and β → new sets.

    Started from speculative sampling's sets (q/p < 1 and > 1), the sets settle in a handful of
    steps (6-7 at V = 128k on peaked random laws), each one pass over the vocabulary. A row has
    settled when its sums repeat exactly and ρ no longer moves: its α and β then give back its
    own sets, so its segment is the root's (KL(ρ) = D has one root) and ρ is that root to
    rounding. The first check waits for ``_SET_STEPS``: each check is one device read.
    Returns (segment ``_Segment`` [N, 1], ρ ``[N, 1]``, settled ``[N, 1]`` bool or None when all are).
    """
    segment, rho, sums = speculative, rho_max, None  # ρ: [N, 1]
    for step in range(_MAX_SET_STEPS):
        if step:
            segment = rows.segment(alpha, beta)
        previous_rho, previous_sums, sums = rho, sums, segment.sums()  # sums: [N, 1, 5]
        turn = segment.turn()
        rho = _segment_root(segment, rho, torch.zeros_like(rho), turn, bound, _STEP_NEWTON_STEPS)
        alpha, beta, _ = segment.at(rho)
        # No root before the turn (α = β there): more tokens belong below α. With only zero-q tokens
        # below it α stays 0 at the turn, so it is moved up to β by hand.
        alpha = torch.where(rho >= turn, beta, alpha)
        settled = (rho - previous_rho).abs() <= _RHO_SETTLED * rho  # [N, 1]
        if previous_sums is not None:
            settled &= (sums == previous_sums).all(-1)
        if step + 1 >= _SET_STEPS and bool(settled.all()):
            return segment, rho, None
    return segment, rho, settled


class _Rows:
    """Each row's ratios t = q/p and the per-token weights every set's sums need (float64).

    ``target_probs`` and ``draft_probs`` ``[N, V]`` are renormalised in float64: float32 laws sum to 1
    only within 1e-7, and the closed form relies on Σq = Σp (e.g. Σ (p - q/α)+ = Σ (q/β - p)+) far
    more tightly than that. Buffers are filled in place: at V = 128k each fresh one costs a pass.
    """

    def __init__(self, target_probs: torch.Tensor, draft_probs: torch.Tensor):
        shape = target_probs.shape  # [N, V]
        self.weights = torch.empty(*shape[:-1], 3, shape[-1], dtype=torch.float64, device=target_probs.device)
        self.q, self.p, q_log_ratio = self.weights.unbind(-2)  # [N, V] views: q, p and q ln(q/p)
        for law, probs in ((self.q, target_probs), (self.p, draft_probs)):
            law.copy_(probs).div_(law.sum(-1, keepdim=True))
        self.t = torch.div(self.q, self.p).nan_to_num_(nan=0.0, posinf=float("inf"))  # [N, V]; 0 where q = 0
        torch.xlogy(self.q, self.t, out=q_log_ratio)  # ∞ where p = 0 < q
        self.full_kl = q_log_ratio.sum(-1, keepdim=True)  # [N, 1]: KL(q ‖ p), ∞ when p misses q's support
        # Tokens with p = 0 < q are always above β: they never enter the sums between α and β.
        self.total_log_ratio = q_log_ratio.nan_to_num_(posinf=0.0).sum(-1, keepdim=True)  # [N, 1]
        self._masks = torch.empty(*shape[:-1], 2, shape[-1], dtype=torch.float64, device=target_probs.device)

    def speculative(self) -> "_Segment":
        """The segment of speculative sampling (α = β = 1): the sets q/p < 1 and q/p > 1."""
        alpha = torch.full_like(self.full_kl, math.nextafter(1.0, 0.0))
        return self.segment(alpha, torch.full_like(self.full_kl, math.nextafter(1.0, 2.0)))

    def segment(self, alpha: torch.Tensor, beta: torch.Tensor) -> "_Segment":
        """The sums over {t ≤ α} and {t ≥ β} for thresholds ``[N, 1]``: one pass over ``[N, V]``."""
        low, high = self._masks.unbind(-2)  # [N, V] each
        low.copy_(self.t <= alpha)
        high.copy_(self.t >= beta)
        sums = self.weights @ self._masks.transpose(-1, -2)  # [N, 3, 2]: (q, p, q ln t) × (low, high)
        q_low, p_low, log_low = sums[..., 0].split(1, -1)  # [N, 1] each
        q_high, p_high, log_high = sums[..., 1].split(1, -1)
        return _Segment(q_low, p_low, q_high, p_high, self.total_log_ratio - log_low - log_high)


class _SortedTable:
    """q and p sorted by t = q/p, with the prefix sums every KL evaluation needs (float64).

    Zero-q tokens sort first (t = 0, always below α), p = 0 < q tokens last (t = ∞, always in β's
    group). A segment is (l, h): tokens [0, l) have t ≤ α, tokens [h, V) have t ≥ β.
    """

    def __init__(self, q: torch.Tensor, p: torch.Tensor, rho_max: torch.Tensor):
        ratio = torch.where(q > 0, q / p, torch.zeros_like(q))  # [..., V]
        self.t, order = ratio.sort(-1)  # [..., V] ascending
        q_sorted, p_sorted = q.gather(-1, order), p.gather(-1, order)  # [..., V]
        q_log_ratio = torch.where(q_sorted > 0, q_sorted * self.t.log(), torch.zeros_like(q_sorted))  # [..., V]
        self.q_prefix, self.p_prefix, self.kl_prefix = (
            torch.nn.functional.pad(values.cumsum(-1), (1, 0)) for values in (q_sorted, p_sorted, q_log_ratio)
        )  # [..., V+1] each: Σ over tokens [0, k)
        self.q_suffix = self.q_prefix[..., -1:] - self.q_prefix  # [..., V+1]: Σ over [k, V)
        self.p_suffix = self.p_prefix[..., -1:] - self.p_prefix  # [..., V+1]
        # ρ at which α reaches t_k (tokens with t > 1 are never below α ≤ 1): non-decreasing in k.
        # Zero-q tokens are below any α > 0, so all of them are in from ρ = 0 on (α = 0 until ρ = p(q = 0)).
        alpha_rho = self.p_prefix[..., 1:] - self.q_prefix[..., 1:] / self.t.clamp_min(TINY)  # [..., V]
        alpha_rho = torch.where(self.t > 0, alpha_rho, torch.zeros_like(alpha_rho))
        self.alpha_rho = torch.where(self.t <= 1, alpha_rho, torch.full_like(alpha_rho, float("inf")))
        # -ρ at which β reaches t_j (β ≥ 1, so only tokens with t ≥ 1): non-decreasing in j.
        beta_rho = (self.p_suffix[..., :-1] - self.q_suffix[..., :-1] / self.t).clamp_max(0)  # [..., V]
        self.minus_beta_rho = torch.where(self.t >= 1, beta_rho, torch.full_like(beta_rho, -float("inf")))
        self.rho_max = rho_max  # [..., 1]: Σ (p - q)+, α = 1, speculative

    def bracket(self, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The two consecutive breakpoints ρ (a token crossing α or β) with KL ≥ D at the first and
        KL < D at the second (0 and ρ_max at the ends) → ``[..., 1]`` each."""
        zero = torch.zeros_like(self.rho_max)
        clip = functools.partial(_clip, low=zero, high=self.rho_max)
        low, high = zero, self.rho_max
        # α's breakpoints ascend with the token index, β's descend: flipped so both ascend.
        for points in (clip(self.alpha_rho), clip(-self.minus_beta_rho).flip(-1)):  # [..., V] each
            count = self._count_at_or_above(points, bound)  # [..., 1]
            last = points.gather(-1, (count - 1).clamp_min(0))
            following = points.gather(-1, count.clamp(max=points.shape[-1] - 1))
            low = torch.maximum(low, torch.where(count > 0, last, zero))
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
            rho = points.gather(-1, middle.clamp(max=size - 1))
            above = (_Segment.of_table(self, *self.segment(rho)).at(rho)[2] >= bound) & (middle < high)
            low = torch.where(above, middle + 1, low)
            high = torch.where(above, high, middle)
        return low

    def segment(self, rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(l, h) for ρ ``[..., M]`` (the segment just right of ρ at a breakpoint) → two ``[..., M]``."""
        low = torch.searchsorted(self.alpha_rho.contiguous(), rho.contiguous(), right=True)
        high = torch.searchsorted(self.minus_beta_rho.contiguous(), (-rho).contiguous(), right=False)
        return low, high


class _Segment:
    """The sums that stay fixed while ρ moves inside one segment: Q and P below α and above β, and
    Σ q ln(q/p) between them (all ``[..., M]``). KL(ρ), α(ρ) and β(ρ) are then O(1) (eq. 24, 27-28)."""

    def __init__(self, q_low, p_low, q_high, p_high, band):
        self.q_low, self.p_low, self.q_high, self.p_high, self.band = q_low, p_low, q_high, p_high, band

    @classmethod
    def of_table(cls, table: _SortedTable, low: torch.Tensor, high: torch.Tensor) -> "_Segment":
        high = high.clamp(max=table.t.shape[-1] - 1)  # the largest ratio is always in β's group
        q_low, p_low = table.q_prefix.gather(-1, low), table.p_prefix.gather(-1, low)  # [..., M]
        q_high, p_high = table.q_suffix.gather(-1, high), table.p_suffix.gather(-1, high)  # [..., M]
        return cls(q_low, p_low, q_high, p_high, table.kl_prefix.gather(-1, high) - table.kl_prefix.gather(-1, low))

    @classmethod
    def accept_all(cls, like: torch.Tensor) -> "_Segment":
        """α = 0 and β = ∞: π = p (with ρ = 0), shaped ``like`` ``[..., M]``."""
        zero, one = torch.zeros_like(like), torch.ones_like(like)
        return cls(zero, one, one, zero, zero)

    @classmethod
    def where(cls, condition: torch.Tensor, chosen: "_Segment", other: "_Segment") -> "_Segment":
        return cls(*(torch.where(condition, a, b) for a, b in zip(chosen.sums().unbind(-1), other.sums().unbind(-1))))

    def sums(self) -> torch.Tensor:
        return torch.stack([self.q_low, self.p_low, self.q_high, self.p_high, self.band], -1)  # [..., M, 5]

    def turn(self) -> torch.Tensor:
        """The ρ where α = β (KL's minimum over this segment), within [0, P_low] → ``[..., M]``."""
        turn = (self.q_high * self.p_low - self.q_low * self.p_high) / (self.q_low + self.q_high).clamp_min(TINY)
        return _clip(turn, torch.zeros_like(turn), self.p_low)

    def alpha_free_root(self, bound: float) -> torch.Tensor:
        """ρ with KL = D where only zero-q tokens are below α (α = 0): KL = band + Q_high ln(Q_high/(P_high + ρ))
        is solved in closed form, which also reaches the tiny ρ (1e-100) that p missing part of q's
        support can call for → ``[..., M]``."""
        root = ((self.band + self.q_high * self.q_high.log() - bound) / self.q_high).exp() - self.p_high
        return root.clamp_min(TINY)  # ρ = 0 would leave KL = ∞ when p misses part of q

    def at(self, rho: torch.Tensor):
        """α, β and KL at ρ ``[..., M]``."""
        # Only zero-q tokens below α: α = 0, and they share the rejected mass (Σ over them of p = P_low ≥ ρ).
        alpha = torch.where(self.q_low > 0, self.q_low / (self.p_low - rho).clamp_min(TINY), 0.0)
        beta = torch.where(self.q_high > 0, self.q_high / (self.p_high + rho), float("inf"))  # [..., M]
        low_term = torch.where(self.q_low > 0, self.q_low * alpha.log(), 0.0)
        high_term = torch.where(self.q_high > 0, self.q_high * beta.log(), 0.0)
        return alpha, beta, low_term + self.band + high_term


def _segment_root(segment: _Segment, start, low, high, bound: float, steps: int) -> torch.Tensor:
    """The root of the segment's KL(ρ) = D in [low, high] from ``start`` (all ``[..., 1]``), or the end
    of the bracket nearest to it when there is none there.

    Each iteration takes the first of these steps that lands inside the bracket:
    Newton on √KL - √D, fast near ρ_max, where KL vanishes quadratically (α and β both reach 1)
    and Newton on KL would only halve the error per step; Newton on KL, which never overshoots
    from the left of the root and lands left of it from its right (KL is convex and
    decreasing); Newton on ln ρ, for the log singularity at ρ = 0 when p misses part of q's
    support (KL ≈ c - q(p = 0) ln ρ there); and bisection.
    """
    rho = _clip(start, low, high)
    for _ in range(steps):
        alpha, beta, kl = segment.at(rho)
        above = kl >= bound  # [..., 1]
        low, high = torch.where(above, rho, low), torch.where(above, high, rho)
        slope = (alpha - beta).clamp(max=-TINY)  # [..., 1]: dKL/dρ
        step = (kl - bound) / slope  # [..., 1]: Newton's decrement of ρ
        root = kl.clamp_min(0).sqrt()
        fast = rho - (root - math.sqrt(bound)) * 2 * root / slope  # Newton on √KL: d√KL = dKL / 2√KL
        candidates = (rho * torch.exp(-step / rho), rho - step)  # on ln ρ, on ρ; converged: ρ itself, at an end
        rho = (low + high) / 2
        for candidate in candidates:
            rho = torch.where((candidate >= low) & (candidate <= high), candidate, rho)
        # Strictly inside: at KL = 0 (ρ_max) this step stands still.
        rho = torch.where((fast > low) & (fast < high), fast, rho)
    return torch.where(segment.q_low > 0, rho, _clip(segment.alpha_free_root(bound), low, high))


def _clip(values: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return torch.maximum(torch.minimum(values, high), low)
