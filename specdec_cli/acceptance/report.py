"""An acceptance report as a table, as files (acceptance.json, acceptance.csv) and as a plot."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from ..base.inputs import write_atomically
from ..base.recipe import Recipe
from ..plugins.sweeps import shown_value
from ..results.plotting import describe_run, save, verifier_colour
from .results import OPTIMUM, SPENT_MEASURES, AcceptanceReport, AcceptanceRequest, AcceptanceRow, Estimate

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 3
"""acceptance.json: 2 moved versions and device into ``environment`` (the provenance record); 3 added each
section's ``drafter`` and ``coverage``, and with ``--drafter`` the ``sections`` list."""


def payload(
    recipe: Recipe, request: AcceptanceRequest, reports: list[AcceptanceReport], device: "torch.device"
) -> dict:
    """acceptance.json's content (also what ``--json`` prints): the one section of a run without ``--drafter`` at
    the top level, as before drafters; with ``--drafter``, ``drafters`` and a ``sections`` list, one per drafter."""
    from ..results.provenance import provenance  # torch: this runs after the models did

    named = [report.drafter for report in reports if report.drafter is not None]
    if named:
        results = {
            "drafters": named,
            "sections": [report.to_dict() for report in reports],
            "interrupted": reports[0].interrupted,
        }
    else:
        results = reports[0].to_dict()
    return {
        "format": FORMAT_VERSION,
        "environment": provenance(device),
        "seed": recipe.seed,
        "recipe": recipe.to_dict(),
        "request": {
            "verifiers": list(request.verifiers),
            "num_drafts": list(request.num_drafts),
            "kl": list(request.kl_values or ()),
            "sweeps": [
                {"verifier": s.verifier, "parameter": s.parameter, "values": list(s.values)} for s in request.sweeps
            ],
            **({"exact_first": request.exact_first} if request.exact_first else {}),
        },
        **results,
    }


def table(report: AcceptanceReport) -> Table:
    title = "token-level acceptance probability" + ("" if report.drafter is None else f" · drafter {report.drafter}")
    coverage = (
        ""
        if report.coverage is None
        else (
            f"coverage {report.coverage:.1%}: positions where at least one draft row proposed (elsewhere none is "
            "accepted)\n"
        )
    )
    result = Table(
        title=title,
        min_width=len(title) + 4,  # a narrow table would fold its own title
        caption=(
            f"{coverage}mean ± standard error over {report.positions} positions of {len(report.prompts)} prompts; "
            "optimum: best of any lossless rule (Hu et al. 2025; Khisti et al. Thm 3), exact: full vocabulary "
            "for identical drafts, K=2 different drafts sharing at most 128 tokens"
        ),
    )
    result.add_column("verifier", overflow="fold")
    for k in report.num_drafts:
        result.add_column(f"K={k}", justify="right", overflow="fold")
    measures = [measure for measure in SPENT_MEASURES if any(report.spent(row, measure) for row in report.rows)]
    for measure in measures:
        result.add_column(SPENT_HEADERS[measure], justify="right", overflow="fold")
    for row in report.rows:
        cells = [_format(report.cell(row, k)) for k in report.num_drafts]
        cells += [f"{value.mean:.4g}" if (value := report.spent(row, measure)) else "" for measure in measures]
        optimum = row.verifier == OPTIMUM
        result.add_row(row.label, *cells, style="bold" if optimum else None, end_section=optimum)
    if len(measures) > 1:
        result.caption += (
            "\nlossy rows at K=1: π is the row's output law; best at that KL / TV: the most any rule accepts "
            "within the KL (or TV) the row spends at each position, averaged"
        )
    if report.exact_first:
        result.caption += "\n" + report.exact_note()
    reasons = sorted(set(report.unavailable.values()))
    if reasons:
        result.caption += "\n—: " + "; ".join(reasons)
    return result


SPENT_HEADERS = {
    "kl": "KL(q‖π), mean",
    "tv": "TV(q,π), mean",
    "optimum_at_kl": "best at that KL",
    "optimum_at_tv": "best at that TV",
}
"""The table's column for each of :data:`~.results.SPENT_MEASURES`."""


def _format(cell: Estimate | None) -> str:
    if cell is None:
        return "—"
    if math.isnan(cell.stderr):
        return f"{cell.mean:.3f}"
    return f"{cell.mean:.3f} ± {cell.stderr:.3f}"


def write(folder: Path, content: dict, reports: list[AcceptanceReport]) -> None:
    """acceptance.json and acceptance.csv (a line per drafter section, row and K) in ``folder``, each replaced
    whole (a failed write leaves the previous file): an OSError is the caller's to report."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / "acceptance.json", json.dumps(content, indent=2) + "\n")
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    spent_columns = [f"{measure}_mean" for measure in SPENT_MEASURES]
    writer.writerow(["drafter", "coverage", "row", "num_drafts", "mean", "stderr", "positions", *spent_columns])
    for report in reports:
        for row in report.rows:
            spent = [value.mean if (value := report.spent(row, measure)) else "" for measure in SPENT_MEASURES]
            for k in report.num_drafts:
                cell = report.cell(row, k)
                if cell is not None:
                    identity = [report.drafter or "", report.coverage, row.label, k]
                    writer.writerow([*identity, cell.mean, cell.stderr, cell.count, *spent])
    write_atomically(folder / "acceptance.csv", buffer.getvalue())


def plot(path: Path, report: AcceptanceReport, content: dict | None = None) -> None:
    """Draw :func:`figure` to ``path`` (the suffix picks the format)."""
    save(figure(report, content), path)


def figure(report: AcceptanceReport, content: dict | None = None):
    """Acceptance against K for every row (± standard error); beside it, for the lossy rows, acceptance at K = 1
    against the KL(q ‖ π) and the TV(q, π) each spends (the frontier: the KL-optimal rule's rows drawn on top);
    above, what was run (from ``content``, acceptance.json's: recipe and environment).
    Each verifier keeps its colour in every plot (:func:`~specdec_cli.results.plotting.verifier_colour`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lossy = [row for row in report.rows if report.kl(row) is not None and report.cell(row, 1) is not None]
    panels = 1 + (2 if lossy else 0)
    drawn, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5.4), squeeze=False)
    if content is not None:
        count = len(report.prompts)
        what = f"{count} prompt{'s' if count != 1 else ''}, {report.positions} positions"
        what += "" if report.drafter is None else f", drafter {report.drafter}"
        what += "" if report.coverage is None else f" (coverage {report.coverage:.1%})"
        drawn.suptitle(describe_run(content["recipe"], what, [content["environment"]]), fontsize=9)
    _plot_by_k(axes[0][0], report)
    if lossy:
        _plot_frontier(axes[0][1], report, lossy, "kl")
        if any(report.spent(row, "tv") for row in lossy):
            _plot_frontier(axes[0][2], report, lossy, "tv")
        else:
            axes[0][2].set_axis_off()
    drawn.tight_layout()
    return drawn


def _plot_by_k(axis, report: AcceptanceReport) -> None:
    """One series per row, each nudged sideways a little so rows that agree (as every lossless
    single-draft rule does at K = 1) stay visible side by side instead of hiding one another."""
    series = [
        (row, [(k, c) for k in report.num_drafts if (c := report.cell(row, k)) is not None])
        for row in report.rows
        if row.kl_bound is None and not row.params and report.kl(row) is None  # lossy rows: the frontier panels
    ]
    series = [(row, points) for row, points in series if points]
    width = 0.3 if len(report.num_drafts) > 1 else 0.6
    for number, (row, points) in enumerate(series):
        shift = width * (number / max(len(series) - 1, 1) - 0.5) if len(series) > 1 else 0.0
        xs = [report.num_drafts.index(k) + shift for k, _ in points]
        means = [c.mean for _, c in points]
        errors = [0.0 if math.isnan(c.stderr) else c.stderr for _, c in points]
        axis.errorbar(
            xs,
            means,
            yerr=errors,
            marker="o",
            markersize=5,
            capsize=2,
            label=row.label,
            color=verifier_colour(row.verifier),
            linestyle="--" if row.verifier == OPTIMUM else "-",
        )
    axis.set_xticks(range(len(report.num_drafts)), [str(k) for k in report.num_drafts])
    axis.set(xlabel="number of drafts K", ylabel="acceptance probability (± s.e.)", title="acceptance vs K")
    axis.legend(fontsize=8, loc="lower right")


def _plot_frontier(axis, report: AcceptanceReport, lossy: list[AcceptanceRow], measure: str) -> None:
    """Acceptance at K = 1 against the mean spent ``measure`` ("kl" or "tv") of the lossy rows: a line per series
    (a verifier with its fixed settings, such as mentored's divergence) through its rows in order of spending, each
    point marked by the value swept along it; the rule optimal under ``measure`` (``report.optimal``) drawn thick
    and on top, the lossless optimum at 0. Rows that spend an infinite KL (an output law that rules out a token q
    allows) are counted in the legend of the KL panel instead."""
    for (verifier, fixed), rows in _series(lossy).items():
        points = sorted(
            ((value.mean, report.cell(row, 1), row) for row in rows if (value := report.spent(row, measure))),
            key=lambda point: point[0],
        )
        finite = [(x, cell, row) for x, cell, row in points if math.isfinite(x)]
        frontier = all(row.label in report.optimal.get(measure, ()) for row in rows)
        label = " ".join([verifier, *fixed]) + (f" ({measure.upper()}-optimal)" if frontier else "")
        label += f" ({len(points) - len(finite)} with KL ∞)" if len(finite) < len(points) else ""
        axis.errorbar(
            [x for x, _, _ in finite],
            [cell.mean for _, cell, _ in finite],
            yerr=[0.0 if math.isnan(cell.stderr) else cell.stderr for _, cell, _ in finite],
            marker="s" if fixed else "o",
            capsize=2,
            color=verifier_colour(verifier),
            linewidth=3 if frontier else 1.2,
            linestyle="-" if frontier or not fixed else "--",
            zorder=4 if frontier else 2,
            label=label,
        )
        for number, (x, cell, row) in enumerate(finite):
            axis.annotate(
                _swept_text(row),
                (x, cell.mean),
                fontsize=6,
                color=verifier_colour(verifier),
                textcoords="offset points",
                xytext=(4, -9 if number % 2 else 4),
                annotation_clip=True,
            )
    if (optimum := report.cell(OPTIMUM, 1)) is not None:
        axis.scatter([0.0], [optimum.mean], color=verifier_colour(OPTIMUM), zorder=5, label="lossless optimum")
    axis.margins(x=0.15, y=0.1)  # room for the labels inside the axes
    axis.locator_params(axis="x", nbins=5)  # small divergences have long tick labels
    name = {"kl": "KL(q ‖ π), nats", "tv": "TV(q, π)"}[measure]
    axis.set(xlabel=f"spent {name}, mean over positions", ylabel="acceptance at K=1 (± s.e.)", title="lossy rules")
    axis.legend(fontsize=7, loc="lower right")


def _series(rows: list[AcceptanceRow]) -> dict[tuple[str, tuple[str, ...]], list[AcceptanceRow]]:
    """The rows grouped by verifier and by the settings that are not numbers (``divergence=tv``): what a line joins."""
    groups: dict[tuple[str, tuple[str, ...]], list[AcceptanceRow]] = {}
    for row in rows:
        fixed = tuple(f"{name}={shown_value(value)}" for name, value in row.params if not _numeric(value))
        groups.setdefault((row.verifier, fixed), []).append(row)
    return groups


def _numeric(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _swept_text(row: AcceptanceRow) -> str:
    """The numbers that tell a series' points apart: its KL bound and its numeric swept values."""
    parts = [] if row.kl_bound is None else [f"D={row.kl_bound:g}"]
    return " ".join(parts + [f"{name}={shown_value(value)}" for name, value in row.params if _numeric(value)])
