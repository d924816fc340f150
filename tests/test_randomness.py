"""Keyed randomness: the hash is SplitMix64, its uniforms are uniform and independent across streams,
positions, lanes and samples, and a shared stream is caught end to end (the negative control)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import UsageError
from specdec_cli.base.randomness import SCHEME, Draws, Stream, block_generator, sample_key, uniforms_from, uniforms_of
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import sample_with
from specdec_cli.kit.testing import chi_square_p_value, random_sequence_laws, target_sequence_law
from specdec_cli.plugins.laws import normalized_excess, ratio_acceptance
from specdec_cli.plugins.verifiers import BlockDecision
from specdec_cli.results.store import ResultsStore
from specdec_plugins.speculative import SpeculativeSampling
from tests.conftest import tiny_recipe

MASK = (1 << 64) - 1
DRAWS = 1 << 20


def _reference_uniform(key: int, counter: int) -> float:
    """SplitMix64 in Python integers (Steele, Lea & Flood 2014), then the top 52 bits as (m + 1/2) 2^-52."""
    z = (key + counter * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return (((z ^ (z >> 31)) >> 12) + 0.5) * 2.0**-52


def test_the_hash_is_splitmix64():
    counters = torch.randint(0, 1 << 60, (2000,), generator=torch.Generator().manual_seed(0))
    for key in (0, -1, sample_key(3, 1, 2), 1 << 62):
        expected = [_reference_uniform(key & MASK, int(c)) for c in counters]
        assert uniforms_of(torch.tensor(key), counters).tolist() == expected


def test_uniforms_are_never_0_or_1_and_have_52_bits():
    values = Draws.create(7).uniforms(Stream.ACCEPT, DRAWS)  # [N, 1]
    assert 0 < values.min() and values.max() < 1
    numerators = (values * 2.0**53).flatten()  # odd integers below 2^53
    assert (numerators == numerators.round()).all() and (numerators.long() % 2 == 1).all()
    assert numerators.unique().numel() > DRAWS - 10  # 2^52 values: collisions are rare


@pytest.mark.parametrize("stream", list(Stream))
def test_each_stream_is_uniform(stream):
    values = Draws.create(sample_key(0, 0, 0), block_start=5).uniforms(stream, DRAWS // 4, 4).flatten().numpy()
    assert stats.kstest(values, "uniform").pvalue > 1e-3


def _pairs_p_value(first: np.ndarray, second: np.ndarray, cells: int = 16) -> float:
    """Chi-square test that (first, second) is uniform on the unit square (so the two are independent)."""
    counts = np.histogram2d(first, second, bins=cells, range=[[0, 1], [0, 1]])[0].flatten()
    return stats.chisquare(counts).pvalue


def _neighbours() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    draws = Draws.create(sample_key(1, 2, 3), block_start=11)
    positions = DRAWS // 8
    accept = draws.uniforms(Stream.ACCEPT, positions + 1, 4)  # [N+1, 4]
    other_sample = Draws.create(sample_key(1, 2, 4), block_start=11).uniforms(Stream.ACCEPT, positions, 4)
    next_block = Draws(draws.key, draws.block_start + 1).uniforms(Stream.ACCEPT, positions, 4)
    return {
        "streams": (accept[:-1], draws.uniforms(Stream.RESIDUAL, positions, 4)),
        "positions": (accept[:-1], accept[1:]),
        "lanes": (accept[:-1, :3], accept[:-1, 1:]),
        "samples": (accept[:-1], other_sample),
        "blocks": (accept[:-1], next_block),
    }


@pytest.mark.parametrize("kind", ["streams", "positions", "lanes", "samples", "blocks"])
def test_neighbouring_draws_are_independent(kind):
    first, second = _neighbours()[kind]
    assert _pairs_p_value(first.flatten().numpy(), second.flatten().numpy()) > 1e-3
    assert abs(np.corrcoef(first.flatten(), second.flatten())[0, 1]) < 0.01


def test_the_independence_check_has_power():
    """Negative control: a pair that is weakly dependent (a quarter of the draws shared) is rejected."""
    values = Draws.create(3).uniforms(Stream.ACCEPT, DRAWS // 2, 2).numpy()  # [N, 2]
    second = values[:, 1].copy()
    second[::4] = values[::4, 0]
    assert _pairs_p_value(values[:, 0], second) < 1e-6


def test_offsets_and_views_agree():
    draws = Draws.create(sample_key(0, 1, 0), block_start=40)
    table = draws.uniforms(Stream.ACCEPT, 6, 3)  # [6, 3]
    assert torch.equal(draws.at(2).uniforms(Stream.ACCEPT, 2, 3), table[2:4])
    assert torch.equal(draws.uniforms(Stream.ACCEPT, 1, 3, offset=torch.tensor(5)), table[5:])
    assert torch.equal(uniforms_from(draws, Stream.ACCEPT, (6, 3), "cpu", lanes_last=True), table)
    assert torch.equal(uniforms_from(draws, Stream.ACCEPT, (6,), "cpu"), table[:, 0])
    assert draws.uniform(Stream.BONUS, 4) == draws.uniforms(Stream.BONUS, 5)[4, 0]


def test_a_block_generator_is_a_function_of_key_and_block():
    first, second = (torch.rand(3, generator=block_generator(99, 7, "cpu")) for _ in range(2))
    assert torch.equal(first, second)
    assert not torch.equal(first, torch.rand(3, generator=block_generator(99, 8, "cpu")))


# --------------------------------------------------------------------------- end to end


class SharedStream(SpeculativeSampling):
    """The bug class vLLM fixed twice: the correction after a rejection is drawn with the acceptance
    uniform of the same position (which, given the rejection, is no longer uniform)."""

    name = "shared-stream"

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        accept = ratio_acceptance(q[:-1], p, x.unsqueeze(-1)).squeeze(-1).double()  # [L]
        uniforms = randomness.uniforms(Stream.ACCEPT, x.shape[0] + 1)[:, 0]  # [L+1]
        num_accepted = (uniforms[:-1] < accept).long().cumprod(0).sum()  # []
        laws = torch.cat([normalized_excess(q[:-1], p), q[-1:]])  # [L+1, V]: corrections, then the bonus law
        law = laws.index_select(0, num_accepted.view(1)).squeeze(0)  # [V]
        cumulative = law.double().cumsum(0)  # [V]
        threshold = uniforms.gather(0, num_accepted.view(1)) * cumulative[-1]  # [1]: the reused uniform
        token = torch.searchsorted(cumulative, threshold, right=True).clamp(max=law.shape[0] - 1)  # [1]
        tokens = torch.cat([x, token]).scatter(0, num_accepted.view(1), token)  # [L+1]
        return BlockDecision(tokens, num_accepted, torch.zeros_like(num_accepted))


VOCAB, LENGTH, DRAFT_LENGTH = 4, 4, 2


def _generate(verifier, target_law, draft_law, key: int) -> tuple[int, ...]:
    """The engine's loop on exact laws: blocks of L draft tokens (stream DRAFT), each decided with the
    block's keyed draws, until LENGTH tokens are committed."""
    committed: tuple[int, ...] = ()
    while len(committed) < LENGTH:
        draws = Draws.create(key, block_start=len(committed))
        uniforms = draws.uniforms(Stream.DRAFT, DRAFT_LENGTH)[:, 0]  # [L]
        drafted: tuple[int, ...] = ()
        for t in range(DRAFT_LENGTH):
            drafted += (int(sample_with(draft_law(committed + drafted), uniforms[t])),)
        prefixes = [committed + drafted[:t] for t in range(DRAFT_LENGTH + 1)]
        target_probs = torch.stack([target_law(prefix) for prefix in prefixes]).float()[None]  # [1, L+1, V]
        draft_probs = torch.stack([draft_law(prefix) for prefix in prefixes[:-1]]).float()[None]  # [1, L, V]
        decision = verifier.verify_block(target_probs, draft_probs, torch.tensor([drafted]), draws)
        committed += tuple(decision.tokens[: int(decision.num_accepted) + 1].tolist())
    return committed[:LENGTH]


def _end_to_end_p_value(verifier, samples: int = 2000) -> float:
    generator = torch.Generator().manual_seed(11)
    depth = LENGTH + DRAFT_LENGTH
    target, draft = (random_sequence_laws(generator, VOCAB, depth) for _ in range(2))
    counts = Counter(_generate(verifier, target.__getitem__, draft.__getitem__, key) for key in range(samples))
    return chi_square_p_value(counts, target_sequence_law(target.__getitem__, VOCAB, LENGTH))


def test_keyed_speculative_sampling_keeps_the_target_law_end_to_end():
    assert _end_to_end_p_value(SpeculativeSampling()) > 1e-3


def test_a_shared_stream_is_caught_end_to_end():
    """Negative control: the same end-to-end check rejects the acceptance uniform reused for the correction."""
    assert _end_to_end_p_value(SharedStream()) < 1e-6


def test_a_sample_does_not_depend_on_what_ran_beside_it(tiny_models):
    recipe = build_recipe(
        tiny_recipe(
            tiny_models,
            "llama",
            verifier={"name": "specinfer"},
            speculation={"draft_length": 3, "num_drafts": 2},
            generation={"max_new_tokens": 12},
        )
    )
    decoder = SpeculativeDecoder.from_recipe(recipe)
    alone = decoder.generate(["c d"])[0].token_ids  # prompt 0, sample 0
    among = decoder.generate(["c d", "a b", "e"], num_samples=3)  # the same (prompt 0, sample 0) first
    decoder.with_config(verifier="speculative", num_drafts=1).generate(["c d"], num_samples=2)  # another config between
    assert among[0].token_ids == alone == decoder.generate(["c d"])[0].token_ids
    assert len({tuple(r.token_ids) for r in among}) > 1  # the samples differ from one another


def test_a_results_folder_of_the_old_randomness_is_not_resumed(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"cells": [], "seeds": [0]}))
    with pytest.raises(UsageError, match="randomness scheme 'torch-generator'.*give a new --output folder"):
        ResultsStore(folder, {"cells": [], "seeds": [0]})
    resumed = tmp_path / "new"
    ResultsStore(resumed, {"cells": [], "seeds": [0]}).close()
    store = ResultsStore(resumed, {"cells": [], "seeds": [0]})
    assert store.config["randomness"] == SCHEME
