"""IS-truncated: importance-weighted sampling with the truncated LP (Khisti et al., §4).

Tokens are ranked by q_i - p_i^2 (different drafts: q_i - p1_i p2_i); only the top ``s`` have
free LP weights, and every pair that touches another token goes to its higher-ranked member.
Guarantee (identical drafts, K = 2): P_trunc ≥ P* - Σ_{ranked below s} (q_i - p_i^2)+.

Alphabet truncation keeps the LP small on large vocabularies: the scheme runs against
q~ = q restricted to a set O of the target's most likely tokens and renormalised; its output
is kept with probability q(O), otherwise a token outside O is drawn in proportion to q. The
output law is exactly q, but acceptance can never exceed q(O): the paper's fixed 40 tokens
cap it well below one draft's acceptance when sampling from the full vocabulary. So O adapts
at each position: the smallest top set with q(O) ≥ ``alphabet_mass`` (1 - ε), capped at
``alphabet`` tokens if given (a cap costs acceptance wherever it binds: at full-vocabulary
sampling a small model's top 1024 tokens can hold under 0.9 of q). K > 2: successive pairwise selection (Remark 4).
"""

from __future__ import annotations

import numpy as np

from ._importance import ImportanceSampling


class ImportanceSamplingTruncated(ImportanceSampling):
    name = "is-truncated"

    def __init__(self, *, s: int = 5, alphabet: int | None = None, alphabet_mass: float = 0.9999):
        if s < 1 or (alphabet is not None and alphabet < 1):
            raise ValueError(f"is-truncated: s and alphabet must be >= 1, got s={s}, alphabet={alphabet}")
        if not 0 < alphabet_mass <= 1:
            raise ValueError(f"is-truncated: alphabet_mass must be in ]0, 1], got {alphabet_mass}")
        self.s = int(s)
        self.alphabet = None if alphabet is None else int(alphabet)
        self.alphabet_mass = float(alphabet_mass)

    def free_tokens(self, order, support):
        return order[support[order]][: self.s]

    def alphabet_size(self, target_descending):
        """The fewest top tokens whose mass reaches ``alphabet_mass`` (all positive ones at 1), at most ``alphabet``."""
        positive = int(np.count_nonzero(target_descending > 0))
        reaching = int(np.searchsorted(np.cumsum(target_descending), self.alphabet_mass)) + 1
        return max(1, min(reaching, positive, self.alphabet or positive))
