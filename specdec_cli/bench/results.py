"""A benchmark's results, derived from its samples: per cell, per seed, and mean ± std over seeds.

``results.json`` is :meth:`BenchResults.to_dict`; it is rewritten from ``samples.jsonl`` whenever a
run stops, and ``bench --report`` rebuilds it from any results folder, old ones included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..registry import VerifierRegistry
from .grid import BASELINE, GridCell
from .metrics import corpus_quality, expected_speedup, mean_and_std, speed_summary

SUMMARIZED = ("block_efficiency", "acceptance_rate", "token_acceptance", "tokens_per_second", "speedup",
              "expected_speedup", "efficiency_vs_expected", "engine_overhead", "bleu", "chrf", "rougeL")  # fmt: skip
"""Metrics given as mean ± std over seeds (in this order)."""


@dataclass(frozen=True)
class MeanStd:
    mean: float | None
    std: float | None
    n: int


@dataclass(kw_only=True)
class CellResult:
    cell: GridCell
    per_seed: dict[str, dict[str, Any]]
    """seed → that seed's metrics: speed pooled over its samples, corpus quality, per-category rates."""
    summary: dict[str, MeanStd]
    """metric → mean ± std over seeds, for the metrics of ``SUMMARIZED`` the cell has."""

    @property
    def key(self) -> str:
        return self.cell.key

    @property
    def samples(self) -> int:
        return sum(metrics["samples"] for metrics in self.per_seed.values())

    def to_dict(self) -> dict:
        summary = {name: dataclasses.asdict(value) for name, value in self.summary.items()}
        return {**dataclasses.asdict(self.cell), "key": self.key, "per_seed": self.per_seed, "summary": summary}


@dataclass(kw_only=True)
class BenchResults:
    cells: list[CellResult]
    config: dict
    """The results folder's config.json: recipe, task, data fingerprint, grid, seeds."""
    environment: dict | None = None
    """Provenance of the run that wrote it (absent when re-rendered with --report)."""
    interrupted: bool = False

    def to_dict(self) -> dict:
        content = {"cells": [cell.to_dict() for cell in self.cells], "config": self.config}
        if self.environment is not None:
            content |= {"environment": self.environment, "interrupted": self.interrupted}
        return content


def summarize(config: dict, records: list[dict], **provenance: Any) -> BenchResults:
    """Per-cell metrics from the samples: speed pooled per seed, quality per seed, mean ± std over seeds.

    ``provenance``: ``environment`` and ``interrupted`` of the run, if it just ran.
    """
    by_cell: dict[str, dict[int, list[dict]]] = {}
    for record in records:
        by_cell.setdefault(record["cell"], {}).setdefault(record["seed"], []).append(record)
    described = VerifierRegistry().describe()  # once: it reads the plugins' description cache
    cells = []
    for spec in config["cells"]:
        cell = GridCell.from_config(spec)
        # A verifier no longer installed (a folder read after its plugin was removed) counts as token-level.
        per_token = cell.verifier == BASELINE or described.get(cell.verifier, {}).get("token_level", True)
        per_seed = {str(seed): _seed_metrics(cell, samples, by_cell.get(cell.baseline_key, {}).get(seed, []), config,
                                             per_token)
                    for seed, samples in sorted(by_cell.get(cell.key, {}).items())}  # fmt: skip
        summary = {}
        for name in SUMMARIZED:
            if cell.verifier == BASELINE and name in ("acceptance_rate", "token_acceptance"):
                continue  # nothing is drafted
            values = [metrics[name] for metrics in per_seed.values() if name in metrics]
            if values:
                summary[name] = MeanStd(**mean_and_std(values))
        cells.append(CellResult(cell=cell, per_seed=per_seed, summary=summary))
    return BenchResults(cells=cells, config=config, **provenance)


def _seed_metrics(cell: GridCell, samples: list[dict], baseline: list[dict], config: dict,
                  per_token: bool) -> dict[str, Any]:  # fmt: skip
    """One seed's metrics for ``cell`` from its samples, with speedups over the same seed's baseline.
    ``per_token``: the verifier decides position by position (else per-token acceptance is undefined)."""
    samples = sorted(samples, key=lambda r: r["index"])
    metrics = speed_summary([r["stats"] for r in samples])
    metrics.update(corpus_quality(config["task"]["metrics"], [r["text"] for r in samples],
                                  [r["reference"] for r in samples]))  # fmt: skip
    if cell.verifier != BASELINE and baseline:
        _add_speedup(metrics, cell, samples, baseline, per_token)
    if not per_token:
        del metrics["token_acceptance"]  # a block-level decision has no per-token acceptance
    if config["task"]["per_category"]:
        metrics["tokens_per_second_by_category"] = _by_category(samples)
        if cell.verifier != BASELINE and baseline:  # like the overall speedup: on the examples both ran
            shared = {r["example_id"] for r in samples} & {r["example_id"] for r in baseline}
            mine = _by_category([r for r in samples if r["example_id"] in shared])
            base = _by_category([r for r in baseline if r["example_id"] in shared])
            metrics["speedup_by_category"] = {name: rate / base[name] for name, rate in mine.items() if base.get(name)}
    return metrics


def _add_speedup(metrics: dict, cell: GridCell, samples: list[dict], baseline: list[dict], per_token: bool) -> None:
    """Speedup on the examples both runs finished; Leviathan's expected speedup from α and c.

    The expected speedup assumes each draft token is accepted independently with probability α,
    so it is left out for verifiers that decide a block jointly (``per_token`` False).
    """
    shared = {r["example_id"] for r in samples} & {r["example_id"] for r in baseline}
    mine = [r["stats"] for r in samples if r["example_id"] in shared]
    theirs = [r["stats"] for r in baseline if r["example_id"] in shared]
    rate, base = speed_summary(mine), speed_summary(theirs)
    if not base["tokens_per_second"]:
        return
    metrics["speedup"] = rate["tokens_per_second"] / base["tokens_per_second"]
    cost_ratio = rate["draft_s_per_forward"] / base["target_s_per_forward"] if base["target_s_per_forward"] else 0.0
    metrics["cost_ratio"] = cost_ratio
    if not per_token:
        return
    metrics["expected_speedup"] = expected_speedup(rate["token_acceptance"], cell.draft_length, cost_ratio)
    metrics["efficiency_vs_expected"] = metrics["speedup"] / metrics["expected_speedup"]


def _by_category(samples: list[dict]) -> dict[str, float]:
    categories: dict[str, list[dict]] = {}
    for record in samples:
        categories.setdefault(record.get("category") or "all", []).append(record["stats"])
    return {name: speed_summary(stats)["tokens_per_second"] for name, stats in sorted(categories.items())}

