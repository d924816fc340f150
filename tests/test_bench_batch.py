"""`specdec bench --batch-size B[,B…]`: batch size is a grid axis, each batched cell compared with the target
alone at its own batch size, its samples those of batch 1, and a killed batched run resumes to them."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import bench_on_files, interruptible, read_cells, read_samples


def _tokens(out: Path) -> dict:
    return {(s["cell"], s["seed"], s["example_id"]): s["token_ids"] for s in read_samples(out)}


def test_batch_size_is_a_grid_axis_with_its_own_baseline(run, bench_recipe, data, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run(bench_on_files(bench_recipe, data, out, "--batch-size", "1,3", "--json"))
    assert code == 0, err
    cells = read_cells(out)
    assert set(cells) == {"baseline T=1", "baseline T=1 B=3", "speculative K=1 L=3 T=1", "speculative K=1 L=3 T=1 B=3"}
    tokens = _tokens(out)
    for (cell, seed, example), ids in tokens.items():  # a sample's tokens do not depend on its batch
        alone = cell.removesuffix(" B=3")
        assert tokens[(alone, seed, example)] == ids
    # The batched cell's speedup is its throughput over the batched baseline's: tokens over the samples' shares.
    samples = read_samples(out)

    def throughput(cell: str) -> float:
        mine = [s["stats"] for s in samples if s["cell"] == cell]
        return sum(s["new_tokens"] for s in mine) / sum(s["share_time_s"] for s in mine)

    batched = cells["speculative K=1 L=3 T=1 B=3"]["per_seed"]["0"]
    assert batched["speedup"] == pytest.approx(
        throughput("speculative K=1 L=3 T=1 B=3") / throughput("baseline T=1 B=3")
    )
    for sample in samples:  # a sample's share of its batch's time is at most its own wall time
        assert 0 < sample["stats"]["share_time_s"] <= sample["stats"]["wall_time_s"] + 1e-9


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--batch-size", "2,x"], "--batch-size"),
    ],
)
def test_bad_batch_sizes_are_one_line_before_any_model_loads(run, bench_recipe, data, tmp_path, args, message):
    code, _, err = run(bench_on_files(bench_recipe, data, tmp_path / "out", *args))
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out" / "samples.jsonl").exists()


def test_a_killed_batched_run_resumes_to_the_same_samples(run, bench_recipe, data, tmp_path):
    def args(out: Path) -> list[str]:
        return bench_on_files(
            bench_recipe, data, out, batch_size=3, verifier="speculative,specinfer", num_drafts="1,2", seeds="0,1"
        )

    # Only the killed run must be a process of its own; the reference and the resumed run go in this process, which
    # has torch imported and the tiny models' code loaded already (two interpreter starts fewer).
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    code, _, err = run(args(reference))
    assert code == 0, err
    total = len(read_samples(reference))
    samples = resumed / "samples.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec_cli", *args(resumed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=interruptible,
    )
    deadline = time.time() + 120
    while time.time() < deadline and (not samples.exists() or len(samples.read_text().splitlines()) < total // 3):
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    kept = len(samples.read_text().splitlines())
    assert kept < total, "the run finished before it was killed"
    code, _, err = run(args(resumed))
    assert code == 0, err
    assert _tokens(resumed) == _tokens(reference)
    assert len(read_samples(resumed)) == total
