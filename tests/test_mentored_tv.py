"""Mentored decoding with ``divergence: tv`` (specdec_plugins/mentored.py), and mentored's exact output law.

Under total variation the bound D gives each position w = min(1, D / TV(q, p)) and speculative sampling against
v = w·p + (1 − w)·q: it outputs v, TV(q, v) = min(D, TV), and accepts 1 − TV + min(D, TV) (the TV optimum), as the
static ensemble does with the draft's share D / TV (transformers' weight 1 − D / TV). Checked here by enumeration,
against ``ensemble`` decision by decision, against the KL rule (KL-optimal, so at the KL the TV rule spends it
accepts at least as much), with the author's kit, in a batch, and on the device path (one read per block).
``output_law`` with "kl" is checked against enumeration and the KL bound.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.engine.device_path import OperationCount
from specdec_cli.kit.conformance import ConformanceError, check_verifier
from specdec_cli.kit.testing import candidate_acceptance, enumerate_output_law, random_distributions
from specdec_cli.plugins.divergences import kl_divergence, total_variation
from specdec_cli.plugins.parameters import PluginParameterError
from specdec_cli.plugins.registry import VerifierRegistry, load_verifier
from specdec_cli.plugins.verifiers import device_path
from specdec_plugins.mentored import MentoredDecoding
from tests.conftest import random_block
from tests.test_verify_batch import batch_draws, decided_alone, random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 6
SEEDS = range(6)
FRACTIONS_BELOW = (0.1, 0.5, 0.9)  # D as a fraction of TV(q, p), D < TV
FRACTIONS_ABOVE = (1.0, 1.7)  # D ≥ TV: every draft token accepted


def _laws(seed: int, sparsity: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, p) ``[V]`` each, float64 with some exact zeros (random_distributions)."""
    q, p = random_distributions(torch.Generator().manual_seed(seed), (2, VOCAB), sparsity)
    return q, p


def _tv(q: torch.Tensor, p: torch.Tensor) -> float:
    return float(total_variation(q, p))


def _mentored(bound: float, divergence: str = "tv") -> MentoredDecoding:
    return load_verifier("mentored", {"kl": bound, "divergence": divergence})


def _ensemble(draft_share: float):
    """The static ensemble whose blend gives the draft ``draft_share`` (transformers' weight, the target's share, is
    1 − draft_share)."""
    return VerifierRegistry().create("ensemble", {"weight": 1 - draft_share})


# ------------------------------------------------------------------ the TV optimum, by enumeration


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fraction", FRACTIONS_BELOW + FRACTIONS_ABOVE)
def test_tv_accepts_one_minus_tv_plus_d_and_spends_min_d_tv(seed, fraction):
    """At K = 1 by enumeration over the draft token: acceptance 1 − TV + min(D, TV), TV(q, π) = min(D, TV), π = v;
    where D ≥ TV every draft token is accepted and π = p."""
    q, p = _laws(seed)
    tv = _tv(q, p)
    bound = fraction * tv
    verifier = _mentored(bound)
    drafts = p.view(1, VOCAB)
    law = enumerate_output_law(verifier, q, drafts)  # [V]
    accepted = candidate_acceptance(verifier, q, drafts)
    assert accepted == pytest.approx(1 - tv + min(bound, tv), abs=1e-12)
    assert float(verifier.acceptance_probability(q, drafts)) == pytest.approx(accepted, abs=1e-12)
    assert _tv(q, law) == pytest.approx(min(bound, tv), abs=1e-12)
    torch.testing.assert_close(verifier.output_law(q, drafts), law, rtol=0, atol=1e-12)
    if fraction >= 1:
        assert accepted == pytest.approx(1, abs=1e-12)
        torch.testing.assert_close(law, p, rtol=0, atol=1e-12)
    else:  # the negative control: neither the target's law nor the draft's comes out
        assert (law - q).abs().max() > 1e-3 and (law - p).abs().max() > 1e-3


def test_tv_at_zero_is_speculative_sampling_and_equal_laws_accept_everything():
    q, p = _laws(0)
    drafts = p.view(1, VOCAB)
    speculative = load_verifier("speculative")
    for x in range(VOCAB):
        token = torch.tensor([x])
        torch.testing.assert_close(
            _mentored(0.0).conditional(q, drafts, token), speculative.conditional(q, drafts, token), rtol=0, atol=1e-15
        )
    # TV = 0: w = 0, v = q = p, every draft token accepted at any D.
    assert candidate_acceptance(_mentored(0.2), q, q.view(1, VOCAB)) == pytest.approx(1, abs=1e-15)
    torch.testing.assert_close(_mentored(0.2).output_law(q, q.view(1, VOCAB)), q, rtol=0, atol=1e-15)


def test_the_enumeration_has_power():
    """Negative control: the ensemble at twice the draft share D / TV accepts more than 1 − TV + D and spends over D."""
    q, p = _laws(1)
    tv, bound = _tv(q, p), 0.2 * _tv(q, p)
    overspent = _ensemble(2 * bound / tv)
    assert candidate_acceptance(overspent, q, p.view(1, VOCAB)) > 1 - tv + bound + 1e-3
    assert _tv(q, enumerate_output_law(overspent, q, p.view(1, VOCAB))) > bound + 1e-3


# ------------------------------------------------------------------ the static ensemble at draft share D / TV


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fraction", FRACTIONS_BELOW)
def test_tv_has_the_ensembles_conditional_laws_at_weight_d_over_tv(seed, fraction):
    q, p = _laws(seed)
    bound = fraction * _tv(q, p)
    mentored, ensemble = _mentored(bound), _ensemble(bound / _tv(q, p))
    drafts = p.view(1, VOCAB)
    for x in range(VOCAB):
        token = torch.tensor([x])
        torch.testing.assert_close(
            mentored.conditional(q, drafts, token), ensemble.conditional(q, drafts, token), rtol=0, atol=1e-12
        )
    torch.testing.assert_close(mentored.acceptance_probability(q, drafts), ensemble.acceptance_probability(q, drafts))
    torch.testing.assert_close(mentored.output_law(q, drafts), ensemble.output_law(q, drafts), rtol=0, atol=1e-12)


def _same_pair_block(dtype: torch.dtype, draft_length: int = 4):
    """A block whose every position has the same (q, p) (so the same TV), the draft tokens the draft overrates
    (p(x) > q(x): often rejected): ``[1, L+1, V]``, ``[1, L, V]``, ``[1, L]``."""
    q, p = _laws(7, sparsity=0.0)
    target_probs = q.expand(1, draft_length + 1, VOCAB).to(dtype)
    draft_probs = p.expand(1, draft_length, VOCAB).to(dtype)
    overrated = (p - q).argsort(descending=True)[:2]  # the two tokens the draft overrates most
    tokens = overrated[torch.arange(draft_length) % 2].view(1, draft_length)
    return target_probs, draft_probs, tokens, _tv(q, p)


def _decisions(verifier, block, keys=range(20), forced=False) -> list[tuple[int, ...]]:
    target_probs, draft_probs, tokens = block
    decided = []
    for key in keys:
        draws = Draws.create(key=key, block_start=5 * key)
        with device_path() if forced else nullcontext():
            decision = verifier.verify_block(target_probs, draft_probs, tokens, draws)
        decided.append(tuple(decision.tokens[: int(decision.num_accepted) + 1].tolist()))
    return decided


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("forced", [False, True], ids=["cpu", "device-path"])
def test_tv_decides_as_the_ensemble_on_a_block_of_one_tv(dtype, forced):
    *block, tv = _same_pair_block(dtype)
    bound = 0.4 * tv
    mentored = _decisions(_mentored(bound), block, forced=forced)
    assert mentored == _decisions(_ensemble(bound / tv), block, forced=forced)
    # Negative control: the ensemble at another weight, and mentored at another bound, decide otherwise.
    assert mentored != _decisions(_ensemble(0.0), block, forced=forced)
    assert mentored != _decisions(_mentored(0.9 * tv), block, forced=forced)
    assert len({len(tokens) for tokens in mentored}) > 1  # rejections at several positions


# ------------------------------------------------------------------ output_law


def _sparse_target_laws(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q with exact zeros (draft mass on tokens the target rules out) and p of full support: KL(q ‖ p) finite."""
    generator = torch.Generator().manual_seed(100 + seed)
    q = random_distributions(generator, (VOCAB,), sparsity=0.4)
    p = random_distributions(generator, (VOCAB,), sparsity=0.0)
    return q, p


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fraction", (0.02, 0.3, 0.8, 0.99, 1.0, 2.0))
@pytest.mark.parametrize("laws", [_laws, _sparse_target_laws], ids=["random", "zero-q"])
def test_the_kl_output_law_is_the_enumerated_law_within_d(seed, fraction, laws):
    """π = q/α, p, q/β (the q = 0 < p tokens, α = 0 and within-bound cases included) equals the enumerated law,
    and KL(q ‖ π) = D where D < KL(q ‖ p), π = p where D ≥ KL(q ‖ p); output_kl agrees with it."""
    q, p = laws(seed)
    full = float(kl_divergence(q, p))
    bound = fraction * full if full < float("inf") else fraction
    verifier = _mentored(bound, "kl")
    drafts = p.view(1, VOCAB)
    law = verifier.output_law(q, drafts)  # [V]
    torch.testing.assert_close(law, enumerate_output_law(verifier, q, drafts), rtol=0, atol=1e-12)
    assert float(law.sum()) == pytest.approx(1, abs=1e-12)
    divergence = float(kl_divergence(q, law))
    if bound < full:
        assert divergence == pytest.approx(bound, abs=1e-9)
    else:
        torch.testing.assert_close(law, p, rtol=0, atol=1e-12)
    if divergence < float("inf"):
        assert float(verifier.output_kl(q, drafts)) == pytest.approx(divergence, abs=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_output_kl_agrees_with_the_output_laws_kl_on_batches_of_random_laws(seed):
    generator = torch.Generator().manual_seed(seed)
    q = random_distributions(generator, (64, 40), sparsity=0.2)
    p = random_distributions(generator, (64, 1, 40), sparsity=0.0)
    for divergence in ("kl", "tv"):
        verifier = _mentored(0.05 * (seed + 1), divergence)
        from_law = kl_divergence(q, verifier.output_law(q, p))  # [64]
        torch.testing.assert_close(verifier.output_kl(q, p), from_law, rtol=0, atol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fraction", FRACTIONS_BELOW + FRACTIONS_ABOVE)
def test_the_tv_output_law_is_the_blend(seed, fraction):
    q, p = _laws(seed)
    tv = _tv(q, p)
    weight = min(1.0, fraction)
    blend = weight * p + (1 - weight) * q
    torch.testing.assert_close(_mentored(fraction * tv).output_law(q, p.view(1, VOCAB)), blend, rtol=0, atol=1e-15)


def test_the_output_law_keeps_the_batch_shape_and_dtype():
    generator = torch.Generator().manual_seed(3)
    q = random_distributions(generator, (2, 3, 16)).float()
    p = random_distributions(generator, (2, 3, 1, 16)).float()
    for divergence in ("kl", "tv"):
        law = _mentored(0.1, divergence).output_law(q, p)
        assert law.shape == (2, 3, 16) and law.dtype == torch.float32
        torch.testing.assert_close(law.sum(-1), torch.ones(2, 3))


def test_the_promised_bound_names_the_divergence():
    assert _mentored(0.2, "tv").promised_bound() == ("tv", 0.2)
    assert _mentored(0.3, "kl").promised_bound() == ("kl", 0.3)
    assert load_verifier("mentored", {"kl": 0.1}).promised_bound() == ("kl", 0.1)


# ------------------------------------------------------------------ the KL rule against the TV rule


@pytest.mark.parametrize("seed", range(12))
def test_the_kl_rule_at_the_tv_rules_spent_kl_accepts_at_least_as_much(seed):
    """Mentored-KL is KL-optimal: given the KL(q ‖ v) the TV rule spends at a TV bound, it accepts at least as much."""
    generator = torch.Generator().manual_seed(seed)
    q, p = random_distributions(generator, (2, 12), sparsity=0.3)
    drafts = p.view(1, 12)
    tv = _tv(q, p)
    gains = []
    for fraction in FRACTIONS_BELOW:
        tv_rule = _mentored(fraction * tv)
        spent = float(tv_rule.output_kl(q, drafts))
        kl_rule = _mentored(spent, "kl")
        assert float(kl_rule.output_kl(q, drafts)) <= spent + 1e-9
        gain = float(kl_rule.acceptance_probability(q, drafts)) - float(tv_rule.acceptance_probability(q, drafts))
        assert gain >= -1e-9
        gains.append(gain)
    assert max(gains) > 1e-4  # the rules differ: the comparison has power


# ------------------------------------------------------------------ the author's kit, batches and the device path


def test_a_batch_decided_with_another_sequences_draws_differs():
    """Negative control for the batch comparison."""
    verifier = _mentored(0.3)
    target, draft, tokens = random_batch(7, 1, 4, False)
    draws = batch_draws(7)
    shifted = Draws.batch([200 + b for b in range(7)])
    with torch.inference_mode(), device_path():
        batch = verifier.verify_batch(target, draft, tokens, shifted)
        alone = decided_alone(verifier, target, draft, tokens, draws)
    assert any(not torch.equal(getattr(batch, f), getattr(alone, f)) for f in ("tokens", "num_accepted"))


def test_the_tv_block_dispatches_a_fixed_number_of_operations_and_reads_nothing():
    verifier = _mentored(0.3)
    counts = set()
    for vocab in (16, 3000):
        for seed, kind in enumerate(("peaked", "near_one_token", "one_token_equal", "equal", "disjoint", "flat_draft")):
            target, draft, tokens = random_block(kind, 1, 6, vocab, seed, True)
            draws = Draws.create(key=seed, block_start=3)
            for forced in (False, True):  # the TV rule has no reading CPU path
                with torch.inference_mode(), OperationCount() as count, device_path() if forced else nullcontext():
                    verifier.verify_block(target, draft, tokens, draws)
                counts.add((count.ops, count.reads))
    assert counts and len(counts) == 1, counts
    assert next(iter(counts))[1] == 0


# ------------------------------------------------------------------ parameters


def test_a_good_divergence_generates(run, recipe_path):
    """Negative control for the refusal: the same command with tv runs."""
    code, out, err = run(
        [
            "generate",
            "-r",
            recipe_path,
            "--verifier",
            "mentored",
            "--kl",
            "0.2",
            "--set",
            "verifier.params.divergence=tv",
            "--max-new-tokens",
            "4",
            "a",
        ]
    )
    assert code == 0, err


def test_the_constructor_refuses_a_bad_divergence():
    with pytest.raises(PluginParameterError, match="divergence must be 'kl' or 'tv', got 'js'"):
        MentoredDecoding(kl=0.1, divergence="js")


class OverspentTV(MentoredDecoding):
    """Negative control for the kit: promises TV D, and spends the TV of twice D."""

    name = "overspent-tv"

    def conditional(self, target_probs, draft_probs, draft_tokens):
        return MentoredDecoding(kl=2 * self.kl, divergence="tv").conditional(target_probs, draft_probs, draft_tokens)


def test_the_kit_fails_a_tv_rule_over_its_bound():
    with pytest.raises(ConformanceError, match=r"TV [0-9.e-]+ from the target's, over the bound 0.1"):
        check_verifier(OverspentTV, {"kl": 0.1, "divergence": "tv"}, samples=300)
