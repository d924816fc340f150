"""SpecInfer's multi-step speculative sampling (Miao et al. 2024, Algorithm 2; docs §3), lossless.

Drafts may follow different laws p_1 … p_K. With ``cur = q``, for k = 1..K::

    accept x_k        with probability min(1, cur(x_k) / p_k(x_k))
    otherwise         cur ← (cur - p_k)+ / Σ (cur - p_k)+   and go on
    all rejected      sample from cur

Acceptance (independent candidates) = 1 - Π_k (1 - Σ min(cur_{k-1}, p_k)). A rejected candidate
has cur(x) < p_k(x), so every later residual is zero there: the fallback never returns a
candidate, and this closed form is exactly P(output ∈ candidates).
"""

from __future__ import annotations

import torch

from specdec_cli.verifiers import Verifier

from ._laws import first_accepted, normalized_excess, one_hot_mass, ratio_acceptance, uniforms_like


class SpecInfer(Verifier):
    name = "specinfer"
    lossless = True
    max_drafts = None

    def conditional(self, target_probs, draft_probs, draft_tokens):
        law = torch.zeros_like(target_probs)  # [..., V]
        reach = torch.ones_like(target_probs[..., :1])  # [..., 1]: P(candidates 1..k-1 all rejected)
        for x, accept, _ in _steps(target_probs, draft_probs, draft_tokens):
            law = one_hot_mass(law, x, reach * accept)
            reach = reach * (1 - accept)
        return law + reach * _final_residual(target_probs, draft_probs)

    def select(self, target_probs, draft_probs, draft_tokens, generator=None):
        accepts = torch.cat([a for _, a, _ in _steps(target_probs, draft_probs, draft_tokens)], -1)  # [..., K]
        residual = _final_residual(target_probs, draft_probs)  # [..., V]
        return first_accepted(uniforms_like(accepts, generator), accepts, draft_tokens, residual, generator)

    def acceptance_probability(self, target_probs, draft_probs):
        all_rejected = torch.ones_like(target_probs[..., 0])  # [...]
        current = target_probs  # [..., V]
        for k in range(draft_probs.shape[-2]):
            proposal = draft_probs[..., k, :]  # [..., V]
            all_rejected = all_rejected * (1 - torch.minimum(current, proposal).sum(-1))
            current = normalized_excess(current, proposal)
        return 1 - all_rejected


def _steps(target_probs, draft_probs, draft_tokens):
    """For k = 1..K: (x_k [..., 1], its acceptance min(1, cur/p_k) [..., 1], cur before step k [..., V])."""
    current = target_probs  # [..., V]
    for k in range(draft_probs.shape[-2]):
        proposal = draft_probs[..., k, :]  # [..., V]
        x = draft_tokens[..., k : k + 1]  # [..., 1]
        yield x, ratio_acceptance(current, proposal, x), current
        current = normalized_excess(current, proposal)


def _final_residual(target_probs, draft_probs):
    current = target_probs  # [..., V]
    for k in range(draft_probs.shape[-2]):
        current = normalized_excess(current, draft_probs[..., k, :])
    return current
