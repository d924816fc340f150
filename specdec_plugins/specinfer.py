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

from specdec_cli.plugins.laws import (
    TINY,
    first_accepted,
    normalized_excess,
    one_hot_mass,
    ratio_acceptance,
    uniforms_like,
)
from specdec_cli.plugins.verifiers import Verifier

from ._problem_walk import verify_by_problems


class SpecInfer(Verifier):
    name = "specinfer"
    lossless = True
    max_drafts = None
    dependent_drafts = True
    batches_by_vmap = True
    reading_cpu_path = True

    def conditional(self, target_probs, draft_probs, draft_tokens):
        accepts, residual = _accepts_and_residual(target_probs, draft_probs, draft_tokens)  # [..., K], [..., V]
        law = torch.zeros_like(target_probs)  # [..., V]
        reach = torch.ones_like(target_probs[..., :1])  # [..., 1]: P(candidates 1..k-1 all rejected)
        for k in range(draft_tokens.shape[-1]):
            accept = accepts[..., k : k + 1]  # [..., 1]
            law = one_hot_mass(law, draft_tokens[..., k : k + 1], reach * accept)
            reach = reach * (1 - accept)
        return law + reach * residual

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        accepts, residual = _accepts_and_residual(target_probs, draft_probs, draft_tokens)
        return first_accepted(uniforms_like(accepts, randomness), accepts, draft_tokens, residual, randomness)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        """Every (leader, position) problem solved at once on a device (:func:`_problem_chains`); on the CPU, where
        reads are free, the walk tests one candidate at a time and updates the residual only after a rejection
        (:func:`_step_reading`). With one draft the rule is speculative sampling, whose block is decided in fewer
        operations (:func:`._problem_walk.verify_by_problems`)."""
        return verify_by_problems(target_probs, draft_probs, draft_tokens, randomness, _step_reading, _problem_chains)

    def acceptance_probability(self, target_probs, draft_probs):
        all_rejected = torch.ones_like(target_probs[..., 0])  # [...]
        current = target_probs  # [..., V]
        for k in range(draft_probs.shape[-2]):
            proposal = draft_probs[..., k, :]  # [..., V]
            all_rejected = all_rejected * (1 - torch.minimum(current, proposal).sum(-1))
            current = normalized_excess(current, proposal)
        return 1 - all_rejected


def _accepts_and_residual(target_probs, draft_probs, draft_tokens):
    """Each candidate's acceptance min(1, cur_{k-1}(x_k)/p_k(x_k)) ``[..., K]`` and the final residual ``[..., V]``."""
    current = target_probs  # [..., V]
    accepts = []
    for k in range(draft_tokens.shape[-1]):
        proposal = draft_probs[..., k, :]  # [..., V]
        accepts.append(ratio_acceptance(current, proposal, draft_tokens[..., k : k + 1]))  # [..., 1]
        current = normalized_excess(current, proposal)
    return torch.cat(accepts, -1), current


def _problem_chains(target_probs, draft_probs, draft_tokens, members):
    """SpecInfer's chain for every problem (k, t) → (accepts ``[K, L, K]``, unnormalised residuals ``[K, L, V]``).

    With R = cur · Σ R kept unnormalised, min(1, cur(x_j)/p_j(x_j)) = min(1, R(x_j) / (Σ R · p_j(x_j))) and
    the next R is (R - Σ R · p_j)+; a candidate that is not a member leaves R as it is. members ``[K, L, K]``.
    """
    num_rows, draft_length = draft_tokens.shape
    residual = target_probs[:, :draft_length]  # [K, L, V]: problem (k, t) starts from row k's q_t
    drafted = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [K, L]: p_j(x_j) at t
    accepts = []
    for j in range(num_rows):
        member = members[..., j : j + 1].to(residual.dtype)  # [K, L, 1]
        mass = residual.sum(-1, keepdim=True)  # [K, L, 1]
        at_token = residual.gather(-1, draft_tokens[j].view(1, draft_length, 1).expand(num_rows, -1, -1))  # [K, L, 1]
        scale = mass * drafted[j].view(1, draft_length, 1)  # [K, L, 1]
        accepts.append((at_token / scale.clamp_min(TINY)).clamp(max=1.0) * member)
        residual = torch.addcmul(residual, mass * member, draft_probs[j], value=-1).clamp_min(0)  # [K, L, V]
    return torch.cat(accepts, -1), residual


def _step_reading(target_probs, draft_probs):
    """SpecInfer at one position with host reads (the CPU path, for :func:`walk_reading`): candidate by
    candidate, stopping at the first acceptance, so a position whose first candidate is accepted costs
    two lookups and a sum, not a pass over V per candidate."""

    def decide(t: int, alive: list[int], tokens: list[list[int]], uniforms: list[list[float]]):
        residual = target_probs[alive[0], t]  # [V]
        for j in alive:
            mass, token = float(residual.sum()), tokens[j][t]
            if uniforms[t][j] < min(1.0, float(residual[token]) / max(mass * float(draft_probs[j, t, token]), TINY)):
                return j, None
            residual = torch.sub(residual, draft_probs[j, t], alpha=mass).clamp_min_(0)  # [V]
        return None, residual

    return decide
