"""The hot loop reads the device once per block: Tensor → Python conversions counted inside generate_ids.

Once, not more: the models' forwards get whole additive masks, so transformers' own padding checks read
nothing, and a sample's keyed draws are made without a read.

On CUDA each conversion is a synchronisation that stalls the queue. On the CPU a read is free and
some verifiers take a path that reads (to skip work); :func:`~specdec_cli.verifiers.device_path`
makes them take the GPU's path, so this test holds the engine and every built-in verifier to the
budget without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import NonFiniteLogitsError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.plugins.verifiers import device_path
from tests.conftest import tiny_recipe

READS_PER_BLOCK = 1
HOST_LP_READS = {"is-lp", "is-truncated"}
"""Importance sampling with two or more drafts solves its free LP on the host: one more read per block
(issue #20 allows it for these schemes)."""


def _decoder(models, family: str, name: str, num_drafts: int, params=None, **generation) -> SpeculativeDecoder:
    recipe = tiny_recipe(
        models,
        family,
        verifier={"name": name, "params": params or {}},
        speculation={"draft_length": 4, "num_drafts": num_drafts},
        generation={"max_new_tokens": 24, **generation},
    )
    return SpeculativeDecoder.from_recipe(build_recipe(recipe))


BUILT_INS = [
    ("speculative", 1, None),
    ("mentored", 1, None),
    ("mentored", 1, {"kl": 0.3}),
    ("ensemble", 1, {"weight": 0.5}),
    ("typical", 1, None),
    ("threshold", 1, {"single": 0.3, "acc": 0.5}),
    ("fuzzy", 1, {"threshold": 0.1, "laws": "sampling"}),
    ("fly", 1, {"window_size": 1, "entropy_threshold": 0.0}),
    ("mentored", 1, {"kl": 0.3, "divergence": "tv"}),
    ("block", 1, None),
    ("specinfer", 3, None),
    ("spectr", 3, None),
    ("is-lp", 2, None),
    ("is-truncated", 2, None),
    ("is-truncated", 1, None),
    ("match", 1, None),
    ("match", 3, None),
    ("traversal", 3, None),
    ("cactus", 1, {"delta": 0.1}),
    ("typical", 1, {"rule": "medusa"}),
    ("fuzzy", 1, {"threshold": 0.1, "laws": "unprocessed"}),
]


@pytest.mark.parametrize(("name", "num_drafts", "params"), BUILT_INS)
@pytest.mark.parametrize("family", ["llama", "t5"])
def test_reads_per_block_stay_within_the_budget(tiny_models, conversions, name, num_drafts, params, family):
    decoder = _decoder(tiny_models, family, name, num_drafts, params)
    prompt_ids = decoder.encode_prompt("a b c d")
    conversions.clear()
    blocks = 0
    with device_path():
        for key in range(3):
            _, _, stats = decoder.generate_ids(prompt_ids, key)
            blocks += stats.blocks
    per_block = READS_PER_BLOCK + (name in HOST_LP_READS and num_drafts > 1)
    assert sum(conversions.values()) <= per_block * blocks, dict(conversions)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize(("name", "num_drafts"), [("speculative", 1), ("specinfer", 3)])
def test_the_static_cache_adds_no_read(tiny_models, conversions, name, num_drafts, batch_size):
    """Slots, positions and masks come from the lengths the host already holds: one read per step, as before."""
    decoder = _decoder(tiny_models, "llama", name, num_drafts).with_config(static_cache=True)
    conversions.clear()
    with device_path():
        results = decoder.generate(["a b c d", "e d"], num_samples=2, batch_size=batch_size)
    assert sum(conversions.values()) <= READS_PER_BLOCK * sum(result.stats.blocks for result in results)


@pytest.mark.xdist_group("compile")  # on the worker that has compiled the tiny models' steps
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize(("name", "num_drafts"), [("speculative", 1), ("specinfer", 3)])
def test_compiled_model_steps_add_no_read(tiny_models, conversions, name, num_drafts, batch_size):
    """Under --compile the model steps' graphs take the slots, positions and masks the host built: one read per step
    still, once every step shape has compiled (the first generation, not counted: compiling may read)."""
    decoder = _decoder(tiny_models, "llama", name, num_drafts).with_config(compile=True)
    prompts = ["a b c d", "e d"]
    with device_path():
        decoder.generate(prompts, num_samples=2, batch_size=batch_size)
        conversions.clear()
        results = decoder.generate(prompts, num_samples=2, batch_size=batch_size)
    assert decoder.drafters[0].session.steps.forward is not None  # the steps ran compiled
    assert sum(conversions.values()) <= READS_PER_BLOCK * sum(result.stats.blocks for result in results)


def test_the_counter_sees_a_read(conversions):
    """Negative control: the fixture does count what the hot loop must not do."""
    value = torch.tensor([1.5, 2.0])
    float(value[0]), bool(value.sum() > 1), value.tolist(), int(value.argmax())
    assert sum(conversions.values()) == 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("broken", ["target", "draft"])
def test_non_finite_logits_are_caught_in_the_block_read(tiny_models, broken, temperature):
    decoder = _decoder(tiny_models, "llama", "speculative", 1, temperature=temperature)
    model = decoder.target.model if broken == "target" else decoder.drafters[0].session.model
    with torch.no_grad():
        model.lm_head.weight[:, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=f"the {broken}.* produced NaN or infinite logits"):
        decoder.generate_ids(decoder.encode_prompt("a b c d"), 0)
