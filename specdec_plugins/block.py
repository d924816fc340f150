"""Block verification (Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh, "Block Verification
Accelerates Speculative Decoding", ICLR 2025, arXiv 2403.10444, Algorithm 2), single draft, lossless.

The rule in the project's notation: docs/verifiers.md §7.

Token-wise speculative sampling accepts each draft token on its own; block verification decides
the accepted prefix of the whole block jointly. With q_t = target law and p_t = draft law after
the first t draft tokens, and x_{t+1} ~ p_t the drafted tokens (t = 0..L-1)::

    w_0 = 1,   w_t = min(1, w_{t-1} · q_{t-1}(x_t) / p_{t-1}(x_t))                 (weights)
    r_t(y) = (w_t q_t(y) - p_t(y))+                                                 (residual excess)
    h_t = Σ r_t / (Σ r_t + 1 - w_t)  for 0 < t < L,     h_L = w_L                  (stop probabilities)

draw η_t ~ U(0, 1) and accept τ = the largest t with η_t < h_t (0 if none) draft tokens; then
draw the next token from r_τ normalised, or from q_L when τ = L (the bonus token). The committed
block is distributed as the target's own continuation (Theorem 1), and its expected length is
the largest of any valid verification that sees only the drafted path: never below token-wise
speculative sampling's (Theorem 2). With L = 1 it is speculative sampling. Per-token acceptance
is not defined here: a draft token that token-wise sampling would reject can be kept.

Weights come from w_t = exp(S_t - max_{j ≤ t} S_j) with S_t = Σ_{j ≤ t} log(q(x_j)/p(x_j)), so the
whole block is a handful of vectorised operations on the tensors' device.
"""

from __future__ import annotations

import torch

from specdec_cli.plugins.laws import TINY, commit_after, normalized_or, row_at, single_draft_draws
from specdec_cli.plugins.verifiers import BlockVerifier


class BlockVerification(BlockVerifier):
    name = "block"
    lossless = True
    max_drafts = 1
    batches_by_vmap = True

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        draft_length = x.shape[0]
        weights, stop = _weights_and_stops(q, p, x)  # [L+1], [L+1]
        draws = single_draft_draws(randomness, draft_length, x.device)  # [L+1, 3]
        eta = draws[:-1, 0]  # [L] float64: η_1..η_L, stream ACCEPT at offsets 0..L-1
        positions = torch.arange(1, draft_length + 1, device=x.device)  # [L]
        accepted = (positions * (eta < stop[1:]).long()).max()  # []: τ, the last t with η_t < h_t, else 0
        stopped_at = accepted.clamp(max=draft_length - 1)  # []: a valid residual row even when τ = L
        residual = _excess(row_at(weights, stopped_at), row_at(q, stopped_at), row_at(p, stopped_at))  # [V]
        return commit_after(accepted, residual, q, x, draws)

    def block_law(self, target_probs, draft_probs, draft_tokens):
        """P(τ = t) = h_t Π_{j > t} (1 - h_j) with h_0 = 1, times the law of the token that follows."""
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        weights, stop = _weights_and_stops(q, p, x)  # [L+1] each
        stop = torch.cat([torch.ones_like(stop[:1]), stop[1:]])  # [L+1]
        kept_after = torch.cat([(1 - stop[1:]).flip(0).cumprod(0).flip(0), torch.ones_like(stop[:1])])  # [L+1]
        residuals = _excess(weights[:-1].unsqueeze(-1), q[:-1], p)  # [L, V]
        following = torch.cat([normalized_or(residuals, q[:-1]), q[-1:]])  # [L+1, V]
        return ((stop * kept_after).unsqueeze(-1) * following).unsqueeze(0)  # [1, L+1, V]


def _excess(weight: torch.Tensor, target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """(w q - p)+ for weight ``[..., 1]`` or ``[]`` and laws ``[..., V]`` → ``[..., V]``."""
    return (weight.to(target.dtype) * target - draft).clamp_min(0)


def _weights_and_stops(q: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w_t and h_t for t = 0..L (float64 ``[L+1]`` each; h_0 = 0, unused: τ = 0 is the fallback).

    q ``[L+1, V]``, p ``[L, V]``, x ``[L]``.
    """
    tokens = x.unsqueeze(-1)  # [L, 1]
    ratio = (q[:-1].gather(-1, tokens) / p.gather(-1, tokens).clamp_min(TINY)).squeeze(-1).double()  # [L]
    log_ratio = torch.cat([ratio.new_zeros(1), ratio.log()]).cumsum(0)  # [L+1]: S_t, -inf after a zero ratio
    weights = (log_ratio - log_ratio.cummax(0).values).exp()  # [L+1]: w_t = min(1, w_{t-1} ratio_t)
    mass = _excess(weights[:-1].unsqueeze(-1), q[:-1], p).sum(-1).double()  # [L]: Σ r_t for t = 0..L-1
    denominator = mass + (1 - weights[:-1])  # [L]
    stops = torch.where(denominator > 0, mass / denominator.clamp_min(TINY), torch.zeros_like(mass))  # [L]
    return weights, torch.cat([torch.zeros_like(stops[:1]), stops[1:], weights[-1:]])  # h_0 = 0, h_t, h_L = w_L
