"""The batched verifier contract (issue #22 §2): ``verify_batch`` decides B blocks, one per sequence.

A plugin that only writes ``verify_block`` (keyed or with a generator) is looped; a batch's draws are each
sequence's own. Negative control: a batch whose draws are those of another sequence decides differently. Every
registered verifier's batch is checked against its blocks decided alone, on either path, in tests/test_contracts.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec_cli import BlockDecision, BlockVerifier, load_verifier
from specdec_cli.base.randomness import Draws, block_generator
from specdec_cli.plugins.verifiers import BatchDecision
from tests.conftest import random_block

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ("peaked", "near_one_token", "equal", "disjoint", "flat_draft")


def random_batch(batch: int, num_drafts: int, draft_length: int, identical: bool, vocab: int = 16):
    """B blocks of different kinds stacked: ``[B, K, L+1, V]``, ``[B, K, L, V]``, ``[B, K, L]``."""
    blocks = [
        random_block(
            KINDS[b % len(KINDS)], num_drafts, draft_length, vocab, seed=b, identical_drafts=identical, support=8
        )
        for b in range(batch)
    ]
    return tuple(torch.stack(parts) for parts in zip(*blocks))


def batch_draws(batch: int) -> Draws:
    draws = Draws.batch([100 + b for b in range(batch)])
    draws.block_start.copy_(torch.arange(batch) * 3)  # every sequence at its own output position
    return draws


def decided_alone(verifier: BlockVerifier, target, draft, tokens, draws: Draws) -> BatchDecision:
    return BatchDecision.stack(
        [verifier.verify_block(target[b], draft[b], tokens[b], draws.row(b)) for b in range(tokens.shape[0])]
    )


def assert_same(batch: BatchDecision, alone: BatchDecision) -> None:
    for field in ("tokens", "num_accepted", "row"):
        assert torch.equal(getattr(batch, field), getattr(alone, field)), field


class OnlyBlocks(BlockVerifier):
    """A third-party verifier that writes only verify_block: keeps the first draft token, draws the next."""

    name = "only-blocks"
    lossless = False
    max_drafts = 1

    def __init__(self, keyed: bool = True):
        self.keyed_randomness = keyed

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        if isinstance(randomness, Draws):
            uniform = randomness.uniform(0)
        else:
            uniform = torch.rand((), generator=randomness, dtype=torch.float64)
        token = (target_probs[0, 1].double().cumsum(0) < uniform).sum().clamp(max=target_probs.shape[-1] - 1)
        filler = draft_tokens[0, 1:]
        one = torch.ones((), dtype=torch.long)
        return BlockDecision(torch.cat([draft_tokens[0, :1], token.view(1), filler]), one, one * 0)


@pytest.mark.parametrize("keyed", [True, False])
def test_a_plugin_without_verify_batch_is_looped_block_by_block(keyed):
    verifier = OnlyBlocks(keyed=keyed)
    target, draft, tokens = random_batch(5, 1, 3, True)
    if keyed:
        randomness, alone = batch_draws(5), None
        alone = decided_alone(verifier, target, draft, tokens, randomness)
    else:
        randomness = [block_generator(b, 0, "cpu") for b in range(5)]
        alone = BatchDecision.stack(
            [verifier.verify_block(target[b], draft[b], tokens[b], block_generator(b, 0, "cpu")) for b in range(5)]
        )
    assert_same(verifier.verify_batch(target, draft, tokens, randomness), alone)


def test_negative_control_draws_of_other_sequences_decide_differently():
    """The equality above is not vacuous: giving each block its neighbour's draws changes decisions."""
    verifier = load_verifier("speculative")
    target, draft, tokens = random_batch(16, 1, 4, True)
    draws = batch_draws(16)
    shifted = Draws(draws.key.roll(1), draws.block_start.roll(1))
    with torch.inference_mode():
        batch = verifier.verify_batch(target, draft, tokens, shifted)
        alone = decided_alone(verifier, target, draft, tokens, draws)
    with pytest.raises(AssertionError):
        assert_same(batch, alone)


def test_batch_draws_are_each_sequences_own_draws():
    keys = [7, -3, 2**62]
    draws = Draws.batch(keys)
    draws.block_start.copy_(torch.tensor([0, 4, 9]))
    table = draws.batch_uniforms(0, 3, 2)  # [B, positions, lanes]
    for b, key in enumerate(keys):
        alone = Draws.create(key, int(draws.block_start[b]))
        assert torch.equal(table[b], alone.uniforms(0, 3, 2))
        assert torch.equal(draws.row(b).uniforms(2, 4, 1), alone.uniforms(2, 4, 1))
