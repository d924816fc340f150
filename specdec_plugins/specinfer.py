"""SpecInfer's multi-step speculative sampling (Miao et al. 2024, Algorithm 2), lossless.

The rule in the project's notation: docs/verifiers.md §3.

Drafts may follow different laws p_1 … p_K. With ``cur = q``, for k = 1..K::

    accept x_k        with probability min(1, cur(x_k) / p_k(x_k))
    otherwise         cur ← (cur - p_k)+ / Σ (cur - p_k)+   and go on
    all rejected      sample from cur

Acceptance (independent candidates) = 1 - Π_k (1 - Σ min(cur_{k-1}, p_k)). A rejected candidate
has cur(x) < p_k(x), so every later residual is zero there: the fallback never returns a
candidate, and this closed form is exactly P(output ∈ candidates). In a block, candidates of
rows no longer alive are skipped: they are neither tested nor subtracted from ``cur``.
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
        accepts, residual = _accepts_and_residual(target_probs, draft_probs, draft_tokens)  # [..., K], [..., V]
        law = torch.zeros_like(target_probs)  # [..., V]
        reach = torch.ones_like(target_probs[..., :1])  # [..., 1]: P(candidates 1..k-1 all rejected)
        for k in range(draft_tokens.shape[-1]):
            accept = accepts[..., k : k + 1]  # [..., 1]
            law = one_hot_mass(law, draft_tokens[..., k : k + 1], reach * accept)
            reach = reach * (1 - accept)
        return law + reach * residual

    def select(self, target_probs, draft_probs, draft_tokens, generator=None):
        accepts, residual = _accepts_and_residual(target_probs, draft_probs, draft_tokens)
        return first_accepted(uniforms_like(accepts, generator), accepts, draft_tokens, residual, generator)

    def select_alive(self, target_probs, draft_probs, draft_tokens, alive, generator=None):
        accepts, residual = _accepts_and_residual(target_probs, draft_probs, draft_tokens, alive)  # [K], [V]
        return first_accepted(uniforms_like(accepts, generator), accepts, draft_tokens, residual, generator)[0]

    def acceptance_probability(self, target_probs, draft_probs):
        all_rejected = torch.ones_like(target_probs[..., 0])  # [...]
        current = target_probs  # [..., V]
        for k in range(draft_probs.shape[-2]):
            proposal = draft_probs[..., k, :]  # [..., V]
            all_rejected = all_rejected * (1 - torch.minimum(current, proposal).sum(-1))
            current = normalized_excess(current, proposal)
        return 1 - all_rejected


def _accepts_and_residual(target_probs, draft_probs, draft_tokens, alive=None):
    """Each candidate's acceptance min(1, cur_{k-1}(x_k)/p_k(x_k)) ``[..., K]`` (0 where not alive) and
    the final residual ``[..., V]``; alive ``[..., K]`` bool, default all.
    """
    current = target_probs  # [..., V]
    accepts = []
    for k in range(draft_tokens.shape[-1]):
        proposal = draft_probs[..., k, :]  # [..., V]
        accept = ratio_acceptance(current, proposal, draft_tokens[..., k : k + 1])  # [..., 1]
        following = normalized_excess(current, proposal)  # [..., V]
        if alive is not None:
            live = alive[..., k : k + 1]  # [..., 1]
            accept = torch.where(live, accept, torch.zeros_like(accept))
            following = torch.where(live, following, current)
        accepts.append(accept)
        current = following
    return torch.cat(accepts, -1), current
