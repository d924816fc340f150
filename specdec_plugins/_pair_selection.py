"""One stage of importance-weighted selection between two candidates (Khisti et al., §3-4, Theorem 4).

A first candidate of law a and a second of law b; the selected token Y has the law p_I with, for a
pair of different tokens (i, j), w_ij = P(Y = i | X1 = i, X2 = j):

    p_I(i) = a_i b_i + Σ_{j≠i} a_i b_j w_ij + Σ_{j≠i} a_j b_i (1 - w_ji).                  (Thm 4)

Tokens are ranked by c_i - a_i b_i (c = the scheme's target). The top ``width`` tokens of the
drafts' support are *free*: their pair weights are variables of the linear program
max Σ_k min(c_k, p_I(k)) (§3, Theorem 1; solved on the host as the maximum flow it is, a few
hundred numbers). A pair that involves a non-free token is decided by a *tail* rule:

- ranked (§4's truncated LP): the higher-ranked member wins, so a non-free token gets
  p_I(i) = a_i b_i + a_i B_<(i) + b_i A_<(i), with A_<(i), B_<(i) the masses ranked below i;
- coin: either member with probability 1/2, so p_I(i) = (a_i + b_i) / 2 and, with identical
  drafts and every free weight at 1/2, p_I = p: two drafts never accept less than one.

Everything over the vocabulary runs on the tensors' device, in the laws' dtype with sums in
float64: the free set (a top-k), the ranking (a stable sort of 32-bit keys, only for the problems
that need it), the tails' laws and their acceptance outside the free set. Only the free
sub-problems cross to the host, where the LP runs in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

RANKED, COIN = "ranked", "coin"
_FLOW_RESOLUTION = 2.0**30  # the largest capacity in int32 steps (scipy's maximum flow takes int32)
_HIGHEST_KEY = 2**31 - 1


@dataclass
class StageInputs:
    """What one stage knows before its LP, for P pair problems (device tensors)."""

    first: torch.Tensor  # [P, V] a: law of the first candidate
    second: torch.Tensor  # [P, V] b: law of the second candidate
    target: torch.Tensor  # [P, V] c: the scheme's target
    score: torch.Tensor  # [P, V] c - a b, -inf off the drafts' support
    free_ids: torch.Tensor  # [P, M] int64: the top M tokens by score
    free_valid: torch.Tensor  # [P, M] bool: in the drafts' support (free), else padding
    support_size: torch.Tensor  # [P] int64: tokens some candidate can be
    base: torch.Tensor  # [P, T, M]: what each free token wins outside the LP's pairs, per tail
    rows: torch.Tensor  # [P] int64: which problems of the stage these are

    def restricted(self, rows: torch.Tensor) -> "StageInputs":
        """The same inputs for the problems ``rows`` ``[A]`` only."""
        picked = {name: getattr(self, name).index_select(0, rows) for name in self.__dataclass_fields__}
        return StageInputs(**picked)

    def host_arrays(self) -> torch.Tensor:
        """The free sub-problems packed as one float64 tensor ``[P, (3 + T) M + 2]`` for one transfer."""
        gathered = [values.gather(-1, self.free_ids).double() * self.free_valid
                    for values in (self.first, self.second, self.target)]  # fmt: skip
        return torch.cat([*gathered, self.base.flatten(1), self.free_valid.double(),
                          self.support_size.double().unsqueeze(-1)], dim=-1)  # fmt: skip


def ascending_order(score: torch.Tensor, top: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens from the lowest rank to the highest → (order ``[A, V]``, int32 rank keys ``[A, V]``).

    Ranks follow float32(score), the ``top`` tokens above all others, ties to the higher token id
    (so a rank is the pair (key, id)). One stable ascending 1-D sort of int32 keys per row: on the
    CPU that is a radix sort, several times faster than sorting floats or a 2-D tensor.
    """
    bits = score.float().view(torch.int32)  # [A, V]
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # [A, V]: negative floats' magnitude flipped: ordered as the reals
    if top is not None:
        key = key.masked_fill(top, _HIGHEST_KEY)
    order = torch.stack([row.sort(stable=True).indices for row in key]) if len(key) else key.long()  # [A, V]
    return order, key


def stage_inputs(first: torch.Tensor, second: torch.Tensor, target: torch.Tensor, width: int, tails) -> StageInputs:
    """Free set and free tokens' base for P pair problems ``[P, V]`` each: the top ``width`` support
    tokens by c - a b (any fixed tie rule will do: :func:`ranked_tail` puts the free tokens first)."""
    unsupported = (first == 0) & (second == 0)  # [P, V]: no candidate can be these tokens
    score = torch.addcmul(target, first, second, value=-1).masked_fill_(unsupported, -torch.inf)  # [P, V]
    free_ids = score.topk(min(width, score.shape[-1]), dim=-1).indices  # [P, M]
    free_valid = ~unsupported.gather(-1, free_ids)  # [P, M]
    fa, fb = (law.gather(-1, free_ids).double() * free_valid for law in (first, second))  # [P, M]: the LP's side
    # Totals in the laws' own dtype (torch sums pairwise): a float64 sum would first copy the laws.
    outside_a = first.sum(-1, keepdim=True).double() - fa.sum(-1, keepdim=True)  # [P, 1]
    outside_b = second.sum(-1, keepdim=True).double() - fb.sum(-1, keepdim=True)  # [P, 1]
    cross = fa * outside_b + fb * outside_a  # [P, M]: pairs of a free token with a non-free one
    # Free tokens outrank every other token: they win all those pairs (ranked) or half of them (coin).
    base = torch.stack([fa * fb + cross * (0.5 if tail == COIN else 1.0) for tail in tails], dim=1)  # [P, T, M]
    support_size = score.shape[-1] - unsupported.sum(-1)  # [P]
    rows = torch.arange(len(first), device=first.device)  # [P]
    return StageInputs(first, second, target, score, free_ids, free_valid, support_size, base, rows)


def ranked_tail(inputs: StageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """§4's tail: p_I = a b + a B_< + b A_< ``[P, V]``, and the rank keys ``[P, V]`` (see :func:`ascending_order`).

    The order is c - a b in float32, ties to the higher token id, with the free tokens first: they win
    every pair with a non-free token, so the masses below a non-free token never include theirs.
    """
    first, second = inputs.first, inputs.second  # [P, V] each
    is_free = torch.zeros_like(inputs.score, dtype=torch.bool).scatter_(-1, inputs.free_ids, inputs.free_valid)  # [P, V]
    order, key = ascending_order(inputs.score, is_free)  # [P, V] each
    laws = torch.stack([first, second])  # [2, P, V]
    in_order = laws.gather(-1, order.expand(2, -1, -1))  # [2, P, V]
    suffix = in_order.cumsum(-1, dtype=torch.float64).sub_(in_order).to(laws.dtype)  # [2, P, V]: sums in float64
    below = torch.empty_like(laws).scatter_(-1, order.expand(2, -1, -1), suffix)  # [2, P, V]
    return first * second + first * below[1] + second * below[0], key


def coin_tail(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The fair-coin tail: p_I = a b + (a (1 - b) + b (1 - a)) / 2 = (a + b) / 2 ``[P, V]``."""
    return torch.add(first, second).mul_(0.5)


def solve_free_problems(host: np.ndarray, width: int, num_tails: int, solved: dict) -> tuple[np.ndarray, ...]:
    """Every problem's free LP, for every tail, on the host (as a maximum flow: :func:`_solve_lps`).

    ``host`` ``[A, (3 + T) M + 2]`` as :meth:`StageInputs.host_arrays` packs it. Returns weights
    ``[A, T, M, M]``, free laws ``[A, T, M]`` and free acceptance Σ min(c, p_I) ``[A, T]``.
    ``solved`` maps a sub-problem's numbers to its solution: a sub-problem met before (in this
    batch or an earlier one) gets the same solution, so the rule is a function of the laws and
    never mixes two optimal vertices for the same laws. New solutions are added to it.
    """
    fa, fb, fc = (host[:, i * width : (i + 1) * width] for i in range(3))  # [A, M] each
    base = host[:, 3 * width : (3 + num_tails) * width].reshape(-1, num_tails, width)  # [A, T, M]
    valid = host[:, (3 + num_tails) * width : (4 + num_tails) * width] > 0.5  # [A, M]
    keys, fresh = [], {}
    for p in range(len(host)):
        for tail in range(num_tails):
            problem = (fa[p][valid[p]], fb[p][valid[p]], fc[p][valid[p]], base[p, tail][valid[p]])
            keys.append(np.concatenate(problem).tobytes())
            if keys[-1] not in solved:
                fresh[keys[-1]] = problem
    solved.update(zip(fresh, _solve_lps(list(fresh.values()))))
    weights = np.zeros((len(host), num_tails, width, width))
    laws = np.zeros((len(host), num_tails, width))
    for (p, tail), key in zip(np.ndindex(len(host), num_tails), keys):
        w, law = solved[key]
        weights[p, tail, : len(law), : len(law)], laws[p, tail, : len(law)] = w, law
    return weights, laws, np.minimum(fc[:, None, :], laws).sum(-1)


def _solve_lps(problems: list[tuple[np.ndarray, ...]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Free problems (a, b, c, base) ``[m]`` each → (weights ``[m, m]``, p_I ``[m]``).

    The LP max Σ_k min(c_k, p_I(k)) over w, with p_I(k) = base_k + Σ_j a_k b_j w_kj +
    Σ_j a_j b_k (1 - w_jk), is a maximum flow: the pair {i, j} holds a_i b_j + a_j b_i to share
    between i and j in any proportion (w_ij and w_ji are free), and token k usefully takes
    (c_k - base_k)+ more. So it is solved as one, exactly up to the capacities' resolution.
    """
    return [_free_law(a, b, base, _flow_weights(a, b, c, base)) for a, b, c, base in problems]


def _flow_weights(a: np.ndarray, b: np.ndarray, c: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Pair weights ``[m, m]`` from a maximum flow (scipy's, on int32 capacities).

    Capacities are floored to 2^-30 of the largest, so the flow fits the true masses and falls short
    of the optimum by at most one such step per pair; the weights are exact for the law they give.
    """
    from scipy.sparse import csr_array
    from scipy.sparse.csgraph import maximum_flow

    m = len(a)
    first, second = np.triu_indices(m, 1)  # [n]: the pairs i < j
    forward, backward = a[first] * b[second], a[second] * b[first]  # [n]: (X1, X2) = (i, j), (j, i)
    mass = forward + backward  # [n]
    room = np.maximum(c - base, 0.0)  # [m]
    weights = np.zeros((m, m))
    if not (mass > 0).any() or not (room > 0).any():  # nothing to share, or nowhere it helps: any weights do
        return weights
    pairs, tokens = 1 + np.arange(len(first)), 1 + len(first) + np.arange(m)  # node ids; 0 = source
    sink = tokens[-1] + 1
    rows = np.concatenate([np.zeros_like(pairs), pairs, pairs, tokens])
    cols = np.concatenate([pairs, tokens[first], tokens[second], np.full(m, sink)])
    capacity = np.concatenate([mass, mass, mass, room])
    scale = _FLOW_RESOLUTION / capacity.max()
    graph = csr_array((np.floor(capacity * scale).astype(np.int32), (rows, cols)), shape=(sink + 1, sink + 1))
    flow = maximum_flow(graph, 0, sink).flow
    to_second = np.asarray(flow[pairs, tokens[second]], dtype=np.float64).ravel() / scale  # [n]
    to_first = np.clip(mass - to_second, 0.0, None)  # the rest of the pair, useful or not, goes to i
    keep = np.divide(to_first, forward, out=np.zeros_like(mass), where=forward > 0).clip(0, 1)  # [n]: w_ij
    taken = np.divide(to_first - forward * keep, backward, out=np.zeros_like(mass), where=backward > 0)  # 1 - w_ji
    weights[first, second], weights[second, first] = keep, 1 - taken.clip(0, 1)
    return weights


def _free_law(a: np.ndarray, b: np.ndarray, base: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weights ``[m, m]`` (clipped to [0, 1], none on the diagonal) and the p_I they give the free tokens ``[m]``."""
    m = len(a)
    weights = weights.clip(0, 1)  # [m, m]
    np.fill_diagonal(weights, 0.0)
    pair = np.outer(a, b) * (1 - np.eye(m))  # [m, m]
    return weights, base + (pair * weights).sum(1) + (pair * (1 - weights)).sum(0)
