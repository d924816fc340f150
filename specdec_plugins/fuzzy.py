"""Fuzzy Speculative Decoding: accept the draft token outright where the draft's law is close to the target's (lossy).

Source: Holsman, Huang & Dhingra, "Fuzzy Speculative Decoding for a Tunable Accuracy-Runtime Tradeoff" (ACL
Findings 2025, arXiv 2502.20704); its reference implementation's ``fsd_div_threshold`` is ``threshold`` here and
its ``fsd_div_type`` in {js_div, kl_div, tv_div} is ``divergence`` ("js", "kl", "tv"). With q = target law and
p = draft law at one position, x ~ p the draft token, Div one of :data:`~specdec_cli.plugins.divergences.DIVERGENCES`
(JS in nats by default; "kl" is KL(q ‖ p)) and a threshold T ≥ 0::

    Div(q, p) ≤ T:   accept x outright
    otherwise:       speculative sampling (accept x w.p. min(1, q(x) / p(x)), else draw from (q − p)+ normalised)

So each position outputs π = p where Div(q, p) ≤ T and q elsewhere: Div(q, π) ≤ T at every position, the bound
:meth:`FuzzySpeculative.promised_bound` promises. It accepts 1 where Div ≤ T and Σ min(p, q) = 1 − TV elsewhere.
T = 0 is speculative sampling (Div = 0 only where q = p, where speculative sampling accepts anyway). The bonus
token after a block accepted whole comes from q. KL(q ‖ p) is +inf where p rules out a token q allows: such a
position never accepts outright, whatever T.

The divergence is computed in float64 (an elementwise pass over [L, V] per block, small beside a forward), so
the comparison with T is not at the mercy of float32 rounding summed over a large vocabulary.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch

from specdec_cli.plugins.divergences import DIVERGENCES

from .speculative import SpeculativeSampling


class FuzzySpeculative(SpeculativeSampling):
    name = "fuzzy"
    lossless = False

    def __init__(
        self,
        *,
        threshold: Annotated[float, "T: where Div(q, p) ≤ T the draft token is accepted outright (0: lossless)"] = 0.0,
        divergence: Annotated[
            Literal["js", "kl", "tv"], "Div: Jensen-Shannon (nats), KL(q ‖ p) (nats) or total variation"
        ] = "js",
    ):
        if not 0 <= threshold < math.inf:  # NaN fails it too
            raise ValueError(f"fuzzy: threshold must be a finite number >= 0, got {threshold}")
        # A divergence outside the Literal is refused before this runs, in one line, by the parameters' type check.
        self.threshold = float(threshold)
        self.divergence = divergence

    def divergences(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """Div(q, p) at each position, in float64: target_probs and draft_probs ``[..., V]`` → ``[...]``."""
        return DIVERGENCES[self.divergence](target_probs.double(), draft_probs.double())  # [...]

    def outright(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """``[...]`` bool: the positions that accept their draft token outright, Div(q, p) ≤ T (``[..., V]`` each)."""
        return self.divergences(target_probs, draft_probs) <= self.threshold  # [...]

    def acceptance(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The probability of accepting candidates ``x`` ``[..., 1]``: 1 where outright, else speculative sampling's
        min(1, q(x) / p(x)); the residual, the bonus and the block are speculative sampling's."""
        ratio = super().acceptance(target_probs, draft_probs, x)  # [..., 1]
        outright = self.outright(target_probs, draft_probs).unsqueeze(-1)  # [..., 1]
        return torch.where(outright, torch.ones_like(ratio), ratio)  # [..., 1]

    def acceptance_probability(self, target_probs, draft_probs):
        overlap = super().acceptance_probability(target_probs, draft_probs)  # [...]: speculative sampling's 1 − TV
        outright = self.outright(target_probs, draft_probs[..., 0, :])  # [...]
        return torch.where(outright, torch.ones_like(overlap), overlap)  # [...]

    def output_law(self, target_probs, draft_probs):
        """p where Div(q, p) ≤ T (the draft token is kept whatever it is), q elsewhere (speculative sampling)."""
        p = draft_probs[..., 0, :]  # [..., V]
        return torch.where(self.outright(target_probs, p).unsqueeze(-1), p, target_probs)  # [..., V]

    def promised_bound(self) -> tuple[str, float]:
        """Div(q, π) ≤ T at every position, in the divergence the rule compares with T."""
        return self.divergence, self.threshold
