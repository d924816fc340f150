"""Fuzzy Speculative Decoding (``fuzzy``), FSD's rule: the draft token accepted where Div ≤ T, rejected elsewhere
with a token drawn from the target's law; FSD's divergences (kl = KL(draft ‖ target), its js formula, tv,
kl_reversed) on the laws it compares (the unprocessed ones, handed as ``judged``, by default). specdec's variant
``fallback: speculative`` runs speculative sampling where Div > T. Both output π = p where Div ≤ T and q elsewhere.

The worked example q = [0.5, 0.5], p = [0.6, 0.4] by hand; the output law and the acceptance by enumeration; the
judged laws deciding in place of the handed ones; FSD's smoothing of compared sampling laws; the kit, vmap
batching, the device path and one graph. Its decisions against FSD's own code: tests/test_rule_sources.py."""

from __future__ import annotations

import math

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.kit.testing import (
    adversarial_distribution_pairs,
    block_acceptance,
    enumerate_output_law,
    random_distributions,
)
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins.fuzzy import FSD_DIVERGENCES, FuzzySpeculative
from tests.conftest import BLOCK_KINDS, random_block

VOCAB = 6
THRESHOLDS = {"js": (0.01, 0.05, 0.2), "kl": (0.02, 0.1, 0.5), "kl_reversed": (0.02, 0.1, 0.5), "tv": (0.05, 0.15, 0.4)}
"""Per divergence, thresholds that the random laws of :func:`_random_laws` fall on both sides of."""


def _fuzzy(threshold: float = 0.0, divergence: str = "js", **params):
    return VerifierRegistry().create("fuzzy", {"threshold": threshold, "divergence": divergence, **params})


def _speculative():
    return VerifierRegistry().create("speculative", {})


# ------------------------------------------------------------------ the worked example, by hand

Q, P = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.6, 0.4], dtype=torch.float64)
M = [0.55, 0.45]
BY_HAND = {
    "tv": 0.5 * (abs(0.5 - 0.6) + abs(0.5 - 0.4)),  # 0.1
    "kl": 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5),  # KL(p ‖ q) = 0.020136
    "kl_reversed": 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4),  # KL(q ‖ p) = 0.020411
    "js": 0.5 * sum(m * math.log(m / q) for m, q in zip(M, (0.5, 0.5)))
    + 0.5 * sum(m * math.log(m / p) for m, p in zip(M, (0.6, 0.4))),  # ½ KL(m ‖ q) + ½ KL(m ‖ p) = 0.0050772
}


def test_the_worked_example_divergences_by_hand():
    assert BY_HAND["tv"] == pytest.approx(0.1, abs=1e-15)
    assert BY_HAND["kl"] == pytest.approx(0.0201355, abs=1e-7)
    assert BY_HAND["kl_reversed"] == pytest.approx(0.0204110, abs=1e-7)
    assert BY_HAND["js"] == pytest.approx(0.0050772, abs=1e-7)
    true_js = 0.5 * (0.5 * math.log(0.5 / 0.55) + 0.5 * math.log(0.5 / 0.45)) + 0.5 * (
        0.6 * math.log(0.6 / 0.55) + 0.4 * math.log(0.4 / 0.45)
    )
    assert abs(BY_HAND["js"] - true_js) > 1e-6  # FSD's js is not the Jensen-Shannon divergence
    for name, value in BY_HAND.items():
        assert float(FSD_DIVERGENCES[name](Q, P)) == pytest.approx(value, rel=1e-12)
        assert float(_fuzzy(divergence=name).divergences(Q, P)) == pytest.approx(value, rel=1e-12)


def _law_given(verifier, x: int) -> torch.Tensor:
    return verifier.conditional(Q, P.view(1, 2), torch.tensor([x]))  # [V]


@pytest.mark.parametrize("fallback", ["target", "speculative"])
@pytest.mark.parametrize("divergence", sorted(BY_HAND))
def test_just_above_the_divergence_the_draft_token_is_accepted(divergence, fallback):
    verifier = _fuzzy(BY_HAND[divergence] * 1.001, divergence, fallback=fallback)
    torch.testing.assert_close(_law_given(verifier, 0), torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(_law_given(verifier, 1), torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert float(verifier.acceptance_probability(Q, P.view(1, 2))) == 1.0
    torch.testing.assert_close(verifier.output_law(Q, P.view(1, 2)), P)


@pytest.mark.parametrize("divergence", sorted(BY_HAND))
def test_just_below_it_fsd_rejects_and_draws_from_the_target(divergence):
    verifier = _fuzzy(BY_HAND[divergence] * 0.999, divergence)
    for x in (0, 1):
        torch.testing.assert_close(_law_given(verifier, x), Q)  # whatever the draft token, a draw from q
    assert float(verifier.acceptance_probability(Q, P.view(1, 2))) == 0.0
    torch.testing.assert_close(verifier.output_law(Q, P.view(1, 2)), Q)


@pytest.mark.parametrize("divergence", sorted(BY_HAND))
def test_just_below_it_the_speculative_variant_accepts_with_min_1_q_over_p(divergence):
    verifier = _fuzzy(BY_HAND[divergence] * 0.999, divergence, fallback="speculative")
    torch.testing.assert_close(_law_given(verifier, 0), torch.tensor([5 / 6, 1 / 6], dtype=torch.float64))
    torch.testing.assert_close(_law_given(verifier, 1), torch.tensor([0.0, 1.0], dtype=torch.float64))  # q/p > 1
    assert float(verifier.acceptance_probability(Q, P.view(1, 2))) == pytest.approx(0.9)  # Σ min(p, q)
    torch.testing.assert_close(verifier.output_law(Q, P.view(1, 2)), Q)


def test_a_divergence_equal_to_the_threshold_is_accepted():
    """Div ≤ T, not < (FSD's ``divs <= div_threshold``): q = [0.5, 0.5], p = [0.75, 0.25] are exactly TV 0.25
    apart (binary fractions)."""
    p = torch.tensor([[0.75, 0.25]], dtype=torch.float64)
    assert float(FSD_DIVERGENCES["tv"](Q, p[0])) == 0.25
    torch.testing.assert_close(
        _fuzzy(0.25, "tv").conditional(Q, p, torch.tensor([0])), torch.tensor([1.0, 0.0], dtype=torch.float64)
    )
    assert float(_fuzzy(0.2499, "tv").acceptance_probability(Q, p)) == 0.0


def _example_block() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of one draft token 0 at the worked example's laws (the bonus law is q again)."""
    return Q.float().expand(1, 2, 2), P.float().view(1, 1, 2), torch.tensor([[0]])


@pytest.mark.parametrize("divergence", sorted(BY_HAND))
def test_the_worked_example_along_a_block(divergence):
    """Above: every one of 180 keyed blocks keeps token 0. Below: FSD rejects every time and draws its token from
    q (both tokens come), and the speculative variant decides as speculative sampling, key by key."""
    block = _example_block()
    above = _fuzzy(BY_HAND[divergence] * 1.001, divergence)
    below = _fuzzy(BY_HAND[divergence] * 0.999, divergence)
    variant = _fuzzy(BY_HAND[divergence] * 0.999, divergence, fallback="speculative")
    drawn = set()
    for key in range(180):
        draws = Draws.create(key, 0)
        assert int(above.verify_block(*block, draws).num_accepted) == 1
        rejected = below.verify_block(*block, draws)
        assert int(rejected.num_accepted) == 0
        drawn.add(int(rejected.tokens[0]))
        decision, speculative = variant.verify_block(*block, draws), _speculative().verify_block(*block, draws)
        assert decision.tokens.tolist() == speculative.tokens.tolist()
        assert int(decision.num_accepted) == int(speculative.num_accepted)
    assert drawn == {0, 1}


# ------------------------------------------------------------------ the output law and acceptance, by enumeration


def _random_laws(seed: int, count: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` pairs (q, p) ``[count, V]`` float64, from far apart to nearly equal: p mixes a random law into q
    in a random share, some laws peaked, some with tokens ruled out (so a KL is +inf at some)."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(count, 1, generator=generator, dtype=torch.float64) * 4  # [N, 1]
    q = (torch.randn(count, VOCAB, generator=generator, dtype=torch.float64) * scale).softmax(-1)  # [N, V]
    other = (torch.randn(count, VOCAB, generator=generator, dtype=torch.float64) * scale).softmax(-1)  # [N, V]
    share = torch.rand(count, 1, generator=generator, dtype=torch.float64) ** 2  # [N, 1]: many close pairs
    p = (1 - share) * q + share * other  # [N, V]
    cut = torch.rand(count, VOCAB, generator=generator) < 0.15  # [N, V]
    cut[:, 0] = False  # every law keeps a token
    p = p.masked_fill(cut & (torch.arange(count) % 4 == 0).unsqueeze(-1), 0.0)  # a quarter of the p rule tokens out
    q = q.masked_fill(cut & (torch.arange(count) % 4 == 1).unsqueeze(-1), 0.0)  # a quarter of the q do
    return q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)


def _enumerated_output_law(verifier, q: torch.Tensor, p: torch.Tensor, **judged) -> torch.Tensor:
    """π = Σ_x p(x) · law(· | draft token x), from ``conditional`` ([N, V] laws → [N, V])."""
    count = q.shape[0]
    return sum(
        p[:, x : x + 1] * verifier.conditional(q, p.unsqueeze(1), torch.full((count, 1), x), **judged)
        for x in range(VOCAB)
    )  # [N, V]


@pytest.mark.parametrize("fallback", ["target", "speculative"])
@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
def test_the_output_law_is_p_where_close_and_q_elsewhere(divergence, fallback):
    """For each T: the enumerated law is where(Div ≤ T, p, q) for either fallback, as output_law says;
    acceptance_probability is [Div ≤ T] (FSD) or 1 there and Σ min(p, q) elsewhere (the variant); the laws fall
    on both sides of T (not vacuous)."""
    q, p = _random_laws(0)
    overlap = torch.minimum(q, p).sum(-1)  # [N]
    for threshold in THRESHOLDS[divergence]:
        verifier = _fuzzy(threshold, divergence, fallback=fallback, laws="sampling")
        close = verifier.divergences(q, p) <= threshold  # [N]: FSD smooths the sampling laws it compares
        assert 20 <= int(close.sum()) <= q.shape[0] - 20, (threshold, int(close.sum()))
        law = _enumerated_output_law(verifier, q, p)  # [N, V]
        torch.testing.assert_close(law, torch.where(close.unsqueeze(-1), p, q), rtol=0, atol=1e-12)
        torch.testing.assert_close(verifier.output_law(q, p.unsqueeze(1)), law, rtol=0, atol=1e-12)
        accepted = torch.where(close, 1.0, overlap if fallback == "speculative" else 0.0).double()  # [N]
        torch.testing.assert_close(verifier.acceptance_probability(q, p.unsqueeze(1)), accepted, rtol=0, atol=1e-12)
        assert verifier.promised_bound() is None  # Div is FSD's, on the laws it compares: no bound on π as handed


@pytest.mark.parametrize("fallback", ["target", "speculative"])
def test_the_kits_enumeration_agrees_on_random_and_adversarial_pairs(fallback):
    """The kit's own enumeration (random sparse laws at V = 3 and 6, and its adversarial pairs): output_law is the
    enumerated law and acceptance_probability the acceptance enumerated from the block law (FSD's rejected token
    may come again from q: the output equals the draft token more often than the draft token is accepted)."""
    generator = torch.Generator().manual_seed(34)
    pairs = [tuple(random_distributions(generator, (2, vocab))) for vocab in (3, 6) for _ in range(10)]
    for divergence, thresholds in THRESHOLDS.items():
        verifier = _fuzzy(thresholds[1], divergence, fallback=fallback)
        for target, draft in pairs + adversarial_distribution_pairs(4):
            drafts = draft.unsqueeze(0)  # [1, V]
            law = enumerate_output_law(verifier, target, drafts)  # [V]
            torch.testing.assert_close(verifier.output_law(target, drafts), law, rtol=0, atol=1e-12)
            claimed = float(verifier.acceptance_probability(target, drafts))
            assert claimed == pytest.approx(block_acceptance(verifier, target, drafts), abs=1e-12)


def test_a_larger_threshold_never_accepts_less():
    q, p = _random_laws(5)
    for divergence, thresholds in THRESHOLDS.items():
        accepted = [_fuzzy(t, divergence).acceptance_probability(q, p.unsqueeze(1)) for t in (0.0, *thresholds)]
        for lower, higher in zip(accepted, accepted[1:]):
            assert bool((higher >= lower).all())
        assert float(accepted[-1].mean()) > float(accepted[0].mean()) + 0.05


def test_fsds_smoothing_makes_a_ruled_out_token_finite_in_compared_sampling_laws():
    """q = [0.5, 0.5], p = [1, 0]: KL(q ‖ p) (kl_reversed) is +inf on the unprocessed laws, and finite (about
    0.5 ln(0.5 / 1e-10) = 10.9) on sampling laws smoothed by 1e-10 as FSD smooths them; KL(p ‖ q) (FSD's kl) is
    ln 2 either way."""
    q, p = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert math.isinf(float(_fuzzy(divergence="kl_reversed").divergences(q, p)))
    smoothed = float(_fuzzy(divergence="kl_reversed", laws="sampling").divergences(q, p))
    assert smoothed == pytest.approx(0.5 * math.log(0.5 / 1e-10) + 0.5 * math.log(0.5), rel=1e-6)
    for laws in ("unprocessed", "sampling"):
        assert float(_fuzzy(divergence="kl", laws=laws).divergences(q, p)) == pytest.approx(math.log(2), rel=1e-8)


# ------------------------------------------------------------------ the laws it compares


def test_the_judged_laws_decide_in_place_of_the_handed_ones():
    """Handed laws far apart (Div > T) but judged laws equal (Div = 0): the draft token is accepted, in every
    method and along a block; and the other way round. Without judged laws (a test, the kit) the handed ones are
    judged."""
    far_q, far_p = Q, torch.tensor([0.9, 0.1], dtype=torch.float64)
    verifier = _fuzzy(0.001, "js")
    assert verifier.judged_laws == "unprocessed" and _fuzzy(laws="sampling").judged_laws is None
    same = (Q, P.view(1, 2))
    far = (far_q, far_p.view(1, 2))
    assert float(verifier.acceptance_probability(*far)) == 0.0
    assert float(verifier.acceptance_probability(*far, judged=(Q, Q.view(1, 2)))) == 1.0
    torch.testing.assert_close(verifier.output_law(*far, judged=(Q, Q.view(1, 2))), far_p)
    assert float(verifier.acceptance_probability(*same, judged=(far_q, far_p.view(1, 2)))) == 0.0
    block = far_q.float().expand(1, 2, 2), far_p.float().view(1, 1, 2), torch.tensor([[0]])
    judged = (Q.float().expand(1, 2, 2), Q.float().view(1, 1, 2))
    for key in range(20):
        assert int(verifier.verify_block(*block, Draws.create(key, 0)).num_accepted) == 0
        assert int(verifier.verify_block(*block, Draws.create(key, 0), judged=judged).num_accepted) == 1


# ------------------------------------------------------------------ T = 0


@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
@pytest.mark.parametrize("key", range(10))
def test_at_threshold_zero_the_speculative_variant_decides_as_speculative_sampling(divergence, key):
    kind = BLOCK_KINDS[key % len(BLOCK_KINDS)]  # "equal" and "one_token_equal" blocks too: q = p, Div = 0
    target_probs, draft_probs, tokens = random_block(kind, 1, 4, 16, seed=key, identical_drafts=False)
    draws = Draws.create(key=key, block_start=3 * key)
    variant = _fuzzy(0.0, divergence, fallback="speculative")
    fuzzy = variant.verify_block(target_probs, draft_probs, tokens, draws)
    speculative = _speculative().verify_block(target_probs, draft_probs, tokens, draws)
    assert fuzzy.tokens.tolist() == speculative.tokens.tolist()
    assert int(fuzzy.num_accepted) == int(speculative.num_accepted)


@pytest.mark.parametrize("fallback", ["target", "speculative"])
def test_at_threshold_zero_the_output_law_is_the_target_law(fallback):
    q, p = _random_laws(7)
    same = torch.cat([q, q])  # and laws equal to q: Div = 0 ≤ 0, accepted, and p = q
    for divergence in THRESHOLDS:
        verifier = _fuzzy(0.0, divergence, fallback=fallback)
        for target, draft in ((q, p), (same, same)):
            law = _enumerated_output_law(verifier, target, draft)
            torch.testing.assert_close(law, target, rtol=0, atol=1e-12)
            torch.testing.assert_close(verifier.output_law(target, draft.unsqueeze(1)), target, rtol=0, atol=0)


# ------------------------------------------------------------------ the contract: kit, batches, device path, reads


def test_it_is_registered_at_its_second_revision():
    """Its flags are in tests/test_contracts.py, with every verifier's."""
    cls = VerifierRegistry().load_class("fuzzy")
    assert cls is FuzzySpeculative and cls.revision() == 2
