"""The verifier's one call (issue #42): ``verify`` over ``[B, K, L+1, V]``, and the one adapter that keeps a plugin
written against ``verify_block`` working, through the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import block_inputs, tiny_recipe

from specdec_cli.base.randomness import Draws
from specdec_cli.engine.decoder import SpeculativeDecoder
from specdec_cli.plugins.registry import VerifierRegistry, class_problem
from specdec_cli.plugins.verifiers import BlockDecision, BlockVerifier, Decision, decide_blocks
from specdec_cli.recipe import build_recipe
from specdec_plugins.speculative import SpeculativeSampling

PROMPTS = ["a b c d", "e e a", "b", "d c b a e d c b a"]


class WrittenForOneBlock(BlockVerifier):
    """A third-party rule as written before ``verify`` existed: only ``verify_block``, no flags (so looped, and
    handed a seeded generator: it draws from torch.rand as such plugins did)."""

    name = "one-block"
    lossless = True
    max_drafts = 1

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None) -> BlockDecision:
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        draft_length = x.shape[0]
        q_x, p_x = q[:-1].gather(1, x.view(-1, 1)).squeeze(1), p.gather(1, x.view(-1, 1)).squeeze(1)  # [L] each
        accepted = torch.rand(draft_length, generator=randomness, dtype=torch.float64) < (q_x / p_x).clamp(max=1)
        num_accepted = accepted.long().cumprod(0).sum()  # []
        excess = (q[:-1] - p).clamp(min=0)  # [L, V]
        laws = torch.cat([excess, q[-1:]])  # [L+1, V]: a rejection's residual at each offset, the bonus law last
        law = laws[num_accepted]  # [V]
        law = torch.where(law.sum() > 0, law, q[num_accepted])  # [V]: p = q at x leaves no excess
        token = torch.multinomial(law, 1, generator=randomness)  # [1]
        tokens = torch.cat([x, token]).scatter(0, num_accepted.view(1), token)  # [L+1]
        return BlockDecision(tokens, num_accepted, torch.zeros_like(num_accepted))


class WrittenForTheBatch(BlockVerifier):
    """A rule written for the batch: only ``verify`` (it reuses speculative sampling's rule for its decisions)."""

    name = "batched"
    lossless = True
    max_drafts = 1
    keyed_randomness = True

    def verify(self, target_probs, draft_probs, draft_tokens, randomness=None, judged=None) -> Decision:
        return decide_blocks(SpeculativeSampling(), target_probs, draft_probs, draft_tokens, randomness)


class WritesNeither(BlockVerifier):
    name = "neither"
    lossless = True
    max_drafts = 1


def _decoder(tiny_models, name: str, cls: type) -> SpeculativeDecoder:
    recipe = tiny_recipe(tiny_models, "llama", verifier={"name": name}, generation={"max_new_tokens": 12})
    return SpeculativeDecoder.from_recipe(build_recipe(recipe), registry=VerifierRegistry(extra={name: cls}))


def test_a_plugin_written_for_one_block_runs_at_every_batch_size(tiny_models):
    decoder = _decoder(tiny_models, "one-block", WrittenForOneBlock)
    alone = decoder.generate(PROMPTS, num_samples=2)
    batched = decoder.generate(PROMPTS, num_samples=2, batch_size=4)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert sum(r.stats.accepted_tokens for r in alone) > 0  # it did decide blocks, accepting some drafts
    # Negative control: another seed gives other samples, so the equality above is not one of constant output.
    other = decoder.generate(PROMPTS, num_samples=2, seed=decoder.config.seed + 1)
    assert [r.token_ids for r in other] != [r.token_ids for r in alone]


def test_a_rule_written_for_the_batch_decides_as_the_rule_it_batches(tiny_models):
    batched = _decoder(tiny_models, "batched", WrittenForTheBatch).generate(PROMPTS, num_samples=2, batch_size=3)
    recipe = tiny_recipe(tiny_models, "llama", verifier={"name": "speculative"}, generation={"max_new_tokens": 12})
    speculative = SpeculativeDecoder.from_recipe(build_recipe(recipe)).generate(PROMPTS, num_samples=2, batch_size=3)
    assert [r.token_ids for r in batched] == [r.token_ids for r in speculative]


def test_verify_block_of_a_batched_rule_is_its_batch_of_one():
    target, draft, tokens = block_inputs(1, identical=True)
    draws = Draws.create(5, block_start=3)
    one = WrittenForTheBatch().verify_block(target, draft, tokens, draws)
    direct = SpeculativeSampling().verify_block(target, draft, tokens, draws)
    for field in ("tokens", "num_accepted", "row"):
        assert torch.equal(getattr(one, field), getattr(direct, field))
    assert one.tokens.shape == direct.tokens.shape


@pytest.mark.parametrize("batch", [1, 3])
def test_verify_is_each_sequence_decided_alone(batch):
    target, draft, tokens = (torch.stack([t] * batch) for t in block_inputs(1, identical=True))
    draws = Draws.batch(list(range(batch)))
    decision = SpeculativeSampling().verify(target, draft, tokens, draws)
    assert decision.tokens.shape == (batch, tokens.shape[-1] + 1)
    for b in range(batch):
        alone = SpeculativeSampling().verify_block(target[b], draft[b], tokens[b], draws.row(b))
        assert torch.equal(decision.tokens[b], alone.tokens)
        assert torch.equal(decision.num_accepted[b], alone.num_accepted)


def test_a_class_that_writes_neither_call_is_abstract():
    with pytest.raises(TypeError, match="verify_block"):
        WritesNeither()
    assert "verify_block" in class_problem(WritesNeither, BlockVerifier, ("lossless",))
    # Negative control: writing either call completes it.
    assert class_problem(WrittenForTheBatch, BlockVerifier, ("lossless",)) is None
    assert class_problem(WrittenForOneBlock, BlockVerifier, ("lossless",)) is None
