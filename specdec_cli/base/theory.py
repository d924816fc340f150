"""Theoretical limits of token-level selection: the best acceptance any lossless rule can reach.

The rule in the project's notation: docs/verifiers.md §6.

With K drafts X_1..X_K drawn independently (X_k ~ p_k) and the output required to follow q, the
largest P(output ∈ {X_1..X_K}) is an optimal-transport problem. Its dual is a minimum over token
sets (Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025; Khisti et al.,
"Multi-Draft Speculative Sampling", Theorem 3 for K = 2):

    P* = 1 + min_S [ q(S) - P(every draft falls in S) ] = 1 + min_S [ q(S) - Π_k p_k(S) ].

A set S whose drafts all land in it must see its mass q(S) cover that event, and the minimum
over S is attained (strong duality).
"""

from __future__ import annotations

import itertools

import torch

#: Largest number of tokens the drafts may share for the exact K = 2 different-drafts optimum:
#: it enumerates 4 m (m - 1) candidate sets of m tokens.
MAX_TWO_DRAFT_SUPPORT = 128


def optimal_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor, num_drafts: int = 2) -> torch.Tensor:
    """P* for K identical drafts, exact for every K, batched: ``[..., V]`` twice → ``[...]``.

    1 + min_S [q(S) - p(S)^K]. The minimising set is a prefix of the tokens sorted by q/p
    ascending: p(S)^K is convex in p(S), so it is the largest of its tangent lines a + c p(S), and
    for each tangent the minimum over S of Σ_{i∈S} (q_i - c p_i) takes exactly the tokens with
    q_i/p_i below c. So this is exact in O(V log V) on the full vocabulary.
    """
    q, p = target_probs.double(), draft_probs.double()  # [..., V]
    ratio = torch.where(p > 0, q / p, torch.full_like(q, float("inf")))  # [..., V]
    order = ratio.argsort(-1)
    zero = q.new_zeros(q.shape[:-1] + (1,))  # [..., 1]
    q_prefix = torch.cat([zero, q.gather(-1, order).cumsum(-1)], -1)  # [..., V+1]
    p_prefix = torch.cat([zero, p.gather(-1, order).cumsum(-1)], -1)  # [..., V+1]
    return 1.0 + (q_prefix - p_prefix**num_drafts).min(-1).values


def two_draft_support(first_probs: torch.Tensor, second_probs: torch.Tensor) -> torch.Tensor:
    """How many tokens either draft can propose, per row ``[...]``."""
    return ((first_probs > 0) | (second_probs > 0)).sum(-1)


def optimal_acceptance_two_drafts(
    target_probs: torch.Tensor, first_probs: torch.Tensor, second_probs: torch.Tensor
) -> torch.Tensor:
    """P* for K = 2 drafts with different laws p1, p2, exact, for one position: ``[V]`` three times → ``[]``.

    1 + min_S [q(S) - p1(S) p2(S)]. The objective is x - y z at the point (q(S), p1(S), p2(S)) of
    the zonotope spanned by the tokens' vectors v_i = (q_i, p1_i, p2_i). Along any direction w the
    quadratic part is -(w·p1)(w·p2), whose Hessian has a non-positive eigenvalue on every face,
    so no face holds a strict interior minimum and the minimum sits at a vertex. Vertices are the
    sets {i : c·v_i > 0}; the candidate directions c = ±(v_i × v_j) (with i and j either side) reach
    every cell of that arrangement. Tokens neither draft proposes never belong to the minimiser.
    Needs the drafts' joint support m ≤ ``MAX_TWO_DRAFT_SUPPORT`` (O(m³) work).
    """
    support = (first_probs > 0) | (second_probs > 0)  # [V]
    vectors = torch.stack([target_probs, first_probs, second_probs], -1)[support].double()  # [m, 3]
    size = vectors.shape[0]
    if size > MAX_TWO_DRAFT_SUPPORT:
        raise ValueError(f"the drafts share {size} tokens, more than {MAX_TWO_DRAFT_SUPPORT}")
    pairs = torch.tensor(list(itertools.combinations(range(size), 2)), dtype=torch.long).view(-1, 2)  # [P, 2]
    normals = torch.linalg.cross(vectors[pairs[:, 0]], vectors[pairs[:, 1]])  # [P, 3]
    normals = torch.cat([normals, -normals])  # [2P, 3]
    pairs = torch.cat([pairs, pairs])  # [2P, 2]
    inside = (normals @ vectors.T) > 0  # [2P, m]
    candidates = [torch.ones(1, size, dtype=torch.bool)]  # the whole support
    for first_in, second_in in itertools.product((False, True), repeat=2):
        chosen = inside.clone()
        chosen.scatter_(1, pairs[:, :1], first_in)
        chosen.scatter_(1, pairs[:, 1:], second_in)
        candidates.append(chosen)
    sums = torch.cat(candidates).double() @ vectors  # [C, 3]: q(S), p1(S), p2(S)
    values = sums[:, 0] - sums[:, 1] * sums[:, 2]  # [C]
    return 1.0 + values.min().clamp(max=0.0)  # the empty set gives 0


def tv_optimal_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor, spent: torch.Tensor) -> torch.Tensor:
    """The most any one-draft rule accepts when its output law π stays within TV(q, π) ≤ D of q: 1 − TV(q, p) + D,
    at most 1 (move D of q's excess over p onto the tokens p has more of; the static ensemble at w = D / TV(q, p)
    reaches it). ``[..., V]`` twice and D ``[...]`` → ``[...]``."""
    distance = (target_probs - draft_probs).clamp_min(0).sum(-1)  # [...]: TV(q, p)
    return (1 - distance + spent).clamp(max=1.0)
