"""speculation.compile (--compile): the verify step and the sampling laws through torch.compile, and the
plugins that draw from a torch.Generator (which it cannot trace), which keep working without it."""

from __future__ import annotations

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import UsageError
from specdec_cli.base.randomness import Draws
from specdec_cli.base.recipe import build_recipe
from specdec_cli.plugins.registry import VerifierRegistry, load_verifier
from specdec_cli.plugins.verifiers import device_path
from specdec_plugins.speculative import SpeculativeSampling
from tests.conftest import random_block, tiny_recipe


class GeneratorPlugin(SpeculativeSampling):
    """A plugin written before keyed randomness: it is handed a torch.Generator and draws from it."""

    name = "generator-plugin"
    keyed_randomness = False
    handed: list = []

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        type(self).handed.append(randomness)
        torch.rand(1, generator=randomness)  # the stateful draw such a plugin makes
        return super().verify_block(target_probs, draft_probs, draft_tokens, randomness)


class _Registry(VerifierRegistry):
    def names(self):
        return sorted([*super().names(), GeneratorPlugin.name])

    def load_class(self, name):
        return GeneratorPlugin if name == GeneratorPlugin.name else super().load_class(name)


def _decoder(tiny_models, verifier: str, compile_steps: bool) -> SpeculativeDecoder:
    recipe = tiny_recipe(
        tiny_models,
        "llama",
        verifier={"name": verifier},
        generation={"max_new_tokens": 4},
        speculation={"draft_length": 3, "compile": compile_steps},
    )
    return SpeculativeDecoder.from_recipe(build_recipe(recipe), registry=_Registry())


def test_the_compiled_steps_decide_as_the_eager_ones(tiny_models):
    compiled = _decoder(tiny_models, "speculative", compile_steps=True)
    eager = compiled.with_config(compile=False)
    prompt_ids = compiled.encode_prompt("a b c")
    assert compiled.generate_ids(prompt_ids, 3)[0] == eager.generate_ids(prompt_ids, 3)[0]  # each compile takes long


@pytest.mark.parametrize(
    ("verifier", "compiled"),
    [
        ("speculative", True),
        ("block", True),
        ("mentored", False),
        ("specinfer", False),
        ("spectr", False),
        ("is-lp", False),
    ],
)
def test_compile_on_the_cpu_leaves_a_reading_cpu_path_eager(tiny_models, verifier, compiled):
    """Compiled, mentored took 80× its eager time per block on the CPU (benchmarks/results/compile_speed_cpu.md):
    the compiler sends a verifier down its device path, which on a CPU costs more than its reading path."""
    decoder = _decoder(tiny_models, verifier, compile_steps=True)
    assert (decoder._verify_block != decoder.verifier.verify_block) == compiled


def test_a_generator_plugin_gets_a_generator_seeded_by_sample_and_block(tiny_models):
    decoder = _decoder(tiny_models, GeneratorPlugin.name, compile_steps=False)
    prompt_ids = decoder.encode_prompt("a b c")
    GeneratorPlugin.handed.clear()
    first = decoder.generate_ids(prompt_ids, 5)[0]
    decoder.generate_ids(prompt_ids, 6)  # another sample between: the next run of key 5 is unchanged
    assert decoder.generate_ids(prompt_ids, 5)[0] == first
    assert GeneratorPlugin.handed and all(isinstance(g, torch.Generator) for g in GeneratorPlugin.handed)


def test_compile_refuses_a_generator_plugin_before_loading(tiny_models):
    with pytest.raises(UsageError, match="'generator-plugin' draws from a torch.Generator.*drop speculation.compile"):
        _decoder(tiny_models, GeneratorPlugin.name, compile_steps=True)


def test_a_multi_draft_verify_block_compiled_by_inductor_decides_as_eager():
    """Inductor, not only dynamo: the keyed draws' counters once reached it as an arange times a 64-bit
    constant, index arithmetic that overflowed, and spectr's compiled K = 4 kernel failed a bounds check."""
    target, draft, tokens = random_block("peaked", 4, 4, 256, seed=3, identical_drafts=True)
    verifier = load_verifier("spectr")
    draws = Draws.create(11, block_start=5)
    with torch.inference_mode(), device_path():
        eager = verifier.verify_block(target, draft, tokens, draws)
        compiled = torch.compile(verifier.verify_block, fullgraph=True)(target, draft, tokens, draws)
    assert torch.equal(compiled.tokens, eager.tokens) and int(compiled.num_accepted) == int(eager.num_accepted)
