"""Mentored decoding: the most accepting rule whose output stays within a divergence D of the target (lossy).

The rule in the project's notation: docs/verifiers.md §2. ``divergence`` picks what the bound D (``kl``, the
``--kl`` flag) bounds at each position: KL(q ‖ π) in nats ("kl", the default: the thresholds below), or the
total variation TV(q, π) ("tv": the blend at the end of this docstring).

Source: "Mentored decoding" proof, §4 and Algorithm 1. With q = target, p = draft and
the ratio t_i = q_i/p_i, the optimum of  max R = Σ p_i r_i  s.t.  KL(q ‖ π) ≤ D  has two thresholds
α ≤ 1 ≤ β:

    t_i ≤ α:      r_i = q_i/(α p_i),  π_i = q_i/α
    α < t_i < β:  r_i = 1,            π_i = p_i
    t_i ≥ β:      r_i = 1,            π_i = q_i/β,  s_i ∝ q_i/β - p_i

with 1 - R = Σ (p_i - q_i/α)+ = Σ (q_i/β - p_i)+ fixing β from α (eq. 24, 27-28), and
KL = Σ q_i ln clip(t_i, α, β). When KL(q ‖ p) ≤ D every draft token is accepted outright. Solving KL = D exactly,
on the device and on the CPU: :mod:`specdec_plugins._mentored_solve`.

Under total variation ("tv"; the optimum accepts 1 - TV(q, p) + D for D ≤ TV, shown below): at each position
w = min(1, D / TV(q, p)) (0 where TV = 0) and v = w·p + (1 - w)·q, and speculative sampling runs against v:
accept x with probability min(1, v(x)/p(x)), else draw from (v - p)+ ∝ (q - p)+; the bonus token comes from q
(:func:`tv_blend`, then :class:`SpeculativeSampling` against it). The output law is v, TV(q, v) = min(D, TV),
and it accepts Σ min(p, v) = 1 - TV + min(D, TV): no rule within TV D of q accepts more, since an accepted draft
token x contributes to π(x) at most p(x) and Σ min(p, π) ≤ 1 - TV(q, p) + TV(q, π). It is the static ensemble
(``ensemble``) with its weight set per position to D / TV; a fixed number of operations on every device (no
reading CPU path). At a TV bound the KL rule, given the KL(q ‖ v) the TV rule spends, accepts at least as much
(it is KL-optimal): tests/test_mentored_tv.py.

The rule is chosen once, when the verifier is made: :class:`MentoredDecoding` is the KL rule, and ``divergence: tv``
makes a :class:`MentoredTotalVariation` instead (one plugin name, two rules, no test of the divergence per call).
Both are :class:`~specdec_cli.plugins.single_draft.SingleDraftRule`: their hooks are the acceptance and the
residual above; each keeps the methods it computes more cheaply from one solve (KL) or one blend (TV).
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Literal

import torch

from specdec_cli.plugins.divergences import kl_divergence
from specdec_cli.plugins.laws import TINY, excess_weights, first_accepted, ratio_acceptance, uniforms_like
from specdec_cli.plugins.single_draft import SingleDraftRule
from specdec_cli.plugins.verifiers import Verifier, reads_are_free

from ._mentored_solve import _normalised, _Solution, solve, verify
from .speculative import SpeculativeSampling

_AGAINST_BLEND = SpeculativeSampling()
"""The TV rule is speculative sampling against each position's blend v (:func:`tv_blend`)."""


class MentoredDecoding(SingleDraftRule):
    """The plugin, and its KL rule (its TV rule: :class:`MentoredTotalVariation`, chosen in :meth:`__new__`)."""

    name = "mentored"
    lossless = False
    kl_bound_parameter = "kl"
    optimal_under = {"kl": {"divergence": "kl"}, "tv": {"divergence": "tv"}}  # the optimum under each (docs §2)
    batches_by_vmap = True
    reading_cpu_path = True

    def __new__(cls, *args, **params):
        # The rule is chosen here, once: a divergence outside the Literal is refused by the parameters' check.
        rule = _total_variation_rule(cls) if params.get("divergence") == "tv" else cls
        return super().__new__(rule, *args, **params)

    def __init__(
        self,
        *,
        kl: Annotated[
            float,
            "the bound D on KL(q ‖ π) in nats per position with divergence kl, or on TV(q, π) with divergence tv, "
            "where π is the output law and q the target's (0: lossless)",
        ] = 0.0,
        divergence: Annotated[
            Literal["kl", "tv"],
            "the divergence kl bounds: kl (KL(q ‖ π), the KL-optimal thresholds) or tv (total variation, "
            "the TV-optimal blend of target and draft)",
        ] = "kl",
    ):
        if not 0 <= kl < math.inf:
            raise ValueError(f"mentored: kl must be a finite number >= 0 (nats), got {kl}")
        self.kl = float(kl)
        self.divergence = divergence

    # Neither rule's residual gives the rejected token back, so the walk over ``conditional`` is the exact block law
    # (one solve or blend per position): a subclass that changes ``conditional`` changes its block law with it.
    block_law = Verifier.block_law

    def promised_bound(self) -> tuple[str, float]:
        """(divergence, D): the bound each position's output law keeps from q, on the divergence chosen."""
        return self.divergence, self.kl

    def solve(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> _Solution:
        """The KL rule's α, β, 1 - R and KL for q ``[..., V]`` and one draft's p ``[..., 1, V]`` (float64)."""
        return solve(target_probs, draft_probs[..., 0, :], self.kl, lazy=reads_are_free(target_probs))

    def acceptance(self, target_probs, draft_probs, x):
        """r_x = min(1, t_x / α) for candidates ``x`` ``[..., k]``."""
        return self.solve(target_probs, draft_probs.unsqueeze(-2)).acceptance_of(x).to(target_probs.dtype)  # [..., k]

    def residual_weights(self, target_probs, draft_probs, x):
        """(q/β - p)+ ``[..., V]`` as weights (q where nothing is rejected)."""
        return self.solve(target_probs, draft_probs.unsqueeze(-2)).residual_weights()  # [..., V]

    def conditional(self, target_probs, draft_probs, draft_tokens):
        x = draft_tokens[..., :1]  # [..., 1]
        solution = self.solve(target_probs, draft_probs)  # one solve for the acceptance and the residual
        r_x = solution.acceptance_of(x)  # [..., 1]
        law = (1 - r_x) * solution.residual()  # [..., V]
        return law.scatter_add(-1, x, r_x).to(target_probs.dtype)

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        x = draft_tokens[..., :1]  # [..., 1]
        solution = self.solve(target_probs, draft_probs)
        accept, residual = solution.acceptance_of(x), solution.residual()  # [..., 1], [..., V]
        return first_accepted(uniforms_like(accept, randomness), accept, x, residual, randomness)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        return verify(q, p, x, self.kl, randomness, lazy=reads_are_free(q))

    def acceptance_probability(self, target_probs, draft_probs):
        """R = 1 - Σ (p_i - q_i/α)+, exact since the residual never returns a rejected token."""
        return (1 - self.solve(target_probs, draft_probs).rejected_mass.squeeze(-1)).to(target_probs.dtype)

    def output_law(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """The exact output law π ``[..., V]`` for q ``[..., V]`` and p ``[..., 1, V]``: the thresholds' q/α, p, q/β
        (:meth:`_Solution.output_law`), computed in float64, given back in q's dtype."""
        return self.solve(target_probs, draft_probs).output_law().to(target_probs.dtype)  # [..., V]

    def output_kl(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """KL(q ‖ π) of the output law π, in nats → ``[...]``, from the solution's closed form: D itself whenever
        D < KL(q ‖ p) (:meth:`output_law` gives the same to rounding)."""
        return self.solve(target_probs, draft_probs).kl.squeeze(-1).to(target_probs.dtype)


class MentoredTotalVariation(MentoredDecoding):
    """Mentored decoding with ``divergence: tv``: speculative sampling against the blend v (:func:`tv_blend`), whose
    methods blend once and hand v to speculative sampling's (a fixed number of operations on every device)."""

    def acceptance(self, target_probs, draft_probs, x):
        """min(1, v(x) / p(x)) for candidates ``x`` ``[..., k]`` (float64)."""
        return ratio_acceptance(*tv_blend(target_probs, draft_probs, self.kl), x)  # [..., k]

    def residual_weights(self, target_probs, draft_probs, x):
        """(v - p)+ ``[..., V]`` as weights, v where it has no mass (float64)."""
        return excess_weights(*tv_blend(target_probs, draft_probs, self.kl))  # [..., V]

    def conditional(self, target_probs, draft_probs, draft_tokens):
        return _AGAINST_BLEND.conditional(*self._laws(target_probs, draft_probs), draft_tokens).to(target_probs.dtype)

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        return _AGAINST_BLEND.select(*self._laws(target_probs, draft_probs), draft_tokens, randomness)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        blend, draft = tv_blend(target_probs[:, :-1], draft_probs, self.kl)  # [1, L, V] each
        bonus = _normalised(target_probs[:, -1:])  # [1, 1, V]: the bonus law stays q
        return _AGAINST_BLEND.verify_block(torch.cat([blend, bonus], dim=1), draft, draft_tokens, randomness)

    def acceptance_probability(self, target_probs, draft_probs):
        """Σ min(p, v) = 1 - TV + min(D, TV)."""
        return _AGAINST_BLEND.acceptance_probability(*self._laws(target_probs, draft_probs)).to(target_probs.dtype)

    def output_law(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """The blend v ``[..., V]``: speculative sampling against v outputs v exactly (float64, given back in q's
        dtype)."""
        return tv_blend(target_probs, draft_probs[..., 0, :], self.kl)[0].to(target_probs.dtype)  # [..., V]

    def output_kl(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """KL(q ‖ v) in nats → ``[...]``, in float64."""
        q, p = _normalised(target_probs), _normalised(draft_probs[..., 0, :])  # [..., V] each
        return kl_divergence(q, tv_blend(q, p, self.kl)[0]).to(target_probs.dtype)

    def _laws(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule as speculative sampling takes it at a position: (v ``[..., V]``, p ``[..., 1, V]``), float64,
        for q ``[..., V]`` and one draft's p ``[..., 1, V]``."""
        blend, draft = tv_blend(target_probs, draft_probs[..., 0, :], self.kl)  # [..., V] each
        return blend, draft.unsqueeze(-2)


@functools.cache
def _total_variation_rule(plugin: type[MentoredDecoding]) -> type[MentoredDecoding]:
    """The TV rule's class for ``plugin`` (mentored, or a subclass of it: its own methods first, then the TV
    rule's)."""
    if issubclass(plugin, MentoredTotalVariation):
        return plugin
    if plugin is MentoredDecoding:
        return MentoredTotalVariation
    return type(plugin.__name__, (plugin, MentoredTotalVariation), {"__module__": plugin.__module__})


def tv_blend(target_probs: torch.Tensor, draft_probs: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The TV rule's law to check draft tokens against, for q and p ``[..., V]`` (any probabilities, renormalised
    in float64) → (v, p) ``[..., V]`` each, float64.

    v = w·p + (1 - w)·q with w = min(1, D / TV(q, p)) per position (0 where TV = 0): TV(q, v) = w·TV = min(D, TV),
    and Σ min(p, v) = 1 - (1 - w)·TV = 1 - TV + min(D, TV), the most any rule within TV D accepts. w = 1 gives
    v = p exactly (every draft token accepted), w = 0 gives v = q exactly (speculative sampling).
    """
    q, p = _normalised(target_probs), _normalised(draft_probs)  # [..., V] each
    distance = (q - p).clamp_min(0).sum(-1, keepdim=True)  # [..., 1]: TV(q, p)
    weight = torch.where(distance > 0, (bound / distance.clamp_min(TINY)).clamp(max=1.0), 0.0)  # [..., 1]
    return torch.addcmul((1 - weight) * q, weight, p), p
