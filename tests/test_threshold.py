"""SGLang's acceptance thresholds (``threshold``): accept x with a(x) = 1 if q(x) ≥ s else min(1, q(x) / a), otherwise
draw from q without x. At the defaults s = a = 1 its output is q for any draft law; lower thresholds bias it. The
block decides as sgl-kernel's tree_speculative_sampling_target_only does on a chain, given the same uniforms."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.kit.testing import (
    adversarial_distribution_pairs,
    candidate_acceptance,
    chi_square_p_value,
    enumerate_block_law,
    enumerate_output_law,
    random_distributions,
    random_sequence_laws,
    target_sequence_law,
)
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins.threshold import ThresholdAcceptance
from tests.conftest import random_block

VOCAB = 5
SETTINGS = [(1.0, 1.0), (0.5, 0.5), (0.3, 1.0), (1.0, 0.2), (0.0, 1.0), (0.9, 0.05), (1.2, 0.0), (-1.0, 2.0)]
"""(single, acc): SGLang's defaults, the worked example's, each threshold alone, s = 0 (accepts all), a tiny a, and
numbers SGLang takes beyond [0, 1] (a = 0 floored at 1e-9, s > 1 off, s < 0 accepting all, a > 1)."""

# The worked example: q = [0.6, 0.3, 0.1], s = a = 0.5, p = [0.2, 0.5, 0.3].
#   a(0) = 1 (0.6 ≥ 0.5), a(1) = min(1, 0.3 / 0.5) = 0.6, a(2) = min(1, 0.1 / 0.5) = 0.2
#   rejected 1 → q without 1: [0.6, 0, 0.1] / 0.7 = [6/7, 0, 1/7]; rejected 2 → [0.6, 0.3, 0] / 0.9 = [2/3, 1/3, 0]
#   conditional(x = 1) = 0.6·δ1 + 0.4·[6/7, 0, 1/7] = [12/35, 3/5, 2/35]
#   conditional(x = 2) = 0.2·δ2 + 0.8·[2/3, 1/3, 0] = [8/15, 4/15, 1/5]
#   π = 0.2·δ0 + 0.5·conditional(1) + 0.3·conditional(2) = [93/175, 19/50, 31/350] ≈ [0.5314, 0.38, 0.0886]
#   acceptance = 0.2·1 + 0.5·0.6 + 0.3·0.2 = 0.56
WORKED_Q = [0.6, 0.3, 0.1]
WORKED_P = [0.2, 0.5, 0.3]


def _threshold(single: float = 1.0, acc: float = 1.0) -> ThresholdAcceptance:
    return VerifierRegistry().create("threshold", {"single": single, "acc": acc})


def _law(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _laws(seed: int, sparsity: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    q, p = random_distributions(torch.Generator().manual_seed(seed), (2, VOCAB), sparsity)  # [V] each
    return q, p


def test_the_worked_example():
    verifier = _threshold(0.5, 0.5)
    q, p = _law(WORKED_Q), _law(WORKED_P).view(1, 3)  # [3], [1, 3]
    conditionals = [verifier.conditional(q, p, torch.tensor([x])) for x in range(3)]  # [3] each
    torch.testing.assert_close(conditionals[0], _law([1.0, 0.0, 0.0]))
    torch.testing.assert_close(conditionals[1], _law([12 / 35, 3 / 5, 2 / 35]))
    torch.testing.assert_close(conditionals[2], _law([8 / 15, 4 / 15, 1 / 5]))
    output = _law([93 / 175, 19 / 50, 31 / 350])
    torch.testing.assert_close(verifier.output_law(q, p), output)
    torch.testing.assert_close(enumerate_output_law(verifier, q, p), output)
    torch.testing.assert_close(verifier.acceptance_probability(q, p), torch.tensor(0.56, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(6))
def test_at_the_defaults_the_output_is_q_for_any_draft_law(seed):
    """π(y) = p(y) q(y) + q(y) (1 − p(y)) = q(y), whatever p: enumerated over the draft token, and as output_law
    gives it, for random laws (some sparse) far from each other and for the kit's adversarial pairs."""
    verifier = _threshold()
    pairs = [_laws(seed, sparsity=0.3 * (seed % 2)), *adversarial_distribution_pairs(VOCAB)]
    for q, p in pairs:
        draft = p.view(1, VOCAB)  # [1, V]
        torch.testing.assert_close(enumerate_output_law(verifier, q, draft), q, atol=1e-12, rtol=0)
        torch.testing.assert_close(verifier.output_law(q, draft), q, atol=1e-12, rtol=0)
        torch.testing.assert_close(verifier.acceptance_probability(q, draft), (p * q).sum())
    q, p = pairs[0]
    assert (q - p).abs().max() > 0.1  # p ≠ q: losslessness does not come from the draft being right


@pytest.mark.parametrize(("single", "acc"), [(0.5, 1.0), (1.0, 0.5), (0.5, 0.5)])
def test_lowering_either_threshold_makes_it_lossy(single, acc):
    """The negative control of the test above: the same enumeration finds π ≠ q (worked example: s = 0.5 alone gives
    a = [1, 0.3, 0.1] and π(0) = 0.2 + 0.6·(0.5 + 0.3) = 0.68; a = 0.5 alone gives the worked example's π)."""
    q, p = _law(WORKED_Q), _law(WORKED_P).view(1, 3)  # [3], [1, 3]
    output = enumerate_output_law(_threshold(single, acc), q, p)  # [3]
    assert (output - q).abs().max() > 0.05
    if acc == 1.0:
        assert float(output[0]) == pytest.approx(0.68)


def test_at_the_defaults_a_whole_block_is_lossless():
    """The committed tokens of one block, enumerated over every draft block (V = 3, L = 2) and completed by the
    target, follow the target's own law: the bonus token included."""
    generator = torch.Generator().manual_seed(5)
    target, draft = (random_sequence_laws(generator, 3, depth) for depth in (3, 2))
    exact = target_sequence_law(target.__getitem__, 3, 3)
    for verifier, lossless in ((_threshold(), True), (_threshold(0.4, 0.6), False)):
        law = enumerate_block_law(verifier, target.__getitem__, [draft.__getitem__], 3, 2)
        gap = max(abs(law.get(sequence, 0.0) - mass) for sequence, mass in exact.items())
        assert (gap < 1e-12) == lossless, gap


@pytest.mark.parametrize(("single", "acc"), SETTINGS)
def test_output_law_and_acceptance_are_exact(single, acc):
    """output_law against the kit's enumeration of conditional, acceptance_probability against its candidate
    acceptance, on random laws (some sparse) and the adversarial pairs; both are laws."""
    verifier = _threshold(single, acc)
    pairs = [_laws(seed, sparsity=0.3 * (seed % 2)) for seed in range(4)] + adversarial_distribution_pairs(VOCAB)
    for q, p in pairs:
        draft = p.view(1, VOCAB)  # [1, V]
        output = verifier.output_law(q, draft)  # [V]
        torch.testing.assert_close(output, enumerate_output_law(verifier, q, draft), atol=1e-12, rtol=0)
        assert float(output.min()) >= 0 and float(output.sum()) == pytest.approx(1.0)
        assert float(verifier.acceptance_probability(q, draft)) == pytest.approx(
            candidate_acceptance(verifier, q, draft)
        )
        if single == 0.0:  # q(x) ≥ 0 for every x: every draft token is accepted, and the output is p
            torch.testing.assert_close(output, p)


def test_select_samples_the_conditional_law_with_keyed_draws():
    """select over 4000 positions holding the worked example's x = 1 follows conditional(x = 1) = [12/35, 3/5, 2/35]
    (a chi-square), says accepted exactly where it output x, and gives the same tokens for the same key."""
    verifier = _threshold(0.5, 0.5)
    positions = 4000
    q, p = _law(WORKED_Q).expand(positions, 3), _law(WORKED_P).expand(positions, 1, 3)  # [N, 3], [N, 1, 3]
    x = torch.ones(positions, 1, dtype=torch.long)  # [N, 1]
    tokens, accepted = verifier.select(q, p, x, Draws.create(key=9, block_start=0))  # [N] each
    assert torch.equal(accepted, tokens == 1)
    assert torch.equal(tokens, verifier.select(q, p, x, Draws.create(key=9, block_start=0))[0])
    counts = Counter(tokens.tolist())
    assert chi_square_p_value(counts, dict(enumerate(verifier.conditional(q[0], p[0], x[0]).tolist()))) > 1e-4
    assert chi_square_p_value(counts, dict(enumerate(WORKED_Q))) < 1e-4  # the test tells q apart from it


@pytest.mark.parametrize(("single", "acc"), [(0.5, 0.5), (0.95, 0.5), (0.0, 0.3)])
def test_a_token_the_target_is_sure_of_is_always_accepted(single, acc):
    """q(x) = 1 ≥ s gives a(x) = 1: the residual (q without x, empty) is never drawn; the law stays valid."""
    verifier = _threshold(single, acc)
    q, p = _law([0.0, 1.0, 0.0]), _law([0.5, 0.25, 0.25]).view(1, 3)  # [3], [1, 3]
    torch.testing.assert_close(verifier.conditional(q, p, torch.tensor([1])), q)
    residual = verifier.residual_weights(q, p[0], torch.tensor([1]))  # [3]
    assert torch.isfinite(residual).all() and float(residual.sum()) > 0


def test_lower_thresholds_accept_more_along_a_block():
    target, draft, tokens = random_block("flat_draft", 1, 4, 12, seed=2, identical_drafts=True)
    verifiers = [_threshold(single, acc) for single, acc in ((1.0, 1.0), (1.0, 0.3), (1.0, 0.01), (0.0, 1.0))]
    accepted = [
        sum(int(verifier.verify_block(target, draft, tokens, Draws.create(key, 0)).num_accepted) for key in range(100))
        for verifier in verifiers
    ]
    assert accepted[0] < accepted[1] < accepted[2] < accepted[3] == 100 * 4  # s = 0 takes every draft token
