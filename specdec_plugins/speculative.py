"""Standard speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

The rule in the project's notation: docs/verifiers.md §1.

With q = target law and p = draft law at one position and one candidate x ~ p::

    accept x         with probability min(1, q(x) / p(x))
    otherwise draw   from (q - p)+ / Σ (q - p)+

The output is distributed exactly as q (Leviathan et al., Appendix A.1), and the acceptance
probability Σ_x min(p(x), q(x)) = 1 - TV(p, q) is the largest of any lossless rule with one draft.
A block tests all L positions at once and draws from the residual only at the first rejection.
"""

from __future__ import annotations

import torch

from specdec_cli.plugins.laws import excess_weights, ratio_acceptance
from specdec_cli.plugins.single_draft import SingleDraftRule


class SpeculativeSampling(SingleDraftRule):
    name = "speculative"
    lossless = True
    batches_by_vmap = True

    def acceptance(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """min(1, q(x) / p(x)) for candidates ``x`` ``[..., k]`` (laws ``[..., V]``)."""
        return ratio_acceptance(target_probs, draft_probs, x)  # [..., k]

    def residual_weights(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(q − p)+ ``[..., V]``, q where it has no mass (q = p: every x is accepted)."""
        return excess_weights(target_probs, draft_probs)  # [..., V]

    def acceptance_probability(self, target_probs, draft_probs):
        return torch.minimum(target_probs, draft_probs[..., 0, :]).sum(-1)  # [...]: Σ min(p, q)
