"""Batched decoding end to end on tiny models loaded through the recipe path (issue #22).

- Exactness: the first tokens of samples decoded in batches of 3 and 8 follow the target's law (chi-square
  against the law enumerated from the target alone) for every lossless verifier and K = 1..3 (decoder-only),
  and one verifier per K on both pairs at batch 3; the draft's own law is rejected by the same check (the test
  has power), and K > 1 rows accept more than one row on the same keys (the later rows are in the decisions the
  test checks). One loop serves every batch size: batch 1 is a batch of one (tests/test_engine.py).
- Batch invariance: greedy at batch 8 equals batch 1 token for token; sampled, a sample's tokens do not
  depend on what else is in its batch (≥ 99 % identical), with sequences finishing and joining mid-run.
- One read of the device per step for the whole batch (transformers' own mask checks included: none).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import UsageError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams
from specdec_cli.engine.decoder import DecodingRun, SequenceJob
from specdec_cli.kit.testing import EOS_ID, chi_square_p_value, exact_sequence_law, keyed_samples
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.drafting import Proposal, SequenceRequest
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.plugins.verifiers import device_path
from specdec_plugins.model_drafter import ModelDrafter
from specdec_plugins.prompt_lookup import PromptLookup
from specdec_plugins.speculative import SpeculativeSampling
from tests import row_acceptance
from tests.conftest import bench_on_files, tiny_recipe
from tests.row_acceptance import ONE_ROW_KEYS

PROMPTS = ["a b c d", "e e a", "b", "d c b a e d c b a"]
LOSSLESS = [
    ("speculative", 1),
    ("block", 1),
    ("specinfer", 1),
    ("specinfer", 2),
    ("specinfer", 3),
    ("spectr", 2),
    ("spectr", 3),
    ("is-lp", 2),
    ("is-truncated", 3),
]


def _decoder(models, family: str, verifier: str = "speculative", num_drafts: int = 1, drafts=None, **generation):
    recipe = tiny_recipe(
        models, family, verifier={"name": verifier}, speculation={"num_drafts": num_drafts}, generation=generation
    )
    if drafts is not None:
        recipe.pop("draft")
        recipe["drafts"] = drafts
    return SpeculativeDecoder.from_recipe(build_recipe(recipe))


BATCH_CASES = [pytest.param("llama", verifier, k, 8, id=f"llama-{verifier}-K{k}-B8") for verifier, k in LOSSLESS] + [
    pytest.param(family, verifier, k, 3, id=f"{family}-{verifier}-K{k}-B3")
    for family in ("llama", "t5")
    for verifier, k in (("speculative", 1), ("specinfer", 2), ("spectr", 3))
]
"""Every lossless verifier at batch 8 on the decoder-only pair; at batch 3 (more steps, and sequences joining more
often) one per K on both pairs: the encoder-decoder's batch is its cache's and its cross-attention's, the same for
every verifier, whose batched decisions tests/test_verify_batch.py checks on their own."""


def _law_decoder(models, family: str, verifier: str, num_drafts: int) -> SpeculativeDecoder:
    """The law test's decoder: three tokens at T = 1. On llama it drafts from the target's own checkpoint at T = 0.5:
    the tiny llama draft is rejected where p > q, where the residual leaves later rows nothing (SpecInfer accepted
    0.173 at K = 1, 2 and 3 alike), so a K-row rule was never in the decisions the test checks. The tiny t5 draft's
    later rows are (0.15 at K = 1, 0.23 at K = 2, 0.27 at K = 3, on 300 keys), where the target's own t5
    checkpoint at T = 0.5 would be accepted 99 % of the time."""
    drafts = None
    if family == "llama":
        drafts = [{"model": str(models["llama-target"]), "device": "cpu", "temperature": 0.5}]
    return _decoder(models, family, verifier, num_drafts, drafts, max_new_tokens=3, temperature=1.0)


LAW_SAMPLES = 600


@pytest.fixture(scope="module")
def one_row_acceptance(tiny_models):
    """one_row_acceptance(family, verifier) → the acceptance of ``verifier`` with one row on the law test's first
    keys (decoded once per pair)."""
    found: dict[tuple[str, str], float] = {}

    def acceptance(family: str, verifier: str) -> float:
        if (family, verifier) not in found:
            found[family, verifier] = row_acceptance.one_row_acceptance(
                _law_decoder(tiny_models, family, verifier, 1), PROMPTS[0]
            )
        return found[family, verifier]

    return acceptance


@pytest.mark.parametrize("family,verifier,num_drafts,batch_size", BATCH_CASES)
def test_batched_first_tokens_follow_the_target_law(
    tiny_models, one_row_acceptance, family, verifier, num_drafts, batch_size
):
    decoder = _law_decoder(tiny_models, family, verifier, num_drafts)
    depth = decoder.config.generation.max_new_tokens
    prompt_ids = decoder.encode_prompt(PROMPTS[0])
    results = keyed_samples(decoder, PROMPTS[0], LAW_SAMPLES, batch_size)
    counts = Counter(tuple(result.token_ids) for result in results)
    law = exact_sequence_law(decoder.target.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    assert chi_square_p_value(counts, law) > 1e-3
    assert 0.05 < row_acceptance.acceptance(results) < 0.95
    if num_drafts > 1:
        assert row_acceptance.acceptance(results, ONE_ROW_KEYS) > one_row_acceptance(family, verifier)
    draft = decoder.drafts[0]
    draft_law = exact_sequence_law(
        draft.model.model, prompt_ids, depth, draft.sampling(decoder.config), decoder.vocab_size, {EOS_ID}
    )
    assert chi_square_p_value(counts, draft_law) < 1e-6  # negative control: the draft's law is told apart


def test_negative_control_the_tiny_llama_drafts_later_rows_accept_nothing_more(tiny_models):
    """The check that K > 1 rows accept more than one row can fail: with the tiny llama draft, SpecInfer's three rows
    accept what one row does on the same keys (why the law test drafts from the target's checkpoint there)."""
    decoder = _decoder(tiny_models, "llama", "specinfer", 3, max_new_tokens=3, temperature=1.0)
    assert row_acceptance.acceptance(keyed_samples(decoder, PROMPTS[0], ONE_ROW_KEYS)) == pytest.approx(
        row_acceptance.one_row_acceptance(decoder.with_config(num_drafts=1), PROMPTS[0])
    )


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("verifier,num_drafts", [("speculative", 1), ("specinfer", 2), ("is-lp", 2)])
def test_greedy_in_a_batch_of_eight_equals_greedy_alone(tiny_models, family, verifier, num_drafts):
    decoder = _decoder(tiny_models, family, verifier, num_drafts, max_new_tokens=24, temperature=0.0)
    alone = decoder.generate(PROMPTS, num_samples=3)
    batched = decoder.generate(PROMPTS, num_samples=3, batch_size=8)  # 12 sequences: 4 join as others finish
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.accepted_mask for r in batched] == [r.accepted_mask for r in alone]
    assert [(r.prompt_index, r.sample_index) for r in batched] == [(r.prompt_index, r.sample_index) for r in alone]


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("verifier,num_drafts", [("speculative", 1), ("block", 1), ("spectr", 2), ("mentored", 1)])
def test_a_sample_does_not_depend_on_its_batch(tiny_models, family, verifier, num_drafts):
    decoder = _decoder(tiny_models, family, verifier, num_drafts, max_new_tokens=16, temperature=1.0)
    runs = [decoder.generate(PROMPTS, num_samples=5, batch_size=size) for size in (1, 3, 8)]
    samples = len(runs[0])
    for other in runs[1:]:
        same = sum(a.token_ids == b.token_ids for a, b in zip(runs[0], other))
        assert same >= 0.99 * samples
    # Not vacuous: samples of one prompt differ, and another seed draws other samples.
    assert len({tuple(r.token_ids) for r in runs[0]}) > len(PROMPTS)
    reseeded = decoder.with_config(seed=1).generate(PROMPTS, num_samples=5, batch_size=8)
    assert sum(a.token_ids != b.token_ids for a, b in zip(runs[0], reseeded)) >= 3


@pytest.mark.parametrize("family,static_cache", [("llama", False), ("llama", True), ("t5", False)])
def test_the_samples_of_a_prompt_joining_one_after_another_share_one_read_of_it(tiny_models, family, static_cache):
    """At batch 3 the four samples of each prompt join one after another (three at once, one as a row leaves): each
    model reads a prompt once (its encoder, or its prefill), the next samples copy that read, and the samples are
    batch one's token for token (numbers equal to a read of their own, not merely close)."""
    recipe = tiny_recipe(
        tiny_models,
        family,
        speculation={"static_cache": static_cache},
        generation={"max_new_tokens": 12, "temperature": 0.0},
    )
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    prompts = ["a b c d e a b c d", "e d c b a e d c b a e"]  # no prompt is as long as a step (1, 2 or L + 1 ids)
    reads: Counter = Counter()

    def count(name: str, length_of_a_read: set[int] | None):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)  # [rows, m]
            if length_of_a_read is None or (ids.shape[0] == 1 and ids.shape[1] in length_of_a_read):
                reads[name] += 1

        return hook

    models = {"target": decoder.target.model, "draft": decoder.drafts[0].model.model}
    lengths = {len(decoder.encode_prompt(prompt)) for prompt in prompts}
    hooks = [
        (model.get_encoder() if family == "t5" else model).register_forward_pre_hook(
            count(name, None if family == "t5" else lengths), with_kwargs=True
        )
        for name, model in models.items()
    ]
    try:
        batched = decoder.generate(prompts, num_samples=4, batch_size=3)
    finally:
        for hook in hooks:
            hook.remove()
    assert reads == {"target": 2, "draft": 2}
    alone = decoder.generate(prompts, num_samples=4)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]


def test_stats_are_kept_per_sequence(tiny_models):
    decoder = _decoder(tiny_models, "llama", max_new_tokens=12, temperature=1.0)
    with device_path():  # where reads are free, a sample alone runs no draft forward after its rows' EOS; a batch may
        alone = decoder.generate(PROMPTS, num_samples=2)
        batched = decoder.generate(PROMPTS, num_samples=2, batch_size=8)
    for one, many in zip(alone, batched):
        for name in (
            "new_tokens",
            "target_forwards",
            "draft_forwards",
            "blocks",
            "drafted_tokens",
            "accepted_tokens",
            "accepted_per_position",
            "drafted_per_position",
            "stop_reason",
        ):
            assert getattr(one.stats, name) == getattr(many.stats, name), name
        assert many.stats.wall_time_s > 0


def test_prompt_lookup_and_a_model_draft_mix_in_a_batch(tiny_models):
    """A drafter without batch methods (prompt lookup) is run per sequence beside the batched model drafter,
    and a sequence's block keeps only the rows that proposed, as it does alone."""
    drafts = [{"model": str(tiny_models["llama-draft"])}, {"drafter": "prompt-lookup"}]
    decoder = _decoder(tiny_models, "llama", "specinfer", 2, drafts=drafts, max_new_tokens=20, temperature=0.0)
    prompts = ["a b c a b c a b", "d d d d", "e a e a e a"]
    alone = decoder.generate(prompts, num_samples=2)
    batched = decoder.generate(prompts, num_samples=2, batch_size=4)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.stats.blocks for r in batched] == [r.stats.blocks for r in alone]


def test_a_batch_reads_the_device_once_per_step(tiny_models, conversions, monkeypatch):
    decoder = _decoder(tiny_models, "llama", max_new_tokens=16, temperature=1.0)
    steps = joins = 0
    step, join = DecodingRun._step, DecodingRun._join

    def counted_step(self):
        nonlocal steps
        steps += 1
        return step(self)

    def counted_join(self, jobs, began):
        nonlocal joins
        joins += 1
        return join(self, jobs, began)

    monkeypatch.setattr(DecodingRun, "_step", counted_step)
    monkeypatch.setattr(DecodingRun, "_join", counted_join)
    prompt_ids = decoder.encode_prompt(PROMPTS[0])  # tokenizing reads nothing, but keep it out of the count
    conversions.clear()
    with device_path():
        results = list(DecodingRun(decoder, 8).run(_jobs(decoder, prompt_ids, 8)))
    assert len(results) == 8 and steps >= 4 and joins == 1
    assert dict(conversions) == {"tolist": steps}  # the step's read; transformers' mask checks read nothing


def _jobs(decoder, prompt_ids, count):
    return [SequenceJob(PROMPTS[0], 0, sample, prompt_ids) for sample in range(count)]


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_a_batch_without_the_kv_cache_recomputes_what_the_cache_holds(tiny_models, family):
    """The reference path batches too: every forward recomputes the held ids, and gives the cached batch's samples."""
    generation = {"max_new_tokens": 12, "temperature": 1.0}
    cached = _decoder(tiny_models, family, **generation).generate(PROMPTS, num_samples=2, batch_size=3)
    recipe = tiny_recipe(tiny_models, family, speculation={"kv_cache": False}, generation=generation)
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert [r.token_ids for r in decoder.generate(PROMPTS, num_samples=2, batch_size=3)] == [
        r.token_ids for r in cached
    ]
    assert not decoder.drafters[0].session.use_cache  # the draft recomputed too
    with pytest.raises(UsageError, match="batch_size must be a whole number"):
        decoder.generate("a b", batch_size=0)


@pytest.mark.parametrize(
    "family,verifier,num_drafts,drafts",
    [
        ("llama", "specinfer", 2, None),
        ("gpt2", "speculative", 1, None),
        ("llama", "specinfer", 2, [{"model": "draft"}, {"drafter": "prompt-lookup"}]),
        ("llama", "speculative", 1, [{"early_exit": 1}]),
    ],
)
def test_a_batch_with_the_static_cache_gives_the_dynamic_caches_samples(
    tiny_models, family, verifier, num_drafts, drafts
):
    """Rows written at their own slots, rejected suffixes overwritten, sequences joining and leaving: the samples
    of the dynamic cache, for the target and every draft model (fanned out to K rows, beside prompt lookup, and the
    target's own first layers)."""
    recipe = tiny_recipe(tiny_models, family, verifier={"name": verifier}, speculation={"num_drafts": num_drafts})
    recipe["generation"] = {"max_new_tokens": 12, "temperature": 1.0}
    if drafts is not None:
        model = str(tiny_models[f"{family}-draft"])
        recipe["drafts"] = [{**draft, "model": model} if draft.get("model") == "draft" else draft for draft in drafts]
        recipe.pop("draft")
    dynamic = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    static = dynamic.with_config(static_cache=True)
    assert static.cache_headroom == 12 + static.config.speculation.draft_length + 1 and dynamic.cache_headroom is None
    assert static.drafters[0].session.headroom == static.cache_headroom  # the draft model's cache is static too
    samples = [decoder.generate(PROMPTS, num_samples=2, batch_size=3) for decoder in (dynamic, static)]
    assert [r.token_ids for r in samples[1]] == [r.token_ids for r in samples[0]]
    assert sum(r.stats.drafted_tokens - r.stats.accepted_tokens for r in samples[1]) > 3  # suffixes were rejected


def test_a_model_the_static_cache_does_not_suit_keeps_the_dynamic_one_and_says_so_in_one_line(
    tiny_models, run, write_recipe
):
    recipe = tiny_recipe(tiny_models, "t5", speculation={"static_cache": True}, generation={"max_new_tokens": 4})
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert decoder.drafters[0].session.headroom is None
    names = [decoder.target.name, decoder.drafts[0].model.name]
    assert decoder.cache_notes == [
        f"static cache: model '{n}' keeps the dynamic cache: an encoder-decoder" for n in names
    ]
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), "a b"])
    assert code == 0 and err.count("keeps the dynamic cache: an encoder-decoder") == 2


@pytest.mark.xdist_group("compile")  # its --compile steps, on the worker that has compiled them
def test_bench_says_once_which_models_keep_the_dynamic_cache_and_keeps_it_with_its_results(
    tiny_models, run, write_recipe, data, tmp_path
):
    """Under --compile (which asks for the static cache) an encoder-decoder keeps the dynamic cache and eager steps:
    bench says so once per model however many cells use it, and its results.json keeps the notes."""
    recipe = write_recipe(tiny_recipe(tiny_models, "t5", generation={"max_new_tokens": 3}))
    out = tmp_path / "results"
    code, _, err = run(bench_on_files(str(recipe), data, out, "--compile", limit=1, verifier="speculative"))
    assert code == 0, err
    said = [line for line in err.splitlines() if "keeps the dynamic cache: an encoder-decoder" in line]
    assert len(said) == 2 and all("run eager under --compile" in line for line in said), said
    kept = json.loads((out / "results.json").read_text())["notes"]
    assert sum("keeps the dynamic cache" in note for note in kept) == 2


def test_a_bart_target_is_refused_before_decoding(tiny_models):
    decoder = _decoder(tiny_models, "bart")
    with pytest.raises(UsageError, match="--batch-size 1"):
        decoder.generate("a b", batch_size=2)
    assert torch.is_inference_mode_enabled() is False


def test_running_out_of_memory_in_a_batch_is_one_line_naming_the_batch_size(tiny_models, monkeypatch):
    from specdec_cli.base.errors import SpecdecError
    from specdec_cli.engine.session import ModelSession

    decoder = _decoder(tiny_models, "llama")

    def refuse(*_args, **_kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456789 bytes")

    monkeypatch.setattr(ModelSession, "_run", refuse)
    message = r"out of memory \(0.11 GiB requested\) decoding a batch of 4; lower --batch-size"
    with pytest.raises(SpecdecError, match=message):
        decoder.generate(PROMPTS, batch_size=4)


def test_a_run_after_an_interrupted_one_gives_the_same_samples(tiny_models):
    """A batched drafter keeps its sequences between calls: the next run must not see an interrupted run's."""
    decoder = _decoder(tiny_models, "llama", max_new_tokens=10, temperature=1.0)
    expected = decoder.generate(PROMPTS, batch_size=2)
    stopped = decoder.samples(PROMPTS, batch_size=2)
    next(stopped)
    stopped.close()  # the caller stops mid-run: sequences stay in the drafter's session
    assert [r.token_ids for r in decoder.generate(PROMPTS, batch_size=2)] == [r.token_ids for r in expected]


@pytest.mark.parametrize("bad", ["shape", "lengths", "raises"])
def test_a_batched_drafters_bad_proposal_is_one_line_naming_it(tiny_models, monkeypatch, bad):
    from specdec_cli.base.errors import SpecdecError
    from specdec_plugins.model_drafter import ModelDrafter

    decoder = _decoder(tiny_models, "llama")
    original = ModelDrafter.propose

    def broken(self, request):
        if bad == "raises":
            raise KeyError("boom")
        proposal = original(self, request)
        if bad == "shape":
            return Proposal(proposal.tokens[:, :, :1].float(), proposal.laws, proposal.finite, proposal.lengths)
        return Proposal(proposal.tokens, proposal.laws, proposal.finite, [99] * len(proposal.lengths))

    monkeypatch.setattr(ModelDrafter, "propose", broken)
    with pytest.raises(SpecdecError, match="drafter 'model'") as caught:
        decoder.generate(PROMPTS, batch_size=3)
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------- plugins in a batch


def _short(context_length: int, length: int) -> int:
    """Drafts one token fewer after a context of odd length (as a drafter that stops early may)."""
    return max(1, length - 1) if context_length % 2 and length else length


class ShortModel(ModelDrafter):
    """A batched model drafter whose proposals are sometimes shorter than asked, alone and in a batch alike."""

    name = "short-model"

    def propose(self, request):
        proposal = super().propose(request)
        lengths = [_short(len(context), n) for context, n in zip(request.contexts, proposal.lengths)]
        return Proposal(proposal.tokens, proposal.laws, proposal.finite, lengths, proposal.forwards)


class FailingLookup(PromptLookup):
    """A drafter written per sequence that raises."""

    name = "failing-lookup"

    def propose_sequence(self, request: SequenceRequest):
        raise KeyError("no index")


class Unkeyed(SpeculativeSampling):
    """Speculative sampling handed a seeded generator per block, as a plugin without keyed randomness is."""

    name = "unkeyed"
    keyed_randomness = False
    batches_by_vmap = False


def test_a_proposal_shorter_than_asked_cuts_the_block_as_alone(tiny_models):
    drafters = DrafterRegistry(extra={"short-model": ShortModel})
    recipe = tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 16, "temperature": 1.0})
    recipe["draft"] = {"drafter": "short-model", "model": str(tiny_models["llama-draft"])}
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe), drafters=drafters)
    alone = decoder.generate(PROMPTS, num_samples=3)
    batched = decoder.generate(PROMPTS, num_samples=3, batch_size=5)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.stats.drafted_tokens for r in batched] == [r.stats.drafted_tokens for r in alone]


def test_a_drafter_without_batch_methods_that_raises_is_one_line(tiny_models):
    from specdec_cli.base.errors import SpecdecError

    drafters = DrafterRegistry(extra={"failing-lookup": FailingLookup})
    recipe = tiny_recipe(tiny_models, "llama")
    recipe.pop("draft")
    recipe["drafts"] = [{"drafter": "failing-lookup"}]
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe), drafters=drafters)
    with pytest.raises(SpecdecError, match="drafter 'failing-lookup'.*KeyError") as caught:
        decoder.generate(PROMPTS, batch_size=3)
    assert "\n" not in str(caught.value)


def test_a_verifier_drawing_from_a_generator_gives_batch_ones_samples(tiny_models):
    registry = VerifierRegistry(extra={"unkeyed": Unkeyed})
    recipe = tiny_recipe(tiny_models, "t5", verifier={"name": "unkeyed"}, generation={"max_new_tokens": 12})
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe), registry=registry)
    alone = decoder.generate(PROMPTS, num_samples=3)
    batched = decoder.generate(PROMPTS, num_samples=3, batch_size=4)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
