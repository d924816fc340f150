"""Threshold acceptance: SGLang's acceptance thresholds for speculative decoding (lossy but at the defaults).

Source: SGLang's ``--speculative-accept-threshold-single`` (s) and ``--speculative-accept-threshold-acc`` (a),
applied by sgl-kernel's ``TreeSpeculativeSamplingTargetOnly`` (sgl-project/sglang,
``sgl-kernel/csrc/speculative/speculative_sampling.cuh`` at 120affb9613cc3f5bcd055ec09c7621d3ced0ebc). This is the
kernel's chain case, one candidate per level. With q = target law at one position and x the draft token
(drawn from p, which the rule never reads), one uniform u per position::

    accept x         iff u ≤ q(x) / a'  or  q(x) ≥ s,  a' = max(a, 1e-9)  (the kernel's fmaxf(threshold_acc, 1e-9f))
                     so with probability  a(x) = 1 if q(x) ≥ s, else min(1, q(x) / a')
    otherwise draw   from q · [y ≠ x] / (1 − q(x))     (the kernel's relu(q − draft_probs) after it sets
                                                        draft_probs[x] = q(x), draft_probs being zero otherwise)

and after a block accepted whole the bonus token comes from q. The output law at one position is
π(y) = p(y) a(y) + q(y) Σ_{x ≠ y} p(x) (1 − a(x)) / (1 − q(x)), and it accepts Σ_x p(x) a(x).

At SGLang's defaults s = a = 1 it accepts x with probability q(x) and otherwise draws from q without x, so
π(y) = p(y) q(y) + q(y) (1 − p(y)) = q(y) for any draft law p: lossless, accepting Σ p q (less than speculative
sampling's Σ min(p, q)). SGLang's flags are plain floats with no range check, and this verifier takes every number
they take (but NaN): lowering s or a accepts more and biases the output towards p (s ≤ 0 or a ≤ 1e-9 accept every
draft token, π = p); s > 1 turns the first test off; a > 1 accepts less than q(x) and is lossy too.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar

import torch

from specdec_cli.plugins.laws import TINY, excess_or
from specdec_cli.plugins.single_draft import SingleDraftRule

ACC_FLOOR = float(torch.tensor(1e-9, dtype=torch.float32))
"""sgl-kernel's floor on threshold_acc (``fmaxf(threshold_acc, 1e-9f)``), as the float32 it is there."""


class ThresholdAcceptance(SingleDraftRule):
    name = "threshold"
    lossless = False  # at the defaults it is; any other threshold is not
    batches_by_vmap = True
    revisions: ClassVar[tuple[str, ...]] = (
        "acc is floored at 1e-9 as sgl-kernel floors it, and any number SGLang takes is taken (acc 0 was refused)",
    )

    def __init__(
        self,
        *,
        single: Annotated[
            float, "s: accept a draft token whose target probability is at least s (1: off; any number SGLang takes)"
        ] = 1.0,
        acc: Annotated[
            float,
            "a: accept a draft token x with probability min(1, q(x) / a), a floored at 1e-9 as sgl-kernel floors it "
            "(1, with single 1: lossless)",
        ] = 1.0,
    ):
        # SGLang's flags are plain floats (no range check), and its kernel floors acc at 1e-9: take every number.
        for parameter, value in (("single", single), ("acc", acc)):
            if math.isnan(value):
                raise ValueError(f"threshold: {parameter} must be a number, got {value}")
        self.single = float(single)
        self.acc = float(acc)
        self.floored_acc = max(self.acc, ACC_FLOOR)
        """What sgl-kernel divides by: ``fmaxf(threshold_acc, 1e-9f)``."""

    def acceptance_at(self, target_x: torch.Tensor) -> torch.Tensor:
        """a(x) for the target probabilities ``target_x`` ``[...]`` of draft tokens → ``[...]``."""
        return torch.where(target_x >= self.single, 1.0, (target_x / self.floored_acc).clamp(max=1.0))  # [...]

    def acceptance(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """a(x) for candidates ``x`` ``[..., k]`` (p is never read)."""
        return self.acceptance_at(target_probs.gather(-1, x))  # [..., k]

    def residual_weights(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q with the rejected token x ``[..., 1]`` removed ``[..., V]``; q itself where nothing is left (q(x) = 1,
        where x is always accepted and the residual is never drawn)."""
        return excess_or(target_probs.scatter(-1, x, 0.0), target_probs)  # [..., V]

    def acceptance_probability(self, target_probs, draft_probs):
        return (draft_probs[..., 0, :] * self.acceptance_at(target_probs)).sum(-1)  # [...]

    def output_law(self, target_probs, draft_probs):
        """π(y) = p(y) a(y) + q(y) (R − r(y)), where r(x) = p(x) (1 − a(x)) / (1 − q(x)) is the mass that
        rejecting x spreads over q without x, and R = Σ_x r(x)."""
        q, p = target_probs, draft_probs[..., 0, :]  # [..., V]
        accept = self.acceptance_at(q)  # [..., V]: a(x) for every token
        rest = q.sum(-1, keepdim=True) - q  # [..., V]: 1 − q(x), as the residual normalises it
        rejected = torch.where(rest > 0, p * (1 - accept) / rest.clamp_min(TINY), 0.0)  # [..., V]: r(x), 0 at a(x) = 1
        return p * accept + q * (rejected.sum(-1, keepdim=True) - rejected)  # [..., V]
