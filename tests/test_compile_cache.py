"""The compile cache (specdec_cli/engine/compile_cache.py): what ``--compile`` compiled, kept under specdec's cache
directory for the next process. A "new process" here is dynamo, inductor's record of artifacts and the cache's own
table reset, with inductor's caches in an empty folder: whatever a run finds, it found in the entry."""

from __future__ import annotations

import json

import pytest
import torch
from torch._inductor.utils import clear_caches
from torch.compiler._cache import CacheArtifactManager

from specdec_cli.engine import compile_cache
from specdec_cli.engine.compile_cache import CompileKey
from specdec_cli.kit.testing import tiny_model
from tests.conftest import tiny_recipe

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.xdist_group("compile"),  # beside the other compiling tests, on one worker
]


@pytest.fixture
def new_process(monkeypatch, tmp_path):
    """new_process() → what a fresh process would start with: specdec's cache in the test's folder (kept between
    calls), inductor's in a new empty one, nothing compiled or recorded."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "specdec"))
    monkeypatch.setattr(compile_cache, "_uses", {})
    folders = iter(range(100))

    def start() -> None:
        torch._dynamo.reset()
        CacheArtifactManager.clear()
        compile_cache._uses.clear()
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / f"inductor-{next(folders)}"))
        clear_caches()

    start()
    return start


def _entries(tmp_path) -> list:
    return sorted((tmp_path / "specdec" / "compile").glob("*.json"))


def _generated(run, recipe: str) -> tuple[list[list[int]], list[str]]:
    """``specdec --verbose generate --compile --json`` of the target alone: two samples' token ids, and the lines
    the run wrote on stderr."""
    arguments = ["--verbose", "generate", "-r", recipe, "--compile", "--autoregressive", "--json"]
    code, out, err = run([*arguments, "--num-samples", "2", "a b c"])
    assert code == 0, err
    return [sample["token_ids"] for sample in json.loads(out)["samples"]], err.splitlines()


def test_a_warm_cache_gives_the_cold_samples_and_a_damaged_entry_is_one_line_then_rebuilt(
    run, tiny_models, write_recipe, new_process, tmp_path
):
    """One cold start, then three more starts from its entry: whole (reused), half-written (one line, rebuilt) and
    rebuilt (reused again); every start gives the cold one's samples."""
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 3})))
    cold, said = _generated(run, recipe)
    (entry,) = _entries(tmp_path)
    assert compile_cache.uses()[0].reused == {}  # nothing there yet
    assert f"compile cache: nothing to reuse for LlamaForCausalLM yet; its steps compile into {entry}" in said
    new_process()
    warm, said = _generated(run, recipe)
    assert warm == cold
    (use,) = compile_cache.uses()
    assert use.entry == entry and use.note is None
    assert use.reused.get("inductor", 0) > 0 and use.reused.get("aot_autograd", 0) > 0
    reused = [line for line in said if line.startswith("compile cache: LlamaForCausalLM reused")]
    assert reused == [use.summary()] and f"{use.reused['aot_autograd']} aot_autograd" in reused[0], said
    assert cold[0] != cold[1]  # the comparison can fail: another sample's key, other tokens

    text = entry.read_text()
    entry.write_text(text[: len(text) // 2])  # a half-written entry, as a killed writer without atomic writes leaves
    new_process()
    rebuilt, said = _generated(run, recipe)
    assert rebuilt == cold
    notes = [line for line in said if "unusable" in line]
    assert len(notes) == 1 and f"the compile cache entry {entry} was unusable" in notes[0], said
    assert "is rebuilt" in notes[0]
    assert json.loads(entry.read_text())["key"] == json.loads(text)["key"]  # rewritten whole by this run
    new_process()
    again, _ = _generated(run, recipe)
    assert again == cold and compile_cache.uses()[0].reused  # the rebuilt entry is read again


def _entry_for(model: torch.nn.Module, function=lambda x: x * 2 + 1) -> None:
    """Prepare ``model``'s entry and fill it with the artifacts of a small compiled function (no model compile)."""
    compile_cache.prepare(model)
    torch.compile(function)(torch.ones(3))  # [3]
    compile_cache.save()


@pytest.mark.parametrize(
    "changed",
    [
        lambda model: model.to(torch.float64),
        lambda model: setattr(model.config, "rope_theta", 1234.0) or model,
    ],
    ids=["dtype", "configuration"],
)
def test_another_dtype_or_configuration_does_not_reuse_the_entry(new_process, changed):
    model = tiny_model("llama", seed=3)
    _entry_for(model)
    new_process()
    assert compile_cache.prepare(model).reused  # the same model finds its entry: the check below can fail
    new_process()
    other = changed(tiny_model("llama", seed=3))
    assert CompileKey.of(other) != CompileKey.of(model)
    use = compile_cache.prepare(other)
    assert use.reused == {} and use.note is None


def test_an_entry_under_another_key_is_not_trusted(new_process, tmp_path):
    model, other = tiny_model("llama", seed=3), tiny_model("llama", seed=3).to(torch.float64)
    _entry_for(model)
    (entry,) = _entries(tmp_path)
    moved = entry.with_name(f"{CompileKey.of(other).digest()}.json")
    entry.rename(moved)  # the float32 entry where the float64 model's would be
    new_process()
    use = compile_cache.prepare(other)
    assert use.reused == {} and "its key is another model's" in use.note
    assert not moved.exists()  # removed, to be rebuilt


def test_the_entry_holds_the_artifacts_of_every_save_and_a_warm_run_only_adds_to_it(new_process):
    model = tiny_model("llama", seed=3)
    _entry_for(model, lambda x: x * 2 + 1)  # a cold run saves after each new step shape: here two
    first = set(compile_cache.uses()[0].held)
    _entry_for(model, lambda x: x.sin() - 3)
    both = set(compile_cache.uses()[0].held)
    assert first and first < both  # an entry of the last save's group alone would differ: the check can fail
    new_process()
    use = compile_cache.prepare(model)
    assert set(use.held) == both and use.reused["inductor"] == sum(name.startswith("inductor/") for name in both)
    _entry_for(model, lambda x: x.cos() / 7)  # a warm run: what it reused plus its one new graph
    grown = set(compile_cache.uses()[0].held)
    new_process()
    assert set(compile_cache.prepare(model).held) == grown and grown > both


def test_a_torch_without_serialised_artifacts_says_so_and_keeps_no_entry(new_process, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "ARTIFACTS_KEPT", False)
    model = tiny_model("llama", seed=3)
    _entry_for(model)  # compiles, and saves as a run does after each new shape
    (use,) = compile_cache.uses()
    assert (
        use.note == f"torch {torch.__version__} does not serialise what it compiles as specdec reads it: no entry kept"
    )
    assert use.summary() == use.note and _entries(tmp_path) == []
    monkeypatch.setattr(compile_cache, "ARTIFACTS_KEPT", True)
    new_process()
    _entry_for(model)
    assert len(_entries(tmp_path)) == 1  # the same steps with the artifacts torch 2.13 serialises: the check can fail
