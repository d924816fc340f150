"""SpecTr's K-SEQ selection (Sun et al. 2023, Algorithm 2 and Theorem 2), lossless.

The rule in the project's notation: docs/verifiers.md §4.

For K i.i.d. candidates from one draft law p, with β(ρ) = Σ_x min(p(x), q(x)/ρ) and
p_acc(ρ) = 1 - (1 - β(ρ))^K, ρ ∈ [1, K] is the smallest root of p_acc(ρ) = ρ β(ρ)::

    for k = 1..K:  accept x_k with probability min(1, q(x_k) / (ρ p(x_k))); return the first accepted
    none:          sample p_res = (q - min(p, q/ρ) · p_acc/β)+ / (1 - p_acc)

Acceptance = p_acc(ρ); K = 1 gives ρ = 1, i.e. speculative sampling. Defined for identical
drafts only: different draft laws are an error.

ρ is solved exactly, not by bisection. ρβ(ρ) = Σ_x min(ρ p(x), q(x)) is piecewise linear in ρ
with breakpoints at the ratios r(x) = q(x)/p(x): between two consecutive ratios, with
A = Σ_{r(x) < ρ} q(x) and B = Σ_{r(x) ≥ ρ} p(x), β = A/ρ + B. So one sort of the ratios and
two prefix sums give g(ρ) = p_acc - ρβ at every breakpoint; g does not increase, so the
breakpoints where g > 0 are a prefix and the root lies in the segment after it. Inside that
segment G(s) = g(1/s) = 1 - (1 - A s - B)^K - A - B/s is concave and increasing in s = 1/ρ,
so Newton's method started where G ≤ 0 climbs to the root monotonically and never crosses it:
the returned ρ keeps p_acc ≤ ρβ (a non-negative residual). p_acc is evaluated as
-expm1(K log1p(-β)), exact to rounding also when β is tiny.

In a block the walk over positions follows the rows that drew every token output so far
(docs/verifiers.md §4). On a GPU every (first alive row, position) problem is solved in one batched
call, so the walk itself only looks results up (a fixed number of operations, no host read). On the
CPU, where reads are free, the walk runs on the host: a candidate's test costs at most one pass over
V (ρ < q(x)/(u p(x)) iff g there is negative), and ρ is solved only where the block ends, by sorting
the one bucket of ratios that holds it; with one row alive (K' = 1) ρ = 1 and nothing is sorted.
"""

from __future__ import annotations

import math

import torch

from specdec_cli.errors import UsageError
from specdec_cli.verifiers import (
    BlockDecision, Verifier, decide_problems, prefix_agreement, problem_members, reads_are_free, walk_reading,
)  # fmt: skip

from ._laws import TINY, first_accepted, normalized_or, one_hot_mass, ratio_acceptance, uniforms_like
from .speculative import SpeculativeSampling

_ONE_DRAFT = SpeculativeSampling()  # built once: torch.compile cannot trace a verifier's construction

NEWTON_STEPS = 6
"""Newton steps inside the root's segment. From the better of two starting points (the segment's end and
the root of the segment with B = 0), five already reach 1e-11 and six the float64 fixed point (1e-15)
on 77,000 random and adversarial problems wherever the root is resolvable: near a double root (q ≈ p,
K' > 1) g stays within rounding of 0 over an interval and every point of it is as good
(tests/test_spectr_solve.py)."""

BUCKETS = 1024
"""Ratio buckets of the CPU solve: the tokens of one bucket are all that is sorted."""


class SpecTr(Verifier):
    name = "spectr"
    lossless = True
    max_drafts = None
    identical_drafts = True
    keyed_randomness = True

    def conditional(self, target_probs, draft_probs, draft_tokens):
        p = _identical_law(draft_probs)  # [..., V]
        rho, p_acc, beta = solve_rho(target_probs, p, draft_probs.shape[-2])  # [..., 1] each
        law = torch.zeros_like(target_probs, dtype=torch.float64)  # [..., V]
        reach = torch.ones_like(rho)  # [..., 1]
        for k in range(draft_tokens.shape[-1]):
            x = draft_tokens[..., k : k + 1]  # [..., 1]
            accept = ratio_acceptance(target_probs, p, x, rho)  # [..., 1]
            law = one_hot_mass(law, x, reach * accept)
            reach = reach * (1 - accept)
        return (law + reach * _residual(target_probs, p, rho, p_acc, beta)).to(target_probs.dtype)

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        p = _identical_law(draft_probs)  # [..., V]
        rho, p_acc, beta = solve_rho(target_probs, p, draft_probs.shape[-2])
        accepts = ratio_acceptance(target_probs, p, draft_tokens, rho)  # [..., K]
        residual = _residual(target_probs, p, rho, p_acc, beta)  # [..., V]
        return first_accepted(uniforms_like(accepts, randomness), accepts, draft_tokens, residual, randomness)

    def select_alive(self, target_probs, draft_probs, draft_tokens, alive, randomness=None):
        # Alive rows share their prefix, so their laws are equal (the engine checked the drafts are
        # identical): read the first alive row's, and solve for ρ with K' = the alive count.
        p = draft_probs.index_select(0, alive.to(torch.uint8).argmax().view(1)).squeeze(0)  # [V]
        count = alive.sum().clamp(min=1).view(1)  # [1]
        rho, p_acc, beta = solve_rho(target_probs, p, count)  # [1] each
        accepts = torch.where(alive, ratio_acceptance(target_probs, p, draft_tokens, rho), 0.0)  # [K]
        residual = _residual(target_probs, p, rho, p_acc, beta)  # [V]
        return first_accepted(uniforms_like(accepts, randomness), accepts, draft_tokens, residual, randomness)[0]

    def acceptance_probability(self, target_probs, draft_probs):
        _, p_acc, _ = solve_rho(target_probs, _identical_law(draft_probs), draft_probs.shape[-2])
        return p_acc.squeeze(-1).to(target_probs.dtype)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None) -> BlockDecision:
        """The walk of :class:`Verifier` (stream ACCEPT: lane k = candidate k at offset t; RESIDUAL at the
        position that ends the block; BONUS at offset L), decided as one computation."""
        if draft_tokens.shape[0] == 1:  # ρ = 1: speculative sampling
            return _ONE_DRAFT.verify_block(target_probs, draft_probs, draft_tokens, randomness)
        if reads_are_free(target_probs):
            return _walk_on_host(target_probs, draft_probs, draft_tokens, randomness)
        return _walk_on_device(target_probs, draft_probs, draft_tokens, randomness)


def _identical_law(draft_probs: torch.Tensor) -> torch.Tensor:
    """The common law of the K drafts ``[..., K, V]`` → ``[..., V]``; an error if they differ.

    On a GPU the check would cost a host synchronisation per call, so there the engine's recipe
    check (``identical_drafts``) is what guards it.
    """
    first = draft_probs[..., 0, :]  # [..., V]
    if draft_probs.shape[-2] > 1 and reads_are_free(draft_probs):
        if not torch.allclose(draft_probs, first.unsqueeze(-2).expand_as(draft_probs), rtol=1e-5, atol=1e-8):
            raise UsageError(
                "spectr needs identical drafts (one draft config sampled K times); these drafts follow different "
                "laws: use specinfer, is-lp or is-truncated for different drafts"
            )
    return first


def _residual(target_probs, p, rho, p_acc, beta):
    """p_res ``[..., V]``; target_probs where nothing is left (then it is never sampled)."""
    return normalized_or(_excess(target_probs, p, rho, p_acc, beta), target_probs)


def _excess(target_probs, p, rho, p_acc, beta):
    """(q - min(p, q/ρ) p_acc/β)+ ``[..., V]`` in the laws' dtype: the residual's weights.

    p_acc/β ≤ ρ, and rounding both to the laws' dtype keeps that order, so no weight is lost to the clamp
    beyond rounding. ρ, p_acc, β ``[..., 1]``.
    """
    scale, coefficient = rho.to(target_probs.dtype), (p_acc / beta.clamp_min(TINY)).to(target_probs.dtype)
    return (target_probs - torch.minimum(p, target_probs / scale) * coefficient).clamp_min(0)


# --------------------------------------------------------------------------- the exact solve for ρ


def solve_rho(target_probs: torch.Tensor, p: torch.Tensor, num_drafts) -> tuple[torch.Tensor, ...]:
    """(ρ, p_acc, β) float64, each ``[..., 1]``, for target and draft laws ``[..., V]``.

    ``num_drafts``: an int, or a tensor broadcastable to ``[..., 1]`` (a count known only on the device).
    """
    counts = torch.as_tensor(num_drafts, dtype=torch.float64, device=p.device)  # [] or [..., 1]
    counts = counts.expand(*target_probs.shape[:-1], 1) if counts.dim() == 0 else counts  # [..., 1]
    return _solve(target_probs.double(), p.double(), counts)


def _solve(q: torch.Tensor, p: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
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


def _solve_by_buckets(q: torch.Tensor, p: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """:func:`_solve` for one problem on the CPU, reading: laws ``[V]`` → (ρ, p_acc, β) ``[1]`` float64.

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
    return _solve_run(q[members].double(), p[members].double(), counts, float(below[first]), float(above[last + 1]),
                      float(edges[last + 1]))  # fmt: skip


def _ratio_buckets(q: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor:
    """Each token's bucket floor(s (q/p - 1) + 2) clamped to [0, BUCKETS + 3], ``[V]`` int32; zero-mass tokens
    (0/0) in the last. Truncation is the floor here: the clamp leaves nothing negative."""
    shifted = torch.addcdiv(q.new_full((), 2 - scale), q, p, value=scale)  # [V]: s·q/p + 2 - s
    return shifted.nan_to_num_(nan=BUCKETS + 3, posinf=BUCKETS + 3).clamp_(0, BUCKETS + 3).int()


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


# --------------------------------------------------------------------------- the block decision


def _walk_on_device(target_probs, draft_probs, draft_tokens, randomness) -> BlockDecision:
    """Every problem (k, t) of :func:`problem_members` solved at once, then :func:`decide_problems`' look-ups:
    a fixed number of operations and no read. Problem (k, t) has K' = its member count and row k's laws."""
    num_rows, draft_length = draft_tokens.shape
    agreement = prefix_agreement(draft_tokens)  # [K, K, L+1]
    members = problem_members(agreement)  # [K, L, K]
    q, p = target_probs[:, :draft_length], draft_probs  # [K, L, V] each
    rho, p_acc, beta = _solve(q.double(), p.double(), members.sum(-1, keepdim=True).double())  # [K, L, 1] each
    candidates = draft_tokens.t().unsqueeze(0).expand(num_rows, -1, -1)  # [K, L, K]: candidate j's token at t
    accepts = ratio_acceptance(q, p, candidates, rho) * members  # [K, L, K]
    residuals = _excess(q, p, rho, p_acc, beta)  # [K, L, V]
    return decide_problems(accepts, residuals, agreement, target_probs, draft_tokens, randomness)


def _walk_on_host(target_probs, draft_probs, draft_tokens, randomness) -> BlockDecision:
    """The same walk on the CPU, reading as it goes (:func:`walk_reading`): candidate by candidate, stopping at
    the first acceptance (:func:`_accepts`, at most one pass over V); ρ itself is solved only where every
    candidate is rejected."""

    def decide(t: int, alive: list[int], tokens: list[list[int]], uniforms: list[list[float]]):
        q, p = target_probs[alive[0], t], draft_probs[alive[0], t]  # [V] each: the alive rows' laws
        accepted = next((j for j in alive if _accepts(q, p, len(alive), tokens[j][t], uniforms[t][j])), None)
        return (accepted, None) if accepted is not None else (None, _excess(q, p, *_solve_by_buckets(q, p, len(alive))))

    return walk_reading(decide, target_probs, draft_tokens, randomness)


_FLOAT32_TERM_ERROR = 2.0**-22
"""Bound on the relative error of one term min(p, q/θ) computed in float32 (θ rounded, then the division)."""


def _accepts(q: torch.Tensor, p: torch.Tensor, count: int, token: int, uniform: float) -> bool:
    """Whether SpecTr accepts candidate ``token``: u < q(x)/(ρ p(x)), i.e. ρ < θ = q(x)/(u p(x)).

    ρ ∈ [1, K'] and g does not increase, so ρ < θ iff θ > K', or θ > 1 and g(θ) = p_acc(θ) - θβ(θ) < 0.
    β(θ) is summed in float64 from float32 terms; only when g is within their rounding of 0 is it
    recomputed in float64. q, p ``[V]``; count: K'.
    """
    theta = float(q[token]) / (uniform * float(p[token]))
    if theta > count or theta <= 1:
        return theta > count
    terms = q / theta  # [V]
    beta = float(torch.minimum(terms, p, out=terms).sum(dtype=torch.float64))  # in place: one V-sized buffer
    gap = theta * beta + math.expm1(count * math.log1p(-min(beta, 1.0)))  # -g(θ)
    if abs(gap) <= (theta + count) * beta * _FLOAT32_TERM_ERROR + 1e-15:
        beta = min(float(torch.minimum(p.double(), q.double() / theta).sum()), 1.0)
        gap = theta * beta + math.expm1(count * math.log1p(-beta))
    return gap > 0
