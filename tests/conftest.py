"""Shared fixtures: tiny models saved to disk once per session, and recipes that point at them; the session's
caches kept out of the user's home and the checkout (tests/isolation.py). Also the test modules' one home of
shared helpers: recipes, `specdec` argument lists, a run started as a child process, and a results folder read
back."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tests import isolation

isolation.redirect_caches()
# One intra-op thread, in this process and in the CLI runs tests start: the models are tiny, and on a loaded
# 2-core machine a second thread only adds waits (a tiny generation took ten to twenty times as long with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from specdec_cli.base.randomness import Draws  # noqa: E402
from specdec_cli.cli import main  # noqa: E402
from specdec_cli.kit.testing import random_sequence_laws, save_tiny_model  # noqa: E402
from specdec_cli.plugins.registry import load_verifier  # noqa: E402
from specdec_cli.plugins.verifiers import BlockVerifier  # noqa: E402
from specdec_cli.results.store import SAMPLES  # noqa: E402

# transformers' own bars (saving and loading tiny models) would land in the stderr tests inspect.
hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Target and draft checkpoints of each tiny family; drafts are seeded differently so they disagree."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "llama-target": save_tiny_model(root / "llama-target", "llama", seed=1),
        "llama-draft": save_tiny_model(root / "llama-draft", "llama", seed=2, layers=1),
        "gpt2-target": save_tiny_model(root / "gpt2-target", "gpt2", seed=3),
        "gpt2-draft": save_tiny_model(root / "gpt2-draft", "gpt2", seed=4, layers=1),
        "t5-target": save_tiny_model(root / "t5-target", "t5", seed=5),
        "t5-draft": save_tiny_model(root / "t5-draft", "t5", seed=6, layers=2),
        "bart-target": save_tiny_model(root / "bart-target", "bart", seed=7),
        "bart-draft": save_tiny_model(root / "bart-draft", "bart", seed=8, layers=1),
    }


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(mapping) -> path of a YAML recipe file holding it."""
    counter = iter(range(10**6))

    def write(data: dict) -> Path:
        path = tmp_path / f"recipe-{next(counter)}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return write


def tiny_recipe(models: dict[str, Path], family: str = "llama", **sections) -> dict:
    """A recipe mapping for a tiny ``family`` target and draft on the CPU; sections override."""
    recipe = {
        "target": {"model": str(models[f"{family}-target"]), "device": "cpu"},
        "draft": {"model": str(models[f"{family}-draft"]), "device": "cpu"},
        "verifier": {"name": "speculative"},
        "speculation": {"draft_length": 3, "num_drafts": 1},
        "generation": {"max_new_tokens": 8, "temperature": 1.0},
        "seed": 0,
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    return recipe


@pytest.fixture(autouse=True)
def quiet_cpu(monkeypatch):
    """The calibration reads a quiet CPU's load (0 on 2 cores): whether a figure is cached never depends on what
    else runs on the machine. Tests of a busy CPU set their own reading (tests/test_threads.py)."""
    from specdec_cli.generation import calibration

    monkeypatch.setattr(calibration, "cpu_load", lambda: calibration.CpuLoad(0.0, 2))


@pytest.fixture
def one_thread():
    """Blocks of a few hundred small operations: on a loaded 2-core machine a second intra-op thread only adds
    waits (ten times the time at V = 64 on 2 busy cores); no count or decision depends on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def interruptible() -> None:
    """``preexec_fn`` of a child a test interrupts: SIGINT back to its default. A test runner started in the
    background by a shell (``cmd &`` without job control) ignores SIGINT, its children inherit that, and Python
    then installs no KeyboardInterrupt handler: the signal would never reach the run under test."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def specdec_args(command: str, recipe: str | Path, *arguments: str, **options: object) -> list[str]:
    """The argument list of `specdec COMMAND -r RECIPE --OPTION VALUE... ARGUMENTS...`: each keyword an option and
    its value (``max_new_tokens=3`` is ``--max-new-tokens 3``), then ``arguments`` as they are (flags, prompts)."""
    named = [part for name, value in options.items() for part in (f"--{name.replace('_', '-')}", str(value))]
    return [command, "-r", str(recipe), *named, *arguments]


def acceptance_of_one_prompt(recipe: str | Path, *extra: str) -> list[str]:
    """The arguments of the smallest `specdec acceptance` run: one prompt, one draft, speculative sampling."""
    return specdec_args("acceptance", recipe, *extra, prompt="a b", num_drafts=1, verifier="speculative")


def bench_on_files(recipe: str, data: dict, out: Path | None, *extra: str, **options: object) -> list[str]:
    """The arguments of a `specdec bench` run over ``data``'s source and reference files, with options as in
    :func:`specdec_args`; no --output where ``out`` is None."""
    folder = ["--output", str(out)] if out is not None else []
    files = {"source": data["source"], "reference": data["reference"]}
    return specdec_args("bench", recipe, *folder, *extra, **files, template="{source}", **options)


# The configuration cells of a bench results folder (config.json): the target alone, and speculative sampling with
# one draft of 3 tokens ("baseline T=1" and "speculative K=1 L=3 T=1").
BASELINE_CELL = {
    "verifier": "none",
    "kl": None,
    "num_drafts": 0,
    "draft_length": 0,
    "temperature": 1.0,
    "draft_temperatures": None,
}
SPECULATIVE_CELL = {**BASELINE_CELL, "verifier": "speculative", "num_drafts": 1, "draft_length": 3}


def read_samples(out: Path) -> list[dict]:
    """The sample records of results folder ``out``, in the order written."""
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def read_results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def read_cells(out: Path) -> dict:
    """The cells of results folder ``out`` by their key."""
    return {cell["key"]: cell for cell in read_results(out)["cells"]}


def start_specdec(args: list[str]) -> subprocess.Popen:
    """`specdec ARGS` in a child process that a test can signal."""
    return subprocess.Popen(
        [sys.executable, "-m", "specdec_cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )


def wait_until_importing_the_commands(process: subprocess.Popen, timeout: float = 120) -> None:
    """Return once ``process`` (a `specdec` child) has loaded numpy's core library, which the CLI first imports
    inside the block that turns an early Ctrl-C into exit 130: from then on SIGINT must stop it as a user's would.
    A fixed sleep raced a loaded machine: a signal before the interpreter's own handler kills the child outright."""
    deadline = time.monotonic() + timeout
    maps = Path(f"/proc/{process.pid}/maps")
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if "_multiarray_umath" in maps.read_text():
                return
        except OSError:  # the child ended between the poll and the read
            return
        time.sleep(0.002)


def wait_for_samples(folder: Path, count: int, process: subprocess.Popen, timeout: float = 120) -> None:
    """Return once ``folder`` holds ``count`` sample lines, ``process`` has ended, or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    path = folder / SAMPLES
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.005)


_LEFT_BY_WORKERS: list[str] = []
"""What each pytest-xdist worker's run left (under its own session folder's home, or in the checkout)."""


def pytest_sessionfinish(session, exitstatus):
    """A run that wrote under the user's home or in the checkout fails, whatever its tests did. Under pytest-xdist
    each worker has its own session folder: it hands what it left to the controller, which fails the run."""
    left = isolation.finish()
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["isolation"] = left
        return
    problems = [problem for problem in (left, *_LEFT_BY_WORKERS) if problem]
    if problems:
        print("\n" + "\n".join(problems))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller, as a worker ends: keep what the worker's run left."""
    _LEFT_BY_WORKERS.append(getattr(node, "workeroutput", {}).get("isolation"))


# The CLI run in this process, and what the CLI tests check and prepare; the count of device reads.


@pytest.fixture
def run(capsys, monkeypatch):
    """run(args, stdin=None) -> (exit code, stdout, stderr) of `specdec ARGS` in this process."""

    def invoke(args: list[str], stdin: str | None = None):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin or ""))
        code = specdec_in_process(args)
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def specdec_in_process(args: list[str]) -> int:
    """The exit code of `specdec ARGS` run in this process, its output left to pytest's capture: what a fixture wider
    than one test runs (a reference run that several tests compare against), where ``run`` (capsys) cannot serve."""
    try:
        main(args)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0


@pytest.fixture(scope="module")
def module_folder(tmp_path_factory, request) -> Path:
    """A folder shared by one module's tests: the inputs and outputs of the runs they share. The CPU reads quiet
    while its fixtures run, as :func:`quiet_cpu` makes it for each test."""
    from specdec_cli.generation import calibration

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "cpu_load", lambda: calibration.CpuLoad(0.0, 2))
        yield tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest.fixture
def recipe_path(tiny_models, write_recipe):
    return str(write_recipe(tiny_recipe(tiny_models, "llama")))


def one_error_line(err: str, pattern: str) -> None:
    """``err`` is one line, ``error: …`` holding ``pattern``, and no traceback."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert pattern in lines[0], lines[0]
    assert "Traceback" not in err


BENCH_DATA = "--source {dir}/source.txt --reference {dir}/reference.txt"
"""Bench options naming the source and reference files :func:`inputs` prepares."""


@pytest.fixture
def inputs(tmp_path, tiny_models, write_recipe):
    """The prepared files, and the substitutions for ``{dir}`` and ``{recipe}``."""
    lines = {
        "null.jsonl": [{"prompt": None}],
        "empty-turns.jsonl": [{"turns": []}],
        "number-turns.jsonl": [{"turns": [5]}],
        "other-field.jsonl": [{"body": "a b"}],
        "duplicate-ids.jsonl": [{"id": 1, "text": "a b"}, {"id": 1, "text": "c d"}],
    }
    for name, records in lines.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 3)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "source.txt").write_text("a b\nc d\n")
    (tmp_path / "reference.txt").write_text("e f\ng h\n")
    (tmp_path / "short.txt").write_text("e f\n")
    (tmp_path / "damaged-config").mkdir()
    (tmp_path / "damaged-config" / "config.json").write_text('{"cells": [')
    (tmp_path / "empty-record").mkdir()
    (tmp_path / "empty-record" / "config.json").write_text('{"cells": []}')
    (tmp_path / "empty-record" / "samples.jsonl").write_text("{}\n{}\n")
    return {"dir": str(tmp_path), "recipe": str(write_recipe(tiny_recipe(tiny_models, "llama")))}


TENSOR_CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "__array__")
"""The Tensor methods that read a tensor into Python (or host memory)."""


@pytest.fixture
def conversions(monkeypatch):
    """A Counter of Tensor → Python conversions made while the fixture is active."""
    counter: Counter = Counter()
    for name in TENSOR_CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counter[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counter


# Random verifier blocks: the device-path, compile, CUDA and batch tests decide them.

BLOCK_KINDS = ("peaked", "near_one_token", "one_token_equal", "equal", "disjoint", "flat_draft")
LP_SUPPORT = 16  # is-lp needs a bounded draft support (as top-k sampling gives)


@dataclass(frozen=True)
class Case:
    name: str
    num_drafts: int
    kl: float | None = None

    @property
    def id(self) -> str:
        return f"{self.name}-K{self.num_drafts}" + ("" if self.kl is None else f"-kl{self.kl}")

    @property
    def host_lp(self) -> bool:
        """Importance sampling with two or more drafts keeps one host read, for its LP."""
        return self.name in ("is-lp", "is-truncated") and self.num_drafts > 1

    def verifier(self) -> BlockVerifier:
        return load_verifier(self.name, {} if self.kl is None else {"kl": self.kl})

    @functools.cached_property
    def identical_drafts(self) -> bool:
        return type(self.verifier()).identical_drafts


CASES = [
    Case("speculative", 1),
    Case("block", 1),
    Case("mentored", 1, 0.0),
    Case("mentored", 1, 0.3),
    *(Case("specinfer", k) for k in (1, 2, 3, 4)),
    *(Case("spectr", k) for k in (2, 4)),
    *(Case(name, k) for name in ("is-lp", "is-truncated") for k in (2, 4)),
    *(Case(name, 1) for name in ("ensemble", "typical", "threshold", "fuzzy", "fly", "cactus")),
    *(Case("match", k) for k in (1, 2, 4)),
]


def random_block(
    kind: str,
    num_drafts: int,
    draft_length: int,
    vocab: int,
    seed: int,
    identical_drafts: bool,
    support: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target laws ``[K, L+1, V]``, draft laws ``[K, L, V]`` and the draft tokens drawn from them ``[K, L]``.

    Rows share position 0's target law (the committed prefix); later positions differ a little per
    row. ``support`` cuts the draft laws to their most likely tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(1, draft_length + 1, vocab, generator=generator) * 3  # [1, L+1, V]
    per_row = torch.randn(num_drafts, draft_length + 1, vocab, generator=generator) * 0.5  # [K, L+1, V]
    per_row[:, 0] = 0
    target_logits = shared + per_row  # [K, L+1, V]
    noise_rows = 1 if identical_drafts else num_drafts
    noise = torch.randn(noise_rows, draft_length, vocab, generator=generator).expand(num_drafts, -1, -1)  # [K, L, V]
    draft_logits = {
        "peaked": target_logits[:, :-1] + noise,
        "near_one_token": (target_logits[:, :-1] + 0.1 * noise) * 12,
        "one_token_equal": target_logits[:, :-1] * 1e4,  # q = p, both one token (float32 softmax is one-hot)
        "equal": target_logits[:, :-1],
        "disjoint": -target_logits[:, :-1] * 3,
        "flat_draft": 0.01 * noise,
    }[kind]  # [K, L, V]
    if identical_drafts:
        draft_logits = draft_logits[:1].expand(num_drafts, -1, -1)
    if support is not None:
        kth = draft_logits.topk(support, -1).values[..., -1:]  # [K, L, 1]
        draft_logits = draft_logits.masked_fill(draft_logits < kth, float("-inf"))
    if kind in ("near_one_token", "one_token_equal"):
        target_logits = target_logits * (12 if kind == "near_one_token" else 1e4)
    draft_probs = draft_logits.softmax(-1)  # [K, L, V]
    target_probs = target_logits.softmax(-1)  # [K, L+1, V]
    if kind in ("equal", "one_token_equal"):
        target_probs = torch.cat([draft_probs, target_probs[:, -1:]], 1)  # q = p at the drafted positions
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator)  # [K L, 1]
    return target_probs, draft_probs, tokens.view(num_drafts, draft_length)


def random_blocks(case: Case, draft_length: int, vocab: int):
    """Every kind of :func:`random_block` for ``case``, with its keyed draws."""
    support = LP_SUPPORT if case.name == "is-lp" else None
    for seed, kind in enumerate(BLOCK_KINDS):
        block = random_block(kind, case.num_drafts, draft_length, vocab, seed, case.identical_drafts, support)
        yield kind, block, Draws.create(key=1000 + seed, block_start=17 * seed)


def block_inputs(num_drafts: int, identical: bool, vocab: int = 4, draft_length: int = 3):
    """float32 laws as the engine passes them: rows share their first draft token, so their alive sets differ later."""
    generator = torch.Generator().manual_seed(21)
    target_law = random_sequence_laws(generator, vocab, draft_length + 1, sparsity=0.0)
    # Drafts close to the target, as real drafts are: long accepted prefixes, where block and token-wise differ.
    draft_law_sets = [
        {prefix: 0.6 * target_law[prefix] + 0.4 * law for prefix, law in noise.items()}
        for noise in (random_sequence_laws(generator, vocab, draft_length, sparsity=0.0) for _ in range(num_drafts))
    ]
    if identical:
        draft_law_sets = draft_law_sets[:1] * num_drafts
    # Rows follow the target's two likeliest tokens at each position, sharing their first token.
    rows = []
    for second_choice in [(), (1,), (2,)][:num_drafts]:
        row: tuple[int, ...] = ()
        for t in range(draft_length):
            ranked = target_law[row].argsort(descending=True).tolist()
            row += (ranked[1] if t in second_choice else ranked[0],)
        rows.append(row)
    target_probs = torch.stack([torch.stack([target_law[r[:t]] for t in range(draft_length + 1)]) for r in rows])
    draft_probs = torch.stack(
        [torch.stack([laws[r[:t]] for t in range(draft_length)]) for laws, r in zip(draft_law_sets, rows)]
    )
    return target_probs.float(), draft_probs.float(), torch.tensor(rows)


TRIGRAM_LOOKUP = {"drafter": "prompt-lookup", "params": {"min_ngram": 3, "max_ngram": 3}}
"""Trigrams over the tiny vocabulary: along a continuation the lookup both hits and misses."""
LOOKUP_PROMPTS = ["a b c d a b c", "c d e c d", "e a b e a"]


def recipe_with_drafts(models, family: str, drafts: list[dict], **sections) -> dict:
    """A tiny recipe whose drafts are ``drafts`` ('draft' as a model: the family's tiny draft model)."""
    recipe = tiny_recipe(models, family, **sections)
    recipe.pop("draft")
    recipe["drafts"] = [
        {"model": str(models[f"{family}-draft"]), "device": "cpu"} if d == "draft" else d for d in drafts
    ]
    return recipe


# The bench tests' inputs: source and reference lines, as files and as a dataset.

SOURCES = ["a b c", "d e a", "c c b", "e d c b", "b a", "d d e", "a e", "c b a d"]
REFERENCES = ["a b c d", "d e", "c b", "e d c", "b a a", "d e", "a e e", "c b a"]


@pytest.fixture
def data(tmp_path) -> dict[str, Path]:
    return write_bench_data(tmp_path)


def write_bench_data(folder: Path) -> dict[str, Path]:
    """The source, reference and dataset files of :data:`SOURCES` and :data:`REFERENCES` in ``folder``."""
    source, reference, dataset = folder / "src.txt", folder / "ref.txt", folder / "data.jsonl"
    source.write_text("\n".join(SOURCES) + "\n")
    reference.write_text("\n".join(REFERENCES) + "\n")
    dataset.write_text(
        "".join(
            json.dumps(
                {"id": i, "question_id": i, "document": s, "summary": r, "turns": [s], "category": "cat" + str(i % 2)}
            )
            + "\n"
            for i, (s, r) in enumerate(zip(SOURCES, REFERENCES))
        )
    )
    return {"source": source, "reference": reference, "dataset": dataset}


@pytest.fixture
def bench_recipe(tiny_models, write_recipe) -> str:
    return str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 12})))


def _write_tiny_gguf(path: Path) -> Path:
    """A tiny llama as a float32 GGUF file, as llama.cpp's converter writes one. Its vocabulary has a BOS
    token, which transformers adds to a GGUF llama tokenizer that lacks one."""
    import gguf
    import numpy as np

    from specdec_cli.kit.testing import EOS_ID, PAD_ID, TINY_VOCAB, tiny_model

    vocab = [*TINY_VOCAB, "<s>"]
    model = tiny_model("llama", seed=1, vocab_size=len(vocab))
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_types([3, 3, 2] + [1] * (len(vocab) - 4) + [3])  # control, control, unknown, words, control
    writer.add_bos_token_id(len(vocab) - 1)
    writer.add_add_bos_token(False)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(PAD_ID)
    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    blocks = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        weight = tensor.float().numpy()  # [out, in] or [hidden]
        if name in top:
            gguf_name = top[name]
        else:
            _, _, layer, *module, _ = name.split(".")
            part = blocks[".".join(module)]
            gguf_name = f"blk.{layer}.{part}"
            if part in heads:  # llama.cpp stores q and k rows with each head's rotary halves interleaved
                halves = weight.reshape(heads[part], 2, -1, weight.shape[1])  # [heads, 2, head_dim / 2, hidden]
                weight = halves.swapaxes(1, 2).reshape(weight.shape)  # [heads * head_dim, hidden]
        writer.add_tensor(f"{gguf_name}.weight", np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return _write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
