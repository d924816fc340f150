"""Tables (terminal, Markdown, CSV) and the plot of a benchmark's results."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from rich.table import Table

from ..plotting import verifier_colour
from .grid import BASELINE
from .results import BenchResults, CellResult, MeanStd

QUALITY = {"bleu": "BLEU", "chrf": "chrF", "rougeL": "ROUGE-L"}
SPEED = [
    ("block_efficiency", "block eff.", "{:.2f}"),
    ("acceptance_rate", "accept", "{:.3f}"),
    ("tokens_per_second", "tok/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}"),
    ("expected_speedup", "expected", "{:.2f}"),
    ("efficiency_vs_expected", "meas/exp", "{:.2f}"),
    ("engine_overhead", "overhead", "{:.3f}"),
]


def _columns(results: BenchResults) -> list[tuple[str, str, str]]:
    quality = [(name, label, "{:.2f}") for name, label in QUALITY.items()
               if any(name in c.summary for c in results.cells)]  # fmt: skip
    return SPEED + quality


def _cell_text(summary: dict[str, MeanStd], name: str, fmt: str) -> str:
    value = summary.get(name)
    if not value or value.mean is None:
        return "—"
    text = fmt.format(value.mean)
    return f"{text} ± {fmt.format(value.std)}" if value.n > 1 else text


def rows(results: BenchResults) -> tuple[list[str], list[list[str]]]:
    columns = _columns(results)
    header = ["configuration", "samples"] + [label for _, label, _ in columns]
    body = []
    for cell in results.cells:
        body.append([cell.key, str(cell.samples)] + [_cell_text(cell.summary, n, f) for n, _, f in columns])
    return header, body


def rich_table(results: BenchResults, title: str) -> Table:
    header, body = rows(results)
    seeds = max((len(c.per_seed) for c in results.cells), default=0)
    table = Table(title=title, caption=f"mean{' ± std over ' + str(seeds) + ' seeds' if seeds > 1 else ''}; "
                  "speedup: token rate over the target-alone baseline of the same run, prompts and seed")  # fmt: skip
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", overflow="fold")
    for line in body:
        table.add_row(*line, style="dim" if line[0].startswith("baseline") else None)
    return table


def category_rows(results: BenchResults) -> tuple[list[str], list[list[str]]] | None:
    """Per-category token rate and speedup (mean over seeds): a row per category, a column per configuration.
    None when the task has no categories."""
    per_cell = [[m for m in cell.per_seed.values()] for cell in results.cells]
    categories = sorted({name for seeds in per_cell for m in seeds for name in m.get("tokens_per_second_by_category", {})})
    if not categories:
        return None
    body = []
    for name in categories:
        line = [name]
        for seeds in per_cell:
            rates = [m["tokens_per_second_by_category"][name] for m in seeds if name in m.get("tokens_per_second_by_category", {})]
            speedups = [m["speedup_by_category"][name] for m in seeds if name in m.get("speedup_by_category", {})]
            text = f"{sum(rates) / len(rates):.1f}" if rates else "—"
            line.append(text + (f" ({sum(speedups) / len(speedups):.2f}×)" if speedups else ""))
        body.append(line)
    return ["category"] + [cell.key for cell in results.cells], body


def category_table(results: BenchResults) -> Table | None:
    rows = category_rows(results)
    if rows is None:
        return None
    header, body = rows
    table = Table(title="tokens/s per category (speedup over the baseline)")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right", overflow="fold")
    for line in body:
        table.add_row(*line)
    return table


def markdown(results: BenchResults) -> str:
    header, body = rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    signatures = {(QUALITY[m], metrics[f"{m}_signature"]) for c in results.cells for metrics in c.per_seed.values()
                  for m in ("bleu", "chrf") if f"{m}_signature" in metrics}  # fmt: skip
    notes = [f"\n{label} signature (sacrebleu): `{signature}`" for label, signature in sorted(signatures)]
    if (categories := category_rows(results)) is not None:
        header, body = categories
        lines += ["", "Tokens/s per category (speedup over the baseline):", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)] + ["| " + " | ".join(line) + " |" for line in body]  # fmt: skip
    return "\n".join(lines + notes) + "\n"


def csv_text(results: BenchResults) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    names = [name for name, _, _ in _columns(results)]
    writer.writerow(["configuration", "verifier", "kl", "num_drafts", "draft_length", "temperature",
                     "draft_temperatures"] + [f"{n}_{s}" for n in names for s in ("mean", "std")])  # fmt: skip
    for result in results.cells:
        values = []
        for name in names:
            value = result.summary.get(name)
            values += [value.mean, value.std] if value else [None, None]
        cell = result.cell
        temps = ",".join(map(str, cell.draft_temperatures)) if cell.draft_temperatures else ""
        writer.writerow([cell.key, cell.verifier, cell.kl, cell.num_drafts, cell.draft_length,
                         cell.temperature, temps] + values)  # fmt: skip
    return buffer.getvalue()


def plot(results: BenchResults, path: Path) -> None:
    """Speedup of every configuration over the target alone (± std over seeds), the baseline at 1 and a
    line there, so a slower configuration reads as slower; beside it, speedup against quality when the
    task has a quality metric. Each verifier keeps its colour (:func:`~specdec_cli.plotting.verifier_colour`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = "speedup" if any("speedup" in c.summary for c in results.cells) else "tokens_per_second"
    quality = next((n for n in QUALITY if any(n in c.summary for c in results.cells)), None)
    cells = [c for c in results.cells if speed in c.summary or c.cell.verifier == BASELINE]
    figure, axes = plt.subplots(1, 2 if quality else 1, figsize=(13 if quality else 7, 0.45 * len(cells) + 2),
                                squeeze=False)  # fmt: skip
    _plot_speed(axes[0][0], cells, speed)
    if quality:
        _plot_speed_against_quality(axes[0][1], cells, speed, quality)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _value(cell: CellResult, name: str) -> tuple[float, float]:
    """(mean, std) of a summarized metric; the baseline's speedup is 1 by definition."""
    if name == "speedup" and cell.cell.verifier == BASELINE:
        return 1.0, 0.0
    value = cell.summary[name]
    return value.mean, value.std if value.n > 1 else 0.0


def _plot_speed(axis, cells: list[CellResult], speed: str) -> None:
    """A bar per configuration, top to bottom as in the table, with the speedup = 1 line."""
    positions = list(range(len(cells)))[::-1]
    values = [_value(cell, speed) for cell in cells]
    axis.barh(positions, [m for m, _ in values], xerr=[s for _, s in values], capsize=3,
              color=[verifier_colour(cell.cell.verifier) for cell in cells])  # fmt: skip
    axis.set_yticks(positions, [cell.key for cell in cells], fontsize=8)
    if speed == "speedup":
        axis.axvline(1.0, color="black", linewidth=1, linestyle="--")
        axis.set_xlim(0, max(1.15, max(m + s for m, s in values) * 1.1))
    axis.set(xlabel=speed.replace("_", " ") + (" over the target alone (± std over seeds)" if speed == "speedup" else ""),
             title="speed per configuration")  # fmt: skip


_MARKERS = "o^Dv<>Ph*X"
"""Configurations of one verifier share its colour and differ by marker."""


def _plot_speed_against_quality(axis, cells: list[CellResult], speed: str, quality: str) -> None:
    seen: dict[str, int] = {}
    for cell in cells:
        if quality not in cell.summary:
            continue
        verifier = cell.cell.verifier
        seen[verifier] = seen.get(verifier, -1) + 1
        marker = "s" if verifier == BASELINE else _MARKERS[seen[verifier] % len(_MARKERS)]
        (y, y_error), (x, x_error) = _value(cell, speed), _value(cell, quality)
        axis.errorbar([x], [y], xerr=[x_error], yerr=[y_error], marker=marker, markersize=7, capsize=2,
                      color=verifier_colour(verifier), label=cell.key)  # fmt: skip
    if speed == "speedup":
        axis.axhline(1.0, color="black", linewidth=1, linestyle="--")
    axis.margins(0.15)
    axis.set(xlabel=QUALITY[quality], ylabel=speed.replace("_", " "), title="speed against quality")
    axis.legend(fontsize=7, loc="best")
