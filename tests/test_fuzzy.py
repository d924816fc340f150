"""Fuzzy Speculative Decoding (``fuzzy``): the draft token accepted outright where Div(q, p) ≤ T, speculative
sampling elsewhere. Each position's output law is π = p where Div ≤ T and q elsewhere, so Div(q, π) ≤ T: the bound
it promises, checked here by enumeration for each divergence (and a variant with the inequality flipped breaks it,
and the check says so). At T = 0 it decides as speculative sampling does; the worked example q = [0.5, 0.5],
p = [0.6, 0.4] by hand; the kit, vmap batching, the device path and one read per block as for every built-in."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from specdec_cli.base.randomness import Draws
from specdec_cli.engine.device_path import OperationCount, count_block
from specdec_cli.kit.conformance import check_verifier
from specdec_cli.kit.testing import (
    adversarial_distribution_pairs,
    candidate_acceptance,
    enumerate_output_law,
    random_distributions,
)
from specdec_cli.plugins.divergences import DIVERGENCES
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.plugins.verifiers import BatchDecision, device_path
from specdec_plugins.fuzzy import FuzzySpeculative
from tests.conftest import BLOCK_KINDS, one_error_line, random_block

VOCAB = 6
THRESHOLDS = {"js": (0.01, 0.05, 0.2), "kl": (0.02, 0.1, 0.5), "tv": (0.05, 0.15, 0.4)}
"""Per divergence, thresholds that the random laws of :func:`_random_laws` fall on both sides of."""


def _fuzzy(threshold: float = 0.0, divergence: str = "js"):
    return VerifierRegistry().create("fuzzy", {"threshold": threshold, "divergence": divergence})


def _speculative():
    return VerifierRegistry().create("speculative", {})


# ------------------------------------------------------------------ the worked example, by hand

Q, P = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([0.6, 0.4], dtype=torch.float64)
TV_BY_HAND = 0.5 * (abs(0.5 - 0.6) + abs(0.5 - 0.4))  # 0.1
KL_BY_HAND = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)  # 0.020411
JS_BY_HAND = 0.5 * (0.5 * math.log(0.5 / 0.55) + 0.5 * math.log(0.5 / 0.45)) + 0.5 * (
    0.6 * math.log(0.6 / 0.55) + 0.4 * math.log(0.4 / 0.45)
)  # 0.0050594: m = [0.55, 0.45]
BY_HAND = {"tv": TV_BY_HAND, "kl": KL_BY_HAND, "js": JS_BY_HAND}


def test_the_worked_example_divergences_by_hand():
    assert TV_BY_HAND == pytest.approx(0.1, abs=1e-15)
    assert KL_BY_HAND == pytest.approx(0.0204110, abs=1e-7)
    assert JS_BY_HAND == pytest.approx(0.0050594, abs=1e-7)
    for name, value in BY_HAND.items():
        assert float(DIVERGENCES[name](Q, P)) == pytest.approx(value, rel=1e-12)


def _law_given(verifier, x: int) -> torch.Tensor:
    return verifier.conditional(Q, P.view(1, 2), torch.tensor([x]))  # [V]


@pytest.mark.parametrize("divergence", sorted(BY_HAND))
def test_just_above_the_divergence_the_draft_token_is_accepted_outright(divergence):
    verifier = _fuzzy(BY_HAND[divergence] * 1.001, divergence)
    torch.testing.assert_close(_law_given(verifier, 0), torch.tensor([1.0, 0.0], dtype=torch.float64))  # not 5/6
    torch.testing.assert_close(_law_given(verifier, 1), torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert float(verifier.acceptance_probability(Q, P.view(1, 2))) == 1.0
    torch.testing.assert_close(verifier.output_law(Q, P.view(1, 2)), P)


@pytest.mark.parametrize("divergence", sorted(BY_HAND))
def test_just_below_the_divergence_the_draft_token_is_accepted_with_min_1_q_over_p(divergence):
    verifier = _fuzzy(BY_HAND[divergence] * 0.999, divergence)
    torch.testing.assert_close(_law_given(verifier, 0), torch.tensor([5 / 6, 1 / 6], dtype=torch.float64))
    torch.testing.assert_close(_law_given(verifier, 1), torch.tensor([0.0, 1.0], dtype=torch.float64))  # q/p > 1
    assert float(verifier.acceptance_probability(Q, P.view(1, 2))) == pytest.approx(0.9)  # Σ min(p, q)
    torch.testing.assert_close(verifier.output_law(Q, P.view(1, 2)), Q)


def test_a_divergence_equal_to_the_threshold_is_accepted_outright():
    """Div ≤ T, not <: q = [0.5, 0.5], p = [0.75, 0.25] are exactly TV 0.25 apart (binary fractions)."""
    p = torch.tensor([[0.75, 0.25]], dtype=torch.float64)
    assert float(DIVERGENCES["tv"](Q, p[0])) == 0.25
    torch.testing.assert_close(
        _fuzzy(0.25, "tv").conditional(Q, p, torch.tensor([0])), torch.tensor([1.0, 0.0], dtype=torch.float64)
    )
    torch.testing.assert_close(_fuzzy(0.25, "tv").output_law(Q, p), p[0])
    assert float(_fuzzy(0.2499, "tv").acceptance_probability(Q, p)) == pytest.approx(0.75)


def _example_block() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of one draft token 0 at the worked example's laws (the bonus law is q again)."""
    return Q.float().expand(1, 2, 2), P.float().view(1, 1, 2), torch.tensor([[0]])


@pytest.mark.parametrize("divergence", sorted(BY_HAND))
def test_the_worked_example_along_a_block(divergence):
    """Above: every one of 180 keyed blocks keeps token 0. Below: speculative sampling's decisions, key by key,
    which reject about 1/6 of the time."""
    block = _example_block()
    above, below = _fuzzy(BY_HAND[divergence] * 1.001, divergence), _fuzzy(BY_HAND[divergence] * 0.999, divergence)
    rejected = 0
    for key in range(180):
        draws = Draws.create(key, 0)
        assert int(above.verify_block(*block, draws).num_accepted) == 1
        decision, speculative = below.verify_block(*block, draws), _speculative().verify_block(*block, draws)
        assert decision.tokens.tolist() == speculative.tokens.tolist()
        assert int(decision.num_accepted) == int(speculative.num_accepted)
        rejected += int(decision.num_accepted) == 0
    assert 12 <= rejected <= 48  # 180 / 6 = 30 expected


# ------------------------------------------------------------------ the promised bound, by enumeration


def _random_laws(seed: int, count: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` pairs (q, p) ``[count, V]`` float64, from far apart to nearly equal: p mixes a random law into q
    in a random share, some laws peaked, some with tokens ruled out (so KL(q ‖ p) is +inf at some)."""
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


def _enumerated_output_law(verifier, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """π = Σ_x p(x) · law(· | draft token x), from ``conditional`` ([N, V] laws → [N, V])."""
    count = q.shape[0]
    return sum(
        p[:, x : x + 1] * verifier.conditional(q, p.unsqueeze(1), torch.full((count, 1), x)) for x in range(VOCAB)
    )  # [N, V]


def bound_excess(verifier, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """How far each position's enumerated output law is past the bound the verifier promises: Div(q, π) − T, ``[N]``
    (positive where the promise is broken)."""
    divergence, bound = verifier.promised_bound()
    return DIVERGENCES[divergence](q, _enumerated_output_law(verifier, q, p)) - bound  # [N]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
def test_the_output_law_keeps_the_promised_bound(divergence, seed):
    """For each T: the enumerated law is where(Div ≤ T, p, q), as output_law says; its divergence from q is at most
    T; acceptance_probability is its mass on the draft token; and the laws fall on both sides of T (not vacuous)."""
    q, p = _random_laws(seed)
    distance = DIVERGENCES[divergence](q, p)  # [N]
    for threshold in THRESHOLDS[divergence]:
        verifier = _fuzzy(threshold, divergence)
        assert verifier.promised_bound() == (divergence, threshold)
        outright = distance <= threshold  # [N]
        assert 20 <= int(outright.sum()) <= q.shape[0] - 20, (threshold, int(outright.sum()))
        law = _enumerated_output_law(verifier, q, p)  # [N, V]
        torch.testing.assert_close(law, torch.where(outright.unsqueeze(-1), p, q), rtol=0, atol=1e-12)
        torch.testing.assert_close(verifier.output_law(q, p.unsqueeze(1)), law, rtol=0, atol=1e-12)
        assert float(bound_excess(verifier, q, p).max()) <= 1e-12
        kept = sum(
            p[:, x] * verifier.conditional(q, p.unsqueeze(1), torch.full((q.shape[0], 1), x))[:, x]
            for x in range(VOCAB)
        )  # [N]: the probability that the output is the draft token
        torch.testing.assert_close(verifier.acceptance_probability(q, p.unsqueeze(1)), kept, rtol=0, atol=1e-12)
        if divergence == "kl":  # what `acceptance` reports is then the same bound
            assert float(verifier.output_kl(q, p.unsqueeze(1)).max()) <= threshold + 1e-12


@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
def test_the_kits_enumeration_agrees_on_random_and_adversarial_pairs(divergence):
    """The kit's own enumeration (random sparse laws at V = 3 and 6, and its adversarial pairs): output_law is the
    enumerated law, acceptance_probability the enumerated acceptance, and the bound holds."""
    generator = torch.Generator().manual_seed(34)
    pairs = [tuple(random_distributions(generator, (2, vocab))) for vocab in (3, 6) for _ in range(10)]
    verifier = _fuzzy(THRESHOLDS[divergence][1], divergence)
    for target, draft in pairs + adversarial_distribution_pairs(4):
        drafts = draft.unsqueeze(0)  # [1, V]
        law = enumerate_output_law(verifier, target, drafts)  # [V]
        torch.testing.assert_close(verifier.output_law(target, drafts), law, rtol=0, atol=1e-12)
        claimed = float(verifier.acceptance_probability(target, drafts))
        assert claimed == pytest.approx(candidate_acceptance(verifier, target, drafts), abs=1e-12)
        assert float(DIVERGENCES[divergence](target, law)) <= THRESHOLDS[divergence][1] + 1e-12


class Flipped(FuzzySpeculative):
    """Negative control: accepts outright where Div(q, p) > T (the inequality flipped), promising the same bound."""

    name = "fuzzy-flipped"

    def outright(self, target_probs, draft_probs):
        return self.divergences(target_probs, draft_probs) > self.threshold


@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
def test_the_bound_check_catches_the_inequality_flipped(divergence):
    q, p = _random_laws(0)
    for threshold in THRESHOLDS[divergence]:
        assert float(bound_excess(_fuzzy(threshold, divergence), q, p).max()) <= 1e-12
        assert float(bound_excess(Flipped(threshold=threshold, divergence=divergence), q, p).max()) > 1e-3


def test_a_larger_threshold_never_accepts_less():
    q, p = _random_laws(5)
    for divergence, thresholds in THRESHOLDS.items():
        accepted = [_fuzzy(t, divergence).acceptance_probability(q, p.unsqueeze(1)) for t in (0.0, *thresholds)]
        for lower, higher in zip(accepted, accepted[1:]):
            assert bool((higher >= lower).all())
        assert float(accepted[-1].mean()) > float(accepted[0].mean()) + 0.05


def test_kl_is_infinite_where_the_draft_rules_out_a_token_the_target_allows():
    """q = [0.5, 0.5], p = [1, 0]: KL(q ‖ p) = +inf > any T, so no outright acceptance under KL; JS (≤ ln 2) does."""
    q, p = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    assert math.isinf(float(DIVERGENCES["kl"](q, p[0])))
    kl = _fuzzy(1e6, "kl")
    torch.testing.assert_close(kl.conditional(q, p, torch.tensor([0])), q)  # accept 1/2, else token 1
    assert float(kl.acceptance_probability(q, p)) == pytest.approx(0.5)
    torch.testing.assert_close(kl.output_law(q, p), q)
    block = q.float().expand(1, 2, 2), p.float().view(1, 1, 2), torch.tensor([[0]])
    assert {int(kl.verify_block(*block, Draws.create(key, 0)).num_accepted) for key in range(100)} == {0, 1}
    js = _fuzzy(math.log(2), "js")
    torch.testing.assert_close(js.output_law(q, p), p[0])


# ------------------------------------------------------------------ T = 0 is speculative sampling


@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
@pytest.mark.parametrize("key", range(20))
def test_at_threshold_zero_it_decides_as_speculative_sampling(divergence, key):
    kind = BLOCK_KINDS[key % len(BLOCK_KINDS)]  # "equal" and "one_token_equal" blocks too: q = p, Div = 0
    target_probs, draft_probs, tokens = random_block(kind, 1, 4, 16, seed=key, identical_drafts=False)
    draws = Draws.create(key=key, block_start=3 * key)
    fuzzy = _fuzzy(0.0, divergence).verify_block(target_probs, draft_probs, tokens, draws)
    speculative = _speculative().verify_block(target_probs, draft_probs, tokens, draws)
    assert fuzzy.tokens.tolist() == speculative.tokens.tolist()
    assert int(fuzzy.num_accepted) == int(speculative.num_accepted)
    q, p, x = target_probs[0, :-1], draft_probs[0].unsqueeze(1), tokens[0].unsqueeze(-1)  # [L, V], [L, 1, V], [L, 1]
    fuzzy_select = _fuzzy(0.0, divergence).select(q, p, x, draws)
    speculative_select = _speculative().select(q, p, x, draws)
    assert all(torch.equal(a, b) for a, b in zip(fuzzy_select, speculative_select))


@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
def test_at_threshold_zero_the_output_law_is_the_target_law(divergence):
    q, p = _random_laws(7)
    same = torch.cat([q, q])  # and laws equal to q: Div = 0 ≤ 0, accepted outright, and p = q
    verifier = _fuzzy(0.0, divergence)
    for target, draft in ((q, p), (same, same)):
        torch.testing.assert_close(_enumerated_output_law(verifier, target, draft), target, rtol=0, atol=1e-12)
        torch.testing.assert_close(verifier.output_law(target, draft.unsqueeze(1)), target, rtol=0, atol=0)
        speculative = _speculative().acceptance_probability(target, draft.unsqueeze(1))
        torch.testing.assert_close(verifier.acceptance_probability(target, draft.unsqueeze(1)), speculative)


# ------------------------------------------------------------------ the contract: kit, batches, device path, reads

CONFIGURATIONS = [
    {},
    {"threshold": 0.05},
    {"threshold": 0.1, "divergence": "kl"},
    {"threshold": 0.2, "divergence": "tv"},
]
REFUSED = [
    {"threshold": -0.1},
    {"threshold": math.inf},
    {"threshold": math.nan},
    {"divergence": "hellinger"},
    {"divergence": "js_div"},
]


@pytest.mark.parametrize("params", CONFIGURATIONS, ids=str)
def test_it_passes_the_authors_kit(params):
    check_verifier(FuzzySpeculative, params, samples=1000, bad_params=REFUSED)


def test_its_capability_flags():
    cls = VerifierRegistry().load_class("fuzzy")
    assert cls is FuzzySpeculative
    assert (cls.lossless, cls.max_drafts, cls.token_level, cls.kl_bound_parameter) == (False, 1, True, None)
    assert cls.batches_by_vmap and cls.capturable and cls.keyed_randomness and not cls.reading_cpu_path


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("threshold", "-1", "verifier 'fuzzy': threshold must be a finite number >= 0, got -1"),
        ("threshold", ".inf", "verifier 'fuzzy': threshold must be a finite number >= 0, got inf"),
        ("threshold", ".nan", "verifier 'fuzzy': threshold must be a finite number >= 0, got nan"),
        ("divergence", "hellinger", "divergence must be 'js' or 'kl' or 'tv', got 'hellinger'"),
    ],
)
def test_a_bad_parameter_is_one_line(run, recipe_path, param, value, message):
    code, _, err = run(
        ["generate", "-r", str(recipe_path), "--verifier", "fuzzy", "--set", f"verifier.params.{param}={value}", "a"]
    )
    assert code == 2
    one_error_line(err, message)


def _batch(batch: int, vocab: int = 16):
    blocks = [
        random_block(BLOCK_KINDS[b % len(BLOCK_KINDS)], 1, 4, vocab, seed=b, identical_drafts=False)
        for b in range(batch)
    ]
    draws = Draws.batch([100 + b for b in range(batch)])
    draws.block_start.copy_(torch.arange(batch) * 3)
    return (*(torch.stack(parts) for parts in zip(*blocks)), draws)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("params", CONFIGURATIONS, ids=str)
def test_a_mapped_batch_decides_each_block_as_alone_in_the_same_operations_and_reads_nothing(params):
    verifier = _fuzzy(**params)
    target, draft, tokens, draws = _batch(7)
    with torch.inference_mode(), warnings.catch_warnings(), device_path():
        warnings.filterwarnings("error", message="There is a performance drop")  # vmap looping an operation
        batch = verifier.verify_batch(target, draft, tokens, draws)
        alone = BatchDecision.stack(
            [verifier.verify_block(target[b], draft[b], tokens[b], draws.row(b)) for b in range(7)]
        )
    for field in ("tokens", "num_accepted", "row"):
        assert torch.equal(getattr(batch, field), getattr(alone, field)), field

    def count(size: int) -> OperationCount:
        *block, batch_draws = _batch(size)
        with torch.inference_mode(), device_path(), OperationCount() as counted:
            verifier.verify_batch(*block, batch_draws)
        return counted

    two, eight = count(2), count(8)
    assert two.ops == eight.ops
    assert eight.reads == 0, eight.read_names


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("params", CONFIGURATIONS, ids=str)
def test_the_device_path_reads_nothing_in_a_fixed_number_of_operations(params):
    """On every kind of block at two vocabularies: no read, the same operations whatever the data (at one length),
    and within the single-draft budget of 200 a block."""
    verifier = _fuzzy(**params)
    for length in (4, 8):
        counts = [
            count_block(verifier, *random_block(kind, 1, length, vocab, seed, False), Draws.create(1000 + seed, seed))
            for vocab in (64, 4096)
            for seed, kind in enumerate(BLOCK_KINDS)
        ]
        assert all(count.reads == 0 for count in counts), [count.read_names for count in counts]
        assert len({count.ops for count in counts}) == 1, [count.ops for count in counts]
        assert counts[0].ops <= 200


@pytest.mark.parametrize("divergence", sorted(THRESHOLDS))
def test_verify_block_traces_into_one_graph(divergence):
    """Dynamo traces a block with keyed draws without a graph break (what --compile and a CUDA graph need)."""
    block = random_block("peaked", 1, 4, 32, seed=0, identical_drafts=False)
    torch._dynamo.reset()
    counters.clear()
    with device_path():
        torch.compile(_fuzzy(0.1, divergence).verify_block, backend="eager")(*block, Draws.create(0, 0))
    assert not counters["graph_break"], list(counters["graph_break"])
