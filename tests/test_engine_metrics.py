"""The engines' metrics: vLLM's per-request counters and mean acceptance length, and the mean draft length, in
`generate --json` (SampleStats.to_dict) and in bench's records, per-seed summary, table and CSV."""

from __future__ import annotations

import json

import pytest

from specdec_cli.bench.metrics import speed_summary
from specdec_cli.bench.report import csv_text, rows
from specdec_cli.bench.results import summarize
from specdec_cli.results.stats import SampleStats
from tests.conftest import BASELINE_CELL, SPECULATIVE_CELL, bench_on_files, read_cells, read_samples, tiny_recipe

VLLM_NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def _blocks(*blocks: tuple[int, int, int]) -> SampleStats:
    stats = SampleStats(prompt_tokens=3)
    for drafted, verified, accepted in blocks:
        stats.record_block(drafted, verified, accepted)
    return stats


def test_counters_follow_vllm_definitions():
    """A block that proposed no position is no draft; the mean acceptance length counts the bonus token."""
    data = _blocks((3, 3, 3), (3, 2, 1), (0, 0, 0), (2, 1, 0)).to_dict()
    assert {name: data[name] for name in VLLM_NAMES} == {
        "num_drafts": 3,
        "num_draft_tokens": 8,
        "num_accepted_tokens": 4,
        "num_accepted_tokens_per_pos": [2, 1, 1],
    }
    assert data["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert data["mean_draft_length"] == pytest.approx(8 / 3)
    assert data["acceptance_rate"] == pytest.approx(4 / 8)  # specdec's own, beside them
    alone = SampleStats(prompt_tokens=3, new_tokens=5, target_forwards=5).to_dict()
    assert (alone["num_drafts"], alone["mean_acceptance_length"], alone["mean_draft_length"]) == (0, 1.0, 0.0)


def test_pooled_counters_are_the_samples_summed_and_old_records_give_them():
    """speed_summary pools the counters over samples; records written before the counters (no vLLM keys) give
    the same figures, from the per-position counts every record has."""
    samples = [_blocks((3, 3, 3), (3, 1, 0)), _blocks((2, 2, 1), (0, 0, 0))]
    for stats in samples:
        stats.new_tokens, stats.target_forwards, stats.wall_time_s = 6, 3, 1.0
    new = [s.to_dict() for s in samples]
    old = [{k: v for k, v in s.items() if k not in (*VLLM_NAMES, "mean_acceptance_length")} for s in new]
    for records in (new, old):
        pooled = speed_summary(records)
        assert pooled["num_drafts"] == 3 and pooled["num_draft_tokens"] == 8 and pooled["num_accepted_tokens"] == 4
        assert pooled["num_accepted_tokens_per_pos"] == [2, 1, 1]
        assert pooled["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
        assert pooled["mean_draft_length"] == pytest.approx(8 / 3)


def test_generate_json_carries_the_counters(run, tiny_models, write_recipe):
    """A draft that is the target, greedy: every draft position is accepted, so each draft commits its positions
    and the bonus token, and the mean acceptance length is one more than the mean draft length."""
    recipe = tiny_recipe(tiny_models, "llama", draft={"model": str(tiny_models["llama-target"])})
    path = str(write_recipe(recipe))
    code, out, err = run(["generate", "-r", path, "--json", "--temperature", "0", "--max-new-tokens", "10", "a b"])
    assert code == 0, err
    stats = json.loads(out)["samples"][0]["stats"]
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["mean_draft_length"])
    assert stats["mean_draft_length"] <= 3


def test_a_comparison_pools_the_counters_of_its_samples(run, recipe_path):
    code, out, err = run(
        ["generate", "-r", recipe_path, "--verifier", "speculative,none", "--num-samples", "2", "--json", "a b"]
    )
    assert code == 0, err
    speculative, alone = json.loads(out)["configurations"]
    samples = [sample["stats"] for sample in speculative["samples"]]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert speculative[name] == sum(stats[name] for stats in samples)
    assert speculative["num_drafts"] > 0
    assert speculative["mean_acceptance_length"] == pytest.approx(
        1 + speculative["num_accepted_tokens"] / speculative["num_drafts"]
    )
    assert (alone["num_drafts"], alone["mean_acceptance_length"]) == (0, 1.0)


def test_bench_records_and_summary_carry_the_counters(run, bench_recipe, data, tmp_path):
    out = tmp_path / "out"
    code, _, err = run(bench_on_files(bench_recipe, data, out, "--limit", "3"))
    assert code == 0, err
    mine = [s["stats"] for s in read_samples(out) if s["cell"] == "speculative K=1 L=3 T=1"]
    assert len(mine) == 3 and all(set(VLLM_NAMES) <= set(stats) for stats in mine)
    per_seed = read_cells(out)["speculative K=1 L=3 T=1"]["per_seed"]["0"]
    assert per_seed["num_drafts"] == sum(s["num_drafts"] for s in mine)
    assert per_seed["mean_acceptance_length"] == pytest.approx(
        1 + sum(s["num_accepted_tokens"] for s in mine) / per_seed["num_drafts"]
    )
    header = (out / "table.csv").read_text().splitlines()[0].split(",")
    assert {"mean_acceptance_length_mean", "mean_draft_length_mean"} <= set(header)


def _record(cell: str, stats: dict) -> dict:
    """A bench record of example 0, seed 0."""
    return {"cell": cell, "seed": 0, "example_id": "0", "index": 0, "text": "x", "reference": None, "stats": stats}


def _timed(stats: SampleStats, tokens: int, seconds: float) -> SampleStats:
    stats.new_tokens, stats.target_forwards, stats.wall_time_s = tokens, tokens, seconds
    return stats


@pytest.mark.parametrize("blocks, shown", [([(3, 3, 3), (3, 1, 0)], False), ([(3, 3, 3), (1, 1, 0)], True)])
def test_the_table_shows_the_mean_draft_length_where_it_differs_from_l(blocks, shown):
    """L = 3: drafts of 3 and 3 positions leave the column out; 3 and 1 (an adaptive length, or the end of the
    budget) show 2.00 in it, and the baseline has none."""
    config = {"cells": [BASELINE_CELL, SPECULATIVE_CELL], "task": {"metrics": [], "per_category": False}}
    records = [
        _record("baseline T=1", _timed(SampleStats(prompt_tokens=2), 8, 1.0).to_dict()),
        _record("speculative K=1 L=3 T=1", _timed(_blocks(*blocks), 8, 0.5).to_dict()),
    ]
    results = summarize(config, records)
    header, body = rows(results)
    assert ("mean L" in header) == shown
    if shown:
        assert [line[header.index("mean L")] for line in body] == ["—", "2.00"]
    csv_header, _, speculative = (line.split(",") for line in csv_text(results).splitlines())
    assert float(speculative[csv_header.index("mean_draft_length_mean")]) == pytest.approx(3.0 if not shown else 2.0)
