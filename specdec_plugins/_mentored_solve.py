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

import math

import torch

from specdec_cli.plugins.laws import commit_known, single_draft_block, single_draft_draws
from specdec_cli.plugins.verifiers import BlockDecision

from ._mentored_sets import _Buffers, _Groups, _solve_by_sets  # noqa: F401 (_Groups: mentored.py imports it from here)
from ._mentored_sorted import _normalised, _Solution, _solve_by_sorting
from ._workspace import per_thread


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
