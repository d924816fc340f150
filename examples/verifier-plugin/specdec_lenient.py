"""A third-party specdec verifier: lenient speculative sampling (Leviathan et al. 2023, §A.5 "lenience").

Accept the draft token x with probability min(1, λ·q(x)/p(x)), otherwise draw from (q - p)+.
λ = 1 is standard speculative sampling (lossless); λ > 1 accepts more often and is lossy.
λ < 1 is refused: a rejection could then happen where q(x) > p(x), and the residual (q - p)+ would
often hand back the rejected token itself, so the rule would neither accept min(p, λq) nor be
the scheme its name promises.
"""

import math
from typing import Annotated

import torch

from specdec_cli import Verifier
from specdec_cli.laws import normalized_excess, one_hot_mass, ratio_acceptance


class LenientSpeculative(Verifier):
    name = "lenient"
    lossless = False
    max_drafts = 1

    def __init__(self, *, leniency: Annotated[float, "λ: accept x with min(1, λ q(x) / p(x)); 1 is lossless"] = 1.0):
        # specdec has checked the type (a number); a ValueError here reaches the user as one line naming the verifier.
        if not math.isfinite(leniency) or leniency < 1:
            raise ValueError(f"leniency must be a finite number >= 1 (1 = speculative sampling), got {leniency!r}")
        self.leniency = float(leniency)

    def conditional(self, target_probs, draft_probs, draft_tokens):
        p, x = draft_probs[..., 0, :], draft_tokens[..., :1]  # [..., V], [..., 1]
        accept = ratio_acceptance(self.leniency * target_probs, p, x)  # [..., 1]: min(1, λ q(x) / p(x))
        residual = normalized_excess(target_probs, p)  # [..., V]: (q - p)+ normalised
        return one_hot_mass((1 - accept) * residual, x, accept)

    def acceptance_probability(self, target_probs, draft_probs):
        p = draft_probs[..., 0, :]  # [..., V]
        return torch.minimum(p, self.leniency * target_probs).sum(-1)
