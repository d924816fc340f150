"""IS-truncated: importance-weighted sampling with the truncated LP (Khisti et al., §4, eqs. 10-13;
different drafts: Appendix G, eqs. 187-189).

The rule in the project's notation: docs/verifiers.md §5.

Only the top ``s`` support tokens by q_i - p1_i p2_i (identical drafts: q_i - p_i^2) have free LP
weights; every pair that touches another token follows the tail rule of :mod:`._pair_selection`. The
paper's tail (eq. 12) gives such a pair to its higher-ranked member, ranked by q_i - p_i^2 with the free
tokens first; over a 128k vocabulary that hands the likeliest tokens every pair with a tail token, and
two drafts then accepted less than SpecInfer (3.31 against 3.69 tokens per target forward in issue #20).
Here tokens rank by (q_i - p1_i p2_i)+ / (p1_i + p2_i) (for tail tokens, Theorem 3's order q/p), and
the pair goes to the higher-ranked member with probability λ, to either with probability (1 - λ)/2,
λ chosen per problem to accept the most (λ = 0 keeps p_I = p for identical drafts: two drafts never
accept less than one). K > 2: the pair (x1, x2), then x3 … xK tested in turn against what is left of q;
each position keeps the better of this and SpecInfer (see :mod:`._importance`).

The paper's alphabet truncation runs the scheme against q~ = q restricted to a set O of the
target's most likely tokens and renormalised; its output is kept with probability q(O), otherwise
a token outside O is drawn in proportion to q. The output law is exactly q, but the scheme's
acceptance can never exceed q(O), so the paper's fixed 40 tokens cap it well below one draft's
acceptance when sampling from the full vocabulary (where the cap binds, the position runs SpecInfer
instead, which ignores O). Here O adapts at each position: the smallest top set with
q(O) ≥ ``alphabet_mass`` (1 - ε), capped at ``alphabet`` tokens if given. The default,
``alphabet_mass = 1`` and no cap, is q's whole support: the work over the vocabulary runs on the
device and the LP only ever sees the ``s`` free tokens, so a smaller alphabet no longer saves
anything and only costs acceptance.
"""

from __future__ import annotations

from typing import Annotated

import torch

from ._importance import ImportanceSampling


class ImportanceSamplingTruncated(ImportanceSampling):
    name = "is-truncated"

    def __init__(
        self,
        *,
        s: Annotated[
            int, "tokens with free LP weights (the top s by (q - p1 p2)+): the others follow the tail rule"
        ] = 5,
        alphabet: Annotated[int | None, "cap on the alphabet's size, in tokens (None: no cap)"] = None,
        alphabet_mass: Annotated[float, "the alphabet: the smallest top set of q with this much mass, in ]0, 1]"] = 1.0,
    ):
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

    @property
    def has_alphabet(self) -> bool:
        return self.alphabet_mass < 1 or self.alphabet is not None

    def alphabet_mask(self, target):
        """O ``[P, V]``: the fewest top tokens of q whose mass reaches ``alphabet_mass`` (never a zero-mass
        token), at most ``alphabet``; None (q's whole support) when neither binds."""
        if not self.has_alphabet:
            return None
        positive = target > 0  # [P, V]
        likeliest, order = target.sort(dim=-1, descending=True, stable=True)  # [P, V] each: ties to the lower id
        cumulative = likeliest.cumsum(-1)  # [P, V]
        mass = torch.full_like(cumulative[:, :1], self.alphabet_mass)  # [P, 1]
        size = (torch.searchsorted(cumulative, mass) + 1).clamp(max=positive.sum(-1, keepdim=True))  # [P, 1]
        if self.alphabet is not None:
            size = size.clamp(max=self.alphabet)
        positions = torch.arange(order.shape[-1], device=order.device)  # [V]
        return torch.zeros_like(positive).scatter_(-1, order, positions < size)  # size ≥ 1: never an empty O
