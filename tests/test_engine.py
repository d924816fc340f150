"""The engine end to end on tiny models loaded through the recipe path.

Exactness: the empirical law of the first tokens under speculative decoding matches the
target's law enumerated from the target alone. Greedy: identical to transformers' own greedy
`generate`. Cache rollback: identical to a run that recomputes everything without a cache.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams, probs_from_logits
from specdec_cli.kit.testing import EOS_ID, chi_square_p_value, exact_sequence_law, keyed_samples
from specdec_cli.plugins.verifier_registry import VerifierRegistry
from specdec_plugins._problem_walk import verify_by_problems
from specdec_plugins.specinfer import SpecInfer
from tests import row_acceptance
from tests.conftest import tiny_recipe

PROMPT = "a b c d"


def _decoder(models, family, **sections) -> SpeculativeDecoder:
    return SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(models, family, **sections)))


LAW_CASES = [(family, length, False) for family in ("llama", "t5") for length in (1, 2, 3)]
LAW_CASES += [("llama", 3, True), ("gpt2", 2, True)]


@pytest.mark.parametrize("family,draft_length,static_cache", LAW_CASES)
def test_first_tokens_follow_the_target_law(tiny_models, family, draft_length, static_cache):
    """One loop for every batch size: samples decoded 16 at a time follow the target's law, with the dynamic cache
    and with the static one (rows written at their own slots, rejected ones overwritten), and a sample decoded alone
    (a batch of one) is the very sample decoded in the batch, so the law holds for it too."""
    depth, samples, alone = 3, 1500, 48
    decoder = _decoder(
        tiny_models,
        family,
        speculation={"draft_length": draft_length, "static_cache": static_cache},
        generation={"max_new_tokens": depth, "temperature": 1.0},
    )
    prompt_ids = decoder.encode_prompt(PROMPT)
    law = exact_sequence_law(decoder.target.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    results = keyed_samples(decoder, PROMPT, samples, 64)
    by_key = {result.prompt_index: result.token_ids for result in results}  # keyed_samples: prompt index = key
    assert {r.prompt_index: r.token_ids for r in keyed_samples(decoder, PROMPT, alone, 1)} == {
        key: by_key[key] for key in range(alone)
    }
    counts = Counter(tuple(result.token_ids) for result in results)
    accepted = sum(result.stats.accepted_tokens for result in results)
    drafted = sum(result.stats.drafted_tokens for result in results)
    assert 0.05 < accepted / drafted < 0.95, "the draft must be accepted sometimes and rejected sometimes"
    assert chi_square_p_value(counts, law) > 1e-3
    # The test has power: the draft's own law is clearly rejected by the same check.
    draft_law = exact_sequence_law(
        decoder.drafters[0].session.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID}
    )
    assert chi_square_p_value(counts, draft_law) < 1e-6


def _transformers_greedy(decoder: SpeculativeDecoder, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = decoder.target.model
    output = model.generate(
        torch.tensor([prompt_ids]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )[0].tolist()
    generated = output[1:] if decoder.target.is_encoder_decoder else output[len(prompt_ids) :]
    return generated[: generated.index(EOS_ID) + 1] if EOS_ID in generated else generated


@pytest.mark.parametrize(
    "family,static_cache", [("llama", False), ("gpt2", False), ("t5", False), ("llama", True), ("gpt2", True)]
)
@pytest.mark.parametrize("prompt", ["a b c d", "e e a", "b", "d c b a e d c b a"])
def test_greedy_equals_target_greedy(tiny_models, family, static_cache, prompt):
    speculation = {"static_cache": static_cache}
    decoder = _decoder(
        tiny_models, family, generation={"max_new_tokens": 40, "temperature": 0.0}, speculation=speculation
    )
    prompt_ids = decoder.encode_prompt(prompt)
    tokens, _, stats = decoder.generate_ids(prompt_ids, key=0)
    assert tokens == _transformers_greedy(decoder, prompt_ids, 40)
    assert len(tokens) <= 40


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_greedy_runs_include_frequent_disagreement(tiny_models, family):
    """The greedy equality above is not vacuous: the tiny drafts are rejected often."""
    decoder = _decoder(tiny_models, family, generation={"max_new_tokens": 40, "temperature": 0.0})
    rejected = 0
    for prompt in ["a b c d", "e e a", "b", "d c b a e d c b a"]:
        _, _, stats = decoder.generate_ids(decoder.encode_prompt(prompt), key=0)
        rejected += stats.drafted_tokens - stats.accepted_tokens
    assert rejected >= 5


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_rollback_matches_full_recomputation(tiny_models, family, temperature):
    generation = {"max_new_tokens": 80, "temperature": temperature}
    cached = _decoder(tiny_models, family, generation=generation, speculation={"draft_length": 4})
    uncached = _decoder(tiny_models, family, generation=generation, speculation={"draft_length": 4, "kv_cache": False})
    rejections = 0
    for seed in range(6):
        prompt_ids = cached.encode_prompt("a b c d e")
        tokens, mask, stats = cached.generate_ids(prompt_ids, seed)
        reference, reference_mask, _ = uncached.generate_ids(prompt_ids, seed)
        assert tokens == reference
        assert mask == reference_mask
        rejections += stats.drafted_tokens - stats.accepted_tokens
    assert rejections > 6


def test_never_overshoots_and_counts_add_up(tiny_models):
    decoder = _decoder(tiny_models, "gpt2", generation={"max_new_tokens": 7}, speculation={"draft_length": 5})
    for seed in range(20):
        tokens, mask, stats = decoder.generate_ids(decoder.encode_prompt("a b"), seed)
        assert len(tokens) == len(mask) == stats.new_tokens <= 7
        assert stats.stop_reason == ("eos" if tokens[-1] == EOS_ID else "max_new_tokens")
        assert EOS_ID not in tokens[:-1]
        assert stats.accepted_tokens == sum(mask)
        assert stats.accepted_tokens <= stats.verified_tokens <= stats.drafted_tokens
        assert sum(stats.accepted_per_position) == stats.accepted_tokens
        assert stats.target_forwards == stats.blocks
        assert stats.block_efficiency == pytest.approx(stats.new_tokens / stats.target_forwards)


def test_autoregressive_baseline_uses_the_same_sampler(tiny_models):
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 3}))
    decoder = SpeculativeDecoder.from_recipe(recipe, autoregressive=True)
    prompt_ids = decoder.encode_prompt(PROMPT)
    law = exact_sequence_law(decoder.target.model, prompt_ids, 3, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    counts = Counter(tuple(decoder.generate_ids(prompt_ids, seed)[0]) for seed in range(800))
    assert chi_square_p_value(counts, law) > 1e-3
    _, _, stats = decoder.generate_ids(prompt_ids, 0)
    assert stats.draft_forwards == 0 and stats.target_forwards == stats.new_tokens


def test_same_seed_same_output_and_seeds_differ(tiny_models):
    decoder = _decoder(tiny_models, "llama", generation={"max_new_tokens": 20})
    first = decoder.generate(["a b", "c d"], num_samples=2)
    second = decoder.generate(["a b", "c d"], num_samples=2)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert [(r.prompt_index, r.sample_index) for r in first] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({tuple(r.token_ids) for r in first}) > 1


def test_padded_vocabulary_is_aligned(tmp_path, tiny_models):
    from specdec_cli.kit.testing import save_tiny_model

    padded = save_tiny_model(tmp_path / "padded-draft", "llama", seed=9, layers=1, vocab_size=12)
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["draft"]["model"] = str(padded)
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert decoder.vocab_size == 8
    tokens, _, _ = decoder.generate_ids(decoder.encode_prompt("a b"), 0)
    assert all(0 <= t < 8 for t in tokens)


def test_early_exit_draft_shares_the_target_weights(tiny_models):
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["draft"] = {"early_exit": 1}
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    draft = decoder.drafters[0].session.model
    target = decoder.target.model
    assert draft.config.num_hidden_layers == 1
    assert draft.model.layers[0].self_attn.q_proj.weight is target.model.layers[0].self_attn.q_proj.weight
    assert draft.lm_head.weight is target.lm_head.weight
    # Its logits are the target's first layer followed by the target's final norm and head.
    ids = torch.tensor([decoder.encode_prompt("a b c")])
    with torch.inference_mode():
        hidden = target.model(ids, output_hidden_states=True).hidden_states[1]
        expected = target.lm_head(target.model.norm(hidden))
        torch.testing.assert_close(draft(ids).logits, expected)
    tokens, _, _ = decoder.generate_ids(ids[0].tolist(), 0)
    assert tokens


def test_early_exit_on_an_encoder_decoder_cuts_the_decoder(tiny_models):
    """The draft keeps the whole encoder and the decoder's first layer (it used to cut the encoder)."""
    recipe = tiny_recipe(tiny_models, "t5")
    recipe["draft"] = {"early_exit": 1}
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    draft, target = decoder.drafters[0].session.model, decoder.target.model
    assert len(draft.decoder.block) == 1 < len(target.decoder.block)
    assert len(draft.encoder.block) == len(target.encoder.block)
    assert (
        draft.decoder.block[0].layer[0].SelfAttention.q.weight
        is target.decoder.block[0].layer[0].SelfAttention.q.weight
    )
    tokens, _, _ = decoder.generate_ids(decoder.encode_prompt("a b c"), 0)
    assert tokens


MULTI_DRAFT_CASES = [
    (name, num_drafts, distinct)
    for name in ("specinfer", "spectr", "is-lp", "is-truncated")
    for num_drafts in (1, 2, 3)
    for distinct in (False, True)
    if not (distinct and (name == "spectr" or num_drafts == 1))
]


def _multi_draft_recipe(models, name: str, num_drafts: int, distinct: bool, **generation) -> dict:
    recipe = tiny_recipe(models, "llama", verifier={"name": name}, generation=generation)
    draft = recipe.pop("draft")
    if distinct:  # drafts that differ only in temperature (the multi-draft paper's non-identical drafts)
        recipe["drafts"] = [{**draft, "temperature": 0.7 + 0.4 * k} for k in range(num_drafts)]
    else:
        recipe["drafts"] = [draft]
        recipe["speculation"] = {**recipe["speculation"], "num_drafts": num_drafts}
    return recipe


def _rows_that_matter_recipe(models, name: str, num_drafts: int, distinct: bool, **generation) -> dict:
    """:func:`_multi_draft_recipe` drafting from the target's own checkpoint at T = 0.5 (and 0.8, 1.1 for distinct
    rows). The tiny llama draft is rejected where p > q, where the residual leaves later rows nothing: SpecInfer at
    K = 3 then accepted exactly what K = 1 did (0.233 both), and its K-row law was never tested."""
    recipe = _multi_draft_recipe(models, name, num_drafts, distinct, **generation)
    target = str(models["llama-target"])
    recipe["drafts"] = [
        {**draft, "model": target, "temperature": 0.5 + 0.3 * k} for k, draft in enumerate(recipe["drafts"])
    ]
    return recipe


def _first_tokens(decoder: SpeculativeDecoder, samples: int) -> tuple[Counter, float]:
    results = keyed_samples(decoder, PROMPT, samples)
    return Counter(tuple(r.token_ids) for r in results), row_acceptance.acceptance(results)


@pytest.mark.parametrize(("name", "num_drafts", "distinct"), MULTI_DRAFT_CASES)
def test_multi_draft_verifiers_keep_the_target_law(tiny_models, one_row, first_token_laws, name, num_drafts, distinct):
    """The first tokens follow the target's law, not the first draft's (the check has power), and K > 1 rows accept
    more than one row does on the same keys (the later rows are in the decisions the test checks)."""
    if num_drafts == 1:
        counts, acceptance = one_row(name)
    else:
        recipe = _rows_that_matter_recipe(tiny_models, name, num_drafts, distinct, max_new_tokens=2, temperature=1.0)
        decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
        assert decoder.num_draft_rows == num_drafts
        counts, acceptance = _first_tokens(decoder, MULTI_DRAFT_SAMPLES)
        assert acceptance > one_row(name)[1]
    assert chi_square_p_value(counts, first_token_laws["target"]) > 1e-3
    assert chi_square_p_value(counts, first_token_laws["draft"]) < 1e-6


MULTI_DRAFT_SAMPLES = 500


@pytest.fixture(scope="module")
def first_token_laws(tiny_models) -> dict[str, dict]:
    """The exact laws of the first two tokens: the target's, and its checkpoint's at the first draft's T = 0.5."""
    recipe = _rows_that_matter_recipe(tiny_models, "specinfer", 1, False, max_new_tokens=2)
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    prompt_ids = decoder.encode_prompt(PROMPT)
    return {
        role: exact_sequence_law(
            decoder.target.model, prompt_ids, 2, SamplingParams(temperature), decoder.vocab_size, {EOS_ID}
        )
        for role, temperature in (("target", 1.0), ("draft", 0.5))
    }


@pytest.fixture(scope="module")
def one_row(tiny_models):
    """one_row(name) → the counts of the first tokens and the acceptance of verifier ``name`` with one row, on the
    law test's keys (decoded once per verifier: the K = 1 case and the K > 1 cases' comparison)."""
    found: dict[str, tuple[Counter, float]] = {}

    def decoded(name: str) -> tuple[Counter, float]:
        if name not in found:
            recipe = _rows_that_matter_recipe(tiny_models, name, 1, False, max_new_tokens=2, temperature=1.0)
            found[name] = _first_tokens(SpeculativeDecoder.from_recipe(build_recipe(recipe)), MULTI_DRAFT_SAMPLES)
        return found[name]

    return decoded


class _SpecInferWithoutResidualUpdates(SpecInfer):
    """Negative control: SpecInfer that tests every candidate against q itself and draws from q once all are rejected
    (it never subtracts a rejected candidate's law)."""

    name = "specinfer-without-residual-updates"

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        def stale_step(target_probs, draft_probs):
            def decide(t: int, alive: list[int], tokens: list[list[int]], uniforms: list[list[float]]):
                law = target_probs[alive[0], t]  # [V]
                for j in alive:
                    if uniforms[t][j] < min(1.0, float(law[tokens[j][t]]) / float(draft_probs[j, t, tokens[j][t]])):
                        return j, None
                return None, law

            return decide

        return verify_by_problems(target_probs, draft_probs, draft_tokens, randomness, stale_step, None)


def test_negative_control_the_law_test_rejects_specinfer_without_residual_updates(tiny_models):
    recipe = _rows_that_matter_recipe(tiny_models, _SpecInferWithoutResidualUpdates.name, 3, False, max_new_tokens=2)
    registry = VerifierRegistry(extra={_SpecInferWithoutResidualUpdates.name: _SpecInferWithoutResidualUpdates})
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe), registry=registry)
    law = exact_sequence_law(
        decoder.target.model, decoder.encode_prompt(PROMPT), 2, SamplingParams(1.0), decoder.vocab_size, {EOS_ID}
    )
    assert chi_square_p_value(_first_tokens(decoder, MULTI_DRAFT_SAMPLES)[0], law) < 1e-6


@pytest.mark.parametrize("name", ["specinfer", "spectr", "is-lp", "is-truncated", "mentored", "block"])
def test_multi_draft_greedy_equals_target_greedy(tiny_models, name):
    recipe = _multi_draft_recipe(
        tiny_models, name, 1 if name in ("mentored", "block") else 3, False, max_new_tokens=30, temperature=0.0
    )
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    prompt_ids = decoder.encode_prompt("d c b a e")
    tokens, _, _ = decoder.generate_ids(prompt_ids, key=0)
    assert tokens == _transformers_greedy(decoder, prompt_ids, 30)


@pytest.mark.parametrize(("name", "distinct"), [("specinfer", True), ("spectr", False)])
def test_engine_acceptance_matches_the_verifiers_closed_form(tiny_models, name, distinct):
    """With K = 3 drafts, how often the engine accepts at the first position is the exact value."""
    recipe = _multi_draft_recipe(tiny_models, name, 3, distinct, max_new_tokens=2)
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    prompt_ids = decoder.encode_prompt(PROMPT)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        target = decoder.target.model(ids).logits[0, -1, : decoder.vocab_size]
        draft = decoder.drafters[0].session.model(ids).logits[0, -1, : decoder.vocab_size]
    q = probs_from_logits(target, decoder.target_params).double()
    p = torch.stack([probs_from_logits(draft, params) for params in decoder.drafters[0].row_params]).double()
    expected = float(decoder.verifier.acceptance_probability(q, p))
    samples = 3000
    accepted = sum(r.stats.accepted_per_position[:1] == [1] for r in keyed_samples(decoder, PROMPT, samples))
    assert abs(accepted / samples - expected) < 4 * (expected * (1 - expected) / samples) ** 0.5
    single = float(decoder.verifier.acceptance_probability(q, p[:1]))
    assert expected > single  # three drafts do accept more often than one


def test_spectr_refuses_drafts_of_different_temperatures(tiny_models):
    from specdec_cli.base.errors import UsageError

    with pytest.raises(UsageError, match="needs identical drafts"):
        SpeculativeDecoder.from_recipe(build_recipe(_multi_draft_recipe(tiny_models, "spectr", 2, True)))


def test_mentored_accepts_at_least_as_often_as_speculative(tiny_models):
    rates = []
    for verifier in ({"name": "speculative"}, {"name": "mentored", "params": {"kl": 0.5}}):
        decoder = _decoder(tiny_models, "llama", verifier=verifier, generation={"max_new_tokens": 30})
        results = decoder.generate(["a b c", "d e"], num_samples=10)
        rates.append(sum(r.stats.accepted_tokens for r in results) / sum(r.stats.drafted_tokens for r in results))
    assert rates[1] > rates[0]
