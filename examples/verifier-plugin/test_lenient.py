"""The plugin's own tests, written with specdec's exactness helpers."""

import pytest
import torch
from specdec_lenient import LenientSpeculative

from specdec_cli.testing import (
    adversarial_distribution_pairs,
    candidate_acceptance,
    check_verifier,
    enumerate_output_law,
)


@pytest.mark.parametrize("leniency", [1.0, 2.0])
def test_the_plugin_passes_specdecs_conformance_kit(leniency):
    # The kit also checks that these are refused in one line, and that a value of the wrong type ("2") is.
    check_verifier(
        LenientSpeculative,
        {"leniency": leniency},
        samples=1000,
        bad_params=[{"leniency": 0.5}, {"leniency": float("nan")}],
    )


def test_leniency_one_is_lossless():
    for target, draft in adversarial_distribution_pairs(4):
        law = enumerate_output_law(LenientSpeculative(leniency=1.0), target, draft.unsqueeze(0))
        torch.testing.assert_close(law, target, rtol=0, atol=1e-9)


@pytest.mark.parametrize("leniency", [1.0, 1.5, 3.0])
def test_acceptance_probability_equals_enumeration(leniency):
    """P(output = the draft token), enumerated over every draft token, is what the plugin reports."""
    verifier = LenientSpeculative(leniency=leniency)
    for target, draft in adversarial_distribution_pairs(4):
        law = enumerate_output_law(verifier, target, draft.unsqueeze(0))
        torch.testing.assert_close(law.sum(), torch.tensor(1.0, dtype=law.dtype), rtol=0, atol=1e-12)
        expected = candidate_acceptance(verifier, target, draft.unsqueeze(0))
        assert float(verifier.acceptance_probability(target, draft.unsqueeze(0))) == pytest.approx(expected, abs=1e-9)


def test_the_enumeration_catches_a_wrong_acceptance():
    """Negative control: below 1 the formula min(p, λq) is wrong (0.5 where enumeration gives 0.65),
    which is why such values are refused."""
    target, draft = (
        torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
        torch.tensor([[0.4, 0.4, 0.2]], dtype=torch.float64),
    )
    unchecked = LenientSpeculative.__new__(LenientSpeculative)
    unchecked.leniency = 0.5
    assert float(unchecked.acceptance_probability(target, draft)) == pytest.approx(0.5)
    assert candidate_acceptance(unchecked, target, draft) == pytest.approx(0.65)


@pytest.mark.parametrize("leniency", [0.5, 0.0, -1.0, float("inf"), float("nan")])
def test_leniency_below_one_or_not_a_number_is_refused(leniency):
    with pytest.raises(ValueError, match="leniency must be a finite number >= 1"):
        LenientSpeculative(leniency=leniency)


def test_more_leniency_accepts_more():
    target, draft = adversarial_distribution_pairs(4)[4]
    rates = [
        float(LenientSpeculative(leniency=level).acceptance_probability(target, draft.unsqueeze(0))) for level in (1, 2)
    ]
    assert rates[1] > rates[0]
