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
from ..results.plotting import describe_run, save, verifier_colour
from .results import OPTIMUM, AcceptanceReport, AcceptanceRequest, AcceptanceRow, Estimate

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
    has_kl = any(report.kl(row) is not None for row in report.rows)
    if has_kl:
        result.add_column("KL(q‖out), mean", justify="right", overflow="fold")
    for row in report.rows:
        cells = [_format(report.cell(row, k)) for k in report.num_drafts]
        if has_kl:
            divergence = report.kl(row)
            cells.append(f"{divergence.mean:.4g}" if divergence else "")
        optimum = row.verifier == OPTIMUM
        result.add_row(row.label, *cells, style="bold" if optimum else None, end_section=optimum)
    reasons = sorted(set(report.unavailable.values()))
    if reasons:
        result.caption += "\n—: " + "; ".join(reasons)
    return result


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
    writer.writerow(["drafter", "coverage", "row", "num_drafts", "mean", "stderr", "positions", "kl_mean"])
    for report in reports:
        for row in report.rows:
            divergence = report.kl(row)
            for k in report.num_drafts:
                cell = report.cell(row, k)
                if cell is not None:
                    writer.writerow(
                        [
                            report.drafter or "",
                            report.coverage,
                            row.label,
                            k,
                            cell.mean,
                            cell.stderr,
                            cell.count,
                            divergence.mean if divergence else "",
                        ]
                    )
    write_atomically(folder / "acceptance.csv", buffer.getvalue())


def plot(path: Path, report: AcceptanceReport, content: dict | None = None) -> None:
    """Draw :func:`figure` to ``path`` (the suffix picks the format)."""
    save(figure(report, content), path)


def figure(report: AcceptanceReport, content: dict | None = None):
    """Acceptance against K for every row (± standard error); beside it, acceptance against KL for rows
    with a KL bound; above, what was run (from ``content``, acceptance.json's: recipe and environment).
    Each verifier keeps its colour in every plot (:func:`~specdec_cli.results.plotting.verifier_colour`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounded = [row for row in report.rows if row.kl_bound is not None and report.kl(row) and report.cell(row, 1)]
    drawn, axes = plt.subplots(1, 2 if bounded else 1, figsize=(12 if bounded else 6.5, 5.4), squeeze=False)
    if content is not None:
        count = len(report.prompts)
        what = f"{count} prompt{'s' if count != 1 else ''}, {report.positions} positions"
        what += "" if report.drafter is None else f", drafter {report.drafter}"
        what += "" if report.coverage is None else f" (coverage {report.coverage:.1%})"
        drawn.suptitle(describe_run(content["recipe"], what, [content["environment"]]), fontsize=9)
    _plot_by_k(axes[0][0], report)
    if bounded:
        _plot_kl_tradeoff(axes[0][1], report, bounded)
    drawn.tight_layout()
    return drawn


def _plot_by_k(axis, report: AcceptanceReport) -> None:
    """One series per row, each nudged sideways a little so rows that agree (as every lossless
    single-draft rule does at K = 1) stay visible side by side instead of hiding one another."""
    series = [
        (row, [(k, c) for k in report.num_drafts if (c := report.cell(row, k)) is not None])
        for row in report.rows
        if row.kl_bound is None
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


def _plot_kl_tradeoff(axis, report: AcceptanceReport, bounded: list[AcceptanceRow]) -> None:
    """Acceptance at K = 1 against KL(q ‖ output) for each bounded verifier, with the lossless optimum at KL 0.
    Bounds are labelled in the legend-like text beside each point, alternating above and below."""
    for verifier in dict.fromkeys(row.verifier for row in bounded):
        rows = [row for row in bounded if row.verifier == verifier]
        divergences = [report.kl(row).mean for row in rows]
        cells = [report.cell(row, 1) for row in rows]
        errors = [0.0 if math.isnan(c.stderr) else c.stderr for c in cells]
        colour = verifier_colour(verifier)
        axis.errorbar(
            divergences, [c.mean for c in cells], yerr=errors, marker="o", capsize=2, color=colour, label=verifier
        )
        for number, (row, x, cell) in enumerate(zip(rows, divergences, cells)):
            axis.annotate(
                f"D={row.kl_bound:g}",
                (x, cell.mean),
                fontsize=7,
                color=colour,
                textcoords="offset points",
                xytext=(5, -12 if number % 2 else 6),
                annotation_clip=True,
            )
    if (optimum := report.cell(OPTIMUM, 1)) is not None:
        axis.scatter([0.0], [optimum.mean], color=verifier_colour(OPTIMUM), zorder=3, label="lossless optimum (KL 0)")
    axis.margins(x=0.15, y=0.1)  # room for the labels inside the axes
    axis.locator_params(axis="x", nbins=5)  # small KL values have long tick labels
    axis.set(xlabel="KL(q ‖ output), nats", ylabel="acceptance probability at K=1 (± s.e.)", title="lossy verifiers")
    axis.legend(fontsize=8, loc="lower right")
