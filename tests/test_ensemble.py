"""The static ensemble (``ensemble``): speculative sampling against v = w·q + (1 − w)·p, w being transformers'
``assistant_ensemble_weight`` (the target's share). Its output law is v exactly (bias (1 − w)·TV), it accepts
1 − w·TV, the TV optimum at that bias, and at w = 1 (or None, the default) it decides as speculative sampling
does. Its decisions against transformers' own ``_speculative_sampling``: tests/test_rule_sources.py."""

from __future__ import annotations

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.plugins.registry import VerifierRegistry

VOCAB = 6


def _laws(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, p = torch.rand(2, VOCAB, generator=generator, dtype=torch.float64) ** 3  # [2, V]: far from uniform
    return q / q.sum(), p / p.sum()


def _ensemble(weight: float | None):
    return VerifierRegistry().create("ensemble", {"weight": weight})


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("weight", [0.0, 0.3, 0.8, 1.0])
def test_the_output_law_is_the_blend_and_acceptance_the_tv_optimum(seed, weight):
    """By enumeration over the draft token: Σ_x p(x) · law(· | x) = v, TV(q, v) = (1 − w)·TV(q, p), and the
    acceptance 1 − w·TV(q, p) is the optimum 1 − TV + D at D = (1 − w)·TV."""
    q, p = _laws(seed)
    verifier = _ensemble(weight)
    output = sum(p[x] * verifier.conditional(q, p.view(1, VOCAB), torch.tensor([x])) for x in range(VOCAB))  # [V]
    blend = weight * q + (1 - weight) * p  # [V]
    torch.testing.assert_close(output, blend)
    tv = 0.5 * (q - p).abs().sum()
    bias = 0.5 * (q - output).abs().sum()
    torch.testing.assert_close(bias, (1 - weight) * tv)
    acceptance = verifier.acceptance_probability(q, p.view(1, VOCAB))
    torch.testing.assert_close(acceptance, 1 - tv + bias)
    if 0 < weight < 1:  # the negative control: the target's own law is not what comes out
        assert (output - q).abs().max() > 1e-3


@pytest.mark.parametrize("weight", [None, 1.0])
@pytest.mark.parametrize("key", range(20))
def test_at_weight_one_it_decides_as_speculative_sampling(weight, key):
    target_probs, draft_probs, tokens = _overdrafted_block()
    draws = Draws.create(key=key, block_start=3 * key)
    ensemble = _ensemble(weight).verify_block(target_probs, draft_probs, tokens, draws)
    speculative = VerifierRegistry().create("speculative", {}).verify_block(target_probs, draft_probs, tokens, draws)
    assert ensemble.tokens.tolist() == speculative.tokens.tolist()
    assert int(ensemble.num_accepted) == int(speculative.num_accepted)


def _overdrafted_block() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of 3 whose draft tokens the draft overrates (p(x) > q(x)): speculative sampling rejects them often."""
    laws = [_laws(100 + t) for t in range(4)]
    target_probs = torch.stack([q for q, _ in laws]).float().unsqueeze(0)  # [1, 4, V]
    draft_probs = torch.stack([p for _, p in laws[:3]]).float().unsqueeze(0)  # [1, 3, V]
    tokens = (draft_probs - target_probs[:, :3]).argmax(-1)  # [1, 3]
    return target_probs, draft_probs, tokens


def test_a_smaller_weight_accepts_more_along_a_block():
    target_probs, draft_probs, tokens = _overdrafted_block()
    accepted = [
        sum(
            int(_ensemble(weight).verify_block(target_probs, draft_probs, tokens, Draws.create(key, 0)).num_accepted)
            for key in range(200)
        )
        for weight in (1.0, 0.5, 0.0)
    ]
    assert accepted[0] < accepted[1] < accepted[2] == 200 * 3  # w = 0 takes every draft token


def test_transformers_none_is_taken_and_is_lossless(run, recipe_path):
    """What a transformers user passes for lossless decoding (``assistant_ensemble_weight=None``) is taken."""
    assert _ensemble(None).weight == 1.0
    code, _, err = run(
        ["generate", "-r", str(recipe_path), "--verifier", "ensemble", "--set", "verifier.params.weight=null", "a"]
    )
    assert code == 0, err
