"""Drafters as plugins (issue 21): prompt lookup's matching, its exactness through the lossless verifiers end to
end (with a negative control), model and prompt-lookup rows in one block, variable draft length, a misbehaving
drafter plugin, and the recipe entries and flags that choose drafters."""

from __future__ import annotations

import json
import random
import types
from collections import Counter

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import SpecdecError, UsageError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams, sampling_law
from specdec_cli.kit.conformance import ConformanceError, check_drafter
from specdec_cli.kit.testing import EOS_ID, chi_square_p_value, exact_sequence_law, keyed_samples
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.drafting import DraftSetup, SequenceProposal, SequenceRequest, block_length
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.plugins.verifiers import device_path
from specdec_plugins.prompt_lookup import PromptLookup
from tests.conftest import one_error_line, tiny_recipe
from tests.row_acceptance import ONE_ROW_KEYS, acceptance, one_row_acceptance

PROMPT = "a b c d a b c"  # repeats, so that prompt lookup finds matches from the first block
LOOKUP = {"drafter": "prompt-lookup"}


def _decoder(models, drafts: list[dict] | None = None, family: str = "llama", drafters=None, **sections):
    recipe = tiny_recipe(models, family, **sections)
    if drafts is not None:
        recipe.pop("draft")
        recipe["drafts"] = [
            {**draft, "model": str(models[f"{family}-draft"])} if draft.get("model") == "draft" else draft
            for draft in drafts
        ]
    return SpeculativeDecoder.from_recipe(build_recipe(recipe), drafters=drafters)


# --------------------------------------------------------------------------- prompt lookup's matching


def _lookup(encoder_prompt: list[int] | None = None, **params) -> PromptLookup:
    drafter = PromptLookup(**params)
    target = types.SimpleNamespace(is_encoder_decoder=encoder_prompt is not None)
    drafter.setup(DraftSetup(None, target, SamplingParams(), 1, 10, torch.device("cpu")))
    drafter.start(encoder_prompt or [])
    return drafter


def _proposed(drafter: PromptLookup, context: list[int], max_length: int = 3) -> list[int]:
    request = SequenceRequest(context, max_length, torch.rand(max_length, 1, dtype=torch.float64), sampling_law)
    proposal = drafter.propose_sequence(request)
    assert proposal.laws.shape == (1, proposal.length, 10)
    assert torch.equal(proposal.laws.argmax(-1), proposal.tokens) and torch.all(proposal.laws.sum(-1) == 1)
    return proposal.tokens[0].tolist()


@pytest.mark.parametrize(
    "context, expected",
    [
        ([5, 6, 7, 8, 5, 6], [7, 8, 5]),  # the 2-gram (5, 6) occurred before; no 3-gram did
        ([1, 2, 3, 1, 2, 4, 1, 2], [4, 1, 2]),  # the latest occurrence, not the first
        ([1, 2, 3, 9, 2, 3], [9, 2, 3]),  # the longest n-gram first: (2, 3) before (3)
        ([1, 2, 3], []),  # a miss proposes nothing
        ([4], []),
        ([7, 7], [7]),  # only what the context holds after the match
    ],
)
def test_prompt_lookup_proposes_what_followed_the_latest_occurrence(context, expected):
    assert _proposed(_lookup(), context) == expected


@pytest.mark.parametrize(
    "prompt, context, expected",
    [
        ([4, 8, 2], [0, 8], [2]),  # the encoder's prompt is searched
        ([4, 8], [0, 8], []),  # a match at the prompt's end does not copy the decoder's first ids
        ([4, 8], [0, 8, 0, 8], [0, 8]),  # within the decoder's ids as usual
        ([4, 8], [0], []),  # no n-gram runs across the join: (8, 0) is not in the prompt
    ],
)
def test_prompt_lookup_on_an_encoder_decoder_searches_the_prompt_without_crossing_into_the_decoder(
    prompt, context, expected
):
    assert _proposed(_lookup(prompt), context) == expected


def _reference(context: list[int], sizes: range, limit: int) -> list[int]:
    """The latest earlier occurrence of the longest final n-gram, by scanning the whole context."""
    last = len(context) - 1
    for size in sizes:
        suffix = context[last + 1 - size :] if last + 1 >= size else None
        for end in range(last - 1, size - 2, -1):
            if suffix is not None and context[end + 1 - size : end + 1] == suffix:
                return context[end + 1 : end + 1 + limit]
    return []


@pytest.mark.parametrize("min_ngram, max_ngram, num_tokens", [(1, 3, None), (2, 4, 2), (1, 1, 5)])
def test_prompt_lookups_index_agrees_with_a_scan_of_the_whole_context(min_ngram, max_ngram, num_tokens):
    generator = random.Random(0)
    for _ in range(20):
        drafter = _lookup(min_ngram=min_ngram, max_ngram=max_ngram, num_tokens=num_tokens)
        context = [generator.randrange(4) for _ in range(3)]
        for _ in range(30):  # the context grows block by block, as the engine commits
            limit = min(5, num_tokens or 5)
            assert _proposed(drafter, context, 5) == _reference(context, range(max_ngram, min_ngram - 1, -1), limit)
            context += [generator.randrange(4) for _ in range(generator.randrange(1, 4))]


@pytest.mark.parametrize(
    "params, error, message",
    [
        ({"min_ngram": 0}, ValueError, "min_ngram must be >= 1"),
        ({"max_ngram": 2.5}, TypeError, "max_ngram must be a whole number, got 2.5"),  # the base class's type check
        ({"num_tokens": True}, TypeError, "num_tokens must be a whole number or null, got True"),
        ({"min_ngram": 3, "max_ngram": 2}, ValueError, "min_ngram (3) must not exceed max_ngram (2)"),
    ],
)
def test_prompt_lookup_refuses_bad_parameters(params, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        PromptLookup(**params)


def test_the_block_verifies_the_shortest_proposal_of_the_drafters_without_a_model():
    assert block_length([3, 0, 2], 4) == 2
    assert block_length([0, 0], 4) == 4  # every lookup missed: the model drafters draft L
    assert block_length([], 4) == 4


# --------------------------------------------------------------------------- exactness end to end


class LyingLookup(PromptLookup):
    """Negative control: prompt lookup's tokens, reported as drawn from the uniform law (they were not)."""

    name = "lying-lookup"
    deterministic = False  # as a drafter whose laws are not one-hot must say

    def propose_sequence(self, request):
        proposal = super().propose_sequence(request)
        laws = torch.full_like(proposal.laws, 1 / self.draft_setup.vocab_size)
        return SequenceProposal(proposal.tokens, laws, proposal.finite)


def _first_tokens(decoder: SpeculativeDecoder, depth: int, samples: int) -> tuple[Counter, list, dict]:
    """The counts of the samples of keys 0 .. samples - 1 (decoded 64 at a time: a sample's tokens do not depend on
    its batch, test_batch_engine.py), the samples, and the target's law."""
    prompt_ids = decoder.encode_prompt(PROMPT)
    results = keyed_samples(decoder, PROMPT, samples)
    assert all(r.stats.draft_forwards <= r.stats.drafted_tokens for r in results)  # prompt lookup runs no forward
    law = exact_sequence_law(decoder.target.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    return Counter(tuple(result.token_ids) for result in results), results, law


LOSSLESS = sorted(name for name in VerifierRegistry().names() if VerifierRegistry().load_class(name).lossless)


@pytest.mark.parametrize("verifier", LOSSLESS)
def test_prompt_lookup_through_every_lossless_verifier_keeps_the_target_law(tiny_models, verifier):
    """Found through the registry. K = 2 where the verifier takes it: a deterministic drafter still fills one row.
    The negative control (a misreported law failing this chi-square) is the kit's, below."""
    depth = 3
    num_drafts = 2 if VerifierRegistry().load_class(verifier).max_drafts is None else 1
    decoder = _decoder(
        tiny_models,
        [LOOKUP],
        verifier={"name": verifier},
        speculation={"num_drafts": num_drafts},
        generation={"max_new_tokens": depth},
    )
    assert decoder.num_draft_rows == 1
    counts, results, law = _first_tokens(decoder, depth, 1000)
    assert 0.05 < acceptance(results) < 0.95, "lookups must be accepted sometimes and rejected sometimes"
    assert chi_square_p_value(counts, law) > 1e-3


def test_the_conformance_kit_catches_a_drafter_that_misreports_its_law():
    """Negative control: prompt lookup's tokens reported under the uniform law fail the kit's chi-square."""
    with pytest.raises(ConformanceError, match="do not follow the target's law"):
        check_drafter(LyingLookup)


class NotOneHot(PromptLookup):
    """Declares deterministic, but reports its one-hot laws smoothed."""

    name = "not-one-hot"

    def propose_sequence(self, request):
        proposal = super().propose_sequence(request)
        laws = proposal.laws * 0.9 + 0.1 / self.draft_setup.vocab_size
        return SequenceProposal(proposal.tokens, laws, proposal.finite)


def test_the_conformance_kit_catches_a_false_deterministic_flag():
    with pytest.raises(ConformanceError, match="declares deterministic but proposed laws that are not one-hot"):
        check_drafter(NotOneHot, samples=50)


@pytest.mark.parametrize("verifier", ["specinfer", "is-truncated"])
def test_model_and_prompt_lookup_rows_in_one_block_keep_the_target_law(tiny_models, verifier):
    """The lookup row is in the decisions the chi-square checks: the two rows accept more than the model row alone
    on the same keys (the first 300: 0.24 with SpecInfer, 0.22 with is-truncated, against 0.17)."""
    depth = 3
    model_row = {"model": "draft", "device": "cpu"}
    sections = {"verifier": {"name": verifier}, "generation": {"max_new_tokens": depth}}
    decoder = _decoder(tiny_models, [model_row, LOOKUP], **sections)
    assert decoder.num_draft_rows == 2
    counts, results, law = _first_tokens(decoder, depth, 1000)
    assert 0.05 < acceptance(results) < 0.95
    assert acceptance(results, ONE_ROW_KEYS) > one_row_acceptance(
        _decoder(tiny_models, [model_row], **sections), PROMPT
    )
    assert chi_square_p_value(counts, law) > 1e-3


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("prompt", ["a b c d a b c", "e e a", "d c b a e d c b a"])
def test_greedy_with_prompt_lookup_equals_the_target_alone(tiny_models, family, prompt):
    decoder = _decoder(tiny_models, [LOOKUP], family, generation={"max_new_tokens": 30, "temperature": 0.0})
    prompt_ids = decoder.encode_prompt(prompt)
    tokens, _, stats = decoder.generate_ids(prompt_ids, key=0)
    alone, _, _ = decoder.with_config(verifier="none").generate_ids(prompt_ids, key=0)
    assert tokens == alone
    assert stats.draft_forwards == 0 and stats.accepted_tokens > 0


def test_a_missing_lookup_leaves_the_block_to_the_model_rows(tiny_models):
    """Rows that proposed nothing leave the block; with a model drafter beside them the block goes on with L
    tokens of its rows, and only as many draft forwards as tokens verified are paid."""
    decoder = _decoder(
        tiny_models,
        [{"model": "draft", "device": "cpu"}, LOOKUP],
        verifier={"name": "specinfer"},
        speculation={"draft_length": 3},
        generation={"max_new_tokens": 24},
    )
    prompt_ids = decoder.encode_prompt("a b c d e")  # no token repeats: the first lookup misses
    with device_path():  # where reads are free, a block whose rows all drafted EOS pays fewer forwards still
        _, _, stats = decoder.generate_ids(prompt_ids, key=0)
    assert stats.drafted_per_position[0] == stats.blocks  # every block verified some tokens
    assert stats.draft_forwards == stats.drafted_tokens  # one forward per verified draft position, never more


# --------------------------------------------------------------------------- a drafter plugin that misbehaves


class Broken(PromptLookup):
    name = "broken"
    returns: object = None

    def propose_sequence(self, request):
        if isinstance(self.returns, Exception):
            raise self.returns
        return self.returns(super().propose_sequence(request)) if callable(self.returns) else self.returns


@pytest.mark.parametrize(
    "returns, message",
    [
        (None, "returned NoneType instead of a SequenceProposal"),
        (lambda p: SequenceProposal(p.tokens.float(), p.laws, p.finite), "returned tokens of shape"),
        (lambda p: SequenceProposal(p.tokens, p.laws[..., :3], p.finite), "returned laws of shape"),
        (
            lambda p: SequenceProposal(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, 8), p.finite),
            "with n <= 3",
        ),
        (RuntimeError("index out of range\nmore"), "raised RuntimeError: index out of range in propose"),
        # Read with the block's decision, not before the target scores them (clamped meanwhile: on a GPU an id
        # outside the embedding is a device-side assert).
        (
            lambda p: SequenceProposal(torch.full((1, 2), 8), torch.zeros(1, 2, 8), p.finite),
            "outside the vocabulary [0, 8)",
        ),
        (
            lambda p: SequenceProposal(torch.full((1, 2), -1), torch.zeros(1, 2, 8), p.finite),
            "outside the vocabulary [0, 8)",
        ),
    ],
)
def test_a_misbehaving_drafter_stops_with_one_line_naming_the_plugin(tiny_models, returns, message):
    broken = type("Broken", (Broken,), {"returns": staticmethod(returns) if callable(returns) else returns})
    decoder = _decoder(
        tiny_models,
        [{"drafter": "broken"}],
        drafters=DrafterRegistry(extra={"broken": broken}),
        generation={"max_new_tokens": 8},
    )
    with pytest.raises(SpecdecError, match="drafter 'broken' ") as caught:
        decoder.generate_ids(decoder.encode_prompt(PROMPT), key=0)
    assert message in str(caught.value) and "the plugin is at fault" in str(caught.value)


# --------------------------------------------------------------------------- recipes and flags


def test_drafters_lists_the_built_ins(run):
    code, out, _ = run(["drafters", "--json"])
    listed = {row["name"]: row for row in json.loads(out)["drafters"]}
    assert code == 0 and {"model", "early-exit", "prompt-lookup"} <= set(listed)
    assert listed["prompt-lookup"]["deterministic"] and not listed["prompt-lookup"]["uses_model"]
    assert listed["early-exit"]["parameters"] == {"layers": "<required>", "branch_after": 0}


def test_a_bare_model_and_a_bare_early_exit_keep_their_meaning():
    registry = DrafterRegistry()
    recipe = build_recipe({"target": {"model": "t"}, "drafts": [{"model": "d"}, {"early_exit": 2}]})
    assert [registry.entry_drafter(entry) for entry in recipe.drafts] == [("model", {}), ("early-exit", {"layers": 2})]


def test_generate_with_drafter_prompt_lookup(run, tiny_models, write_recipe):
    recipe = write_recipe(tiny_recipe(tiny_models))
    code, out, err = run(["generate", "-r", str(recipe), "--drafter", "prompt-lookup", "--json", PROMPT])
    assert code == 0, err
    sample = json.loads(out)["samples"][0]
    assert (
        sample["stats"]["draft_forwards"] == 0 and json.loads(out)["recipe"]["drafts"][0]["drafter"] == "prompt-lookup"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"drafts": [{"drafter": "prompt-lookup", "params": {"max_ngram": 0}}]},
            "drafter 'prompt-lookup': max_ngram must be >= 1",
        ),
        (
            {"drafts": [{"drafter": "prompt-lookup", "params": {"max_ngram": "three"}}]},
            "drafter 'prompt-lookup': max_ngram must be a whole number, got 'three'",
        ),
        ({"drafts": [{"drafter": "prompt-lookup", "model": "x"}]}, "drafts.0: drafter 'prompt-lookup' takes no model"),
        ({"drafts": [{"drafter": "nope"}]}, "unknown drafter 'nope'; installed drafters: "),
        ({"drafts": [{"drafter": "model"}]}, "drafts.0: the model drafter needs 'model'"),
        ({"drafts": [{"drafter": "early-exit", "params": {"layers": 0}}]}, "layers must be a whole number >= 1"),
        ({"drafts": [{"model": "D"}, {"drafter": "prompt-lookup"}], "verifier": {"name": "spectr"}}, "identical"),
    ],
)
def test_a_bad_draft_entry_is_one_line_before_any_model_loads(run, tiny_models, write_recipe, change, message):
    recipe = tiny_recipe(tiny_models)
    recipe.pop("draft")
    recipe.update(change)
    for draft in recipe["drafts"]:
        if draft.get("model") == "D":
            draft["model"] = str(tiny_models["llama-draft"])
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), PROMPT])
    assert code == 2
    one_error_line(err, message)


def test_drafter_flag_needs_an_entry_for_a_drafter_with_a_model(run, tiny_models, write_recipe):
    recipe = write_recipe(tiny_recipe(tiny_models))
    code, _, err = run(["generate", "-r", str(recipe), "--drafter", "early-exit", PROMPT])
    assert code == 2
    one_error_line(err, "--drafter early-exit drafts with a model that the recipe does not name")


def test_acceptance_with_a_drafter_without_a_model_runs(run, tiny_models, write_recipe):
    """A recipe whose only draft is prompt lookup: acceptance asks it along the target's text (see test_acceptance)."""
    recipe = tiny_recipe(tiny_models)
    recipe["draft"] = LOOKUP
    code, out, err = run(["acceptance", "-r", str(write_recipe(recipe)), "--num-drafts", "1", "--json", PROMPT])
    assert code == 0, err
    assert 0 <= json.loads(out)["coverage"] <= 1


def test_a_model_drafter_error_is_a_usage_error():
    with pytest.raises(UsageError, match="drafts.0: the model drafter needs 'model'"):
        DrafterRegistry().check_entries(
            build_recipe({"target": {"model": "t"}, "drafts": [{"drafter": "model"}]}).drafts
        )


def test_a_recipe_without_drafters_writes_what_it_wrote_before():
    """Results folders compare the written recipe to resume: an entry that names no drafter writes no drafter keys."""
    written = build_recipe({"target": {"model": "t"}, "drafts": [{"model": "d"}, LOOKUP]}).to_dict()
    assert "drafter" not in written["drafts"][0] and "params" not in written["drafts"][0]
    assert written["drafts"][1]["drafter"] == "prompt-lookup"


def test_drafters_keep_the_recipes_order_when_entries_share_a_model(tiny_models):
    draft = {"model": "draft", "device": "cpu"}
    decoder = _decoder(
        tiny_models, [draft, {"early_exit": 1}, {**draft, "temperature": 0.5}], verifier={"name": "specinfer"}
    )
    assert [drafter.name for drafter in decoder.drafters] == ["model", "early-exit"]
    assert decoder.drafters[0].rows == 2  # the two entries of one model share its session


@pytest.mark.parametrize(
    "entry, expected",
    [
        ({"drafter": "early-exit", "early_exit": 1}, ("early-exit", {"layers": 1})),
        ({"drafter": "early-exit", "params": {"layers": 2}}, ("early-exit", {"layers": 2})),
    ],
)
def test_early_exit_takes_its_layers_from_either_key(entry, expected):
    recipe = build_recipe({"target": {"model": "t"}, "drafts": [entry]})
    assert DrafterRegistry().entry_drafter(recipe.drafts[0]) == expected


def test_early_exit_refuses_two_different_layer_counts():
    recipe = build_recipe(
        {"target": {"model": "t"}, "drafts": [{"drafter": "early-exit", "early_exit": 1, "params": {"layers": 2}}]}
    )
    with pytest.raises(UsageError, match="sets early_exit: 1 and params.layers: 2; keep one"):
        DrafterRegistry().entry_drafter(recipe.drafts[0])


def test_acceptance_names_a_draft_entry_without_its_model(run, tiny_models, write_recipe):
    recipe = tiny_recipe(tiny_models)
    recipe["draft"] = {"temperature": 0.5}
    code, _, err = run(["acceptance", "-r", str(write_recipe(recipe)), PROMPT])
    assert code == 2
    one_error_line(err, "drafts.0: the model drafter needs 'model'")


@pytest.mark.parametrize(
    "drafts, identical",
    [
        ([{"model": "draft", "device": "cpu"}, {"drafter": "model", "model": "draft", "device": "cpu"}], True),
        ([LOOKUP, {"drafter": "Prompt-Lookup"}], True),
        ([LOOKUP, {"drafter": "prompt-lookup", "params": {"max_ngram": 2}}], False),
        ([{"model": "draft", "device": "cpu"}, {"model": "draft", "device": "cpu", "temperature": 0.5}], False),
    ],
)
def test_the_recipe_and_the_engine_agree_on_identical_laws(tiny_models, drafts, identical):
    """One rule decides which rows draw from one law, before the models load and after (bench keeps the cells
    that the engine then takes)."""
    from specdec_cli.plugins.drafter_registry import recipe_draft_rows

    decoder = _decoder(tiny_models, drafts, verifier={"name": "specinfer"})
    recipe = tiny_recipe(tiny_models)
    recipe.pop("draft")
    recipe["drafts"] = [{**d, "model": str(tiny_models["llama-draft"])} if d.get("model") else d for d in drafts]
    before = recipe_draft_rows(build_recipe(recipe))
    after = type(before).of([draft.law(decoder.config) for draft in decoder.drafts])
    assert before.identical_laws == after.identical_laws == identical


class FailsInEntryProblem(PromptLookup):
    name = "fails"

    def entry_problem(self, entry):
        raise KeyError("model")


class FailsInSetup(PromptLookup):
    name = "fails"

    def setup(self, setup):
        raise RuntimeError("no such vocabulary")


@pytest.mark.parametrize(
    "plugin, message",
    [
        (FailsInEntryProblem, "drafter 'fails' raised KeyError: 'model' in entry_problem"),
        (FailsInSetup, "drafter 'fails' raised RuntimeError: no such vocabulary in setup"),
    ],
)
def test_a_drafter_raising_outside_propose_is_its_fault_in_one_line(tiny_models, plugin, message):
    with pytest.raises(SpecdecError, match=message):
        _decoder(tiny_models, [{"drafter": "fails"}], drafters=DrafterRegistry(extra={"fails": plugin}))
