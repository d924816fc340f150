"""An acceptance report as a table, as files (acceptance.json, acceptance.csv) and as a plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from ..recipe import Recipe
from .results import OPTIMUM, AcceptanceReport, AcceptanceRequest, AcceptanceRow, Estimate

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 2
"""acceptance.json: 2 moved versions and device into ``environment`` (the provenance record)."""


def payload(recipe: Recipe, request: AcceptanceRequest, report: AcceptanceReport, device: "torch.device") -> dict:
    """acceptance.json's content (also what ``--json`` prints)."""
    from ..provenance import provenance  # torch: this runs after the models did

    return {
        "format": FORMAT_VERSION,
        "environment": provenance(device),
        "seed": recipe.seed,
        "recipe": recipe.to_dict(),
        "request": {"verifiers": list(request.verifiers), "num_drafts": list(request.num_drafts),
                    "kl": list(request.kl_values or ())},  # fmt: skip
        **report.to_dict(),
    }


def table(report: AcceptanceReport) -> Table:
    title = "token-level acceptance probability"
    result = Table(
        title=title,
        min_width=len(title) + 4,  # a narrow table would fold its own title
        caption=(
            f"mean ± standard error over {report.positions} positions of {len(report.prompts)} prompts; "
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


def write(folder: Path, content: dict, report: AcceptanceReport) -> None:
    """acceptance.json and acceptance.csv in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "acceptance.json").write_text(json.dumps(content, indent=2) + "\n")
    with open(folder / "acceptance.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["row", "num_drafts", "mean", "stderr", "positions", "kl_mean"])
        for row in report.rows:
            divergence = report.kl(row)
            for k in report.num_drafts:
                cell = report.cell(row, k)
                if cell is not None:
                    writer.writerow([row.label, k, cell.mean, cell.stderr, cell.count,
                                     divergence.mean if divergence else ""])  # fmt: skip


def plot(path: Path, report: AcceptanceReport) -> None:
    """Acceptance against K for every row; beside it, acceptance against KL for rows with a KL bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounded = [row for row in report.rows if row.kl_bound is not None and report.kl(row) and report.cell(row, 1)]
    figure, axes = plt.subplots(1, 2 if bounded else 1, figsize=(11 if bounded else 6, 4.5), squeeze=False)
    by_k = axes[0][0]
    for row in report.rows:
        points = [(k, c.mean) for k in report.num_drafts if (c := report.cell(row, k)) is not None]
        if len(points) > 1 or (points and row.kl_bound is None):
            by_k.plot(*zip(*points), marker="o", label=row.label, linestyle="--" if row.verifier == OPTIMUM else "-")
    by_k.set(xlabel="number of drafts K", ylabel="acceptance probability", title="acceptance vs K",
             xticks=report.num_drafts)  # fmt: skip
    by_k.legend(fontsize=8)
    if bounded:
        _plot_kl_tradeoff(axes[0][1], report, bounded)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plot_kl_tradeoff(axis, report: AcceptanceReport, bounded: list[AcceptanceRow]) -> None:
    """Acceptance at K = 1 against KL(q ‖ output) for each bounded verifier, with the lossless optimum at KL 0."""
    for verifier in dict.fromkeys(row.verifier for row in bounded):
        rows = [row for row in bounded if row.verifier == verifier]
        divergences = [report.kl(row).mean for row in rows]
        accepted = [report.cell(row, 1).mean for row in rows]
        axis.plot(divergences, accepted, marker="o", label=verifier)
        for row, x, y in zip(rows, divergences, accepted):
            axis.annotate(f"D={row.kl_bound:g}", (x, y), fontsize=8, textcoords="offset points", xytext=(4, -10))
    if (optimum := report.cell(OPTIMUM, 1)) is not None:
        axis.scatter([0.0], [optimum.mean], color="black", zorder=3, label="lossless optimum (KL 0)")
    axis.set(xlabel="KL(q ‖ output), nats", ylabel="acceptance probability (K=1)", title="lossy verifiers")
    axis.legend(fontsize=8)
