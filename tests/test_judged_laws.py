"""Laws a verifier judges drafts by (``judged_laws``): FSD compares the unprocessed laws, Medusa tests the untruncated
posterior. The engine computes them from the same logits as the sampling laws, for the target and for each sampling
drafter, and hands them to the verifier; ``acceptance`` hands them to the token-level methods; a drafter that samples
without reporting them is refused before any model loads; a verifier that asks for none is never given any."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams, judged_params, sampling_law
from specdec_cli.engine.decoder import SpeculativeDecoder
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.drafting import SequenceDrafter, SequenceProposal
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins.fuzzy import FuzzySpeculative
from specdec_plugins.speculative import SpeculativeSampling
from tests.conftest import tiny_recipe

SAMPLING = {"temperature": 0.5, "top_k": 0, "top_p": 0.8}


def test_the_views_are_settings_of_the_same_sampling_law():
    params = SamplingParams(temperature=0.5, top_k=7, top_p=0.8)
    assert judged_params(params, "unprocessed") == SamplingParams()
    assert judged_params(params, "untruncated") == SamplingParams(temperature=0.5)
    with pytest.raises(ValueError, match="no judged law 'raw'"):
        judged_params(params, "raw")


class Recorder(FuzzySpeculative):
    """Fuzzy (unprocessed laws) that keeps what each block was handed."""

    name = "recorder"
    seen: list = []

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None, judged=None):
        Recorder.seen.append((target_probs, draft_probs, judged))
        return super().verify_block(target_probs, draft_probs, draft_tokens, randomness, judged=judged)

    def verify_batch(self, target_probs, draft_probs, draft_tokens, randomness, judged=None):
        Recorder.seen.append((target_probs, draft_probs, judged))
        return super().verify_batch(target_probs, draft_probs, draft_tokens, randomness, judged=judged)


class Plain(SpeculativeSampling):
    """Speculative sampling that fails if it is ever handed judged laws."""

    name = "plain"

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None, **judged):
        assert not judged
        return super().verify_block(target_probs, draft_probs, draft_tokens, randomness)


def _decoder(tiny_models, verifier: str, drafters=None, **generation):
    recipe = tiny_recipe(
        tiny_models,
        "llama",
        verifier={"name": verifier, "params": {"threshold": 0.02}} if verifier == "recorder" else {"name": verifier},
        generation={"max_new_tokens": 10, **SAMPLING, **generation},
    )
    registry = VerifierRegistry(extra={"recorder": Recorder, "plain": Plain})
    return SpeculativeDecoder.from_recipe(build_recipe(recipe), registry=registry, drafters=drafters)


def _sampled_from(judged: torch.Tensor, sampling: dict) -> torch.Tensor:
    """The sampling law made from a judged unprocessed law ``[..., V]``: its logits are its logarithm."""
    params = SamplingParams(**sampling)
    return sampling_law(torch.log(judged.float()), params)[0]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_engine_hands_the_unprocessed_laws_of_target_and_draft(tiny_models, batch_size):
    """Each block's judged laws are the models' temperature-1 laws over the whole vocabulary: they allow tokens
    top-p cut from the sampling laws, and the sampling laws are them, tempered and cut."""
    Recorder.seen = []
    decoder = _decoder(tiny_models, "recorder")
    decoder.generate(["a b c", "d e", "a a"][:batch_size], seed=3)
    assert Recorder.seen
    for target, draft, judged in Recorder.seen:
        assert judged is not None
        judged_target, judged_draft = judged
        assert judged_target.shape == target.shape and judged_draft.shape == draft.shape
        assert bool((judged_target > 0).all()) and bool((target == 0).any())  # the whole vocabulary against top-p
        torch.testing.assert_close(_sampled_from(judged_target, SAMPLING), target.float(), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(_sampled_from(judged_draft, SAMPLING), draft.float(), atol=2e-6, rtol=1e-5)


def test_a_verifier_that_judges_by_the_sampling_laws_is_handed_none(tiny_models):
    results = _decoder(tiny_models, "plain").generate(["a b c", "d e"], seed=1)
    assert all(result.token_ids for result in results)


def test_medusas_untruncated_posterior_is_the_target_at_its_temperature(tiny_models):
    """typical with rule: medusa: the engine computes softmax(logits / T), no top-p; its decisions follow it."""
    decoder = _decoder(tiny_models, "typical")
    medusa = decoder.with_config(verifier="typical", verifier_params={"rule": "medusa"})
    assert medusa.judged_view == "untruncated" and decoder.judged_view is None
    assert medusa.generate(["a b c"], seed=2)[0].token_ids


class SamplingWithoutJudged(SequenceDrafter):
    """A drafter that samples (uniformly) but reports no judged laws."""

    name = "uniform"

    def propose_sequence(self, request):
        vocab = self.draft_setup.vocab_size
        laws = torch.full((1, request.max_length, vocab), 1.0 / vocab)  # [1, n, V]
        tokens = (request.uniforms[:, 0] * vocab).long().clamp(max=vocab - 1).view(1, -1)  # [1, n]
        return SequenceProposal(tokens, laws, torch.ones((), dtype=torch.bool))


def test_a_sampling_drafter_that_reports_no_judged_laws_is_refused_before_the_models_load(tiny_models):
    recipe = {
        **tiny_recipe(tiny_models, "llama", verifier={"name": "fuzzy", "params": {"threshold": 0.1}}),
        "draft": {"drafter": "uniform"},
    }
    drafters = DrafterRegistry(extra={"uniform": SamplingWithoutJudged})
    with pytest.raises(Exception) as refused:
        SpeculativeDecoder.check_recipe(build_recipe(recipe), VerifierRegistry(extra={}), drafters=drafters)
    assert "judges drafts by their unprocessed laws, which drafter 'uniform' does not report" in str(refused.value)
    sampling = {**recipe, "verifier": {"name": "fuzzy", "params": {"threshold": 0.1, "laws": "sampling"}}}
    SpeculativeDecoder.check_recipe(build_recipe(sampling), VerifierRegistry(extra={}), drafters=drafters)


def test_prompt_lookup_stands_with_its_one_hot_laws(run, tiny_models, write_recipe):
    """A deterministic drafter's one-hot laws are its laws under any processing: fuzzy takes its rows."""
    recipe = {**tiny_recipe(tiny_models, "llama"), "draft": {"drafter": "prompt-lookup"}}
    recipe = write_recipe(recipe)
    code, _, err = run(["generate", "-r", str(recipe), "--verifier", "fuzzy", "--max-new-tokens", "4", "a b a b"])
    assert code == 0, err


def test_acceptance_reports_fuzzy_on_the_unprocessed_laws(run, recipe_path, tmp_path):
    """With the laws judged unprocessed at temperature 0.5 and top-p 0.8 (full support, so FSD's JS is finite),
    fuzzy accepts every draft token at a huge T and none at T = 0 (the raw laws of two models differ)."""
    out = tmp_path / "acceptance"
    args = ["acceptance", "-r", recipe_path, "--num-drafts", "1", "--max-new-tokens", "6", "--output", str(out)]
    sampling = ["--temperature", "0.5", "--top-p", "0.8", "--verifier", "fuzzy"]
    code, _, err = run([*args, *sampling, "--sweep", "fuzzy.threshold=0,100", "a b c"])
    assert code == 0, err
    table = json.loads((out / "acceptance.json").read_text())["table"]
    assert table["fuzzy threshold=100"]["1"]["mean"] == pytest.approx(1.0)
    assert table["fuzzy threshold=0"]["1"]["mean"] == 0.0


def test_a_verifier_naming_an_unknown_view_is_its_fault(tiny_models):
    class Confused(SpeculativeSampling):
        name = "confused"

        def __init__(self):
            self.judged_laws = "raw"

    recipe = tiny_recipe(tiny_models, "llama", verifier={"name": "confused"})
    with pytest.raises(Exception, match="sets judged_laws 'raw'; set one of unprocessed, untruncated, or None"):
        SpeculativeDecoder.check_recipe(build_recipe(recipe), VerifierRegistry(extra={"confused": Confused}))
