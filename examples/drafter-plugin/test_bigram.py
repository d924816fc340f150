"""The plugin's own tests, with specdec's conformance kit."""

import pytest
from specdec_bigram import ContextBigram

from specdec_cli.testing import check_drafter


def test_the_bigram_drafter_passes_the_conformance_kit():
    # The kit also checks that these are refused in one line, and that a value of the wrong type ("1", True) is.
    check_drafter(ContextBigram, {"smoothing": 0.5}, bad_params=[{"smoothing": 0.0}, {"smoothing": float("nan")}])


@pytest.mark.parametrize("smoothing", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_smoothing_is_refused(smoothing):
    with pytest.raises(ValueError, match="smoothing must be a finite number > 0"):
        ContextBigram(smoothing=smoothing)
