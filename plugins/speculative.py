"""Standard speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

With q = target law and p = draft law at one position and one candidate x ~ p::

    accept x         with probability min(1, q(x) / p(x))
    otherwise draw   from (q - p)+ / Σ (q - p)+

The output is distributed exactly as q (Leviathan et al., Appendix A.1), and the acceptance
probability Σ_x min(p(x), q(x)) = 1 - TV(p, q) is the largest of any lossless rule with one draft.
"""

from __future__ import annotations

import torch

from specdec_cli.verifiers import Verifier

# Where q = p exactly the residual (q - p)+ is all zeros but is never sampled (acceptance is 1);
# this floor keeps the division finite without changing any row that is sampled.
_TINY = torch.finfo(torch.float64).tiny


class SpeculativeSampling(Verifier):
    name = "speculative"
    lossless = True
    max_drafts = 1

    def conditional(self, target_probs, draft_probs, draft_tokens):
        q = target_probs  # [..., V]
        p = draft_probs[..., 0, :]  # [..., V]
        x = draft_tokens[..., :1]  # [..., 1]
        accept = _acceptance_of_candidate(q, p, x)  # [..., 1]
        law = (1 - accept) * _residual(q, p)  # [..., V]
        return law.scatter_add(-1, x, accept)

    def select(self, target_probs, draft_probs, draft_tokens, generator=None):
        q = target_probs  # [..., V]
        p = draft_probs[..., 0, :]  # [..., V]
        x = draft_tokens[..., :1]  # [..., 1]
        u = torch.rand(x.shape, generator=generator, device=q.device, dtype=q.dtype)  # [..., 1]
        accepted = u < _acceptance_of_candidate(q, p, x)  # [..., 1]
        residual = _residual(q, p)  # [..., V]
        resampled = torch.multinomial(residual.reshape(-1, q.shape[-1]), 1, generator=generator)  # [rows, 1]
        token = torch.where(accepted, x, resampled.reshape(x.shape))  # [..., 1]
        return token.squeeze(-1), accepted.squeeze(-1)

    def acceptance_probability(self, target_probs, draft_probs):
        return torch.minimum(target_probs, draft_probs[..., 0, :]).sum(-1)  # [...]


def _acceptance_of_candidate(q: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """min(1, q(x)/p(x)) for candidate ``x`` ``[..., 1]``; p(x) > 0 because x was drawn from p."""
    q_x = q.gather(-1, x)  # [..., 1]
    p_x = p.gather(-1, x)  # [..., 1]
    return torch.where(q_x >= p_x, torch.ones_like(q_x), q_x / p_x.clamp_min(_TINY))


def _residual(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(q - p)+ normalised ``[..., V]``; q itself where p = q (never sampled then, see _TINY)."""
    excess = (q - p).clamp_min(0)  # [..., V]
    mass = excess.sum(-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, excess / mass.clamp_min(_TINY), q)
