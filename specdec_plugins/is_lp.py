"""IS-LP: importance-weighted sampling with the exact selection LP (Khisti et al., §3: Theorem 1, eqs. 2-4;
Theorem 3, eq. 6; Theorem 4, eqs. 38-40; the K = 2 LP of §4, eqs. 10-11, and Appendix G, eq. 187).

The rule in the project's notation: docs/verifiers.md §5.

For K = 2 drafts the LP over all pair weights reaches the optimal acceptance of *any* lossless
rule (identical drafts: Theorem 3's P* = 1 + min_S [q(S) - p(S)^2]; different drafts:
Theorem 4). K > 2: the LP selects among x1 and x2, then x3 … xK are tested against what is left of
q (SpecInfer's steps, see :mod:`._importance`), so a block reads the device once; lossless, not
claimed optimal, and never below SpecInfer. The LP has m(m-1) weights for a draft support of m
tokens, so the support is bounded by ``max_support``: restrict it with top-k / top-p sampling, or
use ``is-truncated``.
"""

from __future__ import annotations

from typing import Annotated

from specdec_cli.base.errors import UsageError

from ._importance import ImportanceSampling


class ImportanceSamplingLP(ImportanceSampling):
    name = "is-lp"

    def __init__(
        self,
        *,
        max_support: Annotated[
            int,
            "the most tokens the drafts may put mass on (the LP has m(m-1) weights "
            "for m tokens): restrict it with top-k or top-p",
        ] = 64,
    ):
        if max_support < 1:
            raise ValueError(f"is-lp: max_support must be >= 1, got {max_support}")
        self.max_support = int(max_support)

    @property
    def free_width(self) -> int:
        return self.max_support

    def check_support(self, support_sizes):
        if len(support_sizes) and support_sizes.max() > self.max_support:
            raise UsageError(
                f"is-lp: the drafts put mass on {int(support_sizes.max())} tokens, "
                f"more than max_support={self.max_support} "
                "allows for the exact LP; restrict sampling (e.g. --top-k 20), raise max_support "
                "(--set verifier.params.max_support=N), or use is-truncated"
            )
