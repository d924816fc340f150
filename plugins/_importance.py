"""Importance-weighted sampling (Khisti et al., "Multi-Draft Speculative Sampling", §3-4; docs §5-6).

Canonical two-step architecture: (a) select one candidate Y from the drafts with weights
β_y(S), whose law is p_I(y); (b) speculative sampling of Y against q: accept with
min(1, q(Y)/p_I(Y)), else sample (q - p_I)+ normalised. Lossless for any weights; the
acceptance Σ_y min(q(y), p_I(y)) is maximised by a linear program (Theorem 1).

Pairwise selection between a candidate of law a and one of law b (ordered drafts, Thm 4):
w_ij = P(Y = i | X1 = i, X2 = j), and
    p_I(i) = a_i b_i + Σ_{j≠i} a_i b_j w_ij + Σ_{j≠i} a_j b_i (1 - w_ji).
Tokens are ranked by c_i - a_i b_i (c = target law); the weights among the *free* tokens are
LP variables, and every pair that involves another token goes to its higher-ranked member
(§4's truncated LP; with every token free this is the exact LP). K > 2 drafts: successive
pairwise selection, (x1, x2) → Y1 of law p_I1, then (Y1, x3) with laws (p_I1, p_3), … (Remark 4).

The LPs are solved on the CPU with scipy's HiGHS: one call per selection stage for every row
of the batch (identical rows are solved once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_cli.verifiers import Verifier

from ._laws import TINY, normalized_excess


@dataclass
class PairSelection:
    """The selection rule between a first and a second candidate, for one row (float64, CPU)."""

    rank: torch.Tensor  # [V]: 0 = highest ranked
    free_position: torch.Tensor  # [V]: index into the free tokens, -1 if not free
    weights: torch.Tensor  # [m, m]: P(Y = free_i | X1 = free_i, X2 = free_j)
    law: torch.Tensor  # [V]: p_I, the law of the selected token

    def keep_first(self, second: int) -> torch.Tensor:
        """P(Y = y | X1 = y, X2 = second) for every y ``[V]`` (1 where y = second)."""
        keep = (self.rank < self.rank[second]).double()  # [V]: deterministic: higher rank wins
        j = int(self.free_position[second])
        if j >= 0:
            free = self.free_position >= 0  # [V]
            keep[free] = self.weights[self.free_position[free], j]
        keep[second] = 1.0
        return keep


class ImportanceSampling(Verifier):
    """Shared body of ``is-lp`` and ``is-truncated``; subclasses choose the free tokens and the alphabet."""

    lossless = True
    max_drafts = None

    def free_tokens(self, order: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
        """Token ids whose pair weights are LP variables, given tokens in rank order and the draft support."""
        raise NotImplementedError

    def alphabet_size(self, vocab: int) -> int:
        """How many of the target's most likely tokens the scheme runs on (the rest is mixed back exactly)."""
        return vocab

    # ----------------------------------------------------------------------- contract

    def conditional(self, target_probs, draft_probs, draft_tokens):
        plans, inverse = self._plans(target_probs, draft_probs)
        tokens = draft_tokens.reshape(-1, draft_tokens.shape[-1]).cpu()  # [N, K]
        laws = torch.stack([plans[int(i)].output_law(tokens[n].tolist()) for n, i in enumerate(inverse)])
        return laws.reshape(target_probs.shape).to(target_probs)  # [..., V]

    def acceptance_probability(self, target_probs, draft_probs):
        """Σ_y min(q(y), p_I(y)) (times q(O) under alphabet truncation).

        This is the canonical acceptance of step (b); the engine also continues a block when the
        residual happens to return another candidate, so the true P(output ∈ candidates) can be
        higher: this value is a lower bound.
        """
        plans, inverse = self._plans(target_probs, draft_probs)
        values = torch.tensor([plans[int(i)].canonical_acceptance() for i in inverse], dtype=torch.float64)
        return values.reshape(target_probs.shape[:-1]).to(target_probs)

    # ----------------------------------------------------------------------- planning

    def prepare(self, target_probs, draft_probs):
        """Solve every position's LPs in one call per stage; ``select`` then finds them in a cache."""
        self._prepared = {}
        plans, _ = self._plans(target_probs, draft_probs)
        self._prepared = {plan.key: plan for plan in plans}

    def _plans(self, target_probs: torch.Tensor, draft_probs: torch.Tensor):
        """One plan per distinct (q, p_1..p_K) row, and each row's plan index."""
        vocab, num_drafts = target_probs.shape[-1], draft_probs.shape[-2]
        rows = torch.cat(
            [target_probs.reshape(-1, 1, vocab), draft_probs.reshape(-1, num_drafts, vocab)], dim=1
        ).double().cpu()  # [N, K+1, V]
        unique, inverse = torch.unique(rows, dim=0, return_inverse=True)  # [U, K+1, V], [N]
        prepared = getattr(self, "_prepared", {})
        # One candidate needs no selection LP, so no alphabet truncation either: the scheme is then
        # exactly speculative sampling, as every multi-draft scheme must be with one draft (docs §7).
        alphabet = self.alphabet_size(vocab) if num_drafts > 1 else vocab
        plans = []
        for row in unique:
            key = row.numpy().tobytes()  # exact content: a cached plan is reused only for identical laws
            plans.append(prepared.get(key) or _Plan(row[0], row[1:], alphabet, key))
        unsolved = [plan for plan in plans if len(plan.stages) < num_drafts - 1]
        for stage in range(num_drafts - 1 if unsolved else 0):
            pairs = [(plan.selected_law(), plan.drafts[stage + 1], plan.scheme_target) for plan in unsolved]
            for plan, selection in zip(unsolved, self._solve_stage(pairs)):
                plan.stages.append(selection)
        return plans, inverse

    def _solve_stage(self, pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[PairSelection]:
        rankings, free_sets = [], []
        for first, second, target in pairs:
            order = torch.argsort(-(target - first * second), stable=True)  # [V]: descending rank score
            support = (first > 0) | (second > 0)  # [V]
            rankings.append(order)
            free_sets.append(self.free_tokens(order, support))
        return solve_pair_selections(pairs, rankings, free_sets)


class _Plan:
    """Everything about one row: its target, drafts, alphabet and selection stages."""

    def __init__(self, target: torch.Tensor, drafts: torch.Tensor, alphabet: int, key: bytes):
        self.key = key
        self.target = target  # [V]
        self.drafts = drafts  # [K, V]
        inside = torch.zeros_like(target, dtype=torch.bool)
        inside[torch.argsort(-target, stable=True)[:alphabet]] = True
        self.inside_mass = float(target[inside].sum())  # q(O)
        outside = torch.where(inside, torch.zeros_like(target), target)  # [V]
        # Decided on the outside mass itself: q(O) can round below 1 when O holds every token.
        self.outside_law = outside / outside.sum() if outside.sum() > 0 else outside  # [V]
        self.scheme_target = torch.where(inside, target, torch.zeros_like(target)) / self.inside_mass  # q~ [V]
        self.stages: list[PairSelection] = []

    def selected_law(self) -> torch.Tensor:
        return self.stages[-1].law if self.stages else self.drafts[0]  # [V]

    def canonical_acceptance(self) -> float:
        return self.inside_mass * float(torch.minimum(self.scheme_target, self.selected_law()).sum())

    def output_law(self, candidates: list[int]) -> torch.Tensor:
        """The law of the output given the candidate tokens ``[V]``."""
        selected = torch.zeros_like(self.target)  # [V]: law of Y given the candidates
        selected[candidates[0]] = 1.0
        for stage, second in zip(self.stages, candidates[1:]):
            keep = stage.keep_first(second)  # [V]
            switched = float((selected * (1 - keep)).sum())
            selected = selected * keep
            selected[second] += switched
        p_selected, q = self.selected_law(), self.scheme_target  # [V]
        accept = (q / p_selected.clamp_min(TINY)).clamp(max=1.0)  # [V]
        rejected = float((selected * (1 - accept)).sum())
        law = selected * accept + rejected * normalized_excess(q, p_selected)  # [V]
        return self.inside_mass * law + (1 - self.inside_mass) * self.outside_law


def solve_pair_selections(
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    rankings: list[torch.Tensor],
    free_sets: list[torch.Tensor],
) -> list[PairSelection]:
    """Solve every row's pairwise-selection LP in one HiGHS call (a block-diagonal LP).

    Row r: laws (a, b) of the first and second candidate, target c, tokens in rank order, free
    token ids F (m of them). Variables w_ij (i, j in F; w_ii fixed at 0) and t_k (k in F):
    maximise Σ t_k  s.t.  t_k ≤ c_k,  t_k ≤ p_I(k),  0 ≤ w ≤ 1.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    objective, bounds, upper = [], [], []
    entries_row, entries_col, entries_value = [], [], []
    layouts = []
    column = constraint = 0
    for (a, b, c), order, free in zip(pairs, rankings, free_sets):
        m = len(free)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        below_a, below_b = _mass_ranked_below(a, order), _mass_ranked_below(b, order)  # [V]
        fa, fb, fc = a[free].numpy(), b[free].numpy(), c[free].numpy()
        is_free = torch.zeros_like(a, dtype=torch.bool)
        is_free[free] = True
        outside_a, outside_b = float(a[~is_free].sum()), float(b[~is_free].sum())
        # Free tokens outrank every other token, so they win all pairs with one.
        base = fa * fb + fa * outside_b + fb * outside_a  # [m]
        pair_mass = np.outer(fa, fb)  # [m, m]: a_i b_j
        np.fill_diagonal(pair_mass, 0.0)
        # Constraint k: t_k - Σ_j a_k b_j w_kj + Σ_j a_j b_k w_jk ≤ base_k + Σ_j a_j b_k
        ii, jj = np.nonzero(pair_mass)
        values = pair_mass[ii, jj]
        w_index = column + ii * m + jj
        entries_row += [constraint + ii, constraint + jj, constraint + np.arange(m)]
        entries_col += [w_index, w_index, column + m * m + np.arange(m)]
        entries_value += [-values, values, np.ones(m)]
        upper.append(base + pair_mass.sum(0))
        w_bounds = [(0.0, 0.0 if i == j else 1.0) for i in range(m) for j in range(m)]
        bounds += w_bounds + [(0.0, float(ck)) for ck in fc]
        objective.append(np.concatenate([np.zeros(m * m), -np.ones(m)]))
        layouts.append((column, m, rank, free, below_a, below_b, is_free))
        column += m * m + m
        constraint += m
    solution = np.zeros(0)
    if column:
        matrix = coo_matrix(
            (np.concatenate(entries_value), (np.concatenate(entries_row), np.concatenate(entries_col))),
            shape=(constraint, column),
        )
        result = linprog(np.concatenate(objective), A_ub=matrix, b_ub=np.concatenate(upper), bounds=bounds,
                         method="highs")  # fmt: skip
        if result.status != 0:
            raise RuntimeError(f"importance-sampling LP failed: {result.message}")
        solution = result.x
    selections = []
    for (a, b, _), (start, m, rank, free, below_a, below_b, is_free) in zip(pairs, layouts):
        weights = torch.from_numpy(solution[start : start + m * m].reshape(m, m).copy()).clamp(0, 1)  # [m, m]
        weights.fill_diagonal_(0.0)
        # Non-free tokens: they win exactly the pairs with lower-ranked tokens.
        law = a * b + a * below_b + b * below_a  # [V]
        fa, fb = a[free], b[free]  # [m]
        pair = torch.outer(fa, fb) * (1 - torch.eye(m, dtype=fa.dtype))  # [m, m]
        outside_a, outside_b = float(a[~is_free].sum()), float(b[~is_free].sum())
        law[free] = (
            fa * fb + fa * outside_b + fb * outside_a + (pair * weights).sum(1) + (pair * (1 - weights)).sum(0)
        )
        free_position = torch.full_like(rank, -1)
        free_position[free] = torch.arange(m)
        selections.append(PairSelection(rank, free_position, weights, law))
    return selections


def _mass_ranked_below(law: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """For each token, the mass of ``law`` on tokens ranked strictly below it ``[V]``."""
    in_order = law[order]  # [V]
    below_in_order = in_order.flip(0).cumsum(0).flip(0) - in_order  # [V]
    below = torch.empty_like(law)
    below[order] = below_in_order
    return below
