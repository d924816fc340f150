"""A benchmark's results, derived from its samples: per cell, per seed, and mean ± std over seeds.

``results.json`` is :meth:`BenchResults.to_dict`; it is rewritten from ``samples.jsonl`` whenever a
run stops, and ``bench --report`` rebuilds it from any results folder, old ones included.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..base.errors import UsageError
from ..plugins.registry import VerifierRegistry
from .grid import BASELINE, GridCell
from .metrics import (
    STAT_TOTALS,
    corpus_quality,
    expected_speedup,
    mean_and_std,
    share_time,
    speed_summary,
    speedup_interval_fields,
    spread,
)

SUMMARIZED = (
    "block_efficiency",
    "acceptance_rate",
    "token_acceptance",
    "mean_acceptance_length",
    "mean_draft_length",
    "tokens_per_second",
    "speedup",
    "expected_speedup",
    "efficiency_vs_expected",
    "engine_overhead",
    "bleu",
    "chrf",
    "rougeL",
)
"""Metrics given as mean ± std over seeds (in this order)."""

_DRAFT_METRICS = ("acceptance_rate", "token_acceptance", "mean_acceptance_length", "mean_draft_length")
"""Metrics of drafting, which the target-alone baseline does not have."""


@dataclass(frozen=True)
class MeanStd:
    mean: float | None
    std: float | None
    n: int


@dataclass(frozen=True)
class Spread:
    """Median, quartiles and range of a cell's per-example speedups, pooled over seeds."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int


@dataclass(frozen=True)
class ConditionsPart:
    """Samples of a results folder run under one set of conditions (threads, device, versions)."""

    conditions: dict | None
    """:func:`~specdec_cli.results.provenance.run_conditions`; None for samples written before they were kept."""
    samples: int


@dataclass(kw_only=True)
class CellResult:
    cell: GridCell
    per_seed: dict[str, dict[str, Any]]
    """seed → that seed's metrics: speed pooled over its samples, corpus quality, per-category rates."""
    summary: dict[str, MeanStd]
    """metric → mean ± std over seeds, for the metrics of ``SUMMARIZED`` the cell has."""
    speedup_spread: Spread | None = None
    """How the per-example speedups spread around the pooled ``speedup`` (None for the baseline)."""
    mixed_conditions: bool = False
    """Its samples, or its baseline's, ran under different conditions: its speedup does not compare."""
    failure: str | None = None
    """Why the cell stopped in the run that wrote these results (None: it did not fail)."""

    @property
    def key(self) -> str:
        return self.cell.key

    @property
    def samples(self) -> int:
        return sum(metrics["samples"] for metrics in self.per_seed.values())

    def to_dict(self) -> dict:
        summary = {name: dataclasses.asdict(value) for name, value in self.summary.items()}
        spread_ = dataclasses.asdict(self.speedup_spread) if self.speedup_spread else None
        return {
            **dataclasses.asdict(self.cell),
            "key": self.key,
            "per_seed": self.per_seed,
            "summary": summary,
            "speedup_spread": spread_,
            "mixed_conditions": self.mixed_conditions,
            "failed": self.failure,
        }


@dataclass(kw_only=True)
class BenchResults:
    cells: list[CellResult]
    config: dict
    """The results folder's config.json: recipe, task, data fingerprint, grid, seeds."""
    conditions: list[ConditionsPart] = dataclasses.field(default_factory=list)
    """The conditions of every part of the run (one part unless a resume changed them), from the samples."""
    environment: dict | None = None
    """Provenance of the run that wrote it (absent when re-rendered with --report)."""
    interrupted: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the run said before it started (skipped cells, data without references, …)."""

    @property
    def mixed_conditions(self) -> bool:
        return len([part for part in self.conditions if part.conditions is not None]) > 1

    def to_dict(self) -> dict:
        content = {
            "cells": [cell.to_dict() for cell in self.cells],
            "config": self.config,
            "conditions": [dataclasses.asdict(part) for part in self.conditions],
            "mixed_conditions": self.mixed_conditions,
        }
        if self.environment is not None:
            content |= {"environment": self.environment, "interrupted": self.interrupted, "notes": self.notes}
        return content


def summarize(
    config: dict, records: list[dict], failures: dict[str, str] | None = None, **provenance: Any
) -> BenchResults:
    """Per-cell metrics from the samples: speed pooled per seed, quality per seed, mean ± std over seeds.

    ``failures``: cell key → why it stopped, in the run that just ran; ``provenance``: that run's
    ``environment``, ``interrupted`` and ``notes``.
    """
    by_cell: dict[str, dict[int, list[dict]]] = {}
    for record in map(_readable, records):
        by_cell.setdefault(record["cell"], {}).setdefault(record["seed"], []).append(record)
    described = VerifierRegistry().describe()  # once: it reads the plugins' description cache
    cells = []
    for spec in config["cells"]:
        cell = GridCell.from_config(spec)
        # A verifier no longer installed (a folder read after its plugin was removed) counts as token-level.
        per_token = cell.verifier == BASELINE or described.get(cell.verifier, {}).get("token_level", True)
        mine = by_cell.get(cell.key, {})
        baseline = by_cell.get(cell.baseline_key, {}) if cell.verifier != BASELINE else {}
        per_seed = {
            str(seed): _seed_metrics(cell, samples, baseline.get(seed, []), config, per_token)
            for seed, samples in sorted(mine.items())
        }
        speedups = [
            value for seed, samples in mine.items() for value in _example_speedups(samples, baseline.get(seed, []))
        ]
        measured = [record for group in (*mine.values(), *baseline.values()) for record in group]
        cells.append(
            CellResult(
                cell=cell,
                per_seed=per_seed,
                summary=_summary(cell, per_seed),
                speedup_spread=Spread(**found) if (found := spread(speedups)) else None,
                mixed_conditions=len(_conditions_parts(measured)) > 1,
                failure=(failures or {}).get(cell.key),
            )
        )
    return BenchResults(
        cells=cells, config=config, conditions=_conditions_parts(records, keep_unknown=True), **provenance
    )


def _summary(cell: GridCell, per_seed: dict[str, dict[str, Any]]) -> dict[str, MeanStd]:
    """Mean ± std over seeds of each metric of ``SUMMARIZED`` the cell has."""
    summary = {}
    for name in SUMMARIZED:
        if cell.verifier == BASELINE and name in _DRAFT_METRICS:
            continue  # nothing is drafted
        values = [metrics[name] for metrics in per_seed.values() if name in metrics]
        if values:
            summary[name] = MeanStd(**mean_and_std(values))
    return summary


def _conditions_parts(records: list[dict], keep_unknown: bool = False) -> list[ConditionsPart]:
    """The distinct conditions of ``records``, in the order they first ran, with their sample counts;
    samples without conditions (older folders) form a part of their own only if ``keep_unknown``."""
    counts: dict[str, int] = {}
    for record in records:
        if record.get("conditions") is not None or keep_unknown:
            key = json.dumps(record.get("conditions"), sort_keys=True)
            counts[key] = counts.get(key, 0) + 1
    return [ConditionsPart(conditions=json.loads(key), samples=count) for key, count in counts.items()]


def _readable(record: dict) -> dict:
    """``record`` as the summary reads it: its category as text (a dataset may mix numbers and text), or
    one line naming a record whose statistics are damaged (the folder's reader checks its other fields)."""
    bad = [name for name in STAT_TOTALS if not _is_number(record["stats"].get(name))]
    if bad:
        raise UsageError(
            f"the sample of cell '{record['cell']}', seed {record['seed']}, example {record['example_id']} has no "
            f"valid {', '.join(bad)}; delete its line from samples.jsonl (that sample runs again)"
        )
    category = record.get("category")
    return record if category is None or isinstance(category, str) else {**record, "category": json.dumps(category)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seed_metrics(
    cell: GridCell, samples: list[dict], baseline: list[dict], config: dict, per_token: bool
) -> dict[str, Any]:
    """One seed's metrics for ``cell`` from its samples, with speedups over the same seed's baseline.
    ``per_token``: the verifier decides position by position (else per-token acceptance is undefined)."""
    samples = sorted(samples, key=lambda r: r["index"])
    metrics = speed_summary([r["stats"] for r in samples])
    metrics.update(
        corpus_quality(config["task"]["metrics"], [r["text"] for r in samples], [r["reference"] for r in samples])
    )
    if cell.verifier != BASELINE and baseline:
        _add_speedup(metrics, cell, samples, baseline, per_token)
    if not per_token:
        del metrics["token_acceptance"]  # a block-level decision has no per-token acceptance
    if config["task"]["per_category"]:
        metrics["tokens_per_second_by_category"] = _by_category(samples)
        if cell.verifier != BASELINE and baseline:  # like the overall speedup: on the examples both ran
            pairs = _pairs(samples, baseline)
            mine, base = _by_category([a for a, _ in pairs]), _by_category([b for _, b in pairs])
            metrics["speedup_by_category"] = {name: rate / base[name] for name, rate in mine.items() if base.get(name)}
    return metrics


def _add_speedup(metrics: dict, cell: GridCell, samples: list[dict], baseline: list[dict], per_token: bool) -> None:
    """Speedup on the examples both runs finished; Leviathan's expected speedup from α and c.

    The expected speedup assumes each draft token is accepted independently with probability α,
    so it is left out for verifiers that decide a block jointly (``per_token`` False), and for a draft length that
    changes from block to block (``draft_length_schedule``, or ``exact_first``, which also shortens the blocks that
    would cross it and changes the rule there).
    """
    pairs = _pairs(samples, baseline)
    rate, base = speed_summary([a["stats"] for a, _ in pairs]), speed_summary([b["stats"] for _, b in pairs])
    if not base["tokens_per_second"]:
        return
    metrics["speedup"] = rate["tokens_per_second"] / base["tokens_per_second"]
    metrics.update(speedup_interval_fields([(a["stats"], b["stats"]) for a, b in pairs]))
    cost_ratio = rate["draft_s_per_forward"] / base["target_s_per_forward"] if base["target_s_per_forward"] else 0.0
    metrics["cost_ratio"] = cost_ratio
    if not per_token or cell.draft_length_schedule != "constant" or cell.exact_first:  # one L and rule every block
        return
    metrics["expected_speedup"] = expected_speedup(rate["token_acceptance"], cell.draft_length, cost_ratio)
    metrics["efficiency_vs_expected"] = metrics["speedup"] / metrics["expected_speedup"]


def _pairs(samples: list[dict], baseline: list[dict]) -> list[tuple[dict, dict]]:
    """(sample, the baseline's sample of the same example) for the examples both ran, in the samples' order."""
    theirs = {record["example_id"]: record for record in baseline}
    return [(record, theirs[record["example_id"]]) for record in samples if record["example_id"] in theirs]


def _example_speedups(samples: list[dict], baseline: list[dict]) -> list[float]:
    """Each shared example's token rate over the baseline's on it (one seed's samples of a cell)."""
    rates = [(_rate(a["stats"]), _rate(b["stats"])) for a, b in _pairs(samples, baseline)]
    return [mine / theirs for mine, theirs in rates if mine is not None and theirs]


def _rate(stats: dict) -> float | None:
    share = share_time(stats)
    return stats["new_tokens"] / share if share > 0 else None


def _by_category(samples: list[dict]) -> dict[str, float]:
    categories: dict[str, list[dict]] = {}
    for record in samples:
        categories.setdefault(record.get("category") or "all", []).append(record["stats"])
    return {name: speed_summary(stats)["tokens_per_second"] for name, stats in sorted(categories.items())}
