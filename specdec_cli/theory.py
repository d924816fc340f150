"""Theoretical limits of token-level selection (docs §6)."""

from __future__ import annotations

import torch


def optimal_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor, num_drafts: int = 2) -> torch.Tensor:
    """1 + min over token sets S of [q(S) - p(S)^K], batched: ``[..., V]`` twice → ``[...]``.

    Khisti et al., Theorem 3: the largest acceptance of any lossless rule with K = 2 identical
    drafts; with exponent K > 2 it is the paper's conjectured K-draft optimum. The minimising
    set is a prefix of the tokens sorted by q/p ascending (docs §6), so this is exact in
    O(V log V) on the full vocabulary, with no truncation.
    """
    q, p = target_probs.double(), draft_probs.double()  # [..., V]
    ratio = torch.where(p > 0, q / p, torch.full_like(q, float("inf")))  # [..., V]
    order = ratio.argsort(-1)
    zero = q.new_zeros(q.shape[:-1] + (1,))  # [..., 1]
    q_prefix = torch.cat([zero, q.gather(-1, order).cumsum(-1)], -1)  # [..., V+1]
    p_prefix = torch.cat([zero, p.gather(-1, order).cumsum(-1)], -1)  # [..., V+1]
    return 1.0 + (q_prefix - p_prefix**num_drafts).min(-1).values
