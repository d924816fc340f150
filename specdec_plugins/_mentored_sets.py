"""Mentored decoding's KL rule on the CPU path: set steps that regroup the tokens below α and above β until the
groups repeat (:func:`_solve_by_sets`); a row that does not settle falls back to the sorted solve
(:mod:`._mentored_sorted`). The derivation: :mod:`._mentored_solve`."""

from __future__ import annotations

import math

import torch

from ._mentored_sorted import _LARGEST, TINY, _pair_direction, _Segment, _Solution, _solution_at, _SortedTable

_MAX_SET_STEPS = 16  # CPU path: set steps before a row falls back to the sorted solve
_RATIO_ROUNDING = 1e-6  # CPU path: a margin far wider than float32's rounding of a float64 ratio (2^-24)
_FLOAT32_NORMAL = (torch.finfo(torch.float32).tiny * 2, torch.finfo(torch.float32).max / 2)
_COARSE_TOLERANCE = 1e-6  # CPU path: float32 set steps stop when α and β move less than this, relatively
_SCALAR_NEWTON_STEPS = 200  # CPU path: Newton from the left on one segment stops earlier, when it stands still


_BELOW_ONE, _ABOVE_ONE = math.nextafter(1.0, 0.0), math.nextafter(1.0, 2.0)  # speculative sampling's α and β
_ACCEPT_ALL = (0.0, 1.0, 1.0, 0.0, 0.0, 0.0)  # (Q_low, Q_high, P_low, P_high, band, ρ): a row with no root to solve


class _Buffers:
    """The CPU path's arrays for rows ``[N, V]``; a block reuses one set per thread (:func:`._workspace.per_thread`)."""

    def __init__(self, rows: int, vocab: int):
        self.weights = torch.empty(rows, 3, vocab, dtype=torch.float64)  # [N, 3, V]: q, p, q ln(q/p)
        self.ratio = torch.empty(rows, vocab, dtype=torch.float64)  # [N, V]: q/p
        self.masks = torch.empty(rows, 2, vocab, dtype=torch.float64)  # [N, 2, V]: below α, above β
        # float32 copies for the first set steps, which only have to come near the root: a float32 step costs
        # half a float64 one, and the float64 steps that follow settle the groups exactly.
        self.coarse = (torch.empty(rows, 3, vocab), torch.empty(rows, vocab), torch.empty(rows, 2, vocab))


class _Groups:
    """Q, P and Σ q ln(q/p) below α and above β, from one comparison pass and one matrix product over V
    per set step (the CPU path; rows ``[N, V]`` of any probabilities, renormalised in float64 as
    :func:`_normalised` does). Every array is filled in place in ``buffers``."""

    def __init__(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, masses=None, buffers=None):
        rows, vocab = target_probs.shape
        buffers = buffers or _Buffers(rows, vocab)
        self.weights, self._masks = buffers.weights, buffers.masks  # [N, 3, V], [N, 2, V]
        self.q, self.p, log_ratio = self.weights.unbind(-2)  # [N, V] views
        masses = masses or [probs.sum(-1, keepdim=True, dtype=torch.float64) for probs in (target_probs, draft_probs)]
        for law, probs, mass in zip((self.q, self.p), (target_probs, draft_probs), masses):
            torch.div(probs, mass.view(rows, 1), out=law)
        self.t = torch.div(self.q, self.p, out=buffers.ratio).nan_to_num_(
            nan=0.0, posinf=math.inf
        )  # [N, V]: :func:`_ratio`
        # q ln t, 0 where q = 0: xlogy, and log at 0, take a slow path per element (4× and 10× slower at V = 128k).
        torch.clamp_min(self.t, TINY, out=log_ratio).log_().mul_(self.q)
        self.full_kl = log_ratio.sum(-1, keepdim=True)  # [N, 1]: KL(q ‖ p)
        self.total_log_ratio = self.full_kl.squeeze(-1).tolist()  # [N]: Σ q ln t over the tokens with t < ∞
        if math.inf in self.total_log_ratio:  # p misses q's support
            self._count_missing_support(log_ratio)
        self._coarse = buffers.coarse  # [N, 3, V], [N, V], [N, 2, V] float32
        self._coarse[0].copy_(self.weights)
        self._coarse[1].copy_(self.t)

    def _count_missing_support(self, log_ratio: torch.Tensor):
        """Where p = 0 < q (t = ∞): those tokens are always above β, never between α and β, so they stay out of
        the band's sums; and KL(q ‖ p) counts them at t = float64's largest number (p = 2^-1024 q there), so a
        row that is still within D has its root ρ below float64's range (the device path's floor) and is
        accepted outright, without set steps that would not settle."""
        missing = self.q.where(self.t == math.inf, 0.0).sum(-1, keepdim=True)  # [N, 1]: q's mass where p = 0
        finite = log_ratio.nan_to_num_(posinf=0.0).sum(-1, keepdim=True)  # [N, 1]
        self.total_log_ratio = finite.squeeze(-1).tolist()
        self.full_kl = finite + math.log(_LARGEST) * missing

    def same_groups(self, row: int, old: list, new: list) -> bool:
        """Whether ``row``'s groups at thresholds ``new`` (α, β) are those at ``old``: no token's float64 ratio
        lies between them. Read on the float32 ratios (within 2^-24 of the float64 ones) over the interval
        widened by 1e-6 (three float32 passes: a tenth of a float64 step); a token inside, or a threshold outside
        float32's normal range, answers no."""
        for old_threshold, new_threshold in zip(old, new):
            low, high = sorted((old_threshold, new_threshold))
            low, high = low * (1 - _RATIO_ROUNDING), high * (1 + _RATIO_ROUNDING)
            if not _FLOAT32_NORMAL[0] < low <= high < _FLOAT32_NORMAL[1]:
                return False
            ratio, distance = self._coarse[1][row], self._coarse[2][row, 0]  # [V] each; the masks' buffer is free
            if not float(torch.sub(ratio, (low + high) / 2, out=distance).abs_().amin()) > (high - low) / 2:
                return False
        return True

    def segments(self, thresholds: list, coarse: bool = False) -> list:
        """The segment (Q_low, Q_high, P_low, P_high, band) of each row's [α, β] → a list [N] of 5-tuples;
        ``coarse``: from the float32 copies (equal groups still give equal sums)."""
        weights, ratio, masks = self._coarse if coarse else (self.weights, self.t, self._masks)
        limits = torch.tensor(thresholds, dtype=ratio.dtype).unsqueeze(-1)  # [N, 2, 1]
        torch.le(ratio, limits[:, 0], out=masks[:, 0])
        torch.ge(ratio, limits[:, 1], out=masks[:, 1])
        sums = torch.bmm(weights, masks.transpose(-1, -2)).tolist()  # [N][3][2]: (q, p, q ln t) × groups
        return [
            (q_low, q_high, p_low, p_high, total - w_low - w_high)
            for ((q_low, q_high), (p_low, p_high), (w_low, w_high)), total in zip(sums, self.total_log_ratio)
        ]


def _solve_by_sets(target_probs, draft_probs, bound: float, masses=None, buffers=None) -> _Solution:
    """Every row of q, p ``[..., V]`` on the CPU, reading as it goes; a row whose sets do not settle by sorting."""
    batch, vocab = target_probs.shape[:-1], target_probs.shape[-1]
    groups = _Groups(target_probs.reshape(-1, vocab), draft_probs.reshape(-1, vocab), masses, buffers)
    outright = groups.full_kl <= bound  # [N, 1]: accept every draft token
    pending = (~outright).squeeze(-1).tolist()  # [N]
    found = _settle_sets(groups, pending, bound)
    roots = torch.tensor([root or _ACCEPT_ALL for root in found], dtype=torch.float64).T.unsqueeze(-1)  # [6, N, 1]
    segment, rho = _Segment.of_sums(roots[0:2], roots[2:4], roots[4:5], bound), roots[5:]  # [2, N, 1], [1, N, 1]
    unsettled = [row for row, (waiting, root) in enumerate(zip(pending, found)) if waiting and root is None]
    if unsettled:  # rarely
        sorted_segment, sorted_rho, _ = _SortedTable(groups.q[unsettled], groups.p[unsettled], bound).root()
        for field, value in zip(
            (segment.q, segment.p, segment.offset, rho),
            (sorted_segment.q, sorted_segment.p, sorted_segment.offset, sorted_rho),
        ):
            field[:, unsettled] = value

    def rows(tensor: torch.Tensor) -> torch.Tensor:  # [..., N, k] → [..., *batch, k]
        return tensor.reshape(*tensor.shape[:-2], *batch, tensor.shape[-1])

    rho = rows(rho)  # [1, *batch, 1]
    segment = _Segment(*(rows(field) for field in (segment.q, segment.p, segment.offset)), _pair_direction(rho))
    return _solution_at(rows(groups.q), rows(groups.p), rows(groups.t), segment, rho, rows(outright[None]), bound)


def _settle_sets(groups: _Groups, pending: list, bound: float) -> list:
    """Each pending row's settled (Q_low, Q_high, P_low, P_high, band, ρ), or None (not pending, or not
    settled within ``_MAX_SET_STEPS`` float64 steps). A row has settled when its float64 sums repeat
    exactly: its α and β then give back their own groups. Float32 steps first bring the thresholds near
    the root (at V = 128k five of them cost what two float64 steps do); the float64 steps start there."""
    thresholds = [[_BELOW_ONE, _ABOVE_ONE] for _ in pending]  # [N][2]: speculative sampling's groups first
    _iterate_sets(groups, list(pending), thresholds, bound, coarse=True)
    return _iterate_sets(groups, list(pending), thresholds, bound, coarse=False)


def _iterate_sets(groups: _Groups, waiting: list, thresholds: list, bound: float, coarse: bool) -> list:
    """Set steps from ``thresholds`` ``[N][2]`` (moved in place) for at most ``_MAX_SET_STEPS`` steps → each
    waiting row's (*sums, ρ) where its groups repeat, else None. They repeat when a step's sums are the last
    step's, or, a step earlier, when no token lies between its old and new thresholds (a token near the root
    may keep that check from answering). Coarse steps stop instead when α and β stand still to
    ``_COARSE_TOLERANCE``."""
    previous, found, rho = [None] * len(waiting), [None] * len(waiting), [0.0] * len(waiting)
    for _ in range(_MAX_SET_STEPS):
        if not any(waiting):
            break
        for row, segment in enumerate(groups.segments(thresholds, coarse)):
            if not waiting[row]:
                continue
            if not coarse and segment == previous[row]:
                found[row], waiting[row] = (*segment, rho[row]), False
                continue
            previous[row] = segment
            rho[row], *moved = _scalar_root(*segment, bound)
            if coarse:
                waiting[row] = not all(
                    math.isclose(*pair, rel_tol=_COARSE_TOLERANCE) for pair in zip(moved, thresholds[row])
                )
            elif groups.same_groups(row, thresholds[row], moved):
                found[row], waiting[row] = (*segment, rho[row]), False
            thresholds[row] = moved
    return found


def _scalar_root(q_low, q_high, p_low, p_high, band, bound: float) -> tuple[float, float, float]:
    """(ρ, α, β) at the root of one segment's KL(ρ) = D in [0, turn] (the end nearest to it when it has
    none there), in Python floats: the CPU path's set steps make thousands of these, and a float
    operation costs a hundred times less than a torch operation on one number.

    The same closed form as :class:`_Segment`; Newton from :meth:`_Segment.lower_root`'s start, on a
    convex decreasing KL, climbs to the root without overshooting, so it stops when it stands still.
    At the turn (α = β, KL's minimum) α is moved up to β: more tokens belong below it.
    """

    def at(rho: float) -> tuple[float, float, float]:
        alpha, beta = q_low / max(p_low - rho, TINY), q_high / max(p_high + rho, TINY)
        return alpha, beta, band + _xlogy(q_low, alpha) + _xlogy(q_high, beta)

    turn = min(max((q_high * p_low - q_low * p_high) / max(q_low + q_high, TINY), 0.0), p_low)
    frozen = band + _xlogy(q_low, q_low / max(p_low, TINY)) + _xlogy(q_high, q_high)
    rho = min(max(math.exp(min((frozen - bound) / max(q_high, TINY), 700.0)) - p_high, 0.0), turn)
    for _ in range(_SCALAR_NEWTON_STEPS):
        alpha, beta, kl = at(rho)
        step = rho + (kl - bound) / (beta - alpha) if kl > bound and beta > alpha else rho
        if not step > rho:
            break
        rho = min(step, turn)
    alpha, beta, _ = at(rho)
    return rho, beta if rho >= turn else alpha, beta


def _xlogy(x: float, y: float) -> float:
    return x * math.log(y) if x > 0 else 0.0
