"""The batched verifier contract (issue #22 §2): ``verify_batch`` decides B blocks, one per sequence.

For every built-in and K: the batch's decisions equal each block decided alone with its own sequence's
draws (``Draws.row``), whichever path decides the batch (mapped by vmap, or looped); the mapped path
dispatches as many operations at B = 8 as at B = 2 and reads nothing; a plugin that only writes
``verify_block`` (keyed or with a generator) is looped. Negative control: a batch whose draws are
those of another sequence decides differently.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import pytest
import torch

from specdec_cli import BlockDecision, BlockVerifier, load_verifier
from specdec_cli.base.randomness import Draws, block_generator
from specdec_cli.engine.device_path import OperationCount
from specdec_cli.plugins.verifiers import BatchDecision, device_path
from tests.conftest import random_block

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    ("speculative", 1, {}),
    ("block", 1, {}),
    ("mentored", 1, {"kl": 0.3}),
    ("mentored", 1, {"kl": 0.0}),
    *(("specinfer", k, {}) for k in (1, 2, 3)),
    *(("spectr", k, {}) for k in (2, 3)),
    *((name, k, {}) for name in ("is-lp", "is-truncated") for k in (1, 2, 3)),
]
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


@pytest.mark.parametrize("forced_device_path", [False, True], ids=["cpu-path", "device-path"])
@pytest.mark.parametrize("name,num_drafts,params", CASES, ids=[f"{n}-K{k}-{p}" for n, k, p in CASES])
def test_a_batch_decides_each_block_as_it_is_decided_alone(name, num_drafts, params, forced_device_path):
    verifier = load_verifier(name, params)
    target, draft, tokens = random_batch(7, num_drafts, 4, type(verifier).identical_drafts)
    draws = batch_draws(7)
    with torch.inference_mode(), warnings.catch_warnings(), device_path() if forced_device_path else nullcontext():
        # vmap's "performance drop" warning: an operation it has no batching rule for, and so loops.
        warnings.filterwarnings("error", message="There is a performance drop")
        batch = verifier.verify_batch(target, draft, tokens, draws)
        alone = decided_alone(verifier, target, draft, tokens, draws)
    assert batch.tokens.shape == (7, 5) and batch.num_accepted.shape == batch.row.shape == (7,)
    assert_same(batch, alone)


@pytest.mark.parametrize("name,num_drafts,params", [case for case in CASES if not case[0].startswith("is-")])
def test_the_mapped_batch_dispatches_the_same_operations_at_any_batch_size_and_reads_nothing(name, num_drafts, params):
    verifier = load_verifier(name, params)
    assert type(verifier).batches_by_vmap

    def count(batch: int) -> OperationCount:
        target, draft, tokens = random_batch(batch, num_drafts, 4, type(verifier).identical_drafts)
        with torch.inference_mode(), device_path(), OperationCount() as counted:
            verifier.verify_batch(target, draft, tokens, batch_draws(batch))
        return counted

    two, eight = count(2), count(8)
    assert two.ops == eight.ops
    assert eight.reads == 0, eight.read_names


@pytest.mark.parametrize("name", ["is-lp", "is-truncated"])
def test_importance_sampling_solves_a_whole_batchs_lps_in_one_host_read(name):
    """Importance sampling solves its free LPs on the host: its batch packs every block's LPs (mapped), reads them
    once, and decides every block with its solutions (mapped again), in as many operations at B = 8 as at B = 2."""
    verifier = load_verifier(name)

    def count(batch: int) -> OperationCount:
        target, draft, tokens = random_batch(batch, 3, 4, False)
        with torch.inference_mode(), device_path(), OperationCount() as counted:
            verifier.verify_batch(target, draft, tokens, batch_draws(batch))
        return counted

    two, eight = count(2), count(8)
    assert two.reads == eight.reads == 1, eight.read_names
    assert two.ops == eight.ops


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
