"""The checks only a GPU can make (issue #20 §4); skipped where no CUDA device is present.

On the CPU, tests/test_device_path.py counts operations and reads with a dispatch counter. Here the GPU
itself is the judge:
(a) the counter sees the same operations and reads on CUDA as on the CPU (no CPU-only branch);
(b) CUDA's sync-debug mode sees no host synchronisation in a built-in's block (importance sampling: its
one LP read and the upload of the LP's answer);
(c) a block captured in a CUDA graph (``torch.cuda.graph``: any sync aborts a capture) and replayed on new
laws decides as the eager block;
(d) the engine's ``speculation.compile`` on a GPU (the verify step replayed from CUDA graphs,
:mod:`specdec_cli.engine.graphs`) decides as the eager engine.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.randomness import Draws
from specdec_cli.base.recipe import build_recipe
from specdec_cli.engine.device_path import capture_cuda_graph, count_block
from specdec_cli.engine.graphs import CapturedVerifyStep
from specdec_cli.plugins.registry import VerifierFault, VerifierRegistry, load_verifier
from specdec_plugins.speculative import SpeculativeSampling
from tests.conftest import BLOCK_KINDS, CASES, Case, random_block, random_blocks, tiny_recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 4096
GRAPH_CASES = [case for case in CASES if not case.host_lp]
"""Importance sampling with several drafts reads its LP on the host once per block: no graph holds it."""


def _on_cuda(block: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.cuda() for tensor in block)


def _cuda_draws(draws: Draws) -> Draws:
    return Draws(draws.key.cuda(), draws.block_start.cuda())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_device_path_counts_on_cuda_as_on_the_cpu(case):
    verifier = case.verifier()
    for kind, block, draws in random_blocks(case, 8, VOCAB):
        on_cpu = count_block(verifier, *block, draws)
        on_gpu = count_block(verifier, *_on_cuda(block), _cuda_draws(draws))
        assert (on_gpu.ops, on_gpu.reads) == (on_cpu.ops, on_cpu.reads), kind


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_block_synchronises_with_the_host_only_for_the_lp(case):
    verifier = case.verifier()
    for kind, block, draws in random_blocks(case, 8, VOCAB):
        block, draws = _on_cuda(block), _cuda_draws(draws)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                verifier.verify_block(*block, draws)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(warning.message) for warning in caught if "called a synchronizing" in str(warning.message)]
        assert len(syncs) == (2 if case.host_lp else 0), (kind, syncs)


def _capture(verifier, block, draws):
    """The block's verification captured in a CUDA graph over ``block`` and ``draws`` (its static inputs)."""
    with torch.inference_mode():
        return capture_cuda_graph(lambda: verifier.verify_block(*block, draws))


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda case: case.id)
def test_a_block_captured_in_a_cuda_graph_decides_as_eager_on_new_laws(case):
    verifier = case.verifier()
    blocks = list(random_blocks(case, 8, VOCAB))
    _, first, first_draws = blocks[0]
    static, static_draws = _on_cuda(first), _cuda_draws(first_draws)
    replay, captured = _capture(verifier, static, static_draws)
    eager_decisions = set()
    for kind, block, draws in blocks:  # every block kind replayed through the one graph
        block, draws = _on_cuda(block), _cuda_draws(draws)
        for buffer, values in zip(
            (*static, static_draws.key, static_draws.block_start), (*block, draws.key, draws.block_start)
        ):
            buffer.copy_(values)
        replay()
        with torch.inference_mode():
            eager = verifier.verify_block(*block, draws)
        accepted = int(eager.num_accepted)
        eager_decisions.add((accepted, *eager.tokens[: accepted + 1].tolist()))
        assert int(captured.num_accepted) == accepted, kind
        assert int(captured.row) == int(eager.row), kind
        assert torch.equal(captured.tokens[: accepted + 1], eager.tokens[: accepted + 1]), kind
    assert len(eager_decisions) > 1  # a replay that ignored its new inputs would fail above


def test_a_captured_step_hands_out_decisions_the_next_replay_does_not_overwrite():
    step = CapturedVerifyStep(load_verifier("speculative"), fallback=None)
    blocks = [
        (_on_cuda(block), _cuda_draws(draws)) for _, block, draws in random_blocks(Case("speculative", 1), 8, VOCAB)
    ]
    first = step(*blocks[0][0], blocks[0][1])
    kept = first.tokens.clone(), first.num_accepted.clone()
    for block, draws in blocks[1:]:
        step(*block, draws)
    assert torch.equal(first.tokens, kept[0]) and torch.equal(first.num_accepted, kept[1])
    assert list(step._captured.values())[0] is not None


class _Uploads(SpeculativeSampling):
    """Uploads a host value mid-block: fine eager, refused by a capture (or baked into the graph)."""

    name = "uploads"

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        scale = torch.tensor(1.0, dtype=target_probs.dtype, device=target_probs.device)  # []
        return super().verify_block(target_probs * scale, draft_probs, draft_tokens, randomness)


class _NotCapturable(SpeculativeSampling):
    name, capturable = "not-capturable", False


class _Raises(SpeculativeSampling):
    name = "raises"

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        raise ValueError("this plugin's own complaint")


def _cuda_decoder(tiny_models, verifier: str, num_drafts: int = 1, **params) -> SpeculativeDecoder:
    recipe = tiny_recipe(
        tiny_models,
        "llama",
        target={"device": "cuda"},
        draft={"device": "cuda"},
        verifier={"name": verifier, "params": params},
        speculation={"draft_length": 4, "num_drafts": num_drafts, "compile": True},
        generation={"max_new_tokens": 24},
    )
    return SpeculativeDecoder.from_recipe(
        build_recipe(recipe), registry=VerifierRegistry(extra={p.name: p for p in (_Uploads, _NotCapturable, _Raises)})
    )


@pytest.mark.parametrize(
    ("verifier", "num_drafts", "captured"),
    [
        ("speculative", 1, True),
        ("mentored", 1, True),
        ("specinfer", 2, True),
        ("is-truncated", 2, False),  # reads its LP on the host: the compiled fallback, no graph
        ("uploads", 1, None),  # a graph, or the fallback where the capture refuses the upload
        ("not-capturable", 1, False),
    ],
)
def test_the_compiled_engine_on_cuda_decides_as_the_eager_one(tiny_models, verifier, num_drafts, captured):
    compiled = _cuda_decoder(tiny_models, verifier, num_drafts, **({"kl": 0.3} if verifier == "mentored" else {}))
    eager = compiled.with_config(compile=False, static_cache=True)  # --compile's cache, its steps eager
    prompt_ids = compiled.encode_prompt("a b c")
    compiled.warm_up(prompt_ids)
    graphs = list(compiled.steps.verify._captured.values())  # a block shape each; none if not capturable
    assert graphs or not compiled.verifier.capturable, "the warm-up captures (or refuses) this decoder's own graphs"
    for sample in range(3):
        assert compiled.generate_ids(prompt_ids, sample)[0] == eager.generate_ids(prompt_ids, sample)[0]
    if captured is not None:
        assert all((graph is not None) == captured for graph in graphs)
    assert compiled.drafters[0].session.steps.forward is not None  # the model steps ran compiled, not fallen back


def test_a_plugin_error_under_compile_on_cuda_is_its_one_line_fault(tiny_models):
    decoder = _cuda_decoder(tiny_models, "raises")
    with pytest.raises(VerifierFault, match="verifier 'raises' raised ValueError: this plugin's own complaint"):
        decoder.generate_ids(decoder.encode_prompt("a b c"), 0)


def test_a_negative_control_block_differs_between_two_keys():
    """The replay test compares tokens: two keys must be able to give different ones, or it proves nothing."""
    block = _on_cuda(random_block(BLOCK_KINDS[0], 1, 8, VOCAB, 0, identical_drafts=False))
    verifier = load_verifier("speculative")
    with torch.inference_mode():
        decisions = {
            tuple(verifier.verify_block(*block, _cuda_draws(Draws.create(key))).tokens.tolist()) for key in range(8)
        }
    assert len(decisions) > 1


def test_the_graph_check_sees_a_sync():
    """Negative control: a verifier that reads a device value cannot be captured (last in the file: a failed
    capture may leave the device in a state no later test should inherit)."""

    class Reads(type(load_verifier("speculative"))):
        def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
            float(target_probs[0, 0, 0])  # a host read mid-block
            return super().verify_block(target_probs, draft_probs, draft_tokens, randomness)

    _, block, draws = next(random_blocks(Case("speculative", 1), 4, VOCAB))
    with pytest.raises(RuntimeError):
        _capture(Reads(), _on_cuda(block), _cuda_draws(draws))
