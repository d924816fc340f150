"""Cactus: constrained acceptance speculative sampling (lossy): speculative sampling against a law h that raises the
drafted token's target probability within a divergence budget δ.

Source: Y. Hao and L. Mou, "Cactus: Accelerating Auto-Regressive Decoding with Constrained Acceptance Speculative
Sampling" (ICLR 2026, arXiv 2604.04987, §2), as its code decides: MANGA-UOFA/Cactus, ``cactus/cactus.py``
(``solve_constraint``, ``CactusRejectionSampler._get_accepted`` and ``_get_recovered_probs``, a patch of vLLM
0.7.3's rejection sampler) at 3b01b816d18bf1e02ce93d0c5d43b42d8814427b. With q = target law, p = draft law at one
position, the draft token x ~ p and the budget δ ≥ 0 (``--delta``; 1.0, the value its README runs and its
``speculative_model`` defaults to)::

    h_x    = clamp(q(x) + sqrt(2 δ q(x) (1 − q(x))), 0, 1)      the drafted token's raised probability
    h^x(y) = q(y) · c_x for y ≠ x,  c_x = (1 − h_x) / (1 − q(x))    the rest scaled down (c_x = 1 where q(x) = 1,
                                                                    the source's nan_to_num)
    accept x         with probability a(x) = min(1, h_x / p(x))     (the source tests uniform < ratio)
    otherwise draw   from (h^x − p)+ / Σ (h^x − p)+                 (h^x depends on x: a residual per draft token)

and after a block accepted whole the bonus token comes from q. δ = 0 gives h^x = q: speculative sampling, decision
for decision. The paper solves for the h of most acceptance under a divergence constraint D(h ‖ q) ≤ δ, with the KL
expanded to second order: h_x is where χ²(h^x ‖ q) = (h_x − q(x))² / (q(x)(1 − q(x))) = 2δ (unless clamped at 1).
So δ bounds each h^x, not what the rule outputs: speculative sampling against h^x outputs h^x only given x, and
averaged over x ~ p the output law is

    π(y) = p(y) a(y) + Σ_x p(x) (1 − a(x)) r^x(y),   r^x = (h^x − p)+ / Σ (h^x − p)+,

whose KL(q ‖ π) is not δ: 2.4× δ on a three-token example, from below δ to several times δ on random six-token
laws, and over ten times δ on 1000-token laws at δ = 0.01 (tests/test_cactus.py). So no ``promised_bound``. The
rule accepts Σ_x min(p(x), h_x).
:meth:`Cactus.output_law` evaluates π in O(V log V) (a sort and cumulative sums, see :func:`_cactus_law`), not by
the O(V²) sum over x.

Where q(x) ∉ ]0, 1[ (0, 1, or above 1 by rounding) the source's h_x is q(x), or NaN (the root of a negative number,
or of 0·∞ where 2δ overflows to ∞); this verifier takes clamp(q(x), 0, 1) there: the source's value wherever the
source's is a number.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch

from specdec_cli.plugins.laws import (
    TINY,
    excess_or,
    first_accepted,
    normalized_or,
    one_hot_mass,
    row_at,
    single_draft_block,
    uniforms_like,
)
from specdec_cli.plugins.verifiers import Verifier


class Cactus(Verifier):
    name = "cactus"
    lossless = False
    max_drafts = 1
    batches_by_vmap = True

    def __init__(
        self,
        *,
        delta: Annotated[
            float,
            "δ: the budget that raises a draft token's target probability q to q + sqrt(2δ q (1 − q)) (0: "
            "speculative sampling); not a bound on the KL the output spends",
        ] = 1.0,
    ):
        if not 0 <= delta < math.inf:  # NaN fails it too
            raise ValueError(f"cactus: delta must be a finite number ≥ 0, got {delta}")
        self.delta = float(delta)

    def boosted(self, target_x: torch.Tensor) -> torch.Tensor:
        """h_x = clamp(q(x) + sqrt(2 δ q(x) (1 − q(x))), 0, 1) for target probabilities ``[...]`` → ``[...]``, in the
        source's order of operations (so its float decisions); clamp(q(x), 0, 1) where the source's is q(x) or NaN."""
        raised = (target_x + torch.sqrt(2 * self.delta * target_x * (1 - target_x))).clamp(0.0, 1.0)  # [...]
        return torch.where((target_x > 0) & (target_x < 1), raised, target_x.clamp(0.0, 1.0))  # [...]

    @staticmethod
    def rest_scale(target_x: torch.Tensor, boosted_x: torch.Tensor) -> torch.Tensor:
        """c_x = (1 − h_x) / (1 − q(x)) ``[...]``, the factor on every other token's q, with the source's nan_to_num
        (1 where q(x) = 1: h = q there)."""
        return ((1 - boosted_x) / (1 - target_x)).nan_to_num(nan=1.0, posinf=1.0, neginf=0.0)  # [...]

    def boosted_law(self, target_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h^x ``[..., V]`` for q ``[..., V]`` and draft tokens ``x`` ``[..., 1]`` (the source's solve_constraint)."""
        target_x = target_probs.gather(-1, x)  # [..., 1]
        boosted_x = self.boosted(target_x)  # [..., 1]
        rest = target_probs * self.rest_scale(target_x, boosted_x)  # [..., V]
        return rest.scatter(-1, x, boosted_x).clamp(0.0, 1.0)  # [..., V]

    def acceptance(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """a(x) = min(1, h_x / p(x)) for candidates ``x`` ``[..., 1]`` → ``[..., 1]`` (laws ``[..., V]``); p(x) > 0
        for a drawn token, and the floor only guards unused rows."""
        boosted_x = self.boosted(target_probs.gather(-1, x))  # [..., 1]
        return (boosted_x / draft_probs.gather(-1, x).clamp_min(TINY)).clamp(max=1.0)  # [..., 1]

    def residual_weights(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(h^x − p)+ ``[..., V]`` as weights to draw from after rejecting ``x`` ``[..., 1]``; h^x where it has no
        mass (then h^x = p, a(x) = 1, and it is never drawn)."""
        boosted = self.boosted_law(target_probs, x)  # [..., V]
        return excess_or((boosted - draft_probs).clamp_min(0), boosted)  # [..., V]

    def conditional(self, target_probs, draft_probs, draft_tokens):
        q, p, x = target_probs, draft_probs[..., 0, :], draft_tokens[..., :1]  # [..., V], [..., V], [..., 1]
        accept = self.acceptance(q, p, x)  # [..., 1]
        residual = normalized_or(self.residual_weights(q, p, x), q)  # [..., V]
        return one_hot_mass((1 - accept) * residual, x, accept)  # [..., V]

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p, x = target_probs, draft_probs[..., 0, :], draft_tokens[..., :1]  # [..., V], [..., V], [..., 1]
        accept = self.acceptance(q, p, x)  # [..., 1]
        return first_accepted(uniforms_like(accept, randomness), accept, x, self.residual_weights(q, p, x), randomness)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        accept = self.acceptance(q[:-1], p, x.unsqueeze(-1)).squeeze(-1)  # [L]: min(1, h_x / p(x)) at each position

        def residual_at(n: torch.Tensor) -> torch.Tensor:  # [V]: h^x of the rejected position only, not all L
            return self.residual_weights(row_at(q, n), row_at(p, n), x.index_select(0, n.view(1)))

        return single_draft_block(accept, residual_at, q, x, randomness)

    def acceptance_probability(self, target_probs, draft_probs):
        return torch.minimum(draft_probs[..., 0, :], self.boosted(target_probs)).sum(-1)  # [...]: Σ_x min(p(x), h_x)

    def output_law(self, target_probs, draft_probs):
        """π(y) = p(y) a(y) + Σ_x p(x) (1 − a(x)) r^x(y), exactly, in O(V log V) (:func:`_cactus_law`). Computed in
        float64, given back in q's dtype."""
        q, p = target_probs.double(), draft_probs[..., 0, :].double()  # [..., V]
        boosted = self.boosted(q)  # [..., V]: h_x for every token as the draft token
        return _cactus_law(q, p, boosted, self.rest_scale(q, boosted)).to(target_probs.dtype)  # [..., V]


def _cactus_law(q: torch.Tensor, p: torch.Tensor, boosted: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Cactus's output law ``[..., V]`` for q, p, h_x and c_x ``[..., V]`` (float64), without the V × V sum.

    Rejecting x has probability mass w_x = p(x)(1 − a(x)) = (p(x) − h_x)+. Then p(x) > h_x ≥ q(x) ≥ c_x q(x), so the
    residual has no mass at x, and for y ≠ x, (h^x(y) − p(y))+ = q(y) (c_x − ρ(y))+ with ρ = p / q (∞ where q(y) = 0,
    where the term is 0). The right side is 0 at y = x too (ρ(x) > c_x), so with no exception:

        Z_x  = Σ_y q(y) (c_x − ρ(y))+ = c_x·Q(c_x) − P(c_x)       Q, P: the q and p of the tokens with ρ < c_x
        π(y) = p(y) a(y) + q(y)·F(ρ(y)),  F(t) = Σ_x (w_x / Z_x)(c_x − t)+ = A(t) − t·B(t)

    where A, B sum w_x c_x / Z_x and w_x / Z_x over the tokens with c_x > t: one sort of ρ, one of c, cumulative sums
    and searches. Z_x ≥ w_x (the residual's mass is TV(h^x, p) ≥ (p(x) − h_x)+), which guards its rounding.
    """
    kept = torch.minimum(p, boosted)  # [..., V]: p(x) a(x)
    rejected = p - kept  # [..., V]: w_x
    ratio = torch.where(q > 0, p / q.clamp_min(TINY), math.inf)  # [..., V]: ρ
    below = _sums_below(ratio, scale, q, p)  # ([..., V], [..., V]): Q(c_x), P(c_x)
    mass = torch.maximum(scale * below[0] - below[1], rejected)  # [..., V]: Z_x
    weight = torch.where(rejected > 0, rejected / mass.clamp_min(TINY), 0.0)  # [..., V]: w_x / Z_x
    above = _sums_above(scale, ratio.clamp(max=1.0), weight * scale, weight)  # A(ρ(y)), B(ρ(y)); c ≤ 1: F(≥ 1) = 0
    spread = (above[0] - ratio.clamp(max=1.0) * above[1]).clamp_min(0)  # [..., V]: F(ρ(y))
    return kept + q * spread  # [..., V]


def _sums_below(keys: torch.Tensor, points: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For each point ``[..., V]``, the sums of each of ``values`` ``[..., V]`` over the entries whose key ``[..., V]``
    is below it → one ``[..., V]`` per value."""
    order = keys.argsort(-1)  # [..., V]
    sorted_keys = keys.gather(-1, order)  # [..., V]
    count = torch.searchsorted(sorted_keys, points.contiguous())  # [..., V]: keys strictly below each point
    return tuple(_prefix_sums(value.gather(-1, order)).gather(-1, count) for value in values)


def _sums_above(keys: torch.Tensor, points: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """As :func:`_sums_below`, over the entries whose key is strictly above each point (the keys negated: the largest
    summed first, so a small tail is not the difference of two large sums)."""
    return _sums_below(-keys, -points, *values)


def _prefix_sums(values: torch.Tensor) -> torch.Tensor:
    """0 then the running sums of ``values`` ``[..., V]`` → ``[..., V+1]``: entry n sums the first n."""
    return torch.nn.functional.pad(values.cumsum(-1), (1, 0))  # [..., V+1]
