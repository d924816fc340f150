"""Faults during `bench` and `acceptance`: signals at random points, a full disk, a second writer.

After each, a re-run of the same command finishes and its per-sample records (tokens, accepted
mask, text) equal those of a run that was never interrupted.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
from pathlib import Path

import pytest
import yaml

from specdec_cli.results.store import LOCK, SAMPLES, ResultsStore
from tests.conftest import (
    one_error_line,
    specdec_args,
    specdec_in_process,
    start_specdec,
    tiny_recipe,
    wait_for_samples,
)

EXAMPLES = 16


@pytest.fixture(scope="module")
def bench_args(tiny_models, module_folder):
    """bench_args(output) -> the arguments of one small bench run (3 cells × EXAMPLES samples)."""
    recipe = module_folder / "bench.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 16})))
    data = {"source": module_folder / "source.txt", "reference": module_folder / "reference.txt"}
    data["source"].write_text("".join(f"the cat {i} sat on a mat\n" for i in range(EXAMPLES)))
    data["reference"].write_text("".join(f"le chat {i}\n" for i in range(EXAMPLES)))

    def args(output: Path) -> list[str]:
        return specdec_args("bench", recipe, **data, verifier="speculative,mentored", kl=0.1, output=output)

    return args


def _records(folder: Path) -> dict:
    """What a sample must reproduce, by (cell, seed, example): not its timings."""
    records = {}
    for line in (folder / SAMPLES).read_text().splitlines():
        record = json.loads(line)
        key = (record["cell"], record["seed"], record["example_id"])
        assert key not in records, f"{key} written twice"
        records[key] = (record["token_ids"], record["accepted_mask"], record["text"])
    return records


@pytest.fixture(scope="module")
def reference(bench_args, module_folder) -> dict:
    """The records of the bench run never interrupted, which every faulted run must end with."""
    assert specdec_in_process(bench_args(module_folder / "reference")) == 0
    records = _records(module_folder / "reference")
    assert len(records) == 3 * EXAMPLES
    return records


def _kill_point(generator: random.Random, done: int, last: int) -> int:
    """A random count of samples past the ``done`` a resumed run starts from, in the first half of what is left
    (so that each of three signals in turn lands while the run is running, never while it is still starting)."""
    return generator.randint(done + 1, max(done + 1, done + (last - done) // 2))


def _stop(process, output: Path, signum: int, count: int) -> str:
    """Send ``signum`` to ``process`` once ``output`` holds ``count`` samples (or it ended); its stderr. One stopped
    by SIGINT or SIGTERM while running ends as Ctrl-C does, exit 130 with the results so far written (unless its
    last records were written before the signal landed)."""
    wait_for_samples(output, count, process)
    running = process.poll() is None
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    if running and signum != signal.SIGKILL and process.returncode != 0:
        assert process.returncode == 130, err
        assert "interrupted" in err and json.loads((output / "results.json").read_text())["interrupted"]
    return err


def test_a_bench_killed_by_each_signal_resumes_to_the_uninterrupted_records(run, bench_args, reference, tmp_path):
    """One run stopped by SIGINT, resumed and stopped by SIGTERM, resumed and killed (SIGKILL), each at a random
    point, each a real process; then resumed to the end, it holds the uninterrupted run's records."""
    generator = random.Random(0)
    output = tmp_path / "killed"
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        done = (output / SAMPLES).read_bytes().count(b"\n") if (output / SAMPLES).exists() else 0
        process = start_specdec(bench_args(output))
        _stop(process, output, signum, _kill_point(generator, done, 3 * EXAMPLES - 1))
    if process.returncode == -signal.SIGKILL:  # no clean end: the lock file stays, its lock freed with the process
        assert (output / LOCK).is_file()
    code, _, err = run(bench_args(output))
    assert code == 0, err
    assert f"note: resuming '{output}': " in err
    assert _records(output) == reference
    assert not (output / LOCK).exists()


class _FullDisk:
    """A file that takes ``room`` more characters, then fails as a full disk does, mid-line: where the room ends
    exactly at a line's end (the records' lengths vary with their timings), in the middle of the next line."""

    def __init__(self, handle, room: int):
        self._handle, self._room = handle, room
        self.name, self.close = handle.name, handle.close

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def write(self, text: str) -> int:
        if len(text) > self._room:
            self._handle.write(text[: self._room or len(text) // 2])
            self._handle.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(text)
        return self._handle.write(text)

    def flush(self) -> None:
        self._handle.flush()


def test_a_full_disk_stops_with_one_line_and_the_rerun_completes(run, bench_args, reference, tmp_path, monkeypatch):
    output = tmp_path / "full"
    original = ResultsStore.__init__

    def tight(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._handle = _FullDisk(self._handle, 6000)

    monkeypatch.setattr(ResultsStore, "__init__", tight)
    code, _, err = run(bench_args(output))
    assert code == 1
    one_error_line(err, "No space left on device")
    assert not (output / SAMPLES).read_text().endswith("\n")  # the disk filled mid-line
    monkeypatch.setattr(ResultsStore, "__init__", original)
    code, _, err = run(bench_args(output))
    assert code == 0 and "last sample line was cut short" in err
    assert _records(output) == reference


def test_a_second_writer_is_refused_and_named(run, bench_args, tmp_path):
    output = tmp_path / "shared"
    first = start_specdec(bench_args(output))
    try:
        wait_for_samples(output, 1, first)
        assert first.poll() is None, "the first run ended before the second started"
        code, _, err = run(bench_args(output))
        assert code == 2
        one_error_line(err, f"is being written by another specdec run (pid {first.pid})")
    finally:
        first.kill()
        first.communicate()


@pytest.fixture(scope="module")
def acceptance_args(tiny_models, module_folder):
    """acceptance_args(output) -> one small acceptance run over EXAMPLES prompts."""
    recipe = module_folder / "acceptance.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 12})))
    (module_folder / "prompts.txt").write_text("".join(f"the cat {i} sat\n" for i in range(EXAMPLES)))

    compared = {"num_drafts": "1,2", "verifier": "speculative,specinfer,mentored", "kl": 0.1}

    def args(output: Path) -> list[str]:
        return specdec_args("acceptance", recipe, prompt_file=module_folder / "prompts.txt", output=output, **compared)

    return args


def _acceptance(folder: Path) -> tuple:
    payload = json.loads((folder / "acceptance.json").read_text())
    return payload["prompts"], payload["table"], payload["interrupted"]


def test_an_acceptance_killed_by_each_signal_resumes_to_the_uninterrupted_table(run, acceptance_args, tmp_path):
    """As the bench above: one run stopped by SIGINT, SIGTERM and SIGKILL in turn, each a real process, then
    resumed to the end; its table is the uninterrupted run's."""
    code, _, err = run(acceptance_args(tmp_path / "reference"))
    assert code == 0, err
    reference = _acceptance(tmp_path / "reference")
    generator, output = random.Random(0), tmp_path / "killed"
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        done = (output / SAMPLES).read_bytes().count(b"\n") if (output / SAMPLES).exists() else 0
        process = start_specdec(acceptance_args(output))
        wait_for_samples(output, _kill_point(generator, done, EXAMPLES - 2), process)
        running = process.poll() is None
        process.send_signal(signum)
        process.communicate(timeout=120)
        if running and signum != signal.SIGKILL and process.returncode != 0:  # the prompts so far summarised at once
            assert process.returncode == 130 and _acceptance(output)[2] is True
    code, _, err = run(acceptance_args(output))
    assert code == 0, err
    assert _acceptance(output) == reference
