"""The adaptive draft length (``speculation.draft_length_schedule: heuristic``): transformers' rule, chosen from past
blocks only, so the output keeps the target's law; greedy stays the target's greedy; batch size changes nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams
from specdec_cli.engine.draft_schedule import next_draft_length
from specdec_cli.kit.testing import EOS_ID, chi_square_p_value, exact_sequence_law, keyed_samples
from tests.conftest import tiny_recipe

PROMPT = "a b c d"


def test_next_draft_length_follows_transformers_rule_within_one_and_l():
    assert next_draft_length("heuristic", 3, 6, drafted=3, accepted=3) == 5  # all accepted: +2
    assert next_draft_length("heuristic", 5, 6, drafted=5, accepted=5) == 6  # never past L
    assert next_draft_length("heuristic", 3, 6, drafted=3, accepted=1) == 2  # a rejection: −1
    assert next_draft_length("heuristic", 1, 6, drafted=1, accepted=0) == 1  # never below 1
    assert next_draft_length("heuristic", 4, 6, drafted=0, accepted=0) == 4  # nothing proposed: no evidence
    assert next_draft_length("constant", 4, 6, drafted=4, accepted=0) == 4


def _decoder(tiny_models, schedule: str, draft_length: int = 3, **generation) -> SpeculativeDecoder:
    recipe = tiny_recipe(
        tiny_models,
        speculation={"draft_length": draft_length, "draft_length_schedule": schedule},
        generation={"temperature": 1.0, **generation},
    )
    return SpeculativeDecoder.from_recipe(build_recipe(recipe))


def test_heuristic_schedule_keeps_the_target_law(tiny_models):
    """Five tokens span several blocks of up to two drafts, whose lengths the schedule picks from the blocks before;
    the empirical law of the whole output is the target's, and the draft's own law is rejected by the same check."""
    depth, samples = 5, 1500
    decoder = _decoder(tiny_models, "heuristic", max_new_tokens=depth, draft_length=2)
    prompt_ids = decoder.encode_prompt(PROMPT)
    law = exact_sequence_law(decoder.target.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    results = keyed_samples(decoder, PROMPT, samples)
    counts = Counter(tuple(result.token_ids) for result in results)
    assert chi_square_p_value(counts, law) > 1e-3
    draft_law = exact_sequence_law(
        decoder.drafters[0].session.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID}
    )
    assert chi_square_p_value(counts, draft_law) < 1e-6
    constant = keyed_samples(_decoder(tiny_models, "constant", max_new_tokens=depth, draft_length=2), PROMPT, samples)
    drafted = [
        sum(r.stats.drafted_tokens for r in run) / sum(r.stats.blocks for r in run) for run in (results, constant)
    ]
    assert drafted[0] < drafted[1] - 0.2, "the schedule shortened blocks after rejections"


def test_heuristic_greedy_equals_constant_greedy(tiny_models):
    """Greedy output does not depend on how blocks are cut: the same tokens as with a constant L (itself the
    target's greedy, tests/test_engine.py)."""
    heuristic = _decoder(tiny_models, "heuristic", max_new_tokens=40, temperature=0.0)
    constant = _decoder(tiny_models, "constant", max_new_tokens=40, temperature=0.0)
    prompts = ["a b c d", "e e a", "b", "d c b a e d c b a"]
    assert [r.token_ids for r in heuristic.generate(prompts)] == [r.token_ids for r in constant.generate(prompts)]
    lengths = [r.stats.drafted_tokens / r.stats.blocks for r in heuristic.generate(prompts)]
    assert min(lengths) < 3, "blocks were shortened somewhere"


@pytest.mark.parametrize("batch_size", [4])
def test_heuristic_schedule_does_not_depend_on_the_batch(tiny_models, batch_size):
    decoder = _decoder(tiny_models, "heuristic", max_new_tokens=16)
    alone = keyed_samples(decoder, PROMPT, 8, batch_size=1)
    batched = sorted(keyed_samples(decoder, PROMPT, 8, batch_size=batch_size), key=lambda r: r.prompt_index)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.stats.drafted_tokens for r in batched] == [r.stats.drafted_tokens for r in alone]
