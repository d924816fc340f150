"""Block-level exactness: the law of a committed block, by enumeration and by sampling verify_block.

`block` (Sun et al. 2025, Algorithm 2) is checked against the target's sequence law exactly, against
token-wise speculative sampling on expected length, and every built-in's vectorised or walked
`verify_block` against its own exact block law by chi-square.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from specdec_cli.kit.testing import (
    adversarial_distribution_pairs,
    chi_square_p_value,
    committed_block_law,
    decision_outcomes,
    enumerate_block_law,
    expected_committed_tokens,
    random_sequence_laws,
    target_sequence_law,
)
from specdec_cli.plugins.registry import load_verifier
from specdec_cli.plugins.verifiers import BlockDecision
from tests.conftest import block_inputs


def _random_cases(vocab: int, draft_length: int, count: int = 5):
    generator = torch.Generator().manual_seed(100 * vocab + draft_length)
    for sparsity in [0.0] * (count - 2) + [0.3, 0.5]:
        yield (
            random_sequence_laws(generator, vocab, draft_length + 1, sparsity).__getitem__,
            random_sequence_laws(generator, vocab, draft_length, sparsity).__getitem__,
        )


def _adversarial_cases(vocab: int):
    """Context-independent adversarial pairs, and pairs that alternate with the prefix length."""
    pairs = adversarial_distribution_pairs(vocab)
    for target, draft in pairs:
        yield (lambda prefix, q=target: q), (lambda prefix, p=draft: p)
    for (target_a, draft_a), (target_b, draft_b) in zip(pairs, pairs[1:]):
        yield (
            lambda prefix, a=target_a, b=target_b: a if len(prefix) % 2 else b,
            lambda prefix, a=draft_a, b=draft_b: b if len(prefix) % 2 else a,
        )


def _max_gap(law: dict, reference: dict) -> float:
    return max(abs(law.get(s, 0.0) - reference.get(s, 0.0)) for s in set(law) | set(reference))


@pytest.mark.parametrize("vocab", [2, 3, 4])
@pytest.mark.parametrize("draft_length", [1, 2, 3])
def test_block_law_is_the_target_sequence_law(vocab, draft_length):
    verifier = load_verifier("block")
    cases = list(_random_cases(vocab, draft_length)) + list(_adversarial_cases(vocab))
    for target_law, draft_law in cases:
        law = enumerate_block_law(verifier, target_law, [draft_law], vocab, draft_length)
        assert _max_gap(law, target_sequence_law(target_law, vocab, draft_length + 1)) < 1e-9


def test_a_wrong_block_verifier_is_caught():
    """Negative control: accepting every draft token gives the draft's law, which the check rejects."""
    from tests.test_conformance import AcceptAll

    for target_law, draft_law in _random_cases(3, 2):
        law = enumerate_block_law(AcceptAll(), target_law, [draft_law], 3, 2)
        assert _max_gap(law, target_sequence_law(target_law, 3, 3)) > 1e-3


@pytest.mark.parametrize("vocab", [2, 3, 4])
@pytest.mark.parametrize("draft_length", [1, 2, 3])
def test_block_is_never_shorter_than_token_wise(vocab, draft_length):
    block, speculative = load_verifier("block"), load_verifier("speculative")
    gains = []
    for target_law, draft_law in list(_random_cases(vocab, draft_length)) + list(_adversarial_cases(vocab)):
        lengths = [
            expected_committed_tokens(committed_block_law(v, target_law, [draft_law], vocab, draft_length))
            for v in (block, speculative)
        ]
        assert lengths[0] >= lengths[1] - 1e-12
        gains.append(lengths[0] - lengths[1])
    if draft_length == 1:
        assert max(gains) < 1e-12  # one position: block verification is speculative sampling
    elif vocab > 2:
        assert max(gains) > 1e-3  # and strictly longer in some cases


def test_the_papers_motivating_example():
    """q = (1/3, 2/3), p = (2/3, 1/3), L = 2: 11/9 accepted tokens against token-wise 10/9 (Sun et al., §1)."""
    target, draft = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    accepted = {
        name: expected_committed_tokens(
            committed_block_law(load_verifier(name), lambda _: target, [lambda _: draft], 2, 2)
        )
        - 1
        for name in ("block", "speculative")
    }
    assert accepted["block"] == pytest.approx(11 / 9, abs=1e-12)
    assert accepted["speculative"] == pytest.approx(10 / 9, abs=1e-12)


@pytest.mark.parametrize(
    ("name", "num_drafts"),
    [
        ("speculative", 1),
        ("specinfer", 2),
        ("specinfer", 3),
        ("spectr", 2),
        ("is-lp", 2),
        ("is-truncated", 2),
    ],
)
def test_token_level_block_laws_are_the_target_law(name, num_drafts):
    """The alive-set walk of the token-level verifiers keeps the target's law over a whole block."""
    verifier, vocab, draft_length = load_verifier(name), 3, 2
    for target_law, draft_law in list(_random_cases(vocab, draft_length, count=3)):
        generator = torch.Generator().manual_seed(7)
        others = [] if name == "spectr" else [random_sequence_laws(generator, vocab, draft_length).__getitem__]
        draft_laws = [draft_law] + (others * (num_drafts - 1) if others else [draft_law] * (num_drafts - 1))
        law = enumerate_block_law(verifier, target_law, draft_laws, vocab, draft_length)
        assert _max_gap(law, target_sequence_law(target_law, vocab, draft_length + 1)) < 1e-9


# --------------------------------------------------------------------------- verify_block samples its law


def _sampled_outcomes(verifier, target_probs, draft_probs, draft_tokens, samples: int) -> Counter:
    generator = torch.Generator().manual_seed(5)
    counts: Counter = Counter()
    for _ in range(samples):
        decision = verifier.verify_block(target_probs, draft_probs, draft_tokens, generator)
        assert isinstance(decision, BlockDecision)
        tokens, accepted, row = decision.tokens.tolist(), int(decision.num_accepted), int(decision.row)
        assert tokens[:accepted] == draft_tokens[row, :accepted].tolist()
        counts[tuple(tokens[: accepted + 1])] += 1
    return counts


def _exact_outcomes(verifier, target_probs, draft_probs, draft_tokens) -> dict:
    return decision_outcomes(
        verifier.block_law(target_probs.double(), draft_probs.double(), draft_tokens), draft_tokens
    )


def _p_value(counts: Counter, law: dict) -> float:
    # Outcomes expected fewer than 5 times are pooled: unpooled, one rare outcome seen twice where 0.1
    # was expected (a 1-in-200 event) reads as p = 2e-5.
    return chi_square_p_value(counts, law)


@pytest.mark.parametrize(
    ("name", "params", "num_drafts", "identical"),
    [
        ("block", {}, 1, True),
        ("speculative", {}, 1, True),
        ("mentored", {"kl": 0.1}, 1, True),
        ("specinfer", {}, 2, False),
        ("specinfer", {}, 3, False),
        ("spectr", {}, 3, True),
        ("is-lp", {}, 2, False),
        ("is-truncated", {"s": 2, "alphabet": 3}, 2, True),
    ],
)
def test_verify_block_samples_its_exact_law(name, params, num_drafts, identical):
    verifier = load_verifier(name, params)
    inputs = block_inputs(num_drafts, identical)
    samples = (
        1500 if name.startswith("is-") else 2000 if name in ("mentored", "spectr") else 4000
    )  # bisections are slow
    counts = _sampled_outcomes(verifier, *inputs, samples=samples)
    law = _exact_outcomes(verifier, *inputs)
    assert _p_value(counts, law) > 1e-3
    if name == "block":  # the check has power: token-wise speculative sampling's law is rejected
        assert _p_value(counts, _exact_outcomes(load_verifier("speculative"), *inputs)) < 1e-4


def test_verify_block_is_deterministic_given_the_generator():
    target_probs, draft_probs, draft_tokens = block_inputs(1, True)
    for name in ("block", "speculative", "mentored"):
        verifier = load_verifier(name)
        first = [
            verifier.verify_block(target_probs, draft_probs, draft_tokens, torch.Generator().manual_seed(s))
            for s in range(20)
        ]
        second = [
            verifier.verify_block(target_probs, draft_probs, draft_tokens, torch.Generator().manual_seed(s))
            for s in range(20)
        ]
        for a, b in zip(first, second):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
        assert len({tuple(d.tokens[: int(d.num_accepted) + 1].tolist()) for d in first}) > 1


def test_walk_follows_a_surviving_row():
    """With several drafts, the committed tokens follow the row the decision names."""
    verifier = load_verifier("specinfer")
    target_probs, draft_probs, draft_tokens = block_inputs(3, False)
    generator = torch.Generator().manual_seed(0)
    rows_seen = set()
    for _ in range(300):
        decision = verifier.verify_block(target_probs, draft_probs, draft_tokens, generator)
        n, row = int(decision.num_accepted), int(decision.row)
        assert decision.tokens[:n].tolist() == draft_tokens[row, :n].tolist()
        rows_seen.add(row)
    assert len(rows_seen) > 1


@pytest.mark.parametrize("vocab", [3, 4])
def test_block_law_of_one_position_is_speculative_sampling(vocab):
    block, speculative = load_verifier("block"), load_verifier("speculative")
    for target_law, draft_law in itertools.islice(_random_cases(vocab, 1), 5):
        q = torch.stack([target_law(()), target_law((0,))]).unsqueeze(0)  # [1, 2, V]
        p = draft_law(()).view(1, 1, -1)  # [1, 1, V]
        for x in range(vocab):
            if p[0, 0, x] > 0:
                torch.testing.assert_close(
                    block.block_law(q, p, torch.tensor([[x]])), speculative.block_law(q, p, torch.tensor([[x]]))
                )


# --------------------------------------------------------------------------- end to end through the CLI


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_block_keeps_the_target_law_through_the_cli(tiny_models, write_recipe, run, family):
    """`specdec generate --verifier block`: the first three tokens follow the target's exact law."""
    import json

    from specdec_cli import SpeculativeDecoder
    from specdec_cli.base.recipe import build_recipe
    from specdec_cli.base.sampling import SamplingParams
    from specdec_cli.kit.testing import EOS_ID, chi_square_p_value, exact_sequence_law
    from tests.conftest import tiny_recipe

    depth, samples = 3, 1200
    recipe = tiny_recipe(
        tiny_models,
        family,
        verifier={"name": "block"},
        speculation={"draft_length": 3},
        generation={"max_new_tokens": depth, "temperature": 1.0},
    )
    # Seed 1: with seed 0 the first 1200 samples of the llama pair are a rare fluctuation for every verifier
    # (they share the draft's draws: p = 6e-6 for block and speculative alike, where seeds 1-7 give 0.2-0.86
    # and seed 0's next 4000 samples give 0.59).
    # --batch-size 64: each sample keeps its own seed, so these are the very samples decoded one at a time (checked on
    # both families: all 1200 token sequences equal), decoded in half the time or less.
    code, out, err = run(
        ["generate", "-r", str(write_recipe(recipe)), "--json", "--num-samples", str(samples), "--seed", "1"]
        + ["--batch-size", "64", "a b c d"]
    )
    assert code == 0, err
    results = json.loads(out)["samples"]
    counts = Counter(tuple(sample["token_ids"]) for sample in results)
    accepted = sum(sample["stats"]["accepted_tokens"] for sample in results)
    drafted = sum(sample["stats"]["drafted_tokens"] for sample in results)
    assert 0.05 < accepted / drafted < 0.95, "the draft must be accepted sometimes and rejected sometimes"
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    prompt_ids = decoder.encode_prompt("a b c d")
    laws = {
        role: exact_sequence_law(model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
        for role, model in (("target", decoder.target.model), ("draft", decoder.drafters[0].session.model))
    }
    assert chi_square_p_value(counts, laws["target"]) > 1e-3
    assert chi_square_p_value(counts, laws["draft"]) < 1e-6  # the check has power


def test_is_lp_solves_only_what_rows_alive_together_need():
    """Rows that differ at the first token are never alive together later: their later supports are not
    pooled into one LP (that LP would exceed max_support here and be refused)."""
    verifier = load_verifier("is-lp", {"max_support": 4})
    shared = torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0], dtype=torch.float64)  # position 0: both rows
    after_a = torch.tensor([0, 0, 0.4, 0.3, 0.3, 0, 0, 0], dtype=torch.float64)  # row 0 after token 0
    after_b = torch.tensor([0, 0, 0, 0, 0, 0.4, 0.3, 0.3], dtype=torch.float64)  # row 1 after token 1
    target = torch.full((8,), 1 / 8, dtype=torch.float64)
    target_probs = torch.stack([torch.stack([target] * 3)] * 2)  # [2, 3, 8]
    draft_probs = torch.stack([torch.stack([shared, after_a]), torch.stack([shared, after_b])])  # [2, 2, 8]
    draft_tokens = torch.tensor([[0, 2], [1, 5]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        decision = verifier.verify_block(target_probs, draft_probs, draft_tokens, generator)
        n, row = int(decision.num_accepted), int(decision.row)
        assert decision.tokens[:n].tolist() == draft_tokens[row, :n].tolist()
    assert float(verifier.block_law(target_probs, draft_probs, draft_tokens).sum()) == pytest.approx(1.0, abs=1e-12)
