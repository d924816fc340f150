"""IS-truncated: importance-weighted sampling with the truncated LP (Khisti et al., §4).

The rule in the project's notation: docs/verifiers.md §5.

Tokens are ranked by q_i - p_i^2 (different drafts: q_i - p1_i p2_i); only the top ``s`` have
free LP weights, and every pair that touches another token goes to its higher-ranked member.
Guarantee (identical drafts, K = 2): P_trunc ≥ P* - Σ_{ranked below s} (q_i - p_i^2)+. Each
stage also solves the fair-coin tail (such a pair goes to either member with probability 1/2)
and keeps the better of the two: the ranked tail alone can accept far less than one draft when
the drafts are close to the target.

The paper's alphabet truncation runs the scheme against q~ = q restricted to a set O of the
target's most likely tokens and renormalised; its output is kept with probability q(O), otherwise
a token outside O is drawn in proportion to q. The output law is exactly q, but acceptance can
never exceed q(O), so the paper's fixed 40 tokens cap it well below one draft's acceptance when
sampling from the full vocabulary. Here O adapts at each position: the smallest top set with
q(O) ≥ ``alphabet_mass`` (1 - ε), capped at ``alphabet`` tokens if given. The default,
``alphabet_mass = 1`` and no cap, is q's whole support: the work over the vocabulary runs on the
device and the LP only ever sees the ``s`` free tokens, so a smaller alphabet no longer saves
anything and only costs acceptance. K > 2: successive pairwise selection (Remark 4).
"""

from __future__ import annotations

import torch

from ._importance import ImportanceSampling
from ._pair_selection import ascending_order


class ImportanceSamplingTruncated(ImportanceSampling):
    name = "is-truncated"

    def __init__(self, *, s: int = 5, alphabet: int | None = None, alphabet_mass: float = 1.0):
        if s < 1 or (alphabet is not None and alphabet < 1):
            raise ValueError(f"is-truncated: s and alphabet must be >= 1, got s={s}, alphabet={alphabet}")
        if not 0 < alphabet_mass <= 1:
            raise ValueError(f"is-truncated: alphabet_mass must be in ]0, 1], got {alphabet_mass}")
        self.s = int(s)
        self.alphabet = None if alphabet is None else int(alphabet)
        self.alphabet_mass = float(alphabet_mass)

    @property
    def free_width(self) -> int:
        return self.s

    def alphabet_mask(self, target):
        """O ``[P, V]``: the fewest top tokens of q whose mass reaches ``alphabet_mass`` (never a zero-mass
        token), at most ``alphabet``; None (q's whole support) when neither binds."""
        if self.alphabet_mass >= 1 and self.alphabet is None:
            return None
        positive = target > 0  # [P, V]
        order = ascending_order(target)[0].flip(-1)  # [P, V]: most likely first
        cumulative = target.gather(-1, order).cumsum(-1)  # [P, V]
        mass = torch.full_like(cumulative[:, :1], self.alphabet_mass)  # [P, 1]
        size = (torch.searchsorted(cumulative, mass) + 1).clamp(max=positive.sum(-1, keepdim=True))  # [P, 1]
        if self.alphabet is not None:
            size = size.clamp(max=self.alphabet)
        positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)  # [P, V]
        return torch.zeros_like(positive).scatter_(-1, order, positions < size.clamp(min=1))
