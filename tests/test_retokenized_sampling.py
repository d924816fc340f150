"""The retokenize-sample drafter: a draft model of another vocabulary samples from its law over the tokens the two
vocabularies share (token-level intersection), which it reports as the law of the target ids it proposes. Through
the real recipe path, with the drafts of tests/retokenize_models.py: the first tokens follow the target's law
through every lossless verifier (chi-square, with a negative control that must fail it); a sample is the same at
B = 1 and B = 4, with and without a KV cache, static or dynamic; the draft context grows as a full read-back of
the committed ids gives it, and the reported laws are a full forward's over it, windows included."""

from __future__ import annotations

import json
import types

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import UsageError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import sampling_law
from specdec_cli.kit.testing import TINY_VOCAB, chi_square_p_value, tiny_tokenizer
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins._vocab_intersection import VocabularyIntersection
from specdec_plugins.retokenized_drafter import SampledRetokenizedDrafter
from tests.retokenize_models import (
    DRAFT_VOCAB,
    PROMPTS,
    first_tokens,
    retokenize_models,
    retokenize_recipe,
    samples_in_order,
    save_draft,
)
from tests.row_acceptance import ONE_ROW_KEYS, acceptance, one_row_acceptance

SAMPLE = SampledRetokenizedDrafter.name
LONG_PROMPTS = [" ".join(["a b c d"] * 4), *PROMPTS]
"""Prompts of 16 words down to one: with a draft of 16 positions, each sequence's window moves at its own time."""
WITHOUT_E = [word for word in DRAFT_VOCAB if word != "e"]
"""A draft vocabulary that lacks a target word: a committed "e" is read back through its text (the draft's <unk>)."""
NEAR_THE_TARGET = 3.0
"""The temperature the target's own weights under the draft's ids sample at, so that their law is near the target's
(at temperature 1) but not it: about two thirds of their tokens are accepted."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("retokenize-sample")
    return {**retokenize_models(root), "short": save_draft(root / "short", "llama", WITHOUT_E, positions=16)}


def _decoder(
    models,
    draft="gpt2",
    verifier="speculative",
    num_drafts=1,
    drafter=SampledRetokenizedDrafter,
    draft_temperature=None,
    **settings,
):
    """A decoder with one retokenize-sample entry over ``models[draft]`` (``drafter`` registered in-process under its
    name), sampling at ``draft_temperature`` where given (the entry's own), else at the run's; ``settings``:
    speculation's cache switches or generation's."""
    recipe = retokenize_recipe(models, draft, drafter=drafter.name)
    if draft_temperature is not None:
        recipe["drafts"][0]["temperature"] = draft_temperature
    speculation = {key: settings.pop(key) for key in ("kv_cache", "static_cache") if key in settings}
    recipe.update(verifier={"name": verifier}, speculation={"draft_length": 3, "num_drafts": num_drafts, **speculation})
    recipe["generation"].update(settings)
    return SpeculativeDecoder.from_recipe(build_recipe(recipe), drafters=DrafterRegistry(extra={drafter.name: drafter}))


# --------------------------------------------------------------------------- the target's law


LOSSLESS = sorted(name for name in VerifierRegistry().names() if VerifierRegistry().load_class(name).lossless)


@pytest.mark.parametrize("verifier", LOSSLESS)
def test_the_first_tokens_follow_the_targets_law_through_every_lossless_verifier(models, verifier):
    """1000 keyed samples at B = 64, chi-square against the law enumerated from the target alone; K = 2 independent
    rows where the verifier takes them, which accept more than one row on the same keys (the first 300: 0.80 to 0.86
    against 0.66; match 0.53 against 0.29): the second row is in the decisions the test checks. The draft: the
    target's weights under the draft's ids, sampled at :data:`NEAR_THE_TARGET`."""
    num_drafts = 2 if VerifierRegistry().load_class(verifier).max_drafts is None else 1
    decoder = _decoder(models, "same-weights", verifier, num_drafts, draft_temperature=NEAR_THE_TARGET)
    assert decoder.num_draft_rows == num_drafts
    counts, law, results = first_tokens(decoder, 1000, batch_size=64)
    assert 0.05 < acceptance(results) < 0.95, "the drafts must be accepted sometimes and rejected sometimes"
    if num_drafts > 1:
        assert acceptance(results, ONE_ROW_KEYS) > one_row_acceptance(decoder.with_config(num_drafts=1), PROMPTS[0])
    assert chi_square_p_value(counts, law) > 1e-3


class MisreportingSampler(SampledRetokenizedDrafter):
    """Negative control: tokens drawn as retokenize-sample draws them, reported as drawn from the uniform law over the
    intersection (the tokens it can draw: a lie of the right support)."""

    name = "misreporting-retokenize-sample"

    def propose(self, request):
        proposal = super().propose(request)
        shared = torch.zeros(self.draft_setup.vocab_size, device=proposal.laws.device)  # [V]
        shared[self.intersection.target_ids.to(shared.device)] = 1.0
        proposal.laws = (shared / shared.sum()).expand_as(proposal.laws).clone()  # [B, K, n, V]
        return proposal


def test_a_misreported_law_fails_the_same_chi_square(models):
    lying = _decoder(models, "same-weights", drafter=MisreportingSampler, draft_temperature=NEAR_THE_TARGET)
    counts, law, _ = first_tokens(lying, 1000, batch_size=64)
    assert chi_square_p_value(counts, law) < 1e-3


def test_greedy_at_temperature_0_equals_the_target_alone(models):
    """At temperature 0 the draft's law is one-hot on its likeliest shared token; the target's own weights under the
    draft's ids propose what the target writes, and most of it is accepted."""
    for draft in ("same-weights", "gpt2"):
        decoder = _decoder(models, draft, max_new_tokens=12, temperature=0.0)
        drafted = decoder.generate(PROMPTS, batch_size=4)
        alone = decoder.generate(PROMPTS, batch_size=4, verifier="none")
        assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
        if draft == "same-weights":
            accepted, proposed = (
                sum(getattr(r.stats, key) for r in drafted) for key in ("accepted_tokens", "drafted_tokens")
            )
            assert accepted > 0.5 * proposed, (accepted, proposed)


# --------------------------------------------------------------------------- batches and caches


def test_a_sample_is_the_same_at_b_1_and_b_4_with_any_cache(models):
    """K = 2 rows through SpecInfer, sequences of different lengths leaving the batch: the keyed samples at B = 1
    equal those at B = 4 with the dynamic cache, the static one (which the note says nothing against) and none."""
    decoder = _decoder(models, verifier="specinfer", num_drafts=2, max_new_tokens=12)
    alone = samples_in_order(decoder, PROMPTS[2], 8, batch_size=1)
    assert samples_in_order(decoder, PROMPTS[2], 8, batch_size=4) == alone
    static = _decoder(models, verifier="specinfer", num_drafts=2, max_new_tokens=12, static_cache=True)
    assert static.cache_notes == [] and static.drafters[0].session.headroom is not None
    assert samples_in_order(static, PROMPTS[2], 8, batch_size=4) == alone
    uncached = _decoder(models, verifier="specinfer", num_drafts=2, max_new_tokens=12, kv_cache=False)
    assert samples_in_order(uncached, PROMPTS[2], 8, batch_size=4) == alone


class CheckedSampler(SampledRetokenizedDrafter):
    """retokenize-sample, checked at each block against what it would be read from scratch: each sequence's draft ids
    against :meth:`draft_context` of its committed ids, and row 0's reported laws against a forward of the draft
    model, with no cache, over its window and the draft ids drawn before each position."""

    name = "checked-retokenize-sample"
    context_mismatches: list[tuple[list[int], list[int]]] = []
    law_differences: list[float] = []
    longest_read: list[int] = []

    def add_sequences(self, prompts, contexts, timer):
        self.prompts = getattr(self, "prompts", []) + [list(prompt) for prompt in prompts]
        super().add_sequences(prompts, contexts, timer)

    def remove_sequences(self, kept):
        self.prompts = [self.prompts[b] for b in kept] if kept else []
        super().remove_sequences(kept)

    def propose(self, request):
        proposal = super().propose(request)
        for b, context in enumerate(request.contexts):
            expected = self.draft_context(self.prompts[b], context)
            if self.contexts[b] != expected:
                self.context_mismatches.append((self.contexts[b], expected))
            window = self._window(b)
            drawn = self.intersection.draft_by_target[proposal.tokens[b, 0]].tolist()  # [n]
            self.longest_read.append(len(window) + len(drawn))
            for t in range(proposal.tokens.shape[-1]):
                ids = torch.tensor([window + drawn[:t]])  # [1, m]
                logits = self.draft_setup.model.model(input_ids=ids).logits[:, -1, : self.draft_vocab]  # [1, V_draft]
                law, _ = sampling_law(self.intersection.target_logits(logits), self.draft_setup.sampling)  # [1, V]
                self.law_differences.append(float((law[0] - proposal.laws[b, 0, t]).abs().max()))
        return proposal


@pytest.mark.parametrize("static_cache", [False, True])
def test_the_draft_context_grows_as_a_full_read_back_gives_it(models, static_cache):
    """A draft of 16 positions, prompts of 16 words down to one, 20 new tokens, K = 2 at B = 4: at every block each
    sequence's draft ids are those read back from scratch, no window with its draft passes 16, and the laws the
    cached session gives are those of a forward over the window with no cache."""
    CheckedSampler.context_mismatches, CheckedSampler.law_differences, CheckedSampler.longest_read = [], [], []
    decoder = _decoder(models, "short", "specinfer", 2, CheckedSampler, max_new_tokens=20, static_cache=static_cache)
    results = decoder.generate(LONG_PROMPTS, batch_size=4)
    assert all(len(result.token_ids) > 0 for result in results)
    assert CheckedSampler.context_mismatches == []
    assert max(CheckedSampler.longest_read) == 16, "the windows must move, and never past the draft's positions"
    assert len(CheckedSampler.law_differences) > 40 and max(CheckedSampler.law_differences) < 1e-5


# --------------------------------------------------------------------------- the intersection and the entries


def test_the_intersection_pairs_the_strings_the_vocabularies_share():
    """The target's words under the draft's ids, and the draft's two words the target lacks left out: their logits
    fall outside the target's vocabulary, and a target word the draft lacks gets -inf."""
    draft_words = [word for word in DRAFT_VOCAB if word != "e"]
    intersection = VocabularyIntersection.build(
        tiny_tokenizer(), tiny_tokenizer(draft_words), len(TINY_VOCAB), len(draft_words), "cpu", "cpu"
    )
    shared = [word for word in TINY_VOCAB if word != "e"]
    assert intersection.draft_of_target == {TINY_VOCAB.index(word): draft_words.index(word) for word in shared}
    draft_logits = torch.arange(len(draft_words), dtype=torch.float).view(1, -1)  # [1, V_draft]
    logits = intersection.target_logits(draft_logits)[0]  # [V]
    assert logits[TINY_VOCAB.index("e")] == float("-inf")
    assert [logits[TINY_VOCAB.index(word)].item() for word in shared] == [draft_words.index(word) for word in shared]


def test_committed_ids_are_read_back_as_the_draft_ids_that_stand_for_them_else_as_text():
    """After the prompt's text, each committed target id is its draft id where the draft has its word; "e", which
    it lacks, is its text encoded by the draft (its <unk>)."""
    drafter = SampledRetokenizedDrafter()
    target, draft = tiny_tokenizer(), tiny_tokenizer(WITHOUT_E)
    drafter.draft_setup = types.SimpleNamespace(
        target=types.SimpleNamespace(tokenizer=target), model=types.SimpleNamespace(tokenizer=draft)
    )
    drafter.intersection = VocabularyIntersection.build(target, draft, len(TINY_VOCAB), len(WITHOUT_E), "cpu", "cpu")
    context = [TINY_VOCAB.index(word) for word in "a b e c".split()]
    assert drafter.draft_context(context[:2], context) == [WITHOUT_E.index(word) for word in "a b <unk> c".split()]


def test_a_verifier_that_judges_by_other_laws_takes_its_rows(models):
    """fuzzy judges drafts by the unprocessed laws, which a sampling drafter must report: it does."""
    decoder = _decoder(models, verifier="fuzzy", max_new_tokens=6, temperature=0.7)
    assert decoder.judged_view is not None
    assert all(result.token_ids for result in decoder.generate(PROMPTS, batch_size=4))


def test_an_entry_without_a_model_is_one_line_before_any_model_loads(models):
    recipe = retokenize_recipe(models, entry={"drafter": SAMPLE})
    with pytest.raises(UsageError) as error:
        SpeculativeDecoder.check_recipe(
            build_recipe(recipe),
            VerifierRegistry(),
            drafters=DrafterRegistry(extra={SAMPLE: SampledRetokenizedDrafter}),
        )
    assert str(error.value) == (
        f"drafts.0: the {SAMPLE} drafter needs 'model' (hub id, local directory or .gguf file) and no 'early_exit': "
        "a draft model with a tokenizer of its own"
    )


@pytest.mark.skipif(SAMPLE not in DrafterRegistry().names(), reason=f"no '{SAMPLE}' entry point installed yet")
def test_generate_with_a_retokenize_sample_entry(run, models, write_recipe):
    recipe = retokenize_recipe(models, "gpt2", drafter=SAMPLE)
    code, out, err = run(["generate", "-r", str(write_recipe(recipe)), "--json", PROMPTS[0]])
    assert code == 0, err
    output = json.loads(out)
    assert output["samples"][0]["stats"]["draft_forwards"] > 0
    assert output["recipe"]["drafts"][0]["drafter"] == SAMPLE
