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

from specdec_cli.plugins.laws import (
    excess_weights,
    first_accepted,
    normalized_excess,
    one_hot_mass,
    ratio_acceptance,
    row_at,
    single_draft_block,
    uniforms_like,
)
from specdec_cli.plugins.verifiers import Verifier


class SpeculativeSampling(Verifier):
    name = "speculative"
    lossless = True
    max_drafts = 1
    batches_by_vmap = True

    def acceptance(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The probability of accepting candidates ``x`` ``[..., 1]`` drawn from draft_probs, against target_probs
        (``[..., V]`` each): min(1, q(x) / p(x)). A rule that keeps the residual and the bonus and changes only this
        test (fuzzy) overrides it."""
        return ratio_acceptance(target_probs, draft_probs, x)  # [..., 1]

    def conditional(self, target_probs, draft_probs, draft_tokens):
        q, p = target_probs, draft_probs[..., 0, :]  # [..., V]
        x = draft_tokens[..., :1]  # [..., 1]
        accept = self.acceptance(q, p, x)  # [..., 1]
        return one_hot_mass((1 - accept) * normalized_excess(q, p), x, accept)

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p = target_probs, draft_probs[..., 0, :]  # [..., V]
        x = draft_tokens[..., :1]  # [..., 1]
        accept = self.acceptance(q, p, x)  # [..., 1]
        return first_accepted(uniforms_like(accept, randomness), accept, x, normalized_excess(q, p), randomness)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        accept = self.acceptance(q[:-1], p, x.unsqueeze(-1)).squeeze(-1)  # [L]: min(1, q(x_t)/p(x_t))
        return single_draft_block(accept, lambda n: excess_weights(row_at(q, n), row_at(p, n)), q, x, randomness)

    def acceptance_probability(self, target_probs, draft_probs):
        return torch.minimum(target_probs, draft_probs[..., 0, :]).sum(-1)  # [...]
