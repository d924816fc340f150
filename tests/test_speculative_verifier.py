"""The verifier contract, for `speculative`: exact by enumeration, statistically, batched."""

from __future__ import annotations

import pytest
import torch
from stevedore import driver

from specdec_cli.kit.testing import adversarial_distribution_pairs, enumerate_output_law, random_distributions
from specdec_cli.plugins.registry import VerifierParameterError, load_verifier
from specdec_plugins.speculative import SpeculativeSampling


def _cases(vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed + vocab)
    random = [tuple(random_distributions(generator, (2, vocab))) for _ in range(20)]
    return random + adversarial_distribution_pairs(vocab)


@pytest.mark.parametrize("vocab", [2, 3, 4, 6])
def test_output_law_is_target_exactly(vocab):
    verifier = SpeculativeSampling()
    for target, draft in _cases(vocab):
        law = enumerate_output_law(verifier, target, draft.unsqueeze(0))
        torch.testing.assert_close(law, target, rtol=0, atol=1e-9)


@pytest.mark.parametrize("vocab", [2, 5])
def test_acceptance_probability_is_sum_of_min(vocab):
    verifier = SpeculativeSampling()
    for target, draft in _cases(vocab):
        expected = torch.minimum(target, draft).sum()
        torch.testing.assert_close(verifier.acceptance_probability(target, draft.unsqueeze(0)), expected)
        # ... and equals the enumerated probability that the output is the candidate.
        enumerated = sum(
            float(draft[x]) * float(verifier.conditional(target, draft.unsqueeze(0), torch.tensor([x]))[x])
            for x in range(vocab)
            if draft[x] > 0
        )
        assert enumerated == pytest.approx(float(expected), abs=1e-12)


def test_select_samples_the_conditional_law():
    """Seeded chi-square: select's tokens follow conditional's law, for a rejected-prone candidate."""
    from scipy.stats import chisquare

    verifier = SpeculativeSampling()
    target = torch.tensor([0.1, 0.6, 0.3, 0.0], dtype=torch.float64)
    draft = torch.tensor([0.5, 0.1, 0.1, 0.3], dtype=torch.float64)
    n = 20000
    candidate = torch.zeros(n, 1, dtype=torch.long)  # token 0: accepted with probability 0.2
    generator = torch.Generator().manual_seed(7)
    tokens, accepted = verifier.select(target.expand(n, 4), draft.expand(n, 1, 4), candidate, generator)
    law = verifier.conditional(target, draft.unsqueeze(0), torch.tensor([0]))
    observed = torch.bincount(tokens, minlength=4)
    support = law > 0
    assert observed[~support].sum() == 0
    assert chisquare(observed[support].numpy(), (law[support] * n).numpy()).pvalue > 1e-3
    assert torch.equal(accepted, tokens == 0)


def test_all_none_and_some_accepted():
    verifier = SpeculativeSampling()
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    p = torch.tensor([[[0.5, 0.5, 0.0]], [[1.0, 0.0, 0.0]], [[0.2, 0.3, 0.5]]], dtype=torch.float64)
    x = torch.tensor([[1], [0], [2]])
    token, accepted = verifier.select(q, p, x, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [True, False, True]  # q >= p: always; q(x) = 0: never
    assert token.tolist() == [1, 2, 2]


def test_greedy_one_hot_target_never_nan():
    verifier = SpeculativeSampling()
    q = torch.tensor([0.0, 1.0, 0.0])
    p = torch.tensor([[1.0, 0.0, 0.0]])
    law = verifier.conditional(q, p, torch.tensor([0]))
    assert torch.equal(law, q)


def test_loads_through_stevedore_and_rejects_unknown_parameters():
    manager = driver.DriverManager("specdec.verifiers", "speculative", invoke_on_load=True, invoke_kwds={})
    assert isinstance(manager.driver, SpeculativeSampling)
    assert load_verifier("Speculative").lossless  # names are case-insensitive
    with pytest.raises(VerifierParameterError, match="valid parameters: none"):
        driver.DriverManager("specdec.verifiers", "speculative", invoke_on_load=True, invoke_kwds={"kl": 1})
