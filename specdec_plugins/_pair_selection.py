"""One stage of importance-weighted selection between two candidates (Khisti et al., "Multi-Draft
Speculative Sampling", §4 and Appendix G).

A first candidate X1 of law a and an independent second X2 of law b; the selected token Y has the law
p_I with, for tokens i ≠ j, w_ij = P(Y = i | X1 = i, X2 = j) (Appendix G, eqs. 185-187; identical
drafts: §4, eqs. 10-11):

    p_I(i) = a_i b_i + Σ_{j≠i} a_i b_j w_ij + Σ_{j≠i} a_j b_i (1 - w_ji).

The weights, for a target c:

- *Free* pairs, both tokens among the top ``width`` of the drafts' support by c - a b (§4's truncated
  LP, eq. 13; eq. 188): variables of the linear program max Σ_k min(c_k, p_I(k)) (Theorem 1, eq. 2),
  solved on the host as the maximum flow it is (:func:`solve_free_problems`).
- Every other pair, the *tail*: w_ij = λ [i ranks above j] + (1 - λ)/2, a mixture of §4's ranked rule
  (eq. 12: the higher-ranked member wins) and a fair coin. Tokens rank by (c - a b)+ / (a + b): what a
  token still needs beyond its own pairs, per unit of the pair mass it can win. For a long tail of small
  tokens that is the ratio c / (a + b), the order of Theorem 3's minimising sets (eq. 6; identical
  drafts: q/p). §4 ranks by c - a b, which over a 128k vocabulary gives the likeliest tokens every pair
  with a tail token and overshoots their c: two drafts then accepted less than SpecInfer (issue #20).
  λ ∈ [0, 1] maximises Σ min(c, p_I) of the tail law, which is concave and piecewise linear in λ
  (:func:`best_mixture`); the coin alone (λ = 0) keeps p_I = p for identical drafts, so two drafts
  never accept less than one. Free tokens keep their rank in pairs with tail tokens; §4 puts them above
  every tail token, which overshoots them the same way. The paper's bound (eqs. 14, 190: at most
  Σ_{ranked out} (c - a b)+ below the full LP) is proved for its own tail; for this one the tests check
  it on small vocabularies, and the verifier compares it with SpecInfer per problem (:mod:`._importance`).

The rank is the score's float32 bit pattern cut to 7 mantissa bits, a bucket 2^-7 wide (relative): a
pair within one bucket is a tie, decided by the coin. So the masses ranked below each token are a
histogram and a prefix sum over 2^15 buckets, not a sort of the vocabulary (on a CPU, sorting 32 rows of
128k entries costs as much as 30-70 elementwise passes), and the number of operations does not
depend on the data. Everything over the vocabulary stays on the tensors' device; only the free
sub-problems (a few numbers per problem) cross to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specdec_cli.plugins.verifiers import reads_are_free

_FLOW_RESOLUTION = 2.0**30  # the largest capacity in int32 steps (scipy's maximum flow takes int32)
_RANK_SHIFT = 16  # float32 bits >> 16: the exponent and the top 7 mantissa bits of a non-negative value
_RANK_BUCKETS = 1 << 15  # 15 bits of key: every non-negative float32, +inf and NaN (masked to 15 bits)
_MIXTURE_BINS = 256  # resolution of λ: the mixture found is within 1/256 of the best one
_TOP_BLOCK = 128  # entries per block when the CPU finds the free tokens (:func:`top_ids`)


@dataclass
class Tail:
    """The tail rule of P pair problems: the laws, every token's rank, the mixture λ and the law p_I it gives."""

    laws: torch.Tensor  # [2, P, V]: a, b
    key: torch.Tensor  # [P, V] int64: the rank bucket (higher ranks above)
    mixture: torch.Tensor  # [P, 1]: λ, the weight of the ranked rule against the coin
    law: torch.Tensor  # [P, V]: p_I when every pair follows the tail rule

    @classmethod
    def of(cls, first: torch.Tensor, second: torch.Tensor, target: torch.Tensor) -> "Tail":
        """The tail of laws a, b and target c ``[P, V]`` each. A token whose own pairs already give it its
        c (a_i b_i ≥ c_i) gains nothing by winning more: its score is 0, the lowest rank."""
        # clamp, not clamp_, here and below: torch.func.vmap (verify_batch) has no batching rule for clamp_.
        need = torch.addcmul(target, first, second, value=-1).clamp(min=0)  # [P, V]: (c - a b)+
        # NaN (0/0) off the support: masking to 15 bits drops the sign, so every key is a valid bucket.
        key = ((need / (first + second)).float().view(torch.int32) >> _RANK_SHIFT & (_RANK_BUCKETS - 1)).long()
        laws = torch.stack([first, second])  # [2, P, V]
        index = key.expand_as(laws)  # [2, P, V]
        counts = laws.new_zeros(*laws.shape[:2], _RANK_BUCKETS).scatter_add_(-1, index, laws)  # [2, P, buckets]
        # A tie is a coin flip: below = the lower buckets and half the rest of the token's own.
        middle = counts.cumsum(-1).sub_(counts, alpha=0.5)  # [2, P, buckets]
        below_a, below_b = middle.gather(-1, index).sub_(laws, alpha=0.5).unbind(0)  # [P, V] each: A≺, B≺
        total_a, total_b = counts.sum(-1, keepdim=True).unbind(0)  # [P, 1] each: A, B (1 up to rounding)
        ranked = torch.addcmul(first * (second + below_b), second, below_a)  # [P, V]: a b + a B≺ + b A≺
        coin = torch.addcmul(first * total_b, second, total_a).mul_(0.5)  # [P, V]: ½ (a B + b A)
        step = ranked - coin  # [P, V]
        mixture = best_mixture(step, coin, target)  # [P, 1]
        return cls(laws, key, mixture, torch.addcmul(coin, step, mixture))

    def keep(self, tokens: torch.Tensor) -> torch.Tensor:
        """P(Y = x1) ``[P, 1]`` for the pair (x1, x2) = ``tokens[:, :2]`` (``tokens`` ``[P, K]``):
        ½ + ½ λ sign(rank(x1) - rank(x2))."""
        keys = self.key.gather(1, tokens[:, :2])  # [P, 2]
        return tail_weight(keys[:, :1], keys[:, 1:], self.mixture)


def tail_weight(first_keys: torch.Tensor, second_keys: torch.Tensor, mixture: torch.Tensor) -> torch.Tensor:
    """w = P(the first member wins) under the tail rule, ½ + ½ λ sign(rank_first - rank_second), for rank keys
    and λ that broadcast together (a tie is the coin's ½)."""
    return torch.sign(first_keys - second_keys).mul(mixture * 0.5).add_(0.5)


def best_mixture(step: torch.Tensor, coin: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """λ ``[P, 1]`` in [0, 1] (a multiple of 1/256) maximising Σ min(c, coin + λ d) for d = ranked - coin,
    coin and c ``[P, V]`` each.

    The objective is concave and piecewise linear: token i adds slope d_i while coin_i + λ d_i < c_i,
    i.e. below its breakpoint (c_i - coin_i)/d_i if d_i > 0, above it if d_i < 0. So the slope is
    D+ - Σ_{breakpoint ≤ λ} |d_i| with D+ = Σ_{d>0} d_i, and the maximum is where that sum first
    reaches D+: a weighted median, read from a histogram of the breakpoints over [0, 1].
    """
    breakpoint = ((target - coin) / step).nan_to_num_(0.0).clamp(0, 1)  # [P, V]: 0/0 where d = 0 (weight 0)
    bins = (breakpoint * _MIXTURE_BINS).long()  # [P, V] in 0..bins
    weight = step.new_zeros(len(step), _MIXTURE_BINS + 1).scatter_add_(1, bins, step.abs())  # [P, bins+1]
    reached = (weight.cumsum(1) < step.clamp(min=0).sum(1, keepdim=True)).sum(1, keepdim=True)  # [P, 1]
    return reached.clamp(max=_MIXTURE_BINS).to(step.dtype).div_(_MIXTURE_BINS)


@dataclass
class FreeSet:
    """The free tokens of P first pairs and what their LP needs (device tensors)."""

    ids: torch.Tensor  # [P, M] int64: the top M support tokens by c - a b (padding past the support: no mass)
    lp_inputs: torch.Tensor  # [P, 4, M] float64: a, b, c on the free tokens and their base (see below)
    support_size: torch.Tensor  # [P] int64: tokens some candidate can be

    @classmethod
    def of(cls, tail: Tail, target: torch.Tensor, width: int) -> "FreeSet":
        """The free set of a first pair (its ``tail``, target c ``[P, V]``), ``width`` tokens at most (§4).

        A free token k's base is what it gets outside the LP's pairs: its tail law less the pairs the tail
        rule shares among free tokens, a_k Σ_f b_f W_kf + b_k Σ_f a_f W_kf with W_kf = ½ + ½ λ
        sign(rank_k - rank_f) (W_fk = 1 - W_kf), plus the diagonal a_k b_k, which no rule shares.
        """
        first, second = tail.laws.unbind(0)  # [P, V] each
        support = (first + second) > 0  # [P, V]
        score = torch.where(support, torch.addcmul(target, first, second, value=-1), -torch.inf)  # [P, V]
        ids = top_ids(score, min(width, score.shape[-1]))  # [P, M]
        laws = tail.laws.gather(-1, ids.expand(2, -1, -1))  # [2, P, M]: a, b on the free tokens
        keys = tail.key.gather(1, ids)  # [P, M]
        pairs = tail_weight(keys[:, :, None], keys[:, None, :], tail.mixture[..., None])  # [P, M(k), M(f)]: W_kf
        shared = torch.matmul(pairs, laws.flip(0).permute(1, 2, 0))  # [P, M, 2]: Σ_f W_kf b_f, Σ_f W_kf a_f
        share = (laws.permute(1, 2, 0) * shared).sum(-1)  # [P, M]: what the tail rule gives k in free pairs
        base = torch.addcmul(tail.law.gather(1, ids) - share, laws[0], laws[1])  # [P, M]
        lp_inputs = torch.stack([laws[0], laws[1], target.gather(1, ids), base], 1).double()  # [P, 4, M]
        return cls(ids, lp_inputs, support.sum(-1))

    def first_keep(self, tokens: torch.Tensor, weights: torch.Tensor, tail_keep: torch.Tensor) -> torch.Tensor:
        """P(keep slot 0's token against slot 1's) ``[P, 1]``: the LP's weight ``[P, M M]`` where both are free,
        else ``tail_keep`` ``[P, 1]``. A padding id is never a drawn token: slots 0 and 1 are in the support."""
        match = tokens[:, :2, None] == self.ids[:, None, :]  # [P, 2, M]
        position = match.long().argmax(-1)  # [P, 2]
        pair = position[:, :1] * self.ids.shape[1] + position[:, 1:]  # [P, 1]: index of (slot 0, slot 1) in M M
        return torch.where(match.any(-1).all(-1, keepdim=True), weights.gather(1, pair), tail_keep)


def top_ids(score: torch.Tensor, count: int) -> torch.Tensor:
    """``score.topk(count).indices`` ``[P, count]`` for scores ``[P, V]`` (-inf: no candidate, a padding id).

    One problem on the CPU (reads are free): the top ``count + 1`` entries lie in the ``count + 1`` blocks of
    ``_TOP_BLOCK`` entries with the largest maxima (plus the entries past the last whole block) when those
    maxima are strictly above the next block's: every entry elsewhere has that many strictly above it. A
    top-k of those few entries then costs one pass over V where the full one copies V (value, index) pairs.
    Their order is topk's whenever the finite values among the top ``count + 1`` are distinct (ids of -inf
    entries are padding, which carries no mass: any will do); on a tie, the full top-k orders it.
    """
    whole = score.shape[-1] // _TOP_BLOCK * _TOP_BLOCK
    if len(score) != 1 or whole < (count + 2) * _TOP_BLOCK or not reads_are_free(score):
        return score.topk(count, dim=-1).indices
    maxima = score[0, :whole].view(-1, _TOP_BLOCK).amax(1).topk(count + 2)  # [count + 2]: values, block ids
    edge = maxima.values[count:].tolist()  # the (count+1)-th and (count+2)-th largest block maxima
    if edge[0] == edge[1] and edge[0] != -math.inf:
        return score.topk(count, dim=-1).indices
    offsets = torch.arange(_TOP_BLOCK, device=score.device)  # [block]
    candidates = torch.cat(
        [
            (maxima.indices[: count + 1, None] * _TOP_BLOCK + offsets).flatten(),
            torch.arange(whole, score.shape[-1], device=score.device),
        ]
    )
    top = score[0, candidates].topk(count + 1)  # [count + 1]
    finite = [value for value in top.values.tolist() if value != -math.inf]
    if len(set(finite)) < len(finite) or any(math.isnan(value) for value in finite):
        return score.topk(count, dim=-1).indices
    return candidates[top.indices[:count]][None]


def solve_free_problems(host: np.ndarray, solved: dict) -> tuple[np.ndarray, np.ndarray]:
    """Every problem's free LP, on the host (as a maximum flow: :func:`_solve_lps`).

    ``host`` ``[A, 4, M]``: a, b, c and base on the free tokens (padding: no mass in a or b) as
    :attr:`FreeSet.lp_inputs` packs them. Returns weights ``[A, M, M]`` and the free tokens' p_I ``[A, M]``.
    ``solved`` maps a sub-problem's numbers to its solution, so a sub-problem met before (in this block
    or an earlier one) is not solved again; new solutions are added to it.
    """
    valid = (host[:, 0] > 0) | (host[:, 1] > 0)  # [A, M]
    problems = [tuple(host[p][:, valid[p]]) for p in range(len(host))]  # (a, b, c, base) [m] each
    keys = [np.concatenate(problem).tobytes() for problem in problems]
    fresh = {key: problem for key, problem in zip(keys, problems) if key not in solved}
    solved.update(zip(fresh, _solve_lps(list(fresh.values()))))
    width = host.shape[-1]
    weights, laws = np.zeros((len(host), width, width)), np.zeros((len(host), width))
    for p, key in enumerate(keys):
        where = np.flatnonzero(valid[p])
        weights[p][np.ix_(where, where)], laws[p, where] = solved[key]
    return weights, laws


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
    # [3 n + m] edges each: source → pair, pair → its first token, pair → its second, token → sink
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
    """The weights ``[m, m]`` (clipped to [0, 1], none on the diagonal) and the p_I they give the free tokens
    ``[m]``."""
    m = len(a)
    weights = weights.clip(0, 1)  # [m, m]
    np.fill_diagonal(weights, 0.0)
    pair = np.outer(a, b) * (1 - np.eye(m))  # [m, m]
    return weights, base + (pair * weights).sum(1) + (pair * (1 - weights)).sum(0)
