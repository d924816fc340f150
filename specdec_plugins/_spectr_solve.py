"""SpecTr's exact solve for ρ (the smallest root of p_acc(ρ) = ρ β(ρ); :mod:`.spectr` states the rule): one sort
of the ratios on a device (:func:`solve`), ratio buckets on the CPU (:func:`solve_by_buckets`), and the problem of
one position of the CPU walk (:class:`HostProblem`), which tests candidates and solves ρ only where a block ends.
"""

from __future__ import annotations

import math

import torch

from ._workspace import per_thread

__all__ = ["BUCKETS", "NEWTON_STEPS", "SET_STEPS", "HostProblem", "solve", "solve_by_buckets", "solve_rho"]


NEWTON_STEPS = 6
"""Newton steps inside the root's segment. From the better of two starting points (the segment's end and
the root of the segment with B = 0), five already reach 1e-11 and six the float64 fixed point (1e-15)
on 77,000 random and adversarial problems wherever the root is resolvable: near a double root (q ≈ p,
K' > 1) g stays within rounding of 0 over an interval and every point of it is as good
(tests/test_spectr_solve.py)."""

BUCKETS = 1024
"""Ratio buckets of the CPU solve: the tokens of one bucket are all that is sorted."""


# --------------------------------------------------------------------------- the exact solve for ρ


def solve_rho(target_probs: torch.Tensor, p: torch.Tensor, num_drafts) -> tuple[torch.Tensor, ...]:
    """(ρ, p_acc, β) float64, each ``[..., 1]``, for target and draft laws ``[..., V]``.

    ``num_drafts``: an int, or a tensor broadcastable to ``[..., 1]`` (a count known only on the device).
    """
    counts = torch.as_tensor(num_drafts, dtype=torch.float64, device=p.device)  # [] or [..., 1]
    counts = counts.expand(*target_probs.shape[:-1], 1) if counts.dim() == 0 else counts  # [..., 1]
    return solve(target_probs.double(), p.double(), counts)


def solve(q: torch.Tensor, p: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(ρ, p_acc, β) ``[..., 1]`` for laws q, p ``[..., V]`` (float64) and K' = counts ``[..., 1]``: one sort.

    A zero-mass token is appended: its ratio 0/0 becomes +inf, so the sorted ratios end with a
    sentinel and the segment after the last breakpoint has an index.
    """
    q, p = torch.nn.functional.pad(q, (0, 1)), torch.nn.functional.pad(p, (0, 1))  # [..., V+1]
    ratio, order = (q / p).nan_to_num(nan=torch.inf, posinf=torch.inf).sort(-1)  # [..., V+1] each
    below, above = _breakpoint_masses(q.gather(-1, order), p.gather(-1, order))  # [..., V+1] each
    return _solve_sorted(ratio, below, above, counts, counts)


def _solve_sorted(ratio, below, above, counts, upper) -> tuple[torch.Tensor, ...]:
    """(ρ, p_acc, β) ``[..., 1]`` from ratios sorted ``[..., n+1]`` (entry n: a sentinel) and their
    :func:`_breakpoint_masses`; upper ``[..., 1]`` ≤ counts: where g ≤ 0 is known (K', or a larger ratio)."""
    positive = _positive_count(ratio, below, above, counts, upper)  # [..., 1]
    previous = ratio.gather(-1, (positive - 1).clamp(min=0))  # [..., 1]
    left = torch.where(positive > 0, previous, 1.0).clamp(min=1.0)  # [..., 1]
    right = ratio.gather(-1, positive).minimum(upper)  # [..., 1]
    return _segment_root(below.gather(-1, positive), above.gather(-1, positive), left, right, counts)


def _breakpoint_masses(q, p, below_q=0.0, above_p=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A_j = q-mass strictly before entry j and B_j = p-mass from entry j on, ``[..., n]`` each, for
    masses ``[..., n]`` sorted by ratio, plus the masses below_q, above_p left out on either side."""
    cumulative_p = p.cumsum(-1)  # [..., n]
    below = q.cumsum(-1) - q  # [..., n]
    above = cumulative_p[..., -1:] - cumulative_p + p  # [..., n]
    if below_q or above_p:  # a run cut out of a longer one (the CPU solve)
        below, above = below + below_q, above + above_p
    return below, above


def _excess_and_log(below, above, minus_above, s, counts) -> tuple[torch.Tensor, torch.Tensor]:
    """-g = ρβ - p_acc at ρ = 1/s and log(1 - β), ``[...]`` each, with β = A s + B and ρβ = A + B/s.

    p_acc = -expm1(K' log1p(-β)): no cancellation when β is tiny. minus_above = -B (callers that
    evaluate g again and again negate it once).
    """
    log_rejected = torch.log1p(torch.addcmul(minus_above, below, s, value=-1).clamp(min=-1.0))  # [...]
    return torch.expm1(counts * log_rejected) + torch.addcdiv(below, above, s), log_rejected


def _positive_count(ratio, below, above, counts, upper) -> torch.Tensor:
    """How many leading sorted ratios ``[..., n]`` have g(ratio) > 0 → ``[..., 1]`` int64.

    Ratios below 1 count (the root is at least 1); ratios from ``upper`` on do not (g ≤ 0 there).
    """
    s = ratio.clamp(min=1.0).minimum(upper).reciprocal()  # [..., n]: g is only evaluated where it decides
    positive = (_excess_and_log(below, above, -above, s, counts)[0] < 0) & (ratio < upper)  # [..., n]
    return (positive | (ratio < 1)).sum(-1, keepdim=True)


def _segment_root(below, above, left, right, counts) -> tuple[torch.Tensor, ...]:
    """The root of g in [left, right] where A = below, B = above ``[..., 1]`` → (ρ, p_acc, β) ``[..., 1]``.

    Newton on G(s) = p_acc(A s + B) - A - B/s, concave and increasing in s = 1/ρ, from
    s = max(1/right, s₀) where s₀ = (1 - B - (1 - A/(1-B))^{1/K'}) / A solves G = 0 with the B/s
    term moved to the constant (G(s₀) ≤ 0: the start of near-double roots, A ≈ 1 and B ≈ 0).
    The root is ``left`` where the segment has no root inside: K' = 1 and q = p give left = right
    = 1, disjoint laws A = B = 0 (g ≡ 0, Newton's s undefined).
    """
    bound_start = (above + torch.expm1(torch.log1p(-below / (1 - above)) / counts)) / -below  # [..., 1]
    s = torch.maximum(right.reciprocal(), bound_start.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))  # [..., 1]
    rejected_powers, counts_below, minus_above = counts - 1, counts * below, -above  # [..., 1] each
    for _ in range(NEWTON_STEPS):
        minus_g, log_rejected = _excess_and_log(below, above, minus_above, s, counts)  # [..., 1] each
        slope = torch.addcdiv(counts_below * torch.exp(rejected_powers * log_rejected), above, s * s)  # G'(s)
        s = torch.addcdiv(s, minus_g, slope)
    rho = s.reciprocal().nan_to_num(nan=1.0).clamp(min=left).minimum(right)  # [..., 1]
    beta = below / rho + above  # [..., 1]
    return rho, _acceptance(rho, beta, counts), beta


def _acceptance(rho, beta, counts) -> torch.Tensor:
    """p_acc = 1 - (1 - β)^K' ``[..., 1]`` at ρ with β = β(ρ) ``[..., 1]``, never above ρβ (which rounding
    could lift it to)."""
    p_acc = -torch.expm1(counts * torch.log1p(-beta.clamp(max=1.0)))  # [..., 1]
    return p_acc.minimum(rho * beta)


def solve_by_buckets(q: torch.Tensor, p: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """:func:`solve` for one problem on the CPU, reading: laws ``[V]`` → (ρ, p_acc, β) ``[1]`` float64.

    K' = 1 needs no order: ρ = 1 and β = Σ min(p, q). Otherwise bucket i holds the ratios in [E_i, E_{i+1}),
    E_i = 1 + (i - 2)/s with BUCKETS buckets over [1, K'], one more on either side, and the ratios below
    and above those in buckets 0 and BUCKETS + 3. Their masses make a run of pseudo-breakpoints E_i whose
    search finds the bucket b that holds the root. Bucketing in the laws' dtype can put a ratio within its
    rounding of an edge on the wrong side, so buckets b-1..b+1 are sorted exactly: the root lies a
    bucket's width inside them. Three passes over V (buckets, masses, members); only the masses are
    converted to float64, for their sums.
    """
    counts = torch.full((1,), float(count), dtype=torch.float64)  # [1]
    if count == 1:
        beta = torch.minimum(p, q).sum(dtype=torch.float64).view(1)  # [1]
        return counts, _acceptance(counts, beta, counts), beta
    scale = BUCKETS / (count - 1)  # buckets per unit of ratio
    bucket = _ratio_buckets(q, p, scale)  # [V] int32
    index = bucket.long()  # [V]: scatter_add_ takes int64 indices
    mass_q = q.new_zeros(BUCKETS + 4, dtype=torch.float64).scatter_add_(0, index, q.double())  # [BUCKETS+4]
    mass_p = q.new_zeros(BUCKETS + 4, dtype=torch.float64).scatter_add_(0, index, p.double())  # [BUCKETS+4]
    edges = (torch.arange(BUCKETS + 4, dtype=torch.float64) - 2).div_(scale).add_(1).clamp_(min=0.0)  # [BUCKETS+4]
    below, above = _breakpoint_masses(mass_q, mass_p)  # [BUCKETS+4] each
    root_bucket = int(_positive_count(edges, below, above, counts, counts)) - 1
    first, last = max(root_bucket - 1, 1), root_bucket + 1  # bucket 0 lies below 1: no order needed
    members = ((bucket >= first) & (bucket <= last)).nonzero().squeeze(-1)  # [n]
    return _solve_run(
        q[members].double(),
        p[members].double(),
        counts,
        float(below[first]),
        float(above[last + 1]),
        float(edges[last + 1]),
    )


def _ratio_buckets(q: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor:
    """Each token's bucket floor(s (q/p - 1) + 2) clamped to [0, BUCKETS + 3], ``[V]`` int32; zero-mass tokens
    (0/0) in the last. Truncation is the floor here: the clamp leaves nothing negative."""
    shifted = torch.addcdiv(q.new_full((), 2 - scale), q, p, value=scale)  # [V]: s·q/p + 2 - s
    return shifted.nan_to_num_(nan=BUCKETS + 3, posinf=BUCKETS + 3).clamp(0, BUCKETS + 3).int()


def _solve_run(q_run, p_run, counts, below_q, above_p, upper_edge) -> tuple[torch.Tensor, ...]:
    """(ρ, p_acc, β) ``[1]`` from the run of tokens ``[n]`` (float64 masses) whose ratios lie between the
    masses below_q and above_p left out on either side, and below ``upper_edge``."""
    run, order = (q_run / p_run).nan_to_num_(nan=torch.inf, posinf=torch.inf).sort()  # [n] each
    sentinel = q_run.new_zeros(1)  # [1]
    below, above = _breakpoint_masses(
        torch.cat([q_run[order], sentinel]), torch.cat([p_run[order], sentinel]), below_q, above_p
    )  # [n+1] each
    upper = counts.clamp(max=upper_edge)  # [1]: the root lies below the next bucket
    return _solve_sorted(torch.cat([run, sentinel + torch.inf]), below, above, counts, upper)


# --------------------------------------------------------------------------- the CPU walk's problem


SET_STEPS = 8
"""Set steps of each phase of the CPU solve (float32 sums, then float64 ones) before it falls back to
:func:`solve_by_buckets`; tests/test_spectr_solve.py counts how rarely that happens."""

_RATIO_ROUNDING = 2.0**-22
"""Bounds the distance of a float32 ratio (and of a threshold rounded to float32) from the exact one, relatively."""

_COARSE_TOLERANCE = 1e-4
"""Where the float32 set steps stop: they converge about quadratically, so a step that moves ρ by less than
this left it within about 1e-7 of the root (about what float32 sums resolve); closer is noise."""


class HostProblem:
    """One (position, alive rows) problem of the CPU walk: laws q, p ``[V]`` (float32) and K' = count.

    A(τ) = Σ_{r < τ} q and B(τ) = Σ_{r ≥ τ} p come from comparisons of the float32 ratios r = q/p into float
    masks and dot products over V (a comparison writing bool, or mask indexing, costs several times more
    on the CPU). Float32 sums (within V·2^-24 of the exact ones) bring the set steps near
    the root; float64 sums over the same tokens then give ρ exactly.
    The CPU is memory-bound here: every array is reused (:class:`_WorkingArrays`) and none is made twice.
    """

    def __init__(self, q: torch.Tensor, p: torch.Tensor, count: int):
        self.q, self.p, self.count, self.lower = q, p, count, 1.0  # ρ ≥ lower: g(1) ≥ 0 always
        self._arrays = None  # _WorkingArrays, filled at the first pass

    def accepts(self, token: int, uniform: float) -> bool:
        """Whether SpecTr accepts candidate ``token``: u < q(x)/(ρ p(x)), i.e. ρ < θ = q(x)/(u p(x)).

        ρ ∈ [1, K'] and g does not increase, so ρ < θ iff θ > K', or θ > max(1, a rejected θ) and
        g(θ) = p_acc(θ) - θβ(θ) < 0; β(θ) summed in float64 from float32 terms (two light passes, cheaper than
        the working arrays), recomputed in float64 only where g is within their rounding of 0 (|dg/dβ| ≤ K' + θ).
        """
        theta = float(self.q[token]) / (uniform * float(self.p[token]))
        if theta > self.count or theta <= self.lower:
            return theta > self.count
        terms = self.q / theta  # [V]
        beta = float(torch.minimum(terms, self.p, out=terms).sum(dtype=torch.float64))  # float32 terms: 2^-22 each
        if abs(_minus_g(theta, beta, self.count)) <= (self.count + theta) * beta * 2 * _RATIO_ROUNDING + 1e-15:
            beta = min(float(torch.minimum(self.p.double(), self.q.double() / theta).sum()), 1.0)
        if _minus_g(theta, beta, self.count) > 0:
            return True
        self.lower = theta
        return False

    def solve(self) -> tuple[torch.Tensor, ...]:
        """(ρ, p_acc, β) ``[1]`` float64, as :func:`solve` gives them: set steps (the segment's root, regrouped)
        from the largest rejected θ on float32 sums until ρ stands still, then on float64 sums: the root ρ of the
        segment of τ is g's own root when no ratio lies between τ and ρ (then its sets are τ's), read on the
        float32 ratios widened by their rounding; where one does, float64 steps on until the sets repeat,
        placing the tokens by their float64 ratios. Otherwise, and for K' = 1 (ρ = 1), :func:`solve_by_buckets`."""
        if self.count == 1:
            return solve_by_buckets(self.q, self.p, 1)
        rho = self.lower
        masses = self._masses(rho, coarse=True)
        for _ in range(SET_STEPS):
            moved = _scalar_segment_root(*masses, self.count)
            rho, settled = moved, math.isclose(moved, rho, rel_tol=_COARSE_TOLERANCE)
            if settled:
                break
            masses = self._masses(rho, coarse=True)
        masses, start = self._masses(rho), rho
        for _ in range(SET_STEPS):
            rho = _scalar_segment_root(*masses, self.count)
            if self._arrays.ratio64 is None and self._arrays.none_between(start, rho):
                return _solution(rho, *masses, self.count)
            masses, previous, start = self._masses(rho), masses, rho
            if masses == previous:
                if self._arrays.ratio64 is not None:
                    return _solution(rho, *masses, self.count)
                self._arrays.compare_in_float64()  # a token within rounding of ρ
                masses = self._masses(rho)
        return solve_by_buckets(self.q, self.p, self.count)

    def _masses(self, threshold: float, coarse: bool = False) -> tuple[float, float]:
        """(A, B) at τ = threshold in float64, or ``coarse`` in float32 (within V·2^-24 relatively)."""
        self._arrays = self._arrays or _WorkingArrays.filled(self.q, self.p)
        return self._arrays.masses(threshold, coarse)


class _WorkingArrays:
    """:class:`HostProblem`'s arrays for one V, made once per thread and reused by every problem after
    (:func:`._workspace.per_thread`; the walk holds one problem at a time)."""

    def __init__(self, vocab: int):
        self.q = self.p = None  # [V] each: the laws, float32
        self.weights64 = torch.empty(2, vocab, dtype=torch.float64)  # [2, V]: q, p
        self.ratio, self.mask32, self.upper32 = torch.empty(3, vocab)  # [V] each: r, r < τ, r ≥ τ
        self.mask64 = torch.empty(vocab, dtype=torch.float64)  # [V]
        self.total_p64 = None  # Σ p in float64, once needed
        self.ratio64 = None  # [V] float64, made only where a float32 ratio lies within rounding of the root

    @classmethod
    def filled(cls, q: torch.Tensor, p: torch.Tensor) -> "_WorkingArrays":
        """This thread's arrays for laws q, p ``[V]``: the float32 ones filled (r = 0/0 stays NaN: never below τ,
        and its masses are 0), the float64 ones at their first use."""
        arrays = per_thread(cls, q.shape[-1])
        arrays.q, arrays.p = q, p
        torch.div(q, p, out=arrays.ratio)
        arrays.total_p64 = arrays.ratio64 = None
        return arrays

    def masses(self, threshold: float, coarse: bool) -> tuple[float, float]:
        """:meth:`HostProblem._masses` over the tokens whose float32 ratio lies below τ (their float64 one once
        :meth:`compare_in_float64` was called). A comparison is fast only into its input's dtype, so the
        float64 mask is a copy of the float32 one."""
        torch.lt(self.ratio, threshold, out=self.mask32)
        if coarse:  # B summed itself, not as Σ p - Σ_{r < τ} p: its error stays relative to B
            above = torch.ge(self.ratio, threshold, out=self.upper32)  # [V]
            return float(torch.dot(self.q, self.mask32)), float(torch.dot(self.p, above))
        if self.total_p64 is None:
            self.weights64[0].copy_(self.q)
            self.weights64[1].copy_(self.p)
            self.total_p64 = float(self.weights64[1].sum())
        if self.ratio64 is None:
            self.mask64.copy_(self.mask32)
        else:
            torch.lt(self.ratio64, threshold, out=self.mask64)
        below_q, below_p = torch.mv(self.weights64, self.mask64).tolist()
        return below_q, self.total_p64 - below_p

    def compare_in_float64(self):
        """Place the tokens by their float64 ratios from now on (one more pass over V, and two per step)."""
        self.ratio64 = torch.div(self.weights64[0], self.weights64[1])  # [V]

    def none_between(self, first: float, second: float) -> bool:
        """Whether no float64 ratio lies between τ = first and ρ = second (either order), so the tokens whose
        float32 ratio lies below τ are those whose float64 ratio lies below ρ: the float32 ratios within
        rounding of that interval are counted (exactly: float32 sums of up to 2^24 ones)."""
        low, high = min(first, second) * (1 - _RATIO_ROUNDING), max(first, second) * (1 + _RATIO_ROUNDING)
        counts = [float(torch.lt(self.ratio, limit, out=self.mask32).sum()) for limit in (low, high)]
        return counts[0] == counts[1]


def _solution(rho: float, below: float, above: float, count: int) -> tuple[torch.Tensor, ...]:
    """(ρ, p_acc, β) ``[1]`` float64 at the root ρ of the segment A = below, B = above."""
    rho_tensor, counts = torch.tensor([rho], dtype=torch.float64), torch.tensor([float(count)], dtype=torch.float64)
    beta = torch.tensor([below / rho + above], dtype=torch.float64)  # [1]
    return rho_tensor, _acceptance(rho_tensor, beta, counts), beta


def _minus_g(theta: float, beta: float, count: int) -> float:
    """-g(θ) = θβ - p_acc = θβ + expm1(K' log1p(-β)) with β = β(θ), in Python floats."""
    return theta * beta + math.expm1(count * _log_rejected(min(beta, 1.0)))


def _log_rejected(beta: float) -> float:
    """log(1 - β), -inf where β ≥ 1 (as torch's log1p gives it)."""
    return math.log1p(-beta) if beta < 1 else -math.inf


def _scalar_segment_root(below: float, above: float, count: int) -> float:
    """:func:`_segment_root`'s ρ in Python floats for A = below, B = above on the whole of [1, K']: Newton on
    G(s) from max(1/K', s₀), run until it stands still (G(1/K') ≤ 0 for the sets of any τ ≤ K', so it climbs
    to the root without crossing it). A float operation costs a hundred times less than a torch one on one
    number. ρ = 1 where g ≡ 0 (A = B = 0)."""
    if below <= 0 and above <= 0:
        return 1.0
    s = max(1 / count, _bound_start(below, above, count))
    for _ in range(100):  # a bound only: it stands still within ten steps
        log_rejected = _log_rejected(below * s + above)
        minus_g = math.expm1(count * log_rejected) + below + above / s
        slope = count * below * math.exp((count - 1) * log_rejected) + above / (s * s)
        if not (slope > 0 and minus_g > 0):
            break
        s += minus_g / slope
    return min(max(1 / s, 1.0), float(count))


def _bound_start(below: float, above: float, count: int) -> float:
    """:func:`_segment_root`'s s₀ = (1 - B - (1 - A/(1-B))^{1/K'}) / A, 0 where it is undefined."""
    if below <= 0 or above >= 1 or below > 1 - above:
        return 0.0
    fraction = below / (1 - above)
    root = -1.0 if fraction == 1 else math.expm1(math.log1p(-fraction) / count)
    return (above + root) / -below
