"""Importance-weighted sampling (Khisti et al., "Multi-Draft Speculative Sampling", §3-4).

Canonical two-step architecture: (a) select one candidate Y from the drafts with weights
β_y(S), whose law is p_I(y); (b) speculative sampling of Y against q: accept with
min(1, q(Y)/p_I(Y)), else sample (q - p_I)+ normalised. Lossless for any weights; the
acceptance Σ_y min(q(y), p_I(y)) is maximised by a linear program (Theorem 1).

Pairwise selection between a candidate of law a and one of law b (ordered drafts, Thm 4):
w_ij = P(Y = i | X1 = i, X2 = j), and
    p_I(i) = a_i b_i + Σ_{j≠i} a_i b_j w_ij + Σ_{j≠i} a_j b_i (1 - w_ji).
Tokens are ranked by c_i - a_i b_i (c = target law); the weights among the *free* tokens are
LP variables, and every pair that involves another token goes to its higher-ranked member
(§4's truncated LP; with every token free this is the exact LP). That ranked tail can accept far
less than one draft when the draft is close to the target (p_I of a pair's winner is no longer
near q). So each stage also solves the LP with a fair-coin tail (a pair with a non-free token
goes to either member with probability 1/2: with identical drafts and every weight 1/2, p_I = p)
and keeps whichever reaches the larger Σ min(c, p_I): lossless either way, the choice depending
on the laws only, never below one draft's acceptance, and never below §4's guarantee. K > 2 drafts: successive
pairwise selection, (x1, x2) → Y1 of law p_I1, then (Y1, x3) with laws (p_I1, p_3), … (Remark 4).

The LPs are solved on the host with scipy's HiGHS: one call per selection stage for every row
of the batch (identical rows are solved once). So in a block the laws cross to the host in one
transfer, and the selection, the walk over positions (alive rows, as the base class walks them)
and the draws run there in NumPy, with a NumPy generator seeded from the block's generator; the
decision goes back to the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specdec_cli.verifiers import BlockDecision, Verifier, shared_prefix_length

from .speculative import SpeculativeSampling

TINY = np.finfo(np.float64).tiny
_BELOW_ONE = 1.0 - 2.0**-52
_SEED_RANGE = 2**52  # seeds travel as float64 with the laws: exact below 2^53


@dataclass
class PairSelection:
    """The selection rule between a first and a second candidate, for one row (float64, host)."""

    rank: np.ndarray  # [V]: 0 = highest ranked
    free_position: np.ndarray  # [V]: index into the free tokens, -1 if not free
    weights: np.ndarray  # [m, m]: P(Y = free_i | X1 = free_i, X2 = free_j)
    law: np.ndarray  # [V]: p_I, the law of the selected token
    even: bool  # a pair that involves a non-free token: a fair coin (True) or the higher rank (False)

    def keep_first(self, second: int) -> np.ndarray:
        """P(Y = y | X1 = y, X2 = second) for every y ``[V]`` (1 where y = second)."""
        if self.even:
            keep = np.full(self.rank.shape, 0.5)  # [V]
        else:
            keep = (self.rank < self.rank[second]).astype(np.float64)  # [V]: higher rank wins
        j = self.free_position[second]
        if j >= 0:
            free = self.free_position >= 0  # [V]
            keep[free] = self.weights[self.free_position[free], j]
        keep[second] = 1.0
        return keep


class ImportanceSampling(Verifier):
    """Shared body of ``is-lp`` and ``is-truncated``; subclasses choose the free tokens and the alphabet."""

    lossless = True
    max_drafts = None

    def free_tokens(self, order: np.ndarray, support: np.ndarray) -> np.ndarray:
        """Token ids whose pair weights are LP variables, given tokens in rank order and the draft support."""
        raise NotImplementedError

    def alphabet_size(self, target_descending: np.ndarray) -> int:
        """How many of the target's most likely tokens the scheme runs on (the rest is mixed back exactly),
        given the target's probabilities in descending order ``[V]``."""
        return len(target_descending)

    # ----------------------------------------------------------------------- contract

    def conditional(self, target_probs, draft_probs, draft_tokens):
        plans, inverse = self._plans(_host_rows(target_probs, draft_probs))
        tokens = draft_tokens.reshape(-1, draft_tokens.shape[-1]).numpy(force=True)  # [N, K]
        laws = np.stack([plans[i].output_law(tokens[n]) for n, i in enumerate(inverse)])  # [N, V]
        return torch.from_numpy(laws).reshape(target_probs.shape).to(target_probs)  # [..., V]

    def acceptance_probability(self, target_probs, draft_probs):
        """Σ_y min(q(y), p_I(y)) (times q(O) under alphabet truncation).

        This is the canonical acceptance of step (b); the engine also continues a block when the
        residual happens to return another candidate, so the true P(output ∈ candidates) can be
        higher: this value is a lower bound.
        """
        plans, inverse = self._plans(_host_rows(target_probs, draft_probs))
        values = np.array([plans[i].canonical_acceptance() for i in inverse])
        return torch.from_numpy(values).reshape(target_probs.shape[:-1]).to(target_probs)

    def prepare(self, target_probs, draft_probs):
        """Solve every position's LPs in one call per stage; later calls find them in a cache."""
        self._prepare_rows(_host_rows(target_probs, draft_probs))

    def verify_block(self, target_probs, draft_probs, draft_tokens, generator=None):
        num_drafts, draft_length = draft_tokens.shape
        if num_drafts == 1:  # one candidate: the scheme is speculative sampling, decided on the device
            return SpeculativeSampling().verify_block(target_probs, draft_probs, draft_tokens, generator)
        vocab = target_probs.shape[-1]
        seed = torch.randint(0, _SEED_RANGE, (1,), generator=generator, device=draft_tokens.device)  # [1]
        packed = torch.cat([target_probs.reshape(-1).double(), draft_probs.reshape(-1).double(),
                            draft_tokens.reshape(-1).double(), seed.double()])  # fmt: skip
        host = packed.numpy(force=True)  # the verifier's one device read of the block
        sizes = np.cumsum([num_drafts * (draft_length + 1) * vocab, num_drafts * draft_length * vocab])
        target = host[: sizes[0]].reshape(num_drafts, draft_length + 1, vocab)  # [K, L+1, V]
        drafts = host[sizes[0] : sizes[1]].reshape(num_drafts, draft_length, vocab)  # [K, L, V]
        tokens = host[sizes[1] : -1].astype(np.int64).reshape(num_drafts, draft_length)  # [K, L]
        committed, accepted, row = self._walk_on_host(target, drafts, tokens, np.random.default_rng(int(host[-1])))
        device = draft_tokens.device
        return BlockDecision(torch.tensor(committed, device=device), torch.tensor(accepted, device=device),
                             torch.tensor(row, device=device))  # fmt: skip

    # ----------------------------------------------------------------------- planning

    def _walk_on_host(self, target: np.ndarray, drafts: np.ndarray, tokens: np.ndarray, rng: np.random.Generator):
        """The alive-row walk of :class:`~specdec_cli.verifiers.Verifier` → (tokens [L+1], accepted, row)."""
        num_drafts, draft_length = tokens.shape
        shared = shared_prefix_length(tokens)  # positions where all rows can be alive: solved at once
        self._prepare_rows(np.concatenate([target[0, :shared, None], drafts[:, :shared].transpose(1, 0, 2)], axis=1))
        alive = list(range(num_drafts))
        outputs: list[int] = []
        for t in range(draft_length):
            rows = np.concatenate([target[alive[0], t][None], drafts[alive, t]])[None]  # [1, K'+1, V]
            plans, _ = self._plans(rows)
            outputs.append(_draw(plans[0].output_law(tokens[alive, t]), rng))
            survivors = [k for k in alive if tokens[k, t] == outputs[-1]]
            if not survivors:
                return outputs + [0] * (draft_length - t), t, alive[0]
            alive = survivors
        return outputs + [_draw(target[alive[0], draft_length], rng)], draft_length, alive[0]

    def _prepare_rows(self, rows: np.ndarray) -> None:
        self._prepared = {}
        plans, _ = self._plans(rows)
        self._prepared = {plan.key: plan for plan in plans}

    def _plans(self, rows: np.ndarray) -> tuple[list["_Plan"], np.ndarray]:
        """One plan per distinct (q, p_1..p_K) row of ``rows`` ``[N, K+1, V]``, and each row's plan index."""
        num_drafts = rows.shape[-2] - 1
        prepared = getattr(self, "_prepared", {})
        # One candidate needs no selection LP, so no alphabet truncation either: the scheme is then
        # exactly speculative sampling, as every multi-draft scheme must be with one draft.
        alphabet = self.alphabet_size if num_drafts > 1 else len
        by_key: dict[bytes, int] = {}
        plans, inverse = [], []
        for row in rows:
            key = row.tobytes()  # exact content: a plan is shared (or reused from the cache) only for identical laws
            if key not in by_key:
                by_key[key] = len(plans)
                plans.append(prepared.get(key) or _Plan(row[0], row[1:], alphabet, key))
            inverse.append(by_key[key])
        unsolved = [plan for plan in plans if len(plan.stages) < num_drafts - 1]
        for stage in range(num_drafts - 1 if unsolved else 0):
            pairs = [(plan.selected_law(), plan.drafts[stage + 1], plan.scheme_target) for plan in unsolved]
            for plan, selection in zip(unsolved, self._solve_stage(pairs)):
                plan.stages.append(selection)
        return plans, np.array(inverse, dtype=np.int64)

    def _solve_stage(self, pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[PairSelection]:
        rankings, free_sets = [], []
        for first, second, target in pairs:
            order = np.argsort(-(target - first * second), kind="stable")  # [V]: descending rank score
            support = (first > 0) | (second > 0)  # [V]
            rankings.append(order)
            free_sets.append(self.free_tokens(order, support))
        # Both tails for every row in one LP call. Either rule is lossless, and which one a row uses
        # depends on its laws only: keep the better.
        tails = [False] * len(pairs) + [True] * len(pairs)
        solved = solve_pair_selections(pairs * 2, rankings * 2, free_sets * 2, tails)
        return [max(options, key=lambda selection: np.minimum(target, selection.law).sum())
                for options, (_, _, target) in zip(zip(solved[: len(pairs)], solved[len(pairs) :]), pairs)]  # fmt: skip


class _Plan:
    """Everything about one row: its target, drafts, alphabet and selection stages."""

    def __init__(self, target: np.ndarray, drafts: np.ndarray, alphabet: Callable[[np.ndarray], int], key: bytes):
        self.key = key
        self.target = target  # [V]
        self.drafts = drafts  # [K, V]
        inside = np.zeros(target.shape, dtype=bool)  # [V]
        order = np.argsort(-target, kind="stable")  # [V]
        inside[order[: alphabet(target[order])]] = True
        self.inside_mass = float(target[inside].sum())  # q(O)
        outside = np.where(inside, 0.0, target)  # [V]
        # Decided on the outside mass itself: q(O) can round below 1 when O holds every token.
        outside_mass = outside.sum()
        self.outside_law = outside / outside_mass if outside_mass > 0 else outside  # [V]
        self.scheme_target = np.where(inside, target, 0.0) / self.inside_mass  # q~ [V]
        self.stages: list[PairSelection] = []

    def selected_law(self) -> np.ndarray:
        return self.stages[-1].law if self.stages else self.drafts[0]  # [V]

    def canonical_acceptance(self) -> float:
        return self.inside_mass * float(np.minimum(self.scheme_target, self.selected_law()).sum())

    def output_law(self, candidates: np.ndarray) -> np.ndarray:
        """The law of the output given the candidate tokens ``[K]`` → ``[V]``."""
        selected = np.zeros_like(self.target)  # [V]: law of Y given the candidates
        selected[candidates[0]] = 1.0
        for stage, second in zip(self.stages, candidates[1:]):
            keep = stage.keep_first(second)  # [V]
            switched = (selected * (1 - keep)).sum()
            selected = selected * keep
            selected[second] += switched
        p_selected, q = self.selected_law(), self.scheme_target  # [V]
        accept = np.minimum(q / np.maximum(p_selected, TINY), 1.0)  # [V]
        rejected = (selected * (1 - accept)).sum()
        law = selected * accept + rejected * _normalized_excess(q, p_selected)  # [V]
        return self.inside_mass * law + (1 - self.inside_mass) * self.outside_law


def solve_pair_selections(
    pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    rankings: list[np.ndarray],
    free_sets: list[np.ndarray],
    tails: list[bool],
) -> list[PairSelection]:
    """Solve every row's pairwise-selection LP in one HiGHS call (a block-diagonal LP).

    Row r: laws (a, b) of the first and second candidate, target c, tokens in rank order, free
    token ids F (m of them). Variables w_ij (i, j in F; w_ii fixed at 0) and t_k (k in F):
    maximise Σ t_k  s.t.  t_k ≤ c_k,  t_k ≤ p_I(k),  0 ≤ w ≤ 1. A pair that involves a token
    outside F goes to its higher-ranked member (Khisti et al. §4), or, where the row's entry of
    ``tails`` is True, to either member with probability 1/2: then a non-free token's p_I is (a + b)/2, so with identical drafts
    and every weight at 1/2 p_I = p, and the LP never accepts less than one draft does.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    objective, bounds, upper = [], [], []
    entries_row, entries_col, entries_value = [], [], []
    layouts = []
    column = constraint = 0
    for (a, b, c), order, free, even in zip(pairs, rankings, free_sets, tails):
        m = len(free)
        is_free = np.zeros(a.shape, dtype=bool)  # [V]
        is_free[free] = True
        fa, fb, fc = a[free], b[free], c[free]  # [m] each
        outside_a, outside_b = a[~is_free].sum(), b[~is_free].sum()
        # Free tokens outrank every other token, so they win all pairs with one (half of them if even).
        base = fa * fb + (fa * outside_b + fb * outside_a) * (0.5 if even else 1.0)  # [m]
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
        layouts.append((column, m, order, free, base, even))
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
    return [_selection(a, b, solution, *layout) for (a, b, _), layout in zip(pairs, layouts)]


def _selection(a, b, solution, start, m, order, free, base, even) -> PairSelection:
    """One row's solved rule: its LP weights and the law p_I of the selected candidate.

    base ``[m]``: what each free token wins without LP weights (its pairs with itself and with
    non-free tokens), as the LP's constraints had it.
    """
    weights = solution[start : start + m * m].reshape(m, m).clip(0, 1)  # [m, m]
    np.fill_diagonal(weights, 0.0)
    if even:  # a non-free token wins half of every pair it is in: p_I = a b + (a (1 - b) + b (1 - a)) / 2
        law = (a + b) / 2  # [V]
    else:  # a non-free token wins exactly the pairs with lower-ranked tokens
        law = a * b + a * _mass_ranked_below(b, order) + b * _mass_ranked_below(a, order)  # [V]
    fa, fb = a[free], b[free]  # [m]
    pair = np.outer(fa, fb) * (1 - np.eye(m))  # [m, m]
    law[free] = base + (pair * weights).sum(1) + (pair * (1 - weights)).sum(0)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    free_position = np.full(a.shape, -1, dtype=np.int64)
    free_position[free] = np.arange(m)
    return PairSelection(rank, free_position, weights, law, even)


def _mass_ranked_below(law: np.ndarray, order: np.ndarray) -> np.ndarray:
    """For each token, the mass of ``law`` on tokens ranked strictly below it ``[V]``."""
    in_order = law[order]  # [V]
    below = np.empty_like(law)
    below[order] = in_order[::-1].cumsum()[::-1] - in_order
    return below


def _normalized_excess(target: np.ndarray, proposal: np.ndarray) -> np.ndarray:
    """(target - proposal)+ normalised ``[V]``; ``target`` itself where the excess is empty."""
    excess = np.maximum(target - proposal, 0.0)
    mass = excess.sum()
    return excess / mass if mass > 0 else target


def _draw(law: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from ``law`` ``[V]`` (never a token of zero mass), as :func:`specdec_cli.sampling.sample`."""
    cumulative = np.cumsum(law)  # [V]
    total = cumulative[-1]
    threshold = min(rng.random() * total, total * _BELOW_ONE)
    return int(min(np.searchsorted(cumulative, threshold, side="right"), len(law) - 1))


def _host_rows(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> np.ndarray:
    """q ``[..., V]`` and p ``[..., K, V]`` as float64 host rows ``[N, K+1, V]``."""
    vocab, num_drafts = target_probs.shape[-1], draft_probs.shape[-2]
    rows = torch.cat([target_probs.reshape(-1, 1, vocab), draft_probs.reshape(-1, num_drafts, vocab)], dim=1)
    return rows.double().numpy(force=True)
