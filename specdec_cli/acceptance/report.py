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
from ..results.plotting import describe_run, save, separate_labels, verifier_colour
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
            f"{coverage}mean ± standard error over {report.positions} positions of "
            f"{_count(len(report.prompts), 'prompt')}; "
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
    columns = [[report.cell(row, k) for row in report.rows] for k in report.num_drafts]
    columns += [[report.spent(row, measure) for row in report.rows] for measure in measures]
    texts = [_column_texts(column, with_error=number < len(report.num_drafts)) for number, column in enumerate(columns)]
    for number, row in enumerate(report.rows):
        optimum = row.verifier == OPTIMUM
        cells = [column[number] for column in texts]
        result.add_row(row.label, *cells, style="bold" if optimum else None, end_section=optimum)
    if len(measures) > 1:
        result.caption += (
            "\nlossy rows at K=1: π is the row's output law; best at that KL / TV: the most any rule accepts "
            "within the KL (or TV) the row spends at each position, averaged"
        )
    if report.exact_first:
        result.caption += "\n" + report.exact_note()
    reasons = unavailable_reasons(report)
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

ROUNDING = 1e-9
"""A value this close to 0 is 0: the float64 sums over a vocabulary leave a few 1e-17 where a row's output law is
the target's own (a KL of -2.4e-18), and no measure here means anything at 1e-9."""
SHOWN_DECIMALS = 3
"""Decimals of a column, unless its smallest value that is not 0 needs more to keep two significant figures."""
MOST_DECIMALS = 9
"""Decimals no column goes past (:data:`ROUNDING` is 0 anyway)."""


def _column_texts(column: list[Estimate | None], with_error: bool) -> list[str]:
    """A column's cells in one format: each mean and standard error with the decimals its means need
    (:func:`_decimals`), 0 as "0", an infinite value as "∞"; with ``with_error`` the standard error after the mean;
    "—" (acceptance: no value) or "" (a spent measure: the row spends none) where there is none."""
    decimals = _decimals([cell.mean for cell in column if cell is not None])
    empty = "—" if with_error else ""
    texts = []
    for cell in column:
        if cell is None:
            texts.append(empty)
        elif with_error and not math.isnan(cell.stderr):
            texts.append(f"{_number(cell.mean, decimals)} ± {_number(cell.stderr, decimals)}")
        else:
            texts.append(_number(cell.mean, decimals))
    return texts


def _decimals(values: list[float]) -> int:
    """:data:`SHOWN_DECIMALS`, or as many as the smallest finite value that is not 0 needs for two significant
    figures (at most :data:`MOST_DECIMALS`)."""
    small = [abs(value) for value in values if math.isfinite(value) and abs(value) >= ROUNDING]
    if not small:
        return SHOWN_DECIMALS
    needed = 1 - math.floor(math.log10(min(small)))
    return min(max(SHOWN_DECIMALS, needed), MOST_DECIMALS)


def _number(value: float, decimals: int) -> str:
    """``value`` with ``decimals`` decimals; "0" within :data:`ROUNDING` of 0 (never "-0.000"), "<0.001" for one
    that is not 0 but rounds to it (a standard error below the column's resolution), "∞" for an infinite one."""
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if abs(value) < ROUNDING:
        return "0"
    if round(abs(value), decimals) == 0:
        return f"<{10**-decimals:.{decimals}f}"
    return f"{value:.{decimals}f}"


def unavailable_reasons(report: AcceptanceReport) -> list[str]:
    """Why cells show "—", each reason once: the registry's reason for a verifier ("verifier 'cactus' takes at most 1
    draft(s) per position") once for every verifier it applies to, naming them."""
    verifiers = {row.label: row.verifier for row in report.rows}
    named: dict[str, list[str]] = {}
    for (label, _), reason in sorted(report.unavailable.items()):
        verifier = verifiers.get(label)
        subject = f"verifier '{verifier}' "
        if verifier is not None and reason.startswith(subject):
            names = named.setdefault("the verifier " + reason.removeprefix(subject), [])
            if verifier not in names:  # a row per KL bound or swept value: the verifier once
                names.append(verifier)
        else:
            named.setdefault(reason, [])
    return [reason + (f" ({', '.join(names)})" if names else "") for reason, names in named.items()]


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
    """The lossless rows' acceptance against K (at one K, row by row), ± standard error; beside it, for the lossy
    rows, acceptance at K = 1 against the KL(q ‖ π) each spends, and against the TV(q, π) where they have one (the
    frontier: the rule optimal under that divergence drawn on top); no panel without something to draw. Above, what
    was run (from ``content``, acceptance.json's: recipe and environment). Each verifier keeps its colour in every
    plot (:func:`~specdec_cli.results.plotting.verifier_colour`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lossy = [row for row in report.rows if report.kl(row) is not None and report.cell(row, 1) is not None]
    measures = [measure for measure in ("kl", "tv") if any(report.spent(row, measure) for row in lossy)]
    drawn, axes = plt.subplots(1, 1 + len(measures), figsize=(6.5 * (1 + len(measures)), 5.4), squeeze=False)
    if content is not None:
        what = f"{_count(len(report.prompts), 'prompt')}, {report.positions} positions"
        what += "" if report.drafter is None else f", drafter {report.drafter}"
        what += "" if report.coverage is None else f" (coverage {report.coverage:.1%})"
        drawn.suptitle(describe_run(content["recipe"], what, [content["environment"]]), fontsize=9)
    _plot_lossless(axes[0][0], report)
    for axis, measure in zip(axes[0][1:], measures):
        _plot_frontier(axis, report, lossy, measure)
    drawn.tight_layout()
    for axis in axes[0][1:]:
        separate_labels(axis)  # after the layout, which moves the points under them
    return drawn


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _plot_lossless(axis, report: AcceptanceReport) -> None:
    """One series per lossless row (the lossy ones have the frontier panels): against K, each nudged sideways a
    little so rows that agree (as every lossless single-draft rule does at K = 1) stay visible side by side; with a
    single K, a point per row, named under it (a K axis with one value would say nothing)."""
    series = [
        (row, [(k, c) for k in report.num_drafts if (c := report.cell(row, k)) is not None])
        for row in report.rows
        if row.kl_bound is None and not row.params and report.kl(row) is None
    ]
    series = [(row, points) for row, points in series if points]
    by_k = len(report.num_drafts) > 1
    for number, (row, points) in enumerate(series):
        shift = 0.3 * (number / max(len(series) - 1, 1) - 0.5) if by_k and len(series) > 1 else 0.0
        axis.errorbar(
            [report.num_drafts.index(k) + shift for k, _ in points] if by_k else [number],
            [c.mean for _, c in points],
            yerr=[0.0 if math.isnan(c.stderr) else c.stderr for _, c in points],
            marker="o",
            markersize=5,
            capsize=2,
            label=row.label,
            color=verifier_colour(row.verifier),
            linestyle="--" if row.verifier == OPTIMUM else "-",
        )
    ylabel = "acceptance probability (± s.e.)"
    if by_k:
        axis.set_xticks(range(len(report.num_drafts)), [str(k) for k in report.num_drafts])
        axis.set(xlabel="number of drafts K", ylabel=ylabel, title="lossless rules: acceptance against K")
        axis.legend(fontsize=8, loc="lower right")
    else:
        axis.set_xticks(range(len(series)), [row.label for row, _ in series], rotation=30, ha="right", fontsize=8)
        axis.set_xlim(-0.6, len(series) - 0.4)
        axis.set(ylabel=ylabel, title=f"lossless rules: acceptance at K={report.num_drafts[0]}")


_DIVERGENCE_NAMES = {"kl": "KL(q ‖ π)", "tv": "TV(q, π)"}


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
        for x, cell, row in finite:
            axis.annotate(
                _swept_text(row),
                (x, cell.mean),
                fontsize=6,
                color=verifier_colour(verifier),
                textcoords="offset points",
                xytext=(4, 4),
                annotation_clip=True,
                zorder=6,  # over the thick frontier line, on a pale ground that keeps it legible there
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.7},
            )
    if (optimum := report.cell(OPTIMUM, 1)) is not None:
        axis.scatter([0.0], [optimum.mean], color=verifier_colour(OPTIMUM), zorder=5, label="lossless optimum")
    axis.margins(x=0.15, y=0.1)  # room for the labels inside the axes
    axis.locator_params(axis="x", nbins=5)  # small divergences have long tick labels
    name = _DIVERGENCE_NAMES[measure]
    unit = ", nats" if measure == "kl" else ""
    axis.set(
        xlabel=f"spent {name}{unit}, mean over positions",
        ylabel="acceptance at K=1 (± s.e.)",
        title=f"lossy rules: acceptance against {name}",
    )
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
