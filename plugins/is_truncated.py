"""IS-truncated: importance-weighted sampling with the truncated LP (Khisti et al., §4).

Tokens are ranked by q_i - p_i^2 (different drafts: q_i - p1_i p2_i); only the top ``s`` have
free LP weights, and every pair that touches another token goes to its higher-ranked member.
Guarantee (identical drafts, K = 2): P_trunc ≥ P* - Σ_{ranked below s} (q_i - p_i^2)+.

Alphabet truncation keeps the LP small on large vocabularies: the scheme runs against
q~ = q restricted to the ``alphabet`` most likely target tokens O and renormalised; its output
is kept with probability q(O), otherwise a token outside O is drawn in proportion to q. The
output law is exactly q. K > 2: successive pairwise selection (Remark 4).
"""

from __future__ import annotations

from ._importance import ImportanceSampling


class ImportanceSamplingTruncated(ImportanceSampling):
    name = "is-truncated"

    def __init__(self, *, s: int = 5, alphabet: int = 40):
        if s < 1 or alphabet < 1:
            raise ValueError(f"is-truncated: s and alphabet must be >= 1, got s={s}, alphabet={alphabet}")
        self.s = int(s)
        self.alphabet = int(alphabet)

    def free_tokens(self, order, support):
        return order[support[order]][: self.s]

    def alphabet_size(self, vocab):
        return min(self.alphabet, vocab)
