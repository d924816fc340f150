"""FLy (``fly``): speculative sampling's native decisions, with a native rejection deferred where the target's top-k
entropy is at least θ, q(x) > 0, and the next W draft tokens are natively accepted (the window inside the block).

Worked examples on hand-made blocks whose native decisions are fixed by the laws (a = 1 is always accepted, a = 0.01
is rejected under keys whose uniforms are read here); the decisions follow the rule on every key of random blocks;
speculative sampling's decisions where no deferral can happen; the exact block law against an enumeration of the
rule and against sampled decisions; the author's kit; batching, the device path and one read per block; parameters.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.base.sampling import sample_with
from specdec_cli.kit import conformance
from specdec_cli.kit.conformance import ConformanceError, check_verifier
from specdec_cli.kit.testing import (
    chi_square_p_value,
    decision_outcomes,
    enumerate_block_law,
    random_sequence_laws,
    target_sequence_law,
)
from specdec_cli.plugins.laws import excess_weights, normalized_excess, single_draft_draws
from specdec_cli.plugins.registry import load_verifier
from specdec_plugins.fly import FLyVerification
from tests.conftest import one_error_line, random_block

pytestmark = pytest.mark.usefixtures("one_thread")


def _fly(**params) -> FLyVerification:
    return load_verifier("fly", params)


SPECULATIVE = load_verifier("speculative")


def _close_block(seed: int, length: int, vocab: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``[1, L+1, V]``, ``[1, L, V]``, ``[1, L]``: a draft halfway to the target, so that native acceptances
    and rejections both come often and windows of acceptances follow rejections (random_block's kinds are mostly
    all-accept or all-reject)."""
    generator = torch.Generator().manual_seed(seed)
    target = (torch.randn(1, length + 1, vocab, generator=generator) * 2).softmax(-1)  # [1, L+1, V]
    noise = (torch.randn(1, length, vocab, generator=generator) * 2).softmax(-1)  # [1, L, V]
    draft = 0.5 * target[:, :-1] + 0.5 * noise  # [1, L, V]
    tokens = torch.multinomial(draft[0], 1, generator=generator).view(1, length)  # [1, L]
    return target, draft, tokens


# ------------------------------------------------------------------ hand-made blocks, V = 4

SURE = ([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], 0)  # (q, p, x): q = p, a = 1: always natively accepted
UNSURE = ([0.40, 0.30, 0.29, 0.01], [0, 0, 0, 1], 3)  # a = 0.01; H_3 = 0.3665 + 0.3612 + 0.3590 = 1.0867 ≥ 0.3
CONFIDENT = ([0.97, 0.01, 0.01, 0.01], [0, 0, 0, 1], 3)  # a = 0.01; H_3 = 0.0295 + 2 · 0.0461 = 0.1216 < 0.3
IMPOSSIBLE = ([0.4, 0.3, 0.3, 0.0], [0, 0, 0, 1], 3)  # a = 0: always rejected, and q(x) = 0 forbids a deferral
BONUS = [0.25, 0.25, 0.25, 0.25]


def _hand_block(positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``[1, L+1, 4]``, ``[1, L, 4]``, ``[1, L]`` from (q, p, x) per position, q_L uniform."""
    target = torch.tensor([q for q, _, _ in positions] + [BONUS]).unsqueeze(0)  # [1, L+1, V]
    draft = torch.tensor([p for _, p, _ in positions], dtype=torch.float32).unsqueeze(0)  # [1, L, V]
    return target, draft, torch.tensor([[x for _, _, x in positions]])


def _key_fixing(positions) -> tuple[Draws, torch.Tensor]:
    """The first key whose ACCEPT uniforms reject every position with a < 1 (u ≥ 0.01), and its draws ``[L+1, 3]``:
    under it the native decisions are exactly 'a = 1'."""
    for key in range(100):
        draws = Draws.create(key, 0)
        table = single_draft_draws(draws, len(positions), torch.device("cpu"))  # [L+1, 3]
        if all(float(table[t, 0]) >= 0.01 for t, (_, p, _) in enumerate(positions) if p != SURE[1]):
            return draws, table
    raise AssertionError("no key rejects every uncertain position")


def _decide(positions, **params):
    """(FLy's decision, speculative sampling's, the draws table) on the hand block, under :func:`_key_fixing`."""
    block = _hand_block(positions)
    draws, table = _key_fixing(positions)
    return _fly(**params).verify_block(*block, draws), SPECULATIVE.verify_block(*block, draws), table


def _same(first, second) -> bool:
    return first.tokens.tolist() == second.tokens.tolist() and int(first.num_accepted) == int(second.num_accepted)


def test_the_worked_entropies():
    fly = _fly()
    entropies = fly.top_k_entropy(torch.tensor([UNSURE[0], CONFIDENT[0], IMPOSSIBLE[0]], dtype=torch.float64))
    expected = [
        -sum(v * math.log(v) for v in law[:3]) for law in ([0.4, 0.3, 0.29], [0.97, 0.01, 0.01], [0.4, 0.3, 0.3])
    ]
    torch.testing.assert_close(entropies, torch.tensor(expected, dtype=torch.float64))
    assert entropies[0] == pytest.approx(1.0867, abs=1e-4) and entropies[1] == pytest.approx(0.1216, abs=1e-4)
    # k = 1: only the largest entry, −0.4 ln 0.4 = 0.3665; k above V is capped at V (the whole entropy).
    assert float(_fly(entropy_top_k=1).top_k_entropy(torch.tensor(UNSURE[0]))) == pytest.approx(0.36652, abs=1e-5)
    whole = -sum(v * math.log(v) for v in UNSURE[0])
    assert float(_fly(entropy_top_k=9).top_k_entropy(torch.tensor(UNSURE[0]))) == pytest.approx(whole, abs=1e-6)


def test_a_rejection_at_zero_is_deferred_when_the_window_is_natively_accepted():
    """L = 4, W = 2: the rejection at 0 (H = 1.09 ≥ 0.3) sees 1 and 2 accepted natively: all four are kept, and the
    bonus comes from q_4 with the BONUS uniform at offset 4. Speculative sampling stops at 0 on the same draws."""
    fly, speculative, table = _decide([UNSURE, SURE, SURE, SURE], window_size=2)
    assert int(fly.num_accepted) == 4 and fly.tokens[:4].tolist() == [3, 0, 0, 0]
    assert int(fly.tokens[4]) == int(sample_with(torch.tensor(BONUS), table[4, 2]))
    assert int(speculative.num_accepted) == 0


def test_no_deferral_when_a_window_position_is_natively_rejected():
    """W = 2: position 2 is natively rejected, so 0 is not deferred (and 2 + W = 4 ≥ L leaves 2 without a window):
    speculative sampling's decision, the correction drawn from (q_0 − p_0)+ ∝ (0.40, 0.30, 0.29, 0)."""
    fly, speculative, table = _decide([UNSURE, SURE, UNSURE, SURE], window_size=2)
    assert _same(fly, speculative) and int(fly.num_accepted) == 0
    residual = torch.tensor([0.40, 0.30, 0.29, 0.0])
    assert int(fly.tokens[0]) == int(sample_with(residual, table[0, 1])) != 3


def test_no_deferral_at_low_entropy_and_the_threshold_and_k_decide():
    fly, speculative, _ = _decide([CONFIDENT, SURE, SURE, SURE], window_size=2)  # H_3 = 0.1216 < 0.3
    assert _same(fly, speculative) and int(fly.num_accepted) == 0
    fly, _, _ = _decide([CONFIDENT, SURE, SURE, SURE], window_size=2, entropy_threshold=0.12)  # 0.1216 ≥ 0.12
    assert int(fly.num_accepted) == 4
    fly, speculative, _ = _decide([UNSURE, SURE, SURE, SURE], window_size=2, entropy_threshold=0.37, entropy_top_k=1)
    assert _same(fly, speculative)  # H_1 = 0.3665 < 0.37, where H_3 = 1.0867 would defer
    fly, _, _ = _decide([UNSURE, SURE, SURE, SURE], window_size=2, entropy_threshold=0.37, entropy_top_k=3)
    assert int(fly.num_accepted) == 4


def test_no_deferral_where_the_target_cannot_produce_the_token():
    """q_0(x_0) = 0 (H_3 = 1.09, θ = 0, the window accepted): still speculative sampling's rejection."""
    fly, speculative, _ = _decide([IMPOSSIBLE, SURE, SURE, SURE], window_size=2, entropy_threshold=0.0)
    assert _same(fly, speculative) and int(fly.num_accepted) == 0


def test_no_deferral_when_the_window_does_not_fit_in_the_block():
    """L = 4, W = 2: a rejection at 2 has 2 + W = 4 ≥ L (kept: 2), one at 1 has 1 + W = 3 < 4 (deferred: 4).
    W ≥ L defers nothing at all."""
    fly, speculative, _ = _decide([SURE, SURE, UNSURE, SURE], window_size=2)
    assert _same(fly, speculative) and int(fly.num_accepted) == 2
    fly, _, _ = _decide([SURE, UNSURE, SURE, SURE], window_size=2)
    assert int(fly.num_accepted) == 4
    for window in (4, 5):
        fly, speculative, _ = _decide([UNSURE, SURE, SURE, SURE], window_size=window, entropy_threshold=0.0)
        assert _same(fly, speculative) and int(fly.num_accepted) == 0


def test_two_deferrals_in_one_long_block_and_windows_of_native_decisions():
    """L = 8, W = 2: rejections at 0 and 3, each followed by two native acceptances: all eight kept."""
    fly, speculative, _ = _decide([UNSURE, SURE, SURE, UNSURE, SURE, SURE, SURE, SURE], window_size=2)
    assert int(fly.num_accepted) == 8 and int(speculative.num_accepted) == 0
    # W = 3: 0's window (1, 2, 3) holds 3's native rejection; that 3 would itself be deferred does not count.
    fly, speculative, _ = _decide([UNSURE, SURE, SURE, UNSURE, SURE, SURE, SURE, SURE], window_size=3)
    assert _same(fly, speculative) and int(fly.num_accepted) == 0


def test_after_a_deferral_the_block_stops_at_the_next_rejection_it_cannot_defer():
    """L = 6, W = 2: 0 deferred; 4 + W = 6 ≥ L, so the block stops at 4 with a draw from (q_4 − p_4)+."""
    fly, _, table = _decide([UNSURE, SURE, SURE, SURE, UNSURE, SURE], window_size=2)
    assert int(fly.num_accepted) == 4 and fly.tokens[:4].tolist() == [3, 0, 0, 0]
    residual = excess_weights(torch.tensor(UNSURE[0]), torch.tensor(UNSURE[1], dtype=torch.float32))  # [V]
    assert int(fly.tokens[4]) == int(sample_with(residual, table[4, 1]))


# ------------------------------------------------------------------ the rule on random blocks, key by key


def _by_the_rule(fly: FLyVerification, target, draft, tokens, draws: Draws) -> tuple[int, int]:
    """(num_accepted, the token after them) by the rule's words, with host loops over the block's own uniforms."""
    q, p, x = target[0].double(), draft[0].double(), tokens[0].tolist()
    length, window = len(x), fly.window(len(x))
    table = single_draft_draws(draws, length, torch.device("cpu")).tolist()  # [L+1][3]
    native = [table[t][0] < min(1.0, float(q[t, x[t]] / p[t, x[t]])) for t in range(length)]
    top = [sorted(q[t].tolist(), reverse=True)[: fly.entropy_top_k] for t in range(length)]
    entropy = [-sum(v * math.log(v) for v in values if v > 0) for values in top]

    def kept(i: int) -> bool:
        deferred = entropy[i] >= fly.entropy_threshold and q[i, x[i]] > 0 and i + window < length
        return native[i] or (deferred and all(native[i + 1 : i + 1 + window]))

    stop = next((t for t in range(length) if not kept(t)), length)
    law = q[length] if stop == length else excess_weights(q[stop], p[stop])  # [V]
    return stop, int(sample_with(law, torch.tensor(table[stop][2 if stop == length else 1])))


RULE_SETTINGS = [
    {"window_size": 2, "entropy_threshold": 0.0},
    {"window_size": 1, "entropy_threshold": 0.3},
    {"window_size": 3, "entropy_threshold": 1.0, "entropy_top_k": 5},
]


@pytest.mark.parametrize("params", RULE_SETTINGS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_the_decisions_follow_the_rule_on_every_key(params):
    fly = _fly(**params)
    deferred = 0
    blocks = [_close_block(seed, 8) for seed in range(3)] + [random_block("flat_draft", 1, 8, 16, 3, True)]
    for seed, block in enumerate(blocks):
        for key in range(25):
            draws = Draws.create(key, 7 * seed)
            decision = fly.verify_block(*block, draws)
            expected = _by_the_rule(fly, *block, draws)
            assert (int(decision.num_accepted), int(decision.tokens[int(decision.num_accepted)])) == expected
            deferred += int(decision.num_accepted) > int(SPECULATIVE.verify_block(*block, draws).num_accepted)
    assert deferred > 0  # the rule's deferrals were exercised


@pytest.mark.parametrize("key", range(20))
def test_where_nothing_can_be_deferred_it_decides_as_speculative_sampling(key):
    fly_huge_threshold, fly_long_window = _fly(entropy_threshold=1e9), _fly(window_size=8)
    for block in [_close_block(seed, 8) for seed in range(3)] + [random_block("disjoint", 1, 8, 16, 3, True)]:
        draws = Draws.create(key, 3 * key)
        speculative = SPECULATIVE.verify_block(*block, draws)
        assert _same(fly_huge_threshold.verify_block(*block, draws), speculative)
        assert _same(fly_long_window.verify_block(*block, draws), speculative)


def test_negative_control_at_theta_zero_it_departs_from_speculative_sampling():
    """The equality above has power: with θ = 0 and W = 1 some of the same keys decide otherwise."""
    block = _close_block(1, 8)
    fly = _fly(window_size=1, entropy_threshold=0.0)
    differ = [not _same(fly.verify_block(*block, d), SPECULATIVE.verify_block(*block, d)) for d in _keys(20)]
    assert any(differ)


def _keys(count: int) -> list[Draws]:
    return [Draws.create(key, 3 * key) for key in range(count)]


# ------------------------------------------------------------------ the exact block law


def _enumerated_law(fly: FLyVerification, target, draft, tokens) -> torch.Tensor:
    """``[1, L+1, V]`` by the rule's words: every native pattern, its mass, the deferrals, the token that follows."""
    q, p, x = target[0], draft[0], tokens[0].tolist()
    length, window = len(x), fly.window(len(x))
    accept = [min(1.0, float(q[t, x[t]] / p[t, x[t]])) for t in range(length)]
    entropy = fly.top_k_entropy(q[:-1]).tolist()
    law = torch.zeros_like(target)
    for native in itertools.product((False, True), repeat=length):
        mass = math.prod(a if kept else 1 - a for a, kept in zip(accept, native))
        deferred = [
            entropy[i] >= fly.entropy_threshold
            and q[i, x[i]] > 0
            and i + window < length
            and all(native[i + 1 :][:window])
            for i in range(length)
        ]
        stop = next((t for t in range(length) if not (native[t] or deferred[t])), length)
        law[0, stop] += mass * (q[length] if stop == length else normalized_excess(q[stop], p[stop]))
    return law


def _in_float64(target, draft, tokens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's float32 laws in float64, renormalised (float32 sums are 1 to about 1e-7)."""
    target, draft = target.double(), draft.double()  # [1, L+1, V], [1, L, V]
    return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True), tokens


@pytest.mark.parametrize("length", [1, 3, 6, 8])
@pytest.mark.parametrize("params", RULE_SETTINGS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_the_block_law_sums_to_one_and_is_the_rules_enumeration(length, params):
    fly = _fly(**params)
    for block in [_close_block(seed, length, 6) for seed in range(3)] + [
        random_block("disjoint", 1, length, 6, 3, True)
    ]:
        block = _in_float64(*block)
        law = fly.block_law(*block)
        assert law.shape == block[0].shape and float(law.min()) >= 0
        assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
        torch.testing.assert_close(law, _enumerated_law(fly, *block), rtol=0, atol=1e-12)


def test_with_nothing_deferrable_the_block_law_is_speculative_samplings():
    block = _in_float64(*_close_block(2, 5, 6))
    torch.testing.assert_close(_fly(entropy_threshold=1e9).block_law(*block), SPECULATIVE.block_law(*block))
    assert (
        _fly(window_size=1, entropy_threshold=0.0).block_law(*block) - SPECULATIVE.block_law(*block)
    ).abs().max() > 1e-3


def _sampled(verifier, block, samples: int) -> Counter:
    """The committed tokens of keys 0 .. samples - 1 on ``block``, decided as one batch (each block as
    verify_block decides it alone: test_a_batch_decides_each_block_as_it_is_decided_alone)."""
    batch = [part.expand(samples, *part.shape) for part in block]  # [B, 1, L+1, V], [B, 1, L, V], [B, 1, L]
    decision = verifier.verify_batch(*batch, Draws.batch(list(range(samples))))
    rows = zip(decision.tokens.tolist(), decision.num_accepted.tolist())
    return Counter(tuple(tokens[: accepted + 1]) for tokens, accepted in rows)


class WindowBlind(FLyVerification):
    """Negative control: defers every gated rejection, whatever its window (its block_law is still FLy's)."""

    name = "window-blind"

    def window_accepted(self, native):
        return torch.ones_like(native)


def test_verify_block_samples_its_block_law_on_a_block_with_deferrals():
    """L = 4, W = 2, θ = 0 (the kit's blocks, L = 2, are too short for W = 2), on a block whose native acceptances
    are a = (1, 0.52, 0.38, 0.89): a rejection at 1 may be deferred, ones at 2 and 3 never (no window fits)."""
    block = _close_block(5, 4, 5)
    fly = _fly(window_size=2, entropy_threshold=0.0)
    law = decision_outcomes(fly.block_law(*_in_float64(*block)), block[2])
    counts = _sampled(fly, block, 4000)
    assert chi_square_p_value(counts, law) > 1e-3
    speculative = decision_outcomes(SPECULATIVE.block_law(*_in_float64(*block)), block[2])
    assert chi_square_p_value(counts, speculative) < 1e-4  # deferrals change the law, and the check sees it
    blind = WindowBlind(window_size=2, entropy_threshold=0.0)
    assert chi_square_p_value(_sampled(blind, block, 4000), law) < 1e-4  # the negative control


# ------------------------------------------------------------------ the author's kit


def test_the_kit_blocks_are_two_tokens_long():
    """So only W = 1 defers there; W = 2 at L = 2 is speculative sampling's law (checked as such)."""
    assert conformance.DRAFT_LENGTH == 2 and conformance.VOCAB == 3
    generator = torch.Generator().manual_seed(5)
    gaps = {}
    for window in (1, 2):
        fly = _fly(window_size=window, entropy_threshold=0.0)
        gaps[window] = max(
            max(abs(law.get(s, 0.0) - mass) for s, mass in target_sequence_law(target.__getitem__, 3, 3).items())
            for target, draft in (
                (random_sequence_laws(generator, 3, 3), random_sequence_laws(generator, 3, 2)) for _ in range(3)
            )
            for law in [enumerate_block_law(fly, target.__getitem__, [draft.__getitem__], 3, 2)]
        )
    assert gaps[1] > 1e-3 and gaps[2] < 1e-12  # W = 1 is lossy on the kit's blocks; W = 2 keeps q there


def test_the_kit_catches_a_window_blind_variant():
    with pytest.raises(ConformanceError, match="do not follow its block_law"):
        check_verifier(WindowBlind, {"window_size": 1, "entropy_threshold": 0.0}, samples=1000)


def test_the_defaults_say_what_it_is():
    """Its flags are in tests/test_contracts.py, with every verifier's."""
    fly = _fly()
    assert (fly.window_size, fly.entropy_threshold, fly.entropy_top_k) == (None, 0.3, 3)
    assert [fly.window(length) for length in (1, 2, 4, 7, 12)] == [0, 1, 3, 6, 6]  # vLLM's min(6, L − 1)
    q, p = torch.tensor([[0.5, 0.5]]), torch.tensor([[[0.9, 0.1]]])
    assert fly.output_law(q, p) is None and fly.output_kl(q, p) is None and fly.promised_bound() is None


# ------------------------------------------------------------------ batches, the device path, reads


# ------------------------------------------------------------------ parameters


def test_acceptance_says_it_has_no_per_token_acceptance(run, recipe_path):
    code, _, err = run(["acceptance", "-r", recipe_path, "a", "--verifier", "fly", "--num-drafts", "1"])
    assert code == 2
    one_error_line(err, "no verifier has a per-token acceptance for these drafts: fly (decides whole blocks")


def test_the_default_window_defers_in_a_short_block():
    """At the default window (vLLM's min(6, L − 1)) a block of 4 defers a rejection at 0 whose next 3 tokens are
    natively accepted, where speculative sampling stops."""
    fly, speculative, _ = _decide([UNSURE, SURE, SURE, SURE], entropy_threshold=0.0)
    assert int(speculative.num_accepted) == 0 and int(fly.num_accepted) == 4


def test_the_configured_draft_length_fixes_the_default_window_for_every_block():
    """Told K = 8, the window is vLLM's min(6, 7) = 6 for every block: in a block of 4 no position has six more after
    it, so the rejection at 0 stands, where a verifier never told K takes W = 3 from the block and defers it."""
    block, (draws, _) = _hand_block([UNSURE, SURE, SURE, SURE]), _key_fixing([UNSURE, SURE, SURE, SURE])
    told = _fly(entropy_threshold=0.0)
    told.set_draft_length(8)
    assert told.window(4) == told.window(8) == 6
    assert int(told.verify_block(*block, draws).num_accepted) == 0
    assert int(_fly(entropy_threshold=0.0).verify_block(*block, draws).num_accepted) == 4
    told.set_draft_length(4)
    assert int(told.verify_block(*block, draws).num_accepted) == 4  # K = 4: W = 3, as in a block of its own length


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--draft-length", "1"], "fly needs at least two draft tokens per block, as vLLM does"),
        (
            ["--draft-length", "3", "--set", "verifier.params.window_size=3"],
            "window_size 3 must be smaller than the draft length, as vLLM requires",
        ),
    ],
)
def test_what_vllm_refuses_of_the_configured_length_is_one_line(run, recipe_path, flags, message):
    code, _, err = run(["generate", "-r", recipe_path, "--verifier", "fly", *flags, "a"])
    assert code == 2
    one_error_line(err, f"verifier 'fly': {message}")
