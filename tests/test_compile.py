"""speculation.compile (--compile): the verify step, the sampling laws and the model steps over the static cache
through torch.compile, and the plugins that draw from a torch.Generator (which it cannot trace), which keep working
without it."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.errors import UsageError
from specdec_cli.base.randomness import Draws
from specdec_cli.base.recipe import build_recipe
from specdec_cli.engine.steps import StepCompiler, step_compiler
from specdec_cli.plugins.registry import VerifierRegistry, load_verifier
from specdec_cli.plugins.verifiers import device_path
from specdec_plugins.speculative import SpeculativeSampling
from tests.conftest import random_block, tiny_recipe

# The first torch.compile in a process imports inductor, whose torch.utils.mkldnn still declares script methods.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # One worker compiles the tiny models' steps once, and its other tests reuse them.
    pytest.mark.xdist_group("compile"),
]


class GeneratorPlugin(SpeculativeSampling):
    """A plugin written before keyed randomness: it is handed a torch.Generator and draws from it."""

    name = "generator-plugin"
    keyed_randomness = False
    handed: list = []

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        type(self).handed.append(randomness)
        torch.rand(1, generator=randomness)  # the stateful draw such a plugin makes
        return super().verify_block(target_probs, draft_probs, draft_tokens, randomness)


def _decoder(tiny_models, verifier: str, compile_steps: bool) -> SpeculativeDecoder:
    recipe = tiny_recipe(
        tiny_models,
        "llama",
        verifier={"name": verifier},
        generation={"max_new_tokens": 4},
        speculation={"draft_length": 3, "compile": compile_steps},
    )
    registry = VerifierRegistry(extra={GeneratorPlugin.name: GeneratorPlugin})
    return SpeculativeDecoder.from_recipe(build_recipe(recipe), registry=registry)


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
    assert (decoder.steps.verify != decoder.verifier.verify) == compiled


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


# ------------------------------------------------------------------ the model steps

STEP_PROMPTS = ["a b c d", "e e a", "b", "d c b a e d c b a"]
"""Prompts of four lengths: at batch 3 the fourth joins as others leave, so the rows go 3 → 1 (K times that)."""


@dataclass
class StepCall:
    model: torch.nn.Module
    shape: tuple[int, int]  # input_ids [rows, m]
    new_graphs: int  # graphs dynamo compiled during the call


@pytest.fixture
def step_calls(monkeypatch) -> list[StepCall]:
    """Every call into a compiled model step (:class:`StepCompiler`), made while the fixture is active."""
    calls: list[StepCall] = []
    original = StepCompiler.__call__

    def recorded(self, **kwargs):
        before = counters["stats"]["unique_graphs"]
        output = original(self, **kwargs)
        calls.append(
            StepCall(self.model, tuple(kwargs["input_ids"].shape), counters["stats"]["unique_graphs"] - before)
        )
        return output

    monkeypatch.setattr(StepCompiler, "__call__", recorded)
    return calls


def _static_decoder(tiny_models, verifier: str = "speculative", num_drafts: int = 1, **generation):
    """The llama pair with the static cache and eager steps: what compile=True must reproduce."""
    recipe = tiny_recipe(
        tiny_models,
        "llama",
        verifier={"name": verifier},
        speculation={"num_drafts": num_drafts, "static_cache": True},
        generation={"max_new_tokens": 12, **generation},
    )
    return SpeculativeDecoder.from_recipe(build_recipe(recipe))


def _samples(decoder: SpeculativeDecoder, batch_size: int, prompts=STEP_PROMPTS, num_samples: int = 2):
    return [r.token_ids for r in decoder.generate(prompts, num_samples=num_samples, batch_size=batch_size)]


def _step_models(decoder: SpeculativeDecoder) -> set[torch.nn.Module]:
    return {decoder.target.model, *(draft.model.model for draft in decoder.drafts)}


@pytest.mark.parametrize(("verifier", "num_drafts"), [("speculative", 1), ("specinfer", 2)])
def test_compiled_model_steps_give_the_eager_static_caches_samples(tiny_models, step_calls, verifier, num_drafts):
    """A compiled step writes the same slots and returns the same logits as the eager one, or a sampled token
    changes: at batch 3 rows join, leave and fan out to K, at batch 1 the first block reads the prompt."""
    eager = _static_decoder(tiny_models, verifier, num_drafts)
    compiled = eager.with_config(compile=True)
    for batch_size in (3, 1):
        assert _samples(compiled, batch_size) == _samples(eager, batch_size)
    # The target's and the draft's sessions both went through their compiled forward, and it never fell back.
    assert {call.model for call in step_calls} == _step_models(compiled)
    assert all(step_compiler(model).forward is not None for model in _step_models(compiled))
    assert compiled.drafters[0].session.steps is step_compiler(compiled.drafts[0].model.model)


def test_compiled_greedy_decoding_gives_the_targets_own_greedy_output(tiny_models, step_calls):
    """Greedy decoding keeps the target's argmax at every position: the compiled steps' logits must give the
    target alone's tokens (eager, dynamic cache), rejected drafts and all."""
    greedy = _static_decoder(tiny_models, temperature=0.0).with_config(compile=True)
    recipe = tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 12, "temperature": 0.0})
    alone = SpeculativeDecoder.from_recipe(build_recipe(recipe), autoregressive=True)
    assert _samples(greedy, 3, num_samples=1) == _samples(alone, 3, num_samples=1)
    assert step_calls  # the compiled steps ran


def _recorded_steps(tiny_models, family: str, monkeypatch) -> tuple[torch.nn.Module, dict[tuple[int, int], dict]]:
    """The target model, and a copy of the arguments of the first compiled step of each shape ``[rows, m]`` that
    a compiled generation at batch 3 makes, every step run eager instead (nothing compiles). The draft is the
    target's own checkpoint, greedy: accepted in full, so each block after a row's first starts with its catch-up."""
    recipe = tiny_recipe(
        tiny_models,
        family,
        draft={"model": str(tiny_models[f"{family}-target"])},
        speculation={"compile": True},
        generation={"temperature": 0.0},
    )
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    recorded: dict[tuple[int, int], dict] = {}

    def record(self, **kwargs):
        recorded.setdefault(tuple(kwargs["input_ids"].shape), copy.deepcopy(kwargs))  # before the step writes
        return self.model(**kwargs)

    monkeypatch.setattr(StepCompiler, "__call__", record)
    decoder.generate(STEP_PROMPTS, batch_size=3)
    return decoder.target.model, recorded


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_kind_of_model_step_traces_into_one_graph(tiny_models, monkeypatch, family):
    """A graph break splits a step into graphs with eager Python between them (on a GPU, CUDA graphs that cannot
    replay as one): every step kind over the static cache, at one row and at several, is one whole graph."""
    model, recorded = _recorded_steps(tiny_models, family, monkeypatch)
    kinds = {"draft step": 1, "draft catch-up": 2, "target scoring": 4}  # m: 1, 2, L + 1 with L = 3
    for rows in (1, 3):
        for kind, new in kinds.items():
            with torch.inference_mode():  # as the engine runs them, on its inference tensors
                assert _explained(model.forward, **recorded[rows, new]) == (1, 0, []), (kind, rows)


def _explained(function, **kwargs) -> tuple[int, int, list[str]]:
    """(graphs, graph breaks, dynamo's break reasons) of one call of ``function``: explain's counts, and the
    reasons, which also see a break explain misses (one before a graph's first operation)."""
    counters["graph_break"].clear()
    explained = torch._dynamo.explain(function)(**kwargs)
    return explained.graph_count, explained.graph_break_count, [*counters["graph_break"]]


def test_the_graph_break_check_sees_a_host_read():
    def reads_the_host(x):  # x [2]
        return x * int(x.sum())

    graphs, breaks, reasons = _explained(reads_the_host, x=torch.ones(2))
    assert (graphs, breaks) == (2, 1) and reasons


def _graphs_by_model(calls: list[StepCall]) -> Counter:
    graphs: Counter = Counter()
    for call in calls:
        graphs[call.model] += call.new_graphs
    return graphs


def test_a_generation_compiles_a_few_step_graphs_per_model_and_later_ones_reuse_them(tiny_models, step_calls):
    """The steps' shapes depend on the step kind and the rows, not on the prompts: a generation compiles a few
    graphs per model (the first shapes, then dynamic ones) and later prompts, lengths and sample counts reuse them."""
    eager = _static_decoder(tiny_models, "specinfer", 2)
    compiled = eager.with_config(compile=True)
    torch._dynamo.reset()  # else the graphs of earlier tests would serve this generation too
    _samples(compiled, 3)
    graphs = _graphs_by_model(step_calls)
    assert set(graphs) == _step_models(compiled)
    # Each model compiles its first step shape, then (automatic dynamic shapes) one graph with dynamic rows and
    # inputs, and one more for a dimension of size 1 (dynamo specialises it): measured here (torch 2.13) 2 for the
    # draft ([6, 1], [4, 1]) and 3 for the target ([6, 4], [4, 4], a last block's [2, 1]) over 118 steps. The bound
    # leaves one to spare; a graph per prompt, length or block would pass it.
    assert all(1 <= count <= 4 for count in graphs.values()), [*graphs.values()]
    assert len(step_calls) > 10 * sum(graphs.values())
    before = counters["stats"]["unique_graphs"]
    other_prompts = ["c c c c c c c c c c c c c", "a b", "e d c b a"]
    _samples(compiled, 3, other_prompts, num_samples=3)
    assert counters["stats"]["unique_graphs"] == before  # no step, law or verify graph compiled again
    _samples(eager, 3)
    assert counters["stats"]["unique_graphs"] == before  # compile=False compiles nothing
    torch._dynamo.reset()  # negative control: once dynamo forgets them, the same generation compiles its graphs
    _samples(compiled, 3, other_prompts, num_samples=3)
    assert counters["stats"]["unique_graphs"] > before


# Why a step could not be compiled, as dynamo raises it; BackendCompilerFailed's first line is "backend='?' raised:".
STEP_FAILURES = [
    pytest.param(torch._dynamo.exc.Unsupported("a model dynamo cannot trace"), id="unsupported"),
    pytest.param(
        torch._dynamo.exc.BackendCompilerFailed("inductor", RuntimeError("a model dynamo cannot trace"), None),
        id="backend-failed",
    ),
]


@pytest.mark.parametrize("failure", STEP_FAILURES)
def test_a_model_step_that_cannot_be_compiled_runs_eager_after_one_warning(tiny_models, failure):
    """A model dynamo cannot trace or a backend that fails (no C++ compiler) must not end the run: the steps run
    eager from then on, with the same samples, and the user is told once why."""
    eager = SpeculativeDecoder.from_recipe(
        build_recipe(tiny_recipe(tiny_models, "llama", speculation={"static_cache": True})), autoregressive=True
    )
    compiled = eager.with_config(compile=True)
    steps = step_compiler(compiled.target.model)  # the target alone: one model, one compiler
    attempts = []

    def fails(**kwargs):
        attempts.append(kwargs)
        raise failure

    steps.forward = fails
    with pytest.warns(RuntimeWarning) as caught:
        samples = _samples(compiled, 3)
    assert samples == _samples(eager, 3)
    said = [str(warning.message) for warning in caught if "--compile" in str(warning.message)]
    assert len(said) == 1 and "run eager" in said[0], said
    assert len(attempts) == 1 and steps.forward is None
    assert "a model dynamo cannot trace" in said[0], said[0]


def test_an_encoder_decoder_under_compile_keeps_the_dynamic_cache_and_eager_steps(tiny_models, step_calls):
    """The static cache writes each row at its own positions, which an encoder-decoder's decoder does not take: T5
    keeps the dynamic cache and so eager steps, decodes as without compile, and the notes printed before decoding
    say that its steps run eager."""
    recipe = tiny_recipe(
        tiny_models,
        "t5",
        verifier={"name": "specinfer"},
        speculation={"num_drafts": 2, "compile": True},
        generation={"max_new_tokens": 6},
    )
    compiled = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    assert compiled.drafters[0].session.headroom is None and compiled.drafters[0].session.steps is None
    notes = compiled.cache_notes
    assert len(notes) == 2 and all("keeps the dynamic cache" in note for note in notes), notes
    assert all("run eager under --compile" in note for note in notes), notes
    prompts = STEP_PROMPTS[:2]
    assert _samples(compiled, 3, prompts) == _samples(compiled.with_config(compile=False), 3, prompts)
    assert not step_calls
