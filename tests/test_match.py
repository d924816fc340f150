"""Sample matching (``match``, docs/verifiers.md): the target draws y_t ~ q_t at every drafted position, keeps the
draft while y_t = x_t, and commits its own y_n at the first mismatch (or the bonus y_L ~ q_L). It replays MLX-LM's
and llama.cpp's acceptance loops on the same draws; its output law is q and it accepts Σ p·q, exactly (and speculative
sampling's Σ min(p, q) never less); the author's kit passes; through `specdec generate` the first tokens follow the
target's law, where a wrong variant of the rule is caught by the same chi-square."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.randomness import Draws, Stream, stream_table_from
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams, sample_with
from specdec_cli.kit.conformance import ConformanceError, check_verifier
from specdec_cli.kit.testing import (
    EOS_ID,
    adversarial_distribution_pairs,
    candidate_acceptance,
    chi_square_p_value,
    enumerate_output_law,
    exact_sequence_law,
    keyed_samples,
    random_distributions,
)
from specdec_cli.plugins.registry import VerifierRegistry, load_verifier
from specdec_cli.plugins.verifiers import BlockDecision, Verifier
from specdec_plugins.match import SampleMatching
from tests.conftest import BLOCK_KINDS, random_block, tiny_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

WORKED_Q = [0.6, 0.3, 0.1]
WORKED_P = [0.2, 0.5, 0.3]
"""The worked example (threshold's, docs/verifiers.md §10): Σ p q = 0.12 + 0.15 + 0.03 = 0.3; Σ min(p, q) = 0.6."""


def _law(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _pairs(vocab: int, count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q, p) float64 ``[V]`` each: random ones (half of them sparse) and the kit's adversarial pairs."""
    generator = torch.Generator().manual_seed(vocab)
    random = [tuple(random_distributions(generator, (2, vocab), 0.3 * (i % 2))) for i in range(count)]
    return random + adversarial_distribution_pairs(vocab)


# --------------------------------------------------------------------------- (a) the sources, replayed


def mlx_lm_accept(tokens: list[int], draft_tokens: list[int], num_draft: int, max_tokens: float = math.inf):
    """MLX-LM's acceptance loop, transcribed from ml-explore/mlx-lm, ``mlx_lm/generate.py``,
    ``speculative_generate_step`` at 0024613ba012d9b4901532921d53f17b9f293d4f. ``tokens`` are the target's sampled
    tokens at the ``num_draft + 1`` positions (``tokens, logprobs = _step(model, model_cache, y, num_draft + 1)``);
    the log-probabilities it yields beside them are left out. → (the yielded tokens, n)."""
    yielded, ntoks = [], 0
    n = 0
    while n < num_draft:
        tn, dtn = tokens[n], draft_tokens[n]
        if tn != dtn:
            break
        n += 1
        ntoks += 1
        yielded.append(tn)  # yield tn, lpn, True
        if ntoks == max_tokens:
            break
    if ntoks < max_tokens:
        ntoks += 1
        yielded.append(tokens[n])  # yield tokens[n], logprobs[n], False
    return yielded, n


def llama_cpp_accept(sample, draft: list[int]) -> list[int]:
    """llama.cpp's ``common_sampler_sample_and_accept_n``, transcribed from ggml-org/llama.cpp, ``common/sampling.cpp``
    at 00efb3e184262872916bf136b3df63c1822a19bd (``idxs = 0 … draft.size()``): ``sample(i)`` is
    ``common_sampler_sample(gsmpl, ctx, idxs[i], grammar_first)``, the target's token at index i. → result."""
    result = []
    i = 0
    while i < len(draft):  # for (; i < draft.size(); i++)
        id_ = sample(i)
        result.append(id_)
        if draft[i] != id_:
            break
        i += 1
    if i == len(draft):
        result.append(sample(i))
    return result


def test_it_replays_mlx_lm_and_llama_cpp_on_the_same_draws():
    """The target's tokens at the L + 1 positions drawn from the uniforms specdec keys for them (stream RESIDUAL at
    offset t, BONUS at offset L); both sources' loops commit what verify_block commits, over blocks of every kind,
    lengths 1 to 6 and many keys: blocks that stop at once, in the middle, and run whole into the bonus."""
    verifier, outcomes = SampleMatching(), Counter()
    for seed, kind in enumerate(BLOCK_KINDS):
        for draft_length in (1, 3, 6):
            target, draft, drafted = random_block(kind, 1, draft_length, 16, seed, identical_drafts=True)
            for key in range(40):
                draws = Draws.create(key, block_start=7 * key)
                table = stream_table_from(draws, Stream.RESIDUAL, 2, draft_length + 1, "cpu")  # [L+1, 2]
                uniforms = torch.cat([table[:-1, 0], table[-1:, 1]])  # [L+1]: RESIDUAL at t < L, BONUS at L
                sampled = sample_with(target[0], uniforms).tolist()  # the target's own draws y_0 … y_L
                decision = verifier.verify_block(target, draft, drafted, draws)
                n = int(decision.num_accepted)
                committed = decision.tokens[: n + 1].tolist()
                assert mlx_lm_accept(sampled, drafted[0].tolist(), draft_length) == (committed, n), (kind, key)
                assert llama_cpp_accept(sampled.__getitem__, drafted[0].tolist()) == committed, (kind, key)
                outcomes["none" if n == 0 else "whole" if n == draft_length else "part"] += 1
    assert min(outcomes["none"], outcomes["part"], outcomes["whole"]) > 50, outcomes


# --------------------------------------------------------------------------- (b) exact laws, and wrong variants


class _DraftAtMismatch(SampleMatching):
    """Wrong: commits the draft's token x where y ≠ x (so it always commits x: π = p)."""

    name = "match-draft-at-mismatch"
    verify_block = Verifier.verify_block  # the base class's block, which samples conditional

    def conditional(self, target_probs, draft_probs, draft_tokens):
        return torch.zeros_like(target_probs).scatter(-1, draft_tokens[..., :1], 1.0)  # [..., V]: one-hot at x


class _FreshDrawAtMismatch(SampleMatching):
    """Wrong: after a mismatch draws a second token from all of q, x included (π(y) = q(y)(1 − Σ p q + p(y)))."""

    name = "match-fresh-draw"
    verify_block = Verifier.verify_block

    def conditional(self, target_probs, draft_probs, draft_tokens):
        x = draft_tokens[..., :1]  # [..., 1]
        matched = target_probs.gather(-1, x)  # [..., 1]: q(x), P(y = x)
        return ((1 - matched) * target_probs).scatter_add(-1, x, matched)  # [..., V]


class _QWithoutXAtMismatch(SampleMatching):
    """Not wrong: after a mismatch draws afresh from q without x. Given y ≠ x, y already has that law, so this is a
    coupling of the same rule (SGLang's thresholds at their defaults, docs/verifiers.md §10)."""

    verify_block = Verifier.verify_block

    def conditional(self, target_probs, draft_probs, draft_tokens):
        x = draft_tokens[..., :1]  # [..., 1]
        matched = target_probs.gather(-1, x)  # [..., 1]
        rest = target_probs.scatter(-1, x, 0.0)  # [..., V]: q without x, mass 1 − q(x)
        return rest.scatter_add(-1, x, matched)  # [..., V]


class _OneUniformPerBlock(SampleMatching):
    """Wrong: draws every y_t of a block with one uniform (keyed by the block, not the position). Each y_t alone
    still has law q_t, but consecutive tokens are coupled, so the committed sequence is not q's."""

    name = "match-one-uniform"

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, x = target_probs[0], draft_tokens[0]  # [L+1, V], [L]
        uniform = stream_table_from(randomness, Stream.RESIDUAL, 1, 1, x.device)  # [1, 1]
        sampled = sample_with(q, uniform.view(1).expand(q.shape[0]))  # [L+1]
        num_accepted = (sampled[:-1] == x).long().cumprod(0).sum()  # []
        return BlockDecision(sampled, num_accepted, torch.zeros_like(num_accepted))


@pytest.mark.parametrize("num_drafts", [1, 2, 3])
def test_the_output_law_is_q_and_the_acceptance_is_the_chance_that_a_draft_is_ys(num_drafts):
    """By enumeration of every candidate tuple: the output law is q; the acceptance is Σ_y q(y)(1 − Π_k (1 −
    p_k(y))), Σ p q for one draft; for identical drafts and for drafts of different laws."""
    verifier = SampleMatching()
    generator = torch.Generator().manual_seed(num_drafts)
    for q, p in _pairs(4):
        others = random_distributions(generator, (num_drafts - 1, 4))  # [K-1, V]
        for drafts in (p.expand(num_drafts, -1), torch.cat([p.unsqueeze(0), others])):  # [K, V]
            torch.testing.assert_close(enumerate_output_law(verifier, q, drafts), q, rtol=0, atol=1e-12)
            claimed = float(verifier.acceptance_probability(q, drafts))
            assert claimed == pytest.approx(candidate_acceptance(verifier, q, drafts), abs=1e-12)
            if num_drafts == 1:
                assert claimed == pytest.approx(float((p * q).sum()), abs=1e-12)


def test_the_worked_example():
    """q = [0.6, 0.3, 0.1], p = [0.2, 0.5, 0.3]: one draft accepts Σ p q = 0.3; two identical drafts accept
    0.6·(1 − 0.8²) + 0.3·(1 − 0.5²) + 0.1·(1 − 0.7²) = 0.216 + 0.225 + 0.051 = 0.492."""
    verifier, q, p = SampleMatching(), _law(WORKED_Q), _law(WORKED_P)
    assert float(verifier.acceptance_probability(q, p.view(1, 3))) == pytest.approx(0.3)
    assert float(verifier.acceptance_probability(q, p.expand(2, 3))) == pytest.approx(0.492)


def test_negative_controls_a_wrong_token_after_a_mismatch_fails_the_law_check():
    """Committing the draft's token gives π = p; a fresh draw from all of q gives q(y)(1 − Σ p q + p(y)): the
    enumeration tells both from q (on the worked example by 0.4 and 0.066 at token 0). Drawing from q without x
    is no bug: it is law q given every x, as sample matching's own conditional is."""
    q, p = _law(WORKED_Q), _law(WORKED_P).view(1, 3)
    draft_law = enumerate_output_law(_DraftAtMismatch(), q, p)
    torch.testing.assert_close(draft_law, p[0])
    fresh = enumerate_output_law(_FreshDrawAtMismatch(), q, p)  # [V]
    torch.testing.assert_close(fresh, q * (1 - 0.3 + p[0]))
    assert float((fresh - q).abs().max()) > 0.05
    for x in range(3):
        candidate = torch.tensor([x])
        torch.testing.assert_close(_QWithoutXAtMismatch().conditional(q, p, candidate), q)
        torch.testing.assert_close(SampleMatching().conditional(q, p, candidate), q)


# --------------------------------------------------------------------------- (c) the author's kit


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (_FreshDrawAtMismatch, "declares lossless, but its block's output law differs"),
        (_OneUniformPerBlock, "verify's decisions do not follow its block_law"),
    ],
)
def test_the_kit_catches_the_wrong_variants(cls, message):
    with pytest.raises(ConformanceError, match=message):
        check_verifier(cls, {}, samples=2000)


# --------------------------------------------------------------------------- (d) end to end


DEPTH, SAMPLES, PROMPT = 3, 1200, "a b c d"


def _first_token_laws(decoder: SpeculativeDecoder) -> dict[str, dict]:
    """The exact law of the first DEPTH tokens under the target alone and under the draft row alone."""
    prompt_ids = decoder.encode_prompt(PROMPT)
    drafter = decoder.drafters[0]
    settings = {
        "target": (decoder.target.model, SamplingParams(1.0)),
        "draft": (drafter.session.model, drafter.row_params[0]),
    }
    return {
        role: exact_sequence_law(model, prompt_ids, DEPTH, params, decoder.vocab_size, {EOS_ID})
        for role, (model, params) in settings.items()
    }


def _recipe(tiny_models, verifier: str, num_drafts: int = 1) -> dict:
    """The tiny llama target; its draft is the target itself at temperature 0.5, which matches half of the time (the
    other tiny llama matches 7%, and its blocks would almost never reach the bonus) while its law is far from q."""
    recipe = tiny_recipe(
        tiny_models,
        "llama",
        verifier={"name": verifier},
        speculation={"draft_length": 3, "num_drafts": num_drafts},
        generation={"max_new_tokens": DEPTH, "temperature": 1.0},
    )
    recipe["draft"] = {**recipe["draft"], "model": str(tiny_models["llama-target"]), "temperature": 0.5}
    return recipe


@pytest.mark.parametrize("num_drafts", [1, 2])
def test_generate_with_match_keeps_the_target_law_through_the_cli(tiny_models, write_recipe, run, num_drafts):
    """`specdec generate --verifier match`: the first three tokens of 1200 samples follow the target's exact law
    (a chi-square), and not the draft's (the check has power); with one draft row and with two."""
    recipe = _recipe(tiny_models, "match", num_drafts)
    # --batch-size 64: each sample keeps its own key, so these are the samples decoded one at a time, sooner.
    arguments = ["--json", "--num-samples", str(SAMPLES), "--seed", "1", "--verifier", "match", "--batch-size", "64"]
    arguments.append(PROMPT)
    code, out, err = run(["generate", "-r", str(write_recipe(recipe)), *arguments])
    assert code == 0, err
    results = json.loads(out)["samples"]
    counts = Counter(tuple(sample["token_ids"]) for sample in results)
    accepted = sum(sample["stats"]["accepted_tokens"] for sample in results)
    drafted = sum(sample["stats"]["drafted_tokens"] for sample in results)
    assert 0.3 < accepted / drafted < 0.9, "the draft must be matched often and missed often"
    laws = _first_token_laws(SpeculativeDecoder.from_recipe(build_recipe(recipe)))
    assert chi_square_p_value(counts, laws["target"]) > 1e-3
    assert chi_square_p_value(counts, laws["draft"]) < 1e-6


def test_negative_control_the_same_chi_square_rejects_a_wrong_variant(tiny_models):
    """The fresh-draw variant, registered in this process and decoded by the library as `generate` decodes: the
    chi-square that passes `match` rejects it."""
    registry = VerifierRegistry(extra={_FreshDrawAtMismatch.name: _FreshDrawAtMismatch})
    recipe = build_recipe(_recipe(tiny_models, _FreshDrawAtMismatch.name))
    decoder = SpeculativeDecoder.from_recipe(recipe, registry=registry)
    counts = Counter(tuple(result.token_ids) for result in keyed_samples(decoder, PROMPT, SAMPLES))
    assert chi_square_p_value(counts, _first_token_laws(decoder)["target"]) < 1e-4


# --------------------------------------------------------------------------- (e) against speculative sampling


def test_speculative_sampling_accepts_at_least_as_much_on_the_same_drafts():
    """Per position, exactly: Σ min(p, q) − Σ p q = Σ min(p, q)(1 − max(p, q)) ≥ 0, both enumerated from the rules'
    conditionals; strictly more on the worked example (0.6 against 0.3), equal for a one-hot draft or target. On
    the same sampled blocks and keys, speculative sampling's blocks keep more draft tokens."""
    speculative, match = load_verifier("speculative"), SampleMatching()
    for q, p in _pairs(4, count=10) + _pairs(6, count=10):
        drafts = p.view(1, -1)  # [1, V]
        ours, theirs = candidate_acceptance(match, q, drafts), candidate_acceptance(speculative, q, drafts)
        gap = float((torch.minimum(p, q) * (1 - torch.maximum(p, q))).sum())
        assert theirs - ours == pytest.approx(gap, abs=1e-12) and gap >= 0
    q, p = _law(WORKED_Q), _law(WORKED_P).view(1, 3)
    assert float(speculative.acceptance_probability(q, p)) == pytest.approx(
        2 * float(match.acceptance_probability(q, p))
    )
    one_hot = torch.nn.functional.one_hot(torch.tensor(1), 3).double()  # [V]
    for pair in ((q, one_hot.view(1, 3)), (one_hot, p)):  # a greedy draft, a greedy target
        assert float(speculative.acceptance_probability(*pair)) == pytest.approx(
            float(match.acceptance_probability(*pair))
        )

    kept = {"speculative": 0, "match": 0}
    for seed in range(20):
        block = random_block("peaked", 1, 4, 16, seed, identical_drafts=True)
        for key in range(20):
            for name, verifier in (("speculative", speculative), ("match", match)):
                kept[name] += int(verifier.verify_block(*block, Draws.create(key, 3 * key)).num_accepted)
    assert kept["speculative"] > 1.2 * kept["match"] > 0, kept


# --------------------------------------------------------------------------- the block and the base class


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_a_block_decides_as_the_base_class_walks(num_drafts):
    """verify_block equals the base class's block for ``conditional = q`` (one draft: every position selected at
    once; several: the walk over alive rows) on the same draws. A batch decides as its blocks alone, in as many
    operations for 8 blocks as for 2: tests/test_contracts.py, for every verifier."""
    verifier = SampleMatching()
    for b in range(6):
        target, draft, tokens = random_block(BLOCK_KINDS[b], num_drafts, 4, 16, seed=b, identical_drafts=False)
        draws = Draws.create(key=100 + b, block_start=3 * b)
        alone = verifier.verify_block(target, draft, tokens, draws)
        walked = Verifier.verify_block(verifier, target, draft, tokens, draws)  # select, or _walk
        n = int(alone.num_accepted)
        assert (n, int(alone.row)) == (int(walked.num_accepted), int(walked.row))
        assert torch.equal(alone.tokens[: n + 1], walked.tokens[: n + 1])
