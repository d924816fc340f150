"""The retokenize drafter (greedy): a draft model with a vocabulary of its own, its text proposed in the target's
ids. The drafts of tests/retokenize_models.py, of other vocabularies than the target's (the same words under other
ids, and two words more): the target's own weights under the draft's ids, whose greedy text is the target's, and a
random GPT-2. Through the real recipe path: greedy equals the target alone at B = 1 and B = 4, with the static
cache, and with a draft of 16 positions whose windows move; the first tokens follow the target's law (chi-square,
with a negative control that must fail it); and the entries and messages that choose it."""

from __future__ import annotations

import json
import types

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import ModelLoadError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.kit.testing import TINY_VOCAB, chi_square_p_value, save_tiny_model, tiny_tokenizer
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins.retokenized_drafter import RetokenizedDrafter
from tests.conftest import one_error_line
from tests.retokenize_models import (
    DRAFT_VOCAB,
    PROMPTS,
    first_tokens,
    retokenize_models,
    retokenize_recipe,
    samples_in_order,
    save_draft,
)
from tests.row_acceptance import acceptance


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return retokenize_models(tmp_path_factory.mktemp("retokenize"))


def _recipe(models, draft="same-weights", entry=None, **generation):
    return retokenize_recipe(models, draft, entry, **generation)


def _decoder(models, draft="same-weights", **generation):
    return SpeculativeDecoder.from_recipe(build_recipe(_recipe(models, draft, **generation)))


# --------------------------------------------------------------------------- greedy, at B = 1 and B = 4


@pytest.mark.parametrize("draft", ["same-weights", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_with_a_draft_of_another_vocabulary_equals_the_target_alone(models, draft, batch_size):
    decoder = _decoder(models, draft, max_new_tokens=20, temperature=0.0)
    drafted = decoder.generate(PROMPTS, batch_size=batch_size)
    alone = decoder.generate(PROMPTS, batch_size=batch_size, verifier="none")
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
    assert all(r.stats.draft_forwards > 0 for r in drafted)
    if draft == "same-weights":  # its text is the target's: most of it is accepted once mapped to the target's ids
        accepted, proposed = (
            sum(getattr(r.stats, name) for r in drafted) for name in ("accepted_tokens", "drafted_tokens")
        )
        assert accepted > 0.5 * proposed, (accepted, proposed)


def test_model_rows_and_retokenized_rows_share_a_block(models):
    """Through specinfer, which takes drafts of different laws: K = 2 rows of a draft of the target's tokenizer beside
    one retokenized row, three sequences in a batch; greedy still equals the target alone."""
    recipe = _recipe(models, max_new_tokens=12, temperature=0.0)
    recipe["drafts"].insert(0, {"model": str(models["same-tokenizer"]), "device": "cpu"})
    recipe.update(verifier={"name": "specinfer"}, speculation={"draft_length": 3, "num_drafts": 2})
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert decoder.num_draft_rows == 3
    drafted = decoder.generate(PROMPTS[:3], batch_size=3)
    alone = decoder.generate(PROMPTS[:3], batch_size=3, verifier="none")
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]


# --------------------------------------------------------------------------- the target's law


class MisreportingRetokenizer(RetokenizedDrafter):
    """Negative control: the retokenized tokens, reported as drawn from the uniform law (they were not)."""

    name = "misreporting-retokenize"
    deterministic = False  # as a drafter whose laws are not one-hot must say

    def propose(self, request):
        proposal = super().propose(request)
        proposal.laws = torch.full_like(proposal.laws, 1 / self.draft_setup.vocab_size)
        return proposal


LOSSLESS = sorted(name for name in VerifierRegistry().names() if VerifierRegistry().load_class(name).lossless)


@pytest.mark.parametrize("verifier", LOSSLESS)
def test_the_first_tokens_follow_the_targets_law_through_every_lossless_verifier(models, verifier):
    """1000 keyed samples, chi-square against the law enumerated from the target alone: at B = 4 for speculative
    sampling, 16 for the others (a keyed sample does not depend on its batch: below). K = 2 where the verifier
    takes it: a deterministic drafter still fills one row."""
    recipe = _recipe(models)
    num_drafts = 2 if VerifierRegistry().load_class(verifier).max_drafts is None else 1
    recipe.update(verifier={"name": verifier}, speculation={"draft_length": 3, "num_drafts": num_drafts})
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert decoder.num_draft_rows == 1
    counts, law, results = first_tokens(decoder, 1000, batch_size=4 if verifier == "speculative" else 16)
    assert 0.05 < acceptance(results) < 0.95, "the drafts must be accepted sometimes and rejected sometimes"
    assert chi_square_p_value(counts, law) > 1e-3


def test_a_misreported_law_fails_the_same_chi_square(models):
    """Negative control: the same drafter reporting the uniform law."""
    drafters = DrafterRegistry(extra={MisreportingRetokenizer.name: MisreportingRetokenizer})
    recipe = _recipe(models, entry={"drafter": MisreportingRetokenizer.name, "model": str(models["same-weights"])})
    lying = SpeculativeDecoder.from_recipe(build_recipe(recipe), drafters=drafters)
    counts, law, _ = first_tokens(lying, 1000, batch_size=4)
    assert chi_square_p_value(counts, law) < 1e-3


def test_a_sample_is_the_same_at_b_1_and_b_4(models):
    """So the chi-square at B = 4 holds at B = 1: keyed samples do not depend on their batch."""
    decoder = _decoder(models, "gpt2", max_new_tokens=6)
    one = samples_in_order(decoder, PROMPTS[2], 8, batch_size=1)
    four = samples_in_order(decoder, PROMPTS[2], 8, batch_size=4)
    assert one == four


# --------------------------------------------------------------------------- between the tokenizers


@pytest.mark.parametrize(
    "text, expected",
    [(" d e", ["d", "e"]), ("", []), ("d", ["d"]), (" a f", ["a", "<unk>"])],
)
def test_the_draft_text_becomes_the_target_ids_that_follow_the_context(text, expected):
    """After "... c": " d e" are two words; "d" glued to "c" is the unknown "cd" if encoded with it, so the ids
    of "d" alone are proposed; a word the target lacks is its <unk>."""
    drafter = RetokenizedDrafter()
    drafter.draft_setup = types.SimpleNamespace(target=types.SimpleNamespace(tokenizer=tiny_tokenizer()))
    context = [TINY_VOCAB.index(word) for word in "a b c".split()]
    assert drafter._continuation(context, text) == [TINY_VOCAB.index(word) for word in expected]


# --------------------------------------------------------------------------- recipes and messages


def test_the_same_draft_without_the_retokenize_drafter_is_refused_by_the_tokenizer_check(models):
    recipe = _recipe(models, entry={"model": str(models["same-weights"]), "device": "cpu"})
    with pytest.raises(
        ModelLoadError, match="does not share the target's tokenizer .*set `drafter: retokenize` on its draft entry"
    ):
        SpeculativeDecoder.from_recipe(build_recipe(recipe))


def test_generate_with_a_retokenize_entry(run, models, write_recipe):
    code, out, err = run(["generate", "-r", str(write_recipe(_recipe(models))), "--json", PROMPTS[0]])
    assert code == 0, err
    output = json.loads(out)
    assert output["samples"][0]["stats"]["draft_forwards"] > 0
    assert output["recipe"]["drafts"][0]["drafter"] == "retokenize"


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"drafter": "retokenize"},
            "drafts.0: the retokenize drafter needs 'model' (hub id, local directory or .gguf file) and no "
            "'early_exit': a draft model with a tokenizer of its own",
        ),
        (
            {"drafter": "retokenize", "model": "MODEL", "temperature": 0.5},
            "drafts.0: the retokenize drafter writes greedily; remove temperature, top_k and top_p from the entry, or "
            "sample with drafter: retokenize-sample",
        ),
        (
            {"drafter": "retokenize", "model": "MODEL", "params": {"draft_tokens": 0}},
            "drafter 'retokenize': draft_tokens must be >= 1, got 0",
        ),
    ],
)
def test_a_bad_retokenize_entry_is_one_line_before_any_model_loads(run, models, write_recipe, entry, message):
    entry = {key: str(models["gpt2"]) if value == "MODEL" else value for key, value in entry.items()}
    recipe = _recipe(models, entry=entry)
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), PROMPTS[0]])
    assert code == 2
    one_error_line(err, message)


def test_a_context_past_the_draft_models_limit_is_read_from_a_window(models, tmp_path):
    """A draft that reads 16 positions, prompts of 1 to 16 words and 20 new tokens: each sequence's window moves
    (alone, at its own time) and the run goes on; greedy still equals the target alone, at B = 1 and B = 4."""
    entry = {"drafter": "retokenize", "model": str(save_draft(tmp_path / "short", "llama", DRAFT_VOCAB, 16))}
    recipe = _recipe(models, entry=entry, max_new_tokens=20, temperature=0.0)
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    prompts = [" ".join(["a b c d"] * 4), *PROMPTS]
    for batch_size in (1, 4):
        drafted = decoder.generate(prompts, batch_size=batch_size)
        alone = decoder.generate(prompts, batch_size=batch_size, verifier="none")
        assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
        assert all(r.stats.draft_forwards > 0 for r in drafted)


def test_the_static_cache_is_the_draft_models_too(models):
    """``speculation.static_cache``: the draft's session holds the static cache (no note says otherwise), and greedy
    still equals the target alone."""
    recipe = _recipe(models, "gpt2", max_new_tokens=12, temperature=0.0)
    recipe["speculation"]["static_cache"] = True
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert decoder.cache_notes == []
    assert decoder.drafters[0].session.headroom is not None
    drafted = decoder.generate(PROMPTS, batch_size=4)
    alone = decoder.generate(PROMPTS, batch_size=4, verifier="none")
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]


def test_an_encoder_decoder_target_is_refused_in_one_line(run, models, write_recipe, tmp_path):
    recipe = _recipe(models)
    recipe["target"]["model"] = str(save_tiny_model(tmp_path / "t5", "t5", seed=5))
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), PROMPTS[0]])
    assert code == 2
    one_error_line(
        err,
        f"the retokenize drafter drafts for decoder-only models, and the target {tmp_path / 't5'} is an "
        "encoder-decoder; use a draft that shares the target's tokenizer (drafter: model)",
    )


def test_a_draft_of_a_smaller_vocabulary(models, tmp_path):
    """A draft whose vocabulary is smaller than the target's does not narrow V: it proposes in the target's ids."""
    path = save_draft(tmp_path / "small", "gpt2", ["<pad>", "</s>", "<unk>", "c", "a", "b"])
    entry = {"drafter": "retokenize", "model": str(path), "device": "cpu"}
    recipe = _recipe(models, entry=entry, max_new_tokens=20, temperature=0.0)
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert decoder.vocab_size == len(TINY_VOCAB)
    drafted = decoder.generate(PROMPTS, batch_size=4)
    alone = decoder.generate(PROMPTS, batch_size=4, verifier="none")
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
