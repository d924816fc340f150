"""A third-party specdec verifier: lenient speculative sampling (Leviathan et al. 2023, §A.5 "lenience").

Accept the draft token x with probability min(1, λ·q(x)/p(x)), otherwise draw from (q - p)+.
λ = 1 is standard speculative sampling (lossless); λ > 1 accepts more often and is lossy.
λ < 1 is refused: a rejection could then happen where q(x) > p(x), and the residual (q - p)+ would
often hand back the rejected token itself, so the rule would neither accept min(p, λq) nor be
the scheme its name promises.
"""

import math

import torch

from specdec_cli import Verifier


class LenientSpeculative(Verifier):
    name = "lenient"
    lossless = False
    max_drafts = 1

    def __init__(self, *, leniency: float = 1.0):
        # specdec shows a constructor's ValueError to the user as one line naming the verifier.
        if not isinstance(leniency, (int, float)) or not math.isfinite(leniency) or leniency < 1:
            raise ValueError(f"leniency must be a finite number >= 1 (1 = speculative sampling), got {leniency!r}")
        self.leniency = float(leniency)

    def _accept(self, target_probs, draft_probs, x):  # min(1, λ q(x)/p(x)) for x [..., 1]
        return (self.leniency * target_probs.gather(-1, x) / draft_probs.gather(-1, x)).clamp(max=1.0)

    def conditional(self, target_probs, draft_probs, draft_tokens):
        p, x = draft_probs[..., 0, :], draft_tokens[..., :1]  # [..., V], [..., 1]
        accept = self._accept(target_probs, p, x)  # [..., 1]
        excess = (target_probs - p).clamp_min(0)  # [..., V]
        mass = excess.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, excess / mass.clamp_min(1e-300), target_probs)
        return ((1 - accept) * residual).scatter_add(-1, x, accept)

    def acceptance_probability(self, target_probs, draft_probs):
        p = draft_probs[..., 0, :]  # [..., V]
        return torch.minimum(p, self.leniency * target_probs).sum(-1)
