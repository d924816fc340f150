"""The plugin's own tests, written with specdec's exactness helpers."""

import torch

from specdec_cli.testing import adversarial_distribution_pairs, enumerate_output_law
from specdec_lenient import LenientSpeculative


def test_leniency_one_is_lossless():
    for target, draft in adversarial_distribution_pairs(4):
        law = enumerate_output_law(LenientSpeculative(leniency=1.0), target, draft.unsqueeze(0))
        torch.testing.assert_close(law, target, rtol=0, atol=1e-9)


def test_more_leniency_accepts_more():
    target, draft = adversarial_distribution_pairs(4)[4]
    rates = [float(LenientSpeculative(leniency=l).acceptance_probability(target, draft.unsqueeze(0))) for l in (1, 2)]
    assert rates[1] > rates[0]
