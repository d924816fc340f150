"""Shared fixtures: tiny models saved to disk once per session, and recipes that point at them; the session's
caches kept out of the user's home and the checkout (tests/isolation.py). Also the test modules' one home of
shared helpers: recipes, `specdec` argument lists, a run started as a child process, and a results folder read
back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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

from specdec_cli.kit.testing import save_tiny_model  # noqa: E402
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


def wait_for_samples(folder: Path, count: int, process: subprocess.Popen, timeout: float = 120) -> None:
    """Return once ``folder`` holds ``count`` sample lines, ``process`` has ended, or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    path = folder / SAMPLES
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.005)


def pytest_sessionfinish(session, exitstatus):
    """A run that wrote under the user's home or in the checkout fails, whatever its tests did."""
    left = isolation.finish()
    if left:
        print(f"\n{left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
