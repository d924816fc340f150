"""Fuzzy Speculative Decoding (FSD): accept the draft token where the draft's law is close to the target's, back off
to the target elsewhere (lossy).

Source: Holsman, Huang & Dhingra, "Fuzzy Speculative Decoding for a Tunable Accuracy-Runtime Tradeoff" (ACL
Findings 2025, arXiv 2502.20704), and its reference implementation, a patched transformers ``utils.py`` whose
``_speculative_backoff_sampling`` decides (its ``q`` is the draft's law and its ``p`` the target's; here, as
everywhere in specdec, q is the target's and p the draft's). Its ``fsd_div_threshold`` is ``threshold`` T and its
``fsd_div_type`` is ``divergence``. At each drafted position, with Div computed on the laws the rule compares::

    Div ≤ T:     accept the draft token x
    otherwise:   reject it, and the block ends with a token drawn from q (the target's sampling law there)

and after a block accepted whole the bonus token comes from q. The draft token's own probabilities never enter
the decision, which FSD makes for whole blocks at once (``is_accepted = divs <= div_threshold``, then the first
rejection). FSD's divergences, in its letters turned into the project's (π_t = target law, π_d = draft law):

- ``kl``: FSD's ``kl_div(log p, q)`` = KL(π_d ‖ π_t) = Σ π_d ln(π_d / π_t), the draft's law against the target's;
- ``kl_reversed``: FSD's ``kl_div(log q, p)`` = KL(π_t ‖ π_d);
- ``js``: FSD's ``js_div`` = ½ KL(m ‖ π_t) + ½ KL(m ‖ π_d) with m = ½ (π_t + π_d): FSD's formula, which is not the
  Jensen-Shannon divergence ½ KL(π_t ‖ m) + ½ KL(π_d ‖ m) (it is +∞ where one law rules out a token the other allows);
- ``tv``: ½ Σ |π_t − π_d|.

The laws compared (``laws``): FSD's default is ``unprocessed``, each model's law at temperature 1 over the whole
vocabulary (softmax of the raw logits, whatever the run samples with), which this verifier asks the engine for
(``judged_laws``); ``sampling`` compares the laws the tokens are sampled from, as FSD does when its
``fsd_div_logit_processor`` names the temperature, top-k and top-p warpers, adding 1e-10 to both laws and
renormalising first, as FSD does there.

``fallback: speculative`` is specdec's own variant, not FSD's: where Div > T it runs speculative sampling (accept x
with probability min(1, q(x) / p(x)), else draw from (q − p)+ normalised). Both output the same law at each
position, π = p where Div ≤ T and q elsewhere; FSD's accepts [Div ≤ T], the variant accepts 1 − TV(q, p) more where
Div > T (more acceptance for the same output law).

Div is computed in float64 (an elementwise pass over [L, V] per block, small beside a forward), so the comparison
with T is not at the mercy of float32 rounding summed over a large vocabulary. On the device the rule is a fixed
number of operations with no read: the decisions are 0 or 1, so each keyed uniform in ]0, 1[ decides as the test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, ClassVar, Literal

import torch

from specdec_cli.plugins.laws import excess_weights
from specdec_cli.plugins.single_draft import _one_draft
from specdec_cli.plugins.verifiers import JudgedLaws

from .speculative import SpeculativeSampling

SMOOTHING = 1e-10
"""What FSD adds to both laws before comparing processed ones (``epsilon``), renormalising after."""


def _kl(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Σ first · ln(first / second) ``[...]`` for laws ``[..., V]``, as torch's ``kl_div(log second, first)`` sums it
    (0 where first is 0; +inf where only second is)."""
    return (torch.xlogy(first, first) - first * torch.log(second)).sum(-1)  # [...]


FSD_DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": lambda target, draft: _kl(draft, target),
    "kl_reversed": lambda target, draft: _kl(target, draft),
    "js": lambda target, draft: (_kl((target + draft) / 2, target) + _kl((target + draft) / 2, draft)) / 2,
    "tv": lambda target, draft: (target - draft).abs().sum(-1) / 2,
}
"""FSD's divergences of the target's law and the draft's ``[..., V]`` each → ``[...]``, by FSD's names (module doc)."""


class FuzzySpeculative(SpeculativeSampling):
    name = "fuzzy"
    lossless = False
    revisions: ClassVar[tuple[str, ...]] = (
        "FSD's rule: where Div > T the draft token is rejected and the target's law drawn from (it ran speculative "
        "sampling there, now fallback: speculative); FSD's divergences (kl is KL(draft ‖ target), js is FSD's "
        "formula) on the unprocessed laws by default",
    )

    def __init__(
        self,
        *,
        threshold: Annotated[float, "T: where Div ≤ T the draft token is accepted, elsewhere rejected"] = 0.0,
        divergence: Annotated[
            Literal["js", "kl", "kl_reversed", "tv"],
            "Div, FSD's fsd_div_type: its js_div, kl_div = KL(draft ‖ target), kl_div_reversed or tv_div (nats)",
        ] = "js",
        laws: Annotated[
            Literal["unprocessed", "sampling"],
            "the laws Div compares: unprocessed (temperature 1, whole vocabulary: FSD's default) or sampling",
        ] = "unprocessed",
        fallback: Annotated[
            Literal["target", "speculative"],
            "where Div > T: target (reject, draw from q: FSD) or speculative (speculative sampling: specdec's variant)",
        ] = "target",
    ):
        if not 0 <= threshold < math.inf:  # NaN fails it too
            raise ValueError(f"fuzzy: threshold must be a finite number >= 0, got {threshold}")
        # Values outside the Literals are refused before this runs, in one line, by the parameters' type check.
        self.threshold = float(threshold)
        self.divergence = divergence
        self.laws = laws
        self.fallback = fallback
        self.judged_laws = "unprocessed" if laws == "unprocessed" else None

    def divergences(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """Div of the target's and the draft's laws at each position, in float64: ``[..., V]`` each → ``[...]``;
        smoothed as FSD smooths the processed laws it compares."""
        target, draft = target_probs.double(), draft_probs.double()  # [..., V] each
        if self.laws == "sampling":
            target = (target + SMOOTHING) / (target + SMOOTHING).sum(-1, keepdim=True)  # [..., V]
            draft = (draft + SMOOTHING) / (draft + SMOOTHING).sum(-1, keepdim=True)  # [..., V]
        return FSD_DIVERGENCES[self.divergence](target, draft)  # [...]

    def close(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, judged: JudgedLaws = None) -> torch.Tensor:
        """``[...]`` bool: Div ≤ T at each position, for the laws ``[..., V]`` handed (``draft_probs`` one draft's)
        or, where the rule compares others, the judged ones (``judged``: target ``[..., V]``, draft ``[..., V]``)."""
        compared = (target_probs, draft_probs) if judged is None else judged
        return self.divergences(*compared) <= self.threshold  # [...]

    def acceptance(self, target_probs, draft_probs, x, judged: JudgedLaws = None):
        """P(accept x) ``[..., 1]``: 1 where Div ≤ T, else 0 (FSD) or min(1, q(x) / p(x)) (the variant)."""
        close = self.close(target_probs, draft_probs, judged).unsqueeze(-1)  # [..., 1]
        otherwise = super().acceptance(target_probs, draft_probs, x) if self.fallback == "speculative" else 0.0
        return torch.where(close, 1.0, otherwise).to(target_probs.dtype)  # [..., 1]

    def residual_weights(self, target_probs, draft_probs, x):
        """What a rejected position draws from ``[..., V]``: q itself (FSD), or (q − p)+ as weights (the variant)."""
        return target_probs if self.fallback == "target" else excess_weights(target_probs, draft_probs)  # [..., V]

    def acceptance_probability(self, target_probs, draft_probs, judged: JudgedLaws = None):
        p = draft_probs[..., 0, :]  # [..., V]
        close = self.close(target_probs, p, _one_draft(judged))  # [...]
        otherwise = super().acceptance_probability(target_probs, draft_probs) if self.fallback == "speculative" else 0
        return torch.where(close, 1.0, otherwise).to(target_probs.dtype)  # [...]

    def output_law(self, target_probs, draft_probs, judged: JudgedLaws = None):
        """p where Div ≤ T (the draft token is kept whatever it is), q elsewhere (either fallback outputs q)."""
        p = draft_probs[..., 0, :]  # [..., V]
        return torch.where(self.close(target_probs, p, _one_draft(judged)).unsqueeze(-1), p, target_probs)  # [..., V]
