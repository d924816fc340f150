"""`bench` under faults: a failing cell, a resume under other conditions, --threads, stopping without
a folder, data without references, damaged or odd results folders, and plots that say what ran."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from specdec_cli.base.recipe import build_recipe
from specdec_cli.bench.metrics import STAT_TOTALS
from specdec_cli.plugins.discovery import PluginEntry
from specdec_cli.plugins.registry import VerifierRegistry
from tests.conftest import (
    BASELINE_CELL,
    SPECULATIVE_CELL,
    acceptance_of_one_prompt,
    bench_on_files,
    one_error_line,
    read_cells,
    read_results,
    read_samples,
    specdec_args,
    tiny_recipe,
)

SOURCES = ["a b c", "d e a", "c c b", "e d c b"]
REFERENCES = ["a b", "d e", "c b", "e d"]
SPECULATIVE = "speculative K=1 L=3 T=1"


@pytest.fixture(autouse=True)
def keep_threads():
    """--threads sets torch's thread count for the whole process: give the next test the one it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def data(tmp_path) -> dict[str, str]:
    source, reference = tmp_path / "src.txt", tmp_path / "ref.txt"
    source.write_text("\n".join(SOURCES) + "\n")
    reference.write_text("\n".join(REFERENCES) + "\n")
    return {"source": str(source), "reference": str(reference)}


@pytest.fixture
def recipe_path(tiny_models, write_recipe) -> str:
    return str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 6})))


# --------------------------------------------------------------------------- a cell that fails


def _nan_draft(folder: Path, first_nan_position: int) -> Path:
    """A gpt2 draft whose position embeddings from ``first_nan_position`` on are NaN: from 20 on, its
    logits turn NaN only on a long prompt, so a cell that drafts with it fails on that example; from 0
    on, on its warm-up."""
    from specdec_cli.kit.testing import tiny_model, tiny_tokenizer

    model = tiny_model("gpt2", seed=4, layers=1)
    with torch.no_grad():
        model.transformer.wpe.weight[first_nan_position:] = float("nan")
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("first_nan_position", "where", "kept"), [(20, "example 2 (seed 0)", {"0", "1"}), (0, "its warm-up", set())]
)
def test_a_cell_whose_generation_fails_is_reported_and_the_others_kept(
    run, tiny_models, write_recipe, tmp_path, first_nan_position, where, kept
):
    recipe = tiny_recipe(tiny_models, "gpt2", generation={"max_new_tokens": 6})
    recipe["draft"]["model"] = str(_nan_draft(tmp_path / "nan-draft", first_nan_position))
    source, reference = tmp_path / "src.txt", tmp_path / "ref.txt"
    source.write_text("a b\nc d\n" + " ".join(["a b c d e"] * 4) + "\ne a\n")  # example 2: 20 words
    reference.write_text("a\nb\nc\nd\n")
    out = tmp_path / "out"
    code, stdout, err = run(
        [
            "bench",
            "-r",
            str(write_recipe(recipe)),
            "--source",
            str(source),
            "--reference",
            str(reference),
            "--template",
            "{source}",
            "--output",
            str(out),
        ]
    )
    assert code == 1, err
    one_error_line(err, f"cell '{SPECULATIVE}' failed on {where}: ")
    assert "draft" in err and "its other samples and every other cell are kept" in err
    done = {(s["cell"], s["example_id"]) for s in read_samples(out)}
    assert done == {("baseline T=1", e) for e in "0123"} | {(SPECULATIVE, e) for e in kept}
    cells = read_cells(out)
    assert cells[SPECULATIVE]["failed"].startswith(f"on {where}: ") and cells["baseline T=1"]["failed"] is None
    assert f"{SPECULATIVE} (failed)" in stdout and f"{SPECULATIVE}: failed on {where}" in (out / "table.md").read_text()


class FailsAfterTenBlocks(VerifierRegistry().load_class("speculative")):
    """A third-party verifier that raises at run time, past its warm-up (at most 8 blocks)."""

    name = "fails-later"

    def __init__(self) -> None:
        super().__init__()
        self.blocks = 0

    def verify_block(self, *args, **kwargs):
        self.blocks += 1
        if self.blocks > 10:
            raise RuntimeError("the plugin's own bug")
        return super().verify_block(*args, **kwargs)


def test_a_plugin_that_raises_at_run_time_fails_its_cell_only(run, recipe_path, data, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # the description cache would keep the plugin
    # An installed plugin as the registry finds one: an entry point naming this module's class.
    entry = PluginEntry("fails-later", f"{__name__}:FailsAfterTenBlocks", "fails-later-plugin", "0.1")
    listed = VerifierRegistry.entry_points
    monkeypatch.setattr(VerifierRegistry, "entry_points", lambda self: [*listed(self), entry])
    out = tmp_path / "out"
    code, _, err = run(bench_on_files(recipe_path, data, out, "--verifier", "fails-later,speculative"))
    assert code == 1, err
    one_error_line(err, "cell 'fails-later K=1 L=3 T=1' failed on example ")
    assert "fails-later" in err and "Traceback" not in err
    cells = read_cells(out)
    assert cells["fails-later K=1 L=3 T=1"]["failed"] and not cells[SPECULATIVE]["failed"]
    assert sum(s["cell"] == SPECULATIVE for s in read_samples(out)) == len(SOURCES)  # ran on after the failure


# --------------------------------------------------------------------------- conditions of a resume


def _edit_samples(out: Path, edit) -> None:
    """Rewrite every sample line of ``out`` through ``edit(record)``."""
    records = read_samples(out)
    for record in records:
        edit(record)
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_resume_under_other_threads_is_refused_or_flagged(run, recipe_path, data, tmp_path):
    out = tmp_path / "out"
    assert run(bench_on_files(recipe_path, data, out, "--threads", "1"))[0] == 0
    assert {s["conditions"]["threads"] for s in read_samples(out)} == {1}
    # A new cell measured with 2 threads against a baseline measured with 1 would not compare.
    code, _, err = run(bench_on_files(recipe_path, data, out, "--threads", "2", "--draft-length", "3,2"))
    assert code == 2
    one_error_line(err, "holds samples run with threads 1 but this run has 2")
    assert "--threads 1" in err and "--allow-mixed-conditions" in err and "new --output" in err
    code, stdout, err = run(
        bench_on_files(recipe_path, data, out, "--threads", "2", "--draft-length", "3,2", "--allow-mixed-conditions")
    )
    assert code == 0, err
    results = read_results(out)
    assert results["mixed_conditions"] is True
    assert [(p["conditions"]["threads"], p["samples"]) for p in results["conditions"]] == [(1, 8), (2, 4)]
    cells = read_cells(out)
    assert cells["speculative K=1 L=2 T=1"]["mixed_conditions"] and not cells[SPECULATIVE]["mixed_conditions"]
    assert "speculative K=1 L=2 T=1 *" in stdout
    assert "* mixed conditions: threads 1 (8 samples); threads 2 (4 samples)" in (out / "table.md").read_text()
    # Nothing left to run: the folder is shown again whatever the conditions.
    assert run(bench_on_files(recipe_path, data, out, "--threads", "1", "--draft-length", "3,2"))[0] == 0


@pytest.mark.parametrize(
    ("condition", "stored"),
    [("device", "NVIDIA H100 80GB HBM3"), ("torch", "2.0.0"), ("transformers", "4.40.0"), ("specdec", "0.0.1")],
)
def test_each_stored_condition_that_differs_is_named(run, recipe_path, data, tmp_path, condition, stored):
    out = tmp_path / "out"
    assert run(bench_on_files(recipe_path, data, out, "--limit", "2"))[0] == 0
    _edit_samples(out, lambda record: record["conditions"].update({condition: stored}))
    code, _, err = run(bench_on_files(recipe_path, data, out, "--limit", "2", "--draft-length", "2"))
    assert code == 2
    one_error_line(err, f"holds samples run with {condition} {stored} but this run has ")


def _record(cell: str, seed: int, example: str, seconds: float) -> dict:
    """A sample record of 10 tokens in ``seconds``, run with 3 threads on a 'Test CPU'."""
    stats = dict.fromkeys(STAT_TOTALS, 1)
    stats |= {"new_tokens": 10, "wall_time_s": seconds, "drafted_per_position": [1], "accepted_per_position": [1]}
    conditions = {"threads": 3, "device": "cpu: Test CPU", "torch": "x", "transformers": "y", "specdec": "z"}
    return {
        "cell": cell,
        "seed": seed,
        "example_id": example,
        "index": int(example),
        "text": "x",
        "reference": None,
        "stats": stats,
        "conditions": conditions,
    }


def test_the_per_example_speedups_spread_next_to_the_pooled_one():
    from specdec_cli.bench.results import summarize

    config = {"cells": [BASELINE_CELL, SPECULATIVE_CELL], "task": {"metrics": [], "per_category": False}}
    # Per example and seed: speedups 2, 1, 0.5 (seed 0) and 4 (seed 1); the pooled rate hides them.
    records = [_record("baseline T=1", 0, e, 1.0) for e in "012"] + [_record("baseline T=1", 1, "0", 1.0)]
    records += [
        _record(SPECULATIVE, 0, "0", 0.5),
        _record(SPECULATIVE, 0, "1", 1.0),
        _record(SPECULATIVE, 0, "2", 2.0),
        _record(SPECULATIVE, 1, "0", 0.25),
    ]
    spread = summarize(config, records).cells[1].speedup_spread
    assert (spread.median, spread.min, spread.max, spread.n) == (1.5, 0.5, 4.0, 4)
    assert (spread.q1, spread.q3) == (pytest.approx(0.875), pytest.approx(2.5))


# --------------------------------------------------------------------------- --threads


def test_threads_are_set_before_the_models_and_recorded(run, recipe_path, data, tmp_path):
    out = tmp_path / "out"
    code, _, err = run(bench_on_files(recipe_path, data, out, "--limit", "1", "--threads", "1"))
    assert code == 0, err
    assert read_results(out)["environment"]["threads"] == 1 and read_samples(out)[0]["conditions"]["threads"] == 1
    code, _, err = run(
        acceptance_of_one_prompt(recipe_path, "--threads", "1", "--output", str(tmp_path / "acceptance"))
    )
    assert code == 0, err
    assert json.loads((tmp_path / "acceptance" / "acceptance.json").read_text())["environment"]["threads"] == 1


# --------------------------------------------------------------------------- what a run says


def _stop_after_samples(monkeypatch, count: int) -> None:
    """SIGTERM this process once ``count`` samples are done, as a scheduler's kill would."""
    from specdec_cli.bench.runner import BenchRunner

    original, done = BenchRunner._keep, []

    def keep_then_maybe_stop(self, *args, **kwargs):
        original(self, *args, **kwargs)
        done.append(1)
        if len(done) == count:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(BenchRunner, "_keep", keep_then_maybe_stop)


@pytest.mark.parametrize("folder", [False, True])
def test_a_stopped_run_says_whether_it_can_resume(run, recipe_path, data, tmp_path, monkeypatch, folder):
    previous = signal.getsignal(signal.SIGTERM)
    _stop_after_samples(monkeypatch, 3)
    out = tmp_path / "out" if folder else None
    try:
        code, _, err = run(bench_on_files(recipe_path, data, out))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 130
    if folder:
        assert f"interrupted: 3 samples kept in '{out}'; run the same command to resume" in err
    else:
        assert "interrupted: 3 samples done, but nothing was saved (no --output): pass --output FOLDER" in err
        assert "run the same command" not in err


def test_data_without_references_is_noted_before_the_run(run, recipe_path, data, tmp_path):
    out = tmp_path / "wmt"
    code, _, err = run(
        specdec_args("bench", recipe_path, source=data["source"], template="{source}", limit=1, output=out)
    )
    assert code == 0, err
    note = "no references: BLEU and chrF are not computed; give --reference FILE"
    assert err.count(note) == 1 and note in read_results(out)["notes"]
    dataset = tmp_path / "articles.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"document": s, **({"summary": "a"} if i else {})}) + "\n" for i, s in enumerate(SOURCES[:2])
        )
    )
    code, _, err = run(specdec_args("bench", recipe_path, task="xsum", dataset=dataset, template="{source}", limit=1))
    assert (
        code == 0 and "no references: ROUGE-L is not computed; name the reference field with --reference-field" in err
    )
    code, _, err = run(specdec_args("bench", recipe_path, task="xsum", dataset=dataset, template="{source}"))
    assert code == 0 and "1 of 2 examples have no reference; ROUGE-L is computed on the other 1" in err


# --------------------------------------------------------------------------- --report on odd folders


def _quietly(args: list[str]) -> None:
    from specdec_cli.cli import main

    try:
        main(args)
    except SystemExit as stopped:
        assert stopped.code in (0, None), args


@pytest.fixture(scope="module")
def finished(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Results folders of two finished runs: xsum (references) and spec-bench (categories)."""
    root = tmp_path_factory.mktemp("finished")
    recipe = root / "recipe.json"
    recipe.write_text(json.dumps(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 4})))
    dataset = root / "data.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"question_id": i, "document": s, "turns": [s], "summary": r, "category": f"cat{i % 2}"}) + "\n"
            for i, (s, r) in enumerate(zip(SOURCES, REFERENCES))
        )
    )
    for task in ("xsum", "spec-bench"):
        _quietly(
            [
                "bench",
                "-r",
                str(recipe),
                "--task",
                task,
                "--dataset",
                str(dataset),
                "--template",
                "{source}",
                "--output",
                str(root / task),
                "--json",
            ]
        )
    return {"xsum": root / "xsum", "spec-bench": root / "spec-bench"}


def _set(field: str, value) -> callable:
    def edit(record: dict) -> None:
        if record["index"] == 1:
            record[field] = value

    return edit


def _set_stat(name: str, value) -> callable:
    def edit(record: dict) -> None:
        if record["index"] == 1:
            record["stats"][name] = value

    return edit


READABLE = [  # (edit of example 1's records, text the category table shows)
    (_set("category", 1), "cat0"),
    (_set("category", [1, "x"]), "cat0"),
    (_set("category", None), "all"),
]


@pytest.mark.parametrize(("edit", "shown"), READABLE)
def test_report_reads_categories_that_mix_numbers_and_text(run, finished, tmp_path, edit, shown):
    folder = tmp_path / "copy"
    shutil.copytree(finished["spec-bench"], folder)
    _edit_samples(folder, edit)
    code, stdout, err = run(["bench", "--report", str(folder), "--plot", str(tmp_path / "plot.png")])
    assert code == 0, err
    assert shown in stdout and (tmp_path / "plot.png").exists()


DAMAGED = [  # (edit of example 1's records, the one line)
    (_set_stat("wall_time_s", "fast"), "has no valid wall_time_s; delete its line from samples.jsonl"),
    (_set_stat("new_tokens", None), "has no valid new_tokens"),
    (lambda record: record["stats"].pop("target_forwards"), "has no valid target_forwards"),
]


@pytest.mark.parametrize(("edit", "message"), DAMAGED)
def test_report_names_a_damaged_record_in_one_line(run, finished, tmp_path, edit, message):
    folder = tmp_path / "copy"
    shutil.copytree(finished["xsum"], folder)
    _edit_samples(folder, edit)
    code, _, err = run(["bench", "--report", str(folder)])
    assert code == 2
    one_error_line(err, message)
    assert "the sample of cell '" in err


# --------------------------------------------------------------------------- bad inputs and odd paths


@pytest.fixture
def odd(tmp_path, finished) -> dict[str, str]:
    """Substitutions for the rows below: a results folder without samples, a folder named like a PNG."""
    empty = tmp_path / "no-samples"
    empty.mkdir()
    shutil.copy(finished["xsum"] / "config.json", empty / "config.json")
    (tmp_path / "folder.png").mkdir()
    return {"dir": str(tmp_path), "empty": str(empty), "xsum": str(finished["xsum"])}


BAD = [  # (arguments after `bench -r RECIPE --source … --reference …` unless they start with --report, one line)
    ("--seeds 0,0", "--seeds lists 0 more than once; give each value once"),
    ("--seeds 1,2,1,2", "--seeds lists 1, 2 more than once"),
    ("--seeds ,", "--seeds expects a comma list of int values, got ','"),
    ("--draft-length 3,3", "--draft-length lists 3 more than once"),
    ("--temperature 1,1.0", "--temperature lists 1.0 more than once"),
    ("--verifier speculative,Speculative", "--verifier lists speculative more than once"),
    ("--kl 0.1,0.1 --verifier mentored", "--kl lists 0.1 more than once"),
    ("--draft-temperatures 1,1.2;1,1.2", "--draft-temperatures lists (1.0, 1.2) more than once"),
    ("--draft-temperatures ;", "--draft-temperatures expects sets such as '1.0,1.2;0.7,0.7'"),
    ("--threads 0", "--threads must be at least 1, got 0"),
    ("--report {empty}", "holds no samples yet (its run stopped before the first); run bench with --output"),
    ("--report {xsum} --threads 0", "--threads must be at least 1"),
]


@pytest.mark.parametrize(("arguments", "message"), BAD)
def test_bad_bench_input_is_one_line(run, recipe_path, data, odd, arguments, message):
    extra = arguments.format(**odd).split()
    args = ["bench", *extra] if extra[0] == "--report" else bench_on_files(recipe_path, data, None, *extra)
    code, _, err = run(args)
    assert code == 2, err
    one_error_line(err, message.format(**odd))


def test_acceptance_threads_is_checked_first(run, recipe_path):
    code, _, err = run(["acceptance", "-r", recipe_path, "--prompt", "a b", "--threads", "-1"])
    assert code == 2
    one_error_line(err, "--threads must be at least 1, got -1")


def test_a_plot_path_that_is_a_folder_is_refused_first(run, finished, odd):
    code, stdout, err = run(["bench", "--report", odd["xsum"], "--plot", f"{odd['dir']}/folder.png"])
    assert code == 2 and not stdout
    one_error_line(err, "is a folder; name a file in it")


# --------------------------------------------------------------------------- plots say what was run


def _results_of(seeds: int, tiny_models):
    """Results of a wmt run of two examples, each seed a little slower than the one before."""
    from specdec_cli.bench.results import summarize

    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 17})).to_dict()
    config = {
        "cells": [BASELINE_CELL, SPECULATIVE_CELL],
        "task": {"name": "wmt", "lang_pair": "en-fr", "metrics": [], "per_category": False},
        "data": {"examples": 2},
        "seeds": list(range(seeds)),
        "recipe": recipe,
    }
    records = [
        _record(cell, seed, e, seconds + seed / 10)
        for seed in range(seeds)
        for e in "01"
        for cell, seconds in (("baseline T=1", 1.0), (SPECULATIVE, 0.8))
    ]
    return summarize(config, records)


@pytest.mark.parametrize("seeds", [1, 2])
def test_the_bench_plot_says_what_ran_and_draws_its_spread(tiny_models, seeds):
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer

    from specdec_cli.bench import report

    figure = report.figure(_results_of(seeds, tiny_models))
    try:
        title = figure._suptitle.get_text()
        for expected in (
            "wmt en-fr",
            "2 examples",
            f"× {seeds} seed",
            "at most 17 new tokens",
            "target llama-target",
            "draft llama-draft",
            "cpu: Test CPU",
            "threads 3",
        ):
            assert expected in title, title
        axis = figure.axes[0]
        bars = next(c for c in axis.containers if isinstance(c, BarContainer))
        assert bars.errorbar is not None  # one seed: the interval over the examples; more: the spread over seeds
        assert ("one seed: 95% interval over the examples" in axis.get_xlabel()) == (seeds == 1)
    finally:
        plt.close(figure)


def test_the_acceptance_plot_says_what_ran(tiny_models):
    import matplotlib.pyplot as plt

    from specdec_cli.acceptance import report
    from specdec_cli.acceptance.results import AcceptanceReport, AcceptanceRow, PromptAcceptance

    prompt = PromptAcceptance(
        prompt="a b", prompt_index=0, positions=2, values={"optimum": {1: [0.5, 0.7]}, "speculative": {1: [0.5, 0.7]}}
    )
    results = AcceptanceReport(
        rows=[AcceptanceRow("optimum"), AcceptanceRow("speculative")], num_drafts=[1], prompts=[prompt]
    )
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 9})).to_dict()
    figure = report.figure(results, {"recipe": recipe, "environment": {"device": "cpu: Test CPU", "threads": 4}})
    try:
        title = figure._suptitle.get_text()
        for expected in (
            "1 prompt, 2 positions",
            "at most 9 new tokens",
            "target llama-target",
            "cpu: Test CPU",
            "threads 4",
        ):
            assert expected in title, title
    finally:
        plt.close(figure)
