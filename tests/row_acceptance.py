"""What the law tests of multi-draft verifiers share to show that their later rows are in the decisions they check:
K > 1 rows accept more than one row on the same keys. The tiny llama draft of tests/conftest.py is rejected where
p > q, where the residual leaves later rows nothing: SpecInfer accepted 0.173 at K = 1, 2 and 3 alike there, and a
law test at K > 1 never exercised its K-row rule."""

from __future__ import annotations

from collections.abc import Sequence

from specdec_cli.kit.testing import keyed_samples
from specdec_cli.results.stats import GenerationResult

ONE_ROW_KEYS = 100
"""The keys a one-row run decodes for the comparison, the first of the K-row run's: the tested margins are 0.05 and
more there (on the same keys, the two runs' draws are shared)."""


def acceptance(results: Sequence[GenerationResult], keys: int | None = None) -> float:
    """The share of drafted tokens accepted in :func:`keyed_samples`' ``results`` (in those of the first ``keys``
    keys, where given: keyed_samples gives a sample's key as its prompt index)."""
    kept = [result for result in results if keys is None or result.prompt_index < keys]
    return sum(result.stats.accepted_tokens for result in kept) / max(sum(r.stats.drafted_tokens for r in kept), 1)


def one_row_acceptance(decoder, prompt: str) -> float:
    """The acceptance of ``decoder`` (one row) on the first :data:`ONE_ROW_KEYS` keys of ``prompt``."""
    return acceptance(keyed_samples(decoder, prompt, ONE_ROW_KEYS))
