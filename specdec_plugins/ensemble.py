"""Static ensemble verification: speculative sampling against a blend of target and draft (lossy).

The rule in the project's notation: docs/verifiers.md §8.

Sources: transformers' ``assistant_ensemble_weight`` (PR #45979; ``_speculative_sampling`` in
``src/transformers/generation/utils.py``, whose docstring calls the draft's law q and the target's p) and DIVERSED
(AISTATS 2026, arXiv 2604.07622). The weight w is transformers' own: the *target's* share of the law each draft
token is checked against. With q = target law, p = draft law at one position and w in [0, 1] (None: lossless, as
transformers' default), the verifier runs speculative sampling (Leviathan et al. 2023, Algorithm 1) against::

    v = w·q + (1 − w)·p
    accept x ~ p     with probability min(1, v(x) / p(x)) = min(1, 1 − w + w·q(x) / p(x))
    otherwise draw   from (v − p)+ / Σ (v − p)+  =  (q − p)+ / Σ (q − p)+   (q where it has no mass)

which is transformers' ``probability_ratio = 1.0 - w + w * (p_i / q_i)`` and its residual, in the project's letters.
Each position's output follows v exactly: its bias is TV(q, v) = (1 − w)·TV(q, p), and it accepts
Σ min(p, v) = 1 − w·TV(q, p). Under total variation that is the most any rule accepts for that bias (the optimum
accepts 1 − TV + D for a bias D ≤ TV): the static ensemble at w = 1 − D / TV is the TV-optimal lossy rule.
w = 1 (or None) is speculative sampling, decision for decision; w = 0 accepts every draft token. The bonus token
after a block accepted whole has no draft law to blend and comes from q.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import torch

from specdec_plugins.speculative import SpeculativeSampling


class StaticEnsemble(SpeculativeSampling):
    name = "ensemble"
    lossless = False
    revisions: ClassVar[tuple[str, ...]] = (
        "weight is transformers' assistant_ensemble_weight, the target's share of the blend (it was the draft's)",
    )

    def __init__(
        self,
        *,
        weight: Annotated[
            float | None,
            "w: transformers' assistant_ensemble_weight, the target's share of the law v = w·q + (1 − w)·p each "
            "draft token is checked against (None or 1: lossless; 0: accept every draft token)",
        ] = None,
    ):
        if weight is not None and not 0 <= weight <= 1:  # NaN fails it too
            raise ValueError(f"ensemble: weight must be a number in [0, 1] or null (lossless), got {weight}")
        self.weight = 1.0 if weight is None else float(weight)

    def acceptance(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """min(1, v(x) / p(x)) for candidates ``x`` ``[..., 1]``, which is transformers' 1 − w + w·q(x)/p(x) where
        p(x) > 0; at w = 1 the blend is q to the bit, so the decisions are speculative sampling's."""
        return super().acceptance(self.blend(target_probs, draft_probs), draft_probs, x)  # [..., 1]

    def blend(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """v = w·q + (1 − w)·p, position by position (``[..., V]`` each)."""
        return self.weight * target_probs + (1 - self.weight) * draft_probs  # [..., V]

    def acceptance_probability(self, target_probs, draft_probs):
        return super().acceptance_probability(self.blend(target_probs, draft_probs[..., 0, :]), draft_probs)

    def output_law(self, target_probs, draft_probs):
        """v itself: speculative sampling against v outputs v exactly."""
        return self.blend(target_probs, draft_probs[..., 0, :])  # [..., V]
