"""The verifier half of the plugin author's kit (issue 21): specdec_cli.testing.check_verifier fails verifiers that
break the contract in each way it checks (negative controls). That it passes every registered verifier, found
through the registry rather than a hand list, is a column of tests/test_contracts.py; the drafter half's negative
controls are in tests/test_drafters.py."""

from __future__ import annotations

import re
from typing import Annotated

import pytest
import torch

from specdec_cli.kit.conformance import ConformanceError, check_verifier
from specdec_cli.plugins.verifiers import BlockDecision, BlockVerifier
from specdec_plugins.ensemble import StaticEnsemble
from specdec_plugins.mentored import MentoredDecoding, solve
from specdec_plugins.speculative import SpeculativeSampling


class AcceptAll(BlockVerifier):
    """Negative control: commits every draft token and calls itself lossless."""

    name, lossless, max_drafts = "accept-all", True, 1

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        raise NotImplementedError

    def block_law(self, target_probs, draft_probs, draft_tokens):
        law = torch.zeros_like(target_probs)  # [1, L+1, V]
        law[0, -1] = target_probs[0, -1]
        return law


class Overspent(MentoredDecoding):
    """Negative control: reports the KL bound it was given, and spends four times it."""

    name = "overspent"

    def solve(self, target_probs, draft_probs):
        return solve(target_probs, draft_probs[..., 0, :], 4 * self.kl, lazy=False)


class Braggart(StaticEnsemble):
    """Negative control (a lossy rule above the frontier): claims to accept every draft token while its output law
    spends only the static ensemble's KL."""

    name = "braggart"

    def acceptance_probability(self, target_probs, draft_probs):
        return torch.ones(target_probs.shape[:-1], dtype=target_probs.dtype)  # [...]


class Overclaiming(StaticEnsemble):
    """Negative control: claims a little more than its rule accepts, still under the frontier."""

    name = "overclaiming"

    def acceptance_probability(self, target_probs, draft_probs):
        return super().acceptance_probability(target_probs, draft_probs) * 0.999 + 1e-4


class Misreported(StaticEnsemble):
    """Negative control: gives the target's law as its output law."""

    name = "misreported"

    def output_law(self, target_probs, draft_probs):
        return target_probs


class BrokenPromise(MentoredDecoding):
    """Negative control: under total variation, promises a tenth of the distance it allows itself."""

    name = "broken-promise"

    def promised_bound(self):
        return self.divergence, self.kl / 10


class RejectsFirst(SpeculativeSampling):
    """Negative control: its block_law is speculative sampling's, its verify_block always rejects at once."""

    name = "rejects-first"

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        token = target_probs[0, 0].argmax().view(1)  # [1]
        zero = torch.zeros((), dtype=torch.long)
        return BlockDecision(torch.cat([token, draft_tokens[0]]), zero, zero)


@pytest.mark.parametrize(
    "cls, params, message",
    [
        (AcceptAll, {}, "declares lossless, but its block's output law differs from the target's"),
        (Overspent, {"kl": 0.05}, "over the bound 0.05 it promises"),
        (Braggart, {"weight": 0.7}, "above the KL-optimal rule's"),
        (Overclaiming, {"weight": 0.7}, "acceptance_probability gives"),
        (Misreported, {"weight": 0.7}, "output_law differs from the law its conditional gives"),
        (BrokenPromise, {"kl": 0.3, "divergence": "tv"}, "over the bound 0.03 it promises"),
        (RejectsFirst, {}, "verify's decisions do not follow its block_law"),
    ],
)
def test_the_kit_fails_a_verifier_that_breaks_the_contract(cls, params, message):
    with pytest.raises(ConformanceError, match=message):
        check_verifier(cls, params, samples=300)


class Undescribed(SpeculativeSampling):
    """Negative control: a parameter without a description."""

    name = "undescribed"

    def __init__(self, *, strength: float = 1.0):
        self.strength = strength


class Careless(SpeculativeSampling):
    """Negative control: a parameter it takes without checking its value."""

    name = "careless"

    def __init__(self, *, strength: Annotated[float, "how strongly"] = 1.0):
        self.strength = {1.0: "one", 2.0: "two"}[strength]  # a KeyError for any other value


class Silent(SpeculativeSampling):
    """Negative control: refuses a bad value without saying which parameter."""

    name = "silent"

    def __init__(self, *, strength: Annotated[float, "how strongly"] = 1.0):
        if strength <= 0:
            raise ValueError("bad value")


@pytest.mark.parametrize(
    "cls, bad_params, message",
    [
        (Undescribed, [], "parameter 'strength' needs a type and a description"),
        (Careless, [{"strength": 3.0}], "made its constructor fail"),
        (SpeculativeSampling, [{}], "accepted the bad parameters {}"),
        (Silent, [{"strength": -1.0}], "refused {'strength': -1.0} without naming the parameter"),
    ],
)
def test_the_kit_fails_a_verifier_whose_parameters_break_the_contract(cls, bad_params, message):
    with pytest.raises(ConformanceError, match=re.escape(message)):
        check_verifier(cls, bad_params=bad_params, samples=300)
