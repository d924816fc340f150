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
V (ρ < q(x)/(u p(x)) iff g there is negative; of candidates that drew the same token only the largest
θ is tested), and ρ is solved only where the block ends, by set steps from the largest rejected θ: A
and B at a guess (one comparison and one product over V), the root of that segment's G in Python
floats, regrouped until the sets are the root's own; with one row alive (K' = 1) ρ = 1.
"""

from __future__ import annotations

import torch

from specdec_cli.base.errors import UsageError
from specdec_cli.plugins.laws import TINY, first_accepted, normalized_or, one_hot_mass, ratio_acceptance, uniforms_like
from specdec_cli.plugins.verifiers import BlockDecision, Verifier, reads_are_free

from ._problem_walk import verify_by_problems
from ._spectr_solve import HostProblem, solve, solve_rho


class SpecTr(Verifier):
    name = "spectr"
    lossless = True
    max_drafts = None
    identical_drafts = True
    batches_by_vmap = True
    reading_cpu_path = True

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
        position that ends the block; BONUS at offset L), decided as one computation: for one row as speculative
        sampling (ρ = 1), on the CPU by :func:`_host_step`, on a device by :func:`_solve_problems`
        (:func:`._problem_walk.verify_by_problems`)."""
        return verify_by_problems(target_probs, draft_probs, draft_tokens, randomness, _host_step, _solve_problems)


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


# --------------------------------------------------------------------------- the block decision


def _solve_problems(target_probs, draft_probs, draft_tokens, members) -> tuple[torch.Tensor, torch.Tensor]:
    """Every problem (k, t) of :func:`problem_members` (members ``[K, L, K]``) solved at once, for
    :func:`decide_problems`' look-ups: a fixed number of operations and no read. Problem (k, t) has K' = its
    member count and row k's laws → (accepts ``[K, L, K]``, residuals ``[K, L, V]``)."""
    num_rows, draft_length = draft_tokens.shape
    q, p = target_probs[:, :draft_length], draft_probs  # [K, L, V] each
    rho, p_acc, beta = solve(q.double(), p.double(), members.sum(-1, keepdim=True).double())  # [K, L, 1] each
    candidates = draft_tokens.t().unsqueeze(0).expand(num_rows, -1, -1)  # [K, L, K]: candidate j's token at t
    accepts = ratio_acceptance(q, p, candidates, rho) * members  # [K, L, K]
    residuals = _excess(q, p, rho, p_acc, beta)  # [K, L, V]
    return accepts, residuals


def _host_step(target_probs, draft_probs):
    """One position of the same walk on the CPU, reading as it goes (for :func:`walk_reading`): candidate by
    candidate, stopping at the first acceptance (:meth:`HostProblem.accepts`); ρ itself is solved only where
    every candidate is rejected (:meth:`HostProblem.solve`), from what those tests found."""

    def decide(t: int, alive: list[int], tokens: list[list[int]], uniforms: list[list[float]]):
        problem = HostProblem(target_probs[alive[0], t], draft_probs[alive[0], t], len(alive))  # the alive rows' laws
        accepted = _first_accepted(problem, [tokens[j][t] for j in alive], [uniforms[t][j] for j in alive])
        if accepted is not None:
            return alive[accepted], None
        return None, _excess(problem.q, problem.p, *problem.solve())

    return decide


def _first_accepted(problem: "HostProblem", tokens: list[int], uniforms: list[float]) -> int | None:
    """The first candidate (an index into ``tokens``) that ``problem`` accepts, or None. Once every candidate left
    drew the same token, which of them is accepted does not matter (the walk goes on with that token's rows):
    one is iff ρ < the largest of their θ = q(x)/(u p(x)), the smallest u's, so that one test decides."""
    for index, token in enumerate(tokens):
        if tokens[index:].count(token) == len(tokens) - index:
            return index if problem.accepts(token, min(uniforms[index:])) else None
        if problem.accepts(token, uniforms[index]):
            return index
    return None
