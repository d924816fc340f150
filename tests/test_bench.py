"""`specdec bench` on tiny models and tiny local datasets made here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import (
    BASELINE_CELL,
    SOURCES,
    SPECULATIVE_CELL,
    bench_on_files,
    interruptible,
    read_cells,
    read_samples,
    specdec_args,
    specdec_in_process,
    tiny_recipe,
    write_bench_data,
)


def test_metrics_in_results_equal_recomputation_from_samples(run, bench_recipe, data, tmp_path):
    from sacrebleu.metrics import BLEU, CHRF

    out = tmp_path / "out"
    code, stdout, _ = run(
        bench_on_files(
            bench_recipe, data, out, verifier="speculative,specinfer", num_drafts="1,2", draft_length="2,3", seeds="0,1"
        )
    )
    assert code == 0 and "speculative K=1 L=2 T=1" in stdout and "baseline T=1" in stdout
    samples = read_samples(out)
    cells = read_cells(out)
    # baseline + speculative (K=1, L=2,3) + specinfer (K=1,2, L=2,3) = 7 cells, 2 seeds, 8 examples
    assert len(cells) == 7 and len(samples) == 7 * 2 * 8
    for key, cell in cells.items():
        for seed in ("0", "1"):
            mine = sorted((s for s in samples if s["cell"] == key and str(s["seed"]) == seed), key=lambda s: s["index"])
            hyps, refs = [s["text"] for s in mine], [s["reference"] for s in mine]
            metrics = cell["per_seed"][seed]
            assert metrics["bleu"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
            assert metrics["chrf"] == pytest.approx(CHRF().corpus_score(hyps, [refs]).score)
            stats = [s["stats"] for s in mine]
            assert metrics["block_efficiency"] == pytest.approx(
                sum(s["new_tokens"] for s in stats) / sum(s["target_forwards"] for s in stats)
            )
            if not key.startswith("baseline"):
                assert metrics["acceptance_rate"] == pytest.approx(
                    sum(s["accepted_tokens"] for s in stats) / sum(s["drafted_tokens"] for s in stats)
                )
                assert metrics["speedup"] > 0 and metrics["expected_speedup"] > 0
    assert (out / "table.md").read_text().startswith("| configuration |")
    table = (out / "table.md").read_text()
    assert "BLEU signature (sacrebleu): `nrefs:1|" in table and "chrF signature (sacrebleu): `nrefs:1|" in table
    assert (out / "table.csv").read_text().splitlines()[0].startswith("configuration,verifier")
    results = json.loads((out / "results.json").read_text())
    assert {"torch", "transformers", "device", "date", "specdec", "git"} <= set(results["environment"])


def test_same_seed_cells_share_the_baseline_and_lossless_cells_agree(run, bench_recipe, data, tmp_path):
    out = tmp_path / "out"
    code, _, _ = run(
        bench_on_files(
            bench_recipe, data, out, "--verifier", "speculative,specinfer,spectr,block", "--temperature", "0"
        )
    )
    assert code == 0
    texts = {}
    for sample in read_samples(out):
        texts.setdefault(sample["cell"], {})[sample["example_id"]] = sample["token_ids"]
    # Greedy: every lossless configuration reproduces the baseline's output exactly.
    baseline = texts.pop("baseline T=0")
    assert texts and all(outputs == baseline for outputs in texts.values())


def test_block_level_cells_have_no_per_token_figures(run, bench_recipe, data, tmp_path):
    out = tmp_path / "out"
    code, stdout, _ = run(
        bench_on_files(bench_recipe, data, out, "--verifier", "block,speculative", "--draft-length", "3")
    )
    assert code == 0
    cells = read_cells(out)
    block, speculative = cells["block K=1 L=3 T=1"], cells["speculative K=1 L=3 T=1"]
    for name in ("token_acceptance", "expected_speedup", "efficiency_vs_expected"):
        assert name not in block["summary"] and name in speculative["summary"]
    for cell in (block, speculative):
        assert cell["summary"]["speedup"]["mean"] > 0 and 0 < cell["summary"]["engine_overhead"]["mean"] < 1
    row = next(line for line in (out / "table.md").read_text().splitlines() if line.startswith("| block"))
    header = (out / "table.md").read_text().splitlines()[0].split(" | ")
    assert row.split(" | ")[header.index("expected")] == "—"


def test_rouge_for_summaries_and_spec_bench_categories(run, bench_recipe, data, tmp_path):
    from rouge_score import rouge_scorer

    out = tmp_path / "xsum"
    code, _, _ = run(
        specdec_args(
            "bench", bench_recipe, task="xsum", dataset=data["dataset"], template="{source}", limit=5, output=out
        )
    )
    assert code == 0
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    for key, cell in read_cells(out).items():
        mine = [s for s in read_samples(out) if s["cell"] == key]
        assert len(mine) == 5
        expected = 100 * sum(scorer.score(s["reference"], s["text"])["rougeL"].fmeasure for s in mine) / len(mine)
        assert cell["per_seed"]["0"]["rougeL"] == pytest.approx(expected)
    out = tmp_path / "spec-bench"
    code, _, _ = run(
        specdec_args("bench", bench_recipe, "--json", task="spec-bench", dataset=data["dataset"], output=out)
    )
    assert code == 0
    speculative = read_cells(out)["speculative K=1 L=3 T=1"]["per_seed"]["0"]
    assert set(speculative["tokens_per_second_by_category"]) == {"cat0", "cat1"}


def test_changed_configuration_is_refused_and_report_rerenders(run, bench_recipe, data, tmp_path):
    out = tmp_path / "out"
    assert run(bench_on_files(bench_recipe, data, out, "--limit", "3"))[0] == 0
    code, _, err = run(bench_on_files(bench_recipe, data, out, "--limit", "4"))
    assert code == 2 and "holds results of a different configuration (changed: data.examples (3 → 4), " in err
    code, _, err = run(bench_on_files(bench_recipe, data, out, "--limit", "3", "--max-new-tokens", "5"))
    assert code == 2 and "(changed: recipe.generation.max_new_tokens (12 → 5))" in err
    picture = tmp_path / "plot.png"
    code, stdout, _ = run(["bench", "--report", str(out), "--plot", str(picture)])
    assert code == 0 and "speculative K=1 L=3 T=1" in stdout
    assert picture.read_bytes()[:4] == b"\x89PNG"


def test_a_rerun_with_other_cells_reuses_the_shared_samples(run, bench_recipe, data, tmp_path):
    """Adding a cell (or replacing a failing one) keeps the baseline's and the other cells' samples."""
    out = tmp_path / "out"
    assert run(bench_on_files(bench_recipe, data, out, "--limit", "3"))[0] == 0
    before = (out / "samples.jsonl").read_text()
    code, _, err = run(bench_on_files(bench_recipe, data, out, "--limit", "3", "--draft-length", "3,5"))
    assert code == 0, err
    after = (out / "samples.jsonl").read_text()
    assert after.startswith(before) and len(after.splitlines()) == len(before.splitlines()) + 3  # only L=5 ran
    assert set(read_cells(out)) == {"baseline T=1", "speculative K=1 L=3 T=1", "speculative K=1 L=5 T=1"}
    code, _, err = run(bench_on_files(bench_recipe, data, out, "--limit", "3", "--draft-length", "5"))
    assert code == 0 and (out / "samples.jsonl").read_text() == after  # nothing left to run
    assert set(read_cells(out)) == {"baseline T=1", "speculative K=1 L=5 T=1"}


def test_grid_expansion(run, bench_recipe, data, tmp_path):
    out = tmp_path / "out"
    code, _, err = run(
        bench_on_files(
            bench_recipe, data, out, limit=2, verifier="speculative,mentored,spectr", kl="0.1,0.3", num_drafts="1,2"
        )
    )
    assert code == 0
    keys = set(read_cells(out))
    assert keys == {
        "baseline T=1",
        "speculative K=1 L=3 T=1",
        "mentored D=0.1 K=1 L=3 T=1",
        "mentored D=0.3 K=1 L=3 T=1",
        "spectr K=1 L=3 T=1",
        "spectr K=2 L=3 T=1",
    }
    assert "skipped: verifier 'speculative' takes at most 1 draft(s) per position" in err


def test_offline_task_without_data_says_how_to_give_it(run, bench_recipe):
    code, _, err = run(["bench", "-r", bench_recipe, "--task", "dolly"])
    assert code == 1 and "offline, give the data as --dataset FILE.jsonl" in err


def _command(recipe: str, data: dict, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "specdec_cli",
        *bench_on_files(
            recipe, data, out, "--verifier", "speculative,specinfer", "--num-drafts", "1,2", "--seeds", "0,1"
        ),
    ]


def _final_numbers(out: Path) -> dict:
    samples = {(s["cell"], s["seed"], s["example_id"]): s["token_ids"] for s in read_samples(out)}
    cells = {
        k: {m: v for m, v in c["per_seed"]["1"].items() if m in ("block_efficiency", "acceptance_rate", "bleu")}
        for k, c in read_cells(out).items()
    }
    return {"samples": samples, "cells": cells}


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, module_folder) -> tuple[str, dict, Path]:
    """The recipe and data the process-level tests below share, and the results folder of their bench run never
    interrupted (run once, in this process), which each compares its own run against."""
    recipe = module_folder / "bench.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 12})))
    data = write_bench_data(module_folder)
    reference = module_folder / "reference"
    assert specdec_in_process(_command(str(recipe), data, reference)[3:]) == 0
    return str(recipe), data, reference


def test_interrupted_run_resumes_to_the_same_results(run, uninterrupted, tmp_path):
    recipe, data, reference = uninterrupted
    resumed = tmp_path / "resumed"
    total = len((reference / "samples.jsonl").read_text().splitlines())
    samples = resumed / "samples.jsonl"
    for attempt in range(3):  # on a busy machine the run can finish its last samples before the signal lands
        threshold = max(1, total // 3 // 4**attempt)  # early, and earlier at each try: the tiny models are fast
        shutil.rmtree(resumed, ignore_errors=True)
        process = subprocess.Popen(
            _command(recipe, data, resumed),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=interruptible,
        )
        deadline = time.time() + 120
        while time.time() < deadline and (not samples.exists() or len(samples.read_text().splitlines()) < threshold):
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
        if process.returncode != 0:  # 0: it had finished; try again
            break
    assert process.returncode == 130, err.decode()
    kept = len(samples.read_text().splitlines())
    assert threshold <= kept < total
    assert json.loads((resumed / "results.json").read_text())["interrupted"] is True
    code, _, err = run(_command(recipe, data, resumed)[3:])  # the resumed run, in this process
    assert code == 0, err
    assert _final_numbers(resumed) == _final_numbers(reference)


def test_two_processes_give_the_samples_of_one(uninterrupted, tmp_path):
    recipe, data, single = uninterrupted
    double = tmp_path / "double"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(launcher + _command(recipe, data, double)[1:], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(double.glob("samples.rank*.jsonl"))
    assert _final_numbers(double)["samples"] == _final_numbers(single)["samples"]
    assert json.loads((double / "results.json").read_text())["environment"]["world_size"] == 2


def test_spec_bench_per_category_speedups_and_the_multi_turn_note(run, bench_recipe, tmp_path):
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"question_id": i, "category": f"cat{i % 2}", "turns": [s, "d e"] if i < 2 else [s]}) + "\n"
            for i, s in enumerate(SOURCES[:4])
        )
    )
    out = tmp_path / "out"
    code, stdout, err = run(
        ["bench", "-r", bench_recipe, "--task", "spec-bench", "--dataset", str(dataset), "--output", str(out)]
    )
    assert code == 0, err
    assert "2 of 4 questions have 2 turns; only the first turn of each is generated" in err
    metrics = read_cells(out)["speculative K=1 L=3 T=1"]["per_seed"]["0"]
    assert set(metrics["speedup_by_category"]) == {"cat0", "cat1"} and min(metrics["speedup_by_category"].values()) > 0
    assert "tokens/s per category" in stdout and "Tokens/s per category" in (out / "table.md").read_text()


def test_cells_run_example_by_example_so_drift_cancels(run, bench_recipe, data, tmp_path):
    out = tmp_path / "out"
    assert run(bench_on_files(bench_recipe, data, out, "--limit", "3", "--draft-length", "2,3"))[0] == 0
    order = [(s["example_id"], s["cell"]) for s in read_samples(out)]
    cells = ["baseline T=1", "speculative K=1 L=2 T=1", "speculative K=1 L=3 T=1"]
    assert order == [(example, cell) for example in ("0", "1", "2") for cell in cells]


def test_per_category_speedup_compares_the_examples_both_runs_finished():
    """An interrupted baseline lacks an example: the category's speedup leaves it out on both sides."""
    from specdec_cli.bench.results import summarize

    def record(cell, example, category, tokens, seconds):
        stats = {
            "new_tokens": tokens,
            "target_forwards": tokens,
            "draft_forwards": 0,
            "drafted_tokens": 0,
            "verified_tokens": 0,
            "accepted_tokens": 0,
            "draft_time_s": 0.0,
            "target_time_s": seconds,
            "verify_time_s": 0.0,
            "wall_time_s": seconds,
            "forward_time_s": seconds,
            "drafted_per_position": [],
            "accepted_per_position": [],
        }
        return {
            "cell": cell,
            "seed": 0,
            "example_id": example,
            "index": int(example),
            "category": category,
            "text": "x",
            "reference": None,
            "stats": stats,
        }

    config = {"cells": [BASELINE_CELL, SPECULATIVE_CELL], "task": {"metrics": [], "per_category": True}}
    records = [
        record("baseline T=1", "0", "a", 10, 1.0),  # the baseline never ran example 1
        record("speculative K=1 L=3 T=1", "0", "a", 10, 0.5),
        record("speculative K=1 L=3 T=1", "1", "a", 10, 5.0),
    ]
    metrics = summarize(config, records).cells[1].per_seed["0"]
    assert metrics["speedup_by_category"] == {"a": pytest.approx(2.0)} and metrics["speedup"] == pytest.approx(2.0)


def test_drafters_are_a_grid_axis(run, bench_recipe, data, tmp_path):
    """`bench --task xsum --drafter model,prompt-lookup` runs one cell per drafter beside the baseline, in one table
    with their ROUGE-L; the prompt-lookup cell runs no draft forward."""
    out = tmp_path / "out"
    args = specdec_args("bench", bench_recipe, task="xsum", dataset=data["dataset"], template="{source}", output=out)
    code, stdout, err = run([*args, "--drafter", "model,prompt-lookup"])
    assert code == 0, err
    cells = read_cells(out)
    assert set(cells) == {
        "baseline T=1",
        "speculative K=1 L=3 T=1 drafter=model",
        "speculative K=1 L=3 T=1 drafter=prompt-lookup",
    }
    lookup = [s["stats"] for s in read_samples(out) if s["cell"].endswith("drafter=prompt-lookup")]
    assert lookup and all(stats["draft_forwards"] == 0 for stats in lookup)
    table = " ".join(stdout.replace("│", " ").split())
    assert "ROUGE-L" in table and "drafter=model " in table and "drafter=prompt-lookup " in table
