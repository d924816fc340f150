"""Static ensemble verification: speculative sampling against a blend of target and draft (lossy).

The rule in the project's notation: docs/verifiers.md §8.

Sources: transformers' ``assistant_ensemble_weight`` (PR #45979) and DIVERSED (AISTATS 2026, arXiv 2604.07622).
With q = target law, p = draft law at one position and a weight w in [0, 1], the verifier runs speculative
sampling (Leviathan et al. 2023, Algorithm 1) against the blend::

    v = w·p + (1 − w)·q
    accept x ~ p     with probability min(1, v(x) / p(x))
    otherwise draw   from (v − p)+ / Σ (v − p)+  =  (q − p)+ / Σ (q − p)+

so each position's output follows v exactly: its bias is TV(q, v) = w·TV(q, p), and it accepts
Σ min(p, v) = 1 − (1 − w)·TV(q, p). Under total variation that is the most any rule accepts for that bias
(the optimum accepts 1 − TV + D for a bias D ≤ TV): the static ensemble at w = D / TV is the TV-optimal
lossy rule. w = 0 is speculative sampling; w = 1 accepts every draft token. The bonus token after a block
accepted whole has no draft law to blend and comes from q.
"""

from __future__ import annotations

from typing import Annotated

import torch

from specdec_plugins.speculative import SpeculativeSampling


class StaticEnsemble(SpeculativeSampling):
    name = "ensemble"
    lossless = False

    def __init__(
        self,
        *,
        weight: Annotated[float, "w: the draft's share of the law the draft is checked against (0: lossless)"] = 0.0,
    ):
        if not 0 <= weight <= 1:  # NaN fails it too
            raise ValueError(f"ensemble: weight must be a number in [0, 1], got {weight}")
        self.weight = float(weight)

    def blend(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """v = w·p + (1 − w)·q, position by position (``[..., V]`` each)."""
        return self.weight * draft_probs + (1 - self.weight) * target_probs  # [..., V]

    def conditional(self, target_probs, draft_probs, draft_tokens):
        return super().conditional(self.blend(target_probs, draft_probs[..., 0, :]), draft_probs, draft_tokens)

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        blended = self.blend(target_probs, draft_probs[..., 0, :])  # [..., V]
        return super().select(blended, draft_probs, draft_tokens, randomness)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        drafted = self.blend(target_probs[:, :-1], draft_probs)  # [1, L, V]
        blended = torch.cat([drafted, target_probs[:, -1:]], dim=1)  # [1, L+1, V]: the bonus law stays q
        return super().verify_block(blended, draft_probs, draft_tokens, randomness)

    def acceptance_probability(self, target_probs, draft_probs):
        return super().acceptance_probability(self.blend(target_probs, draft_probs[..., 0, :]), draft_probs)

    def output_law(self, target_probs, draft_probs):
        """v itself: speculative sampling against v outputs v exactly."""
        return self.blend(target_probs, draft_probs[..., 0, :])  # [..., V]
