"""Tables (terminal, Markdown, CSV) and the plot of a benchmark's results."""

from __future__ import annotations

import csv
import io
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from ..results.plotting import describe_run, save, verifier_colour
from ..results.stats import INTERVAL_LEVEL, describe_speedup
from .grid import BASELINE
from .metrics import mean_and_std
from .results import SUMMARIZED, BenchResults, CellResult, ConditionsPart, MeanStd

QUALITY = {"bleu": "BLEU", "chrf": "chrF", "rougeL": "ROUGE-L"}
SPREAD = "speedup_spread"
"""The column of the per-example speedups' median [quartiles], next to the pooled speedup."""
SPEED = [
    ("block_efficiency", "block eff.", "{:.2f}"),
    ("acceptance_rate", "accept", "{:.3f}"),
    ("tokens_per_second", "tok/s (tokens)", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}"),
    (SPREAD, "per example", "{:.2f}"),
    ("expected_speedup", "expected", "{:.2f}"),
    ("efficiency_vs_expected", "meas/exp", "{:.2f}"),
    ("engine_overhead", "overhead", "{:.3f}"),
]
DRAFT_LENGTH = ("mean_draft_length", "mean L", "{:.2f}")
"""The column of the draft length used (draft positions per draft), shown where it differs from a cell's L."""
DRAFTED = ("mean_draft_length", "mean_acceptance_length")
"""Metrics of drafts, which the target alone has none of."""


def _columns(results: BenchResults) -> list[tuple[str, str, str]]:
    quality = [
        (name, label, "{:.2f}") for name, label in QUALITY.items() if any(name in c.summary for c in results.cells)
    ]
    return SPEED + ([DRAFT_LENGTH] if _draft_length_differs(results) else []) + quality


def _draft_length_differs(results: BenchResults) -> bool:
    """Some configuration drafted, per draft, another number of positions than its L (to the table's 2 decimals):
    an adaptive draft length, or blocks shortened near max_new_tokens."""
    fmt = DRAFT_LENGTH[2]
    used = [(cell, _metric(cell, DRAFT_LENGTH[0])) for cell in results.cells if cell.cell.verifier != BASELINE]
    return any(value and fmt.format(value.mean) != fmt.format(cell.cell.draft_length) for cell, value in used)


def _metric(cell: CellResult, name: str) -> MeanStd | None:
    """Mean ± std over seeds of a metric of the seeds: the results' summary has those of ``SUMMARIZED``; the
    others (the engines' counters) are taken from the seeds here. None where the cell lacks it."""
    if name in SUMMARIZED:
        return cell.summary.get(name)
    values = [metrics[name] for metrics in cell.per_seed.values() if name in metrics]
    if not values or (name in DRAFTED and cell.cell.verifier == BASELINE):
        return None
    return MeanStd(**mean_and_std(values))


def _cell_text(cell: CellResult, name: str, fmt: str) -> str:
    if name == SPREAD:
        spread = cell.speedup_spread
        if spread is None:
            return "—"
        quartiles = f" [{fmt.format(spread.q1)}–{fmt.format(spread.q3)}]" if spread.n > 1 else ""
        return fmt.format(spread.median) + quartiles
    value = _metric(cell, name)
    if value is None or value.mean is None:
        return "—"
    if name == "speedup" and (interval := _speedup_interval(cell)) is not None:
        return interval
    text = fmt.format(value.mean)
    text = f"{text} ± {fmt.format(value.std)}" if value.n > 1 else text
    tokens = _metric(cell, "new_tokens")
    return f"{text} ({tokens.mean:.0f})" if name == "tokens_per_second" and tokens else text


def _speedup_interval(cell: CellResult) -> str | None:
    """A one-seed cell's speedup with its interval over the examples, or saying that one example gives none;
    None over several seeds (their spread is the std) and in results written before intervals."""
    if len(cell.per_seed) != 1:
        return None
    metrics = next(iter(cell.per_seed.values()))
    if "speedup_samples" not in metrics:
        return None
    return describe_speedup(metrics["speedup"], _seed_interval(cell), metrics["speedup_samples"])


def _seed_interval(cell: CellResult) -> tuple[float, float] | None:
    """(low, high) of a one-seed cell's speedup over the examples; None over several seeds, for one example,
    for the baseline and in results written before intervals."""
    metrics = next(iter(cell.per_seed.values())) if len(cell.per_seed) == 1 else {}
    return (metrics["speedup_low"], metrics["speedup_high"]) if "speedup_low" in metrics else None


def _label(cell: CellResult) -> str:
    """The configuration, marked when it failed or pools samples of different conditions (see :func:`notes`)."""
    return cell.key + (" (failed)" if cell.failure else "") + (" *" if cell.mixed_conditions else "")


def rows(results: BenchResults) -> tuple[list[str], list[list[str]]]:
    columns = _columns(results)
    header = ["configuration", "samples"] + [label for _, label, _ in columns]
    body = []
    for cell in results.cells:
        body.append([_label(cell), str(cell.samples)] + [_cell_text(cell, n, f) for n, _, f in columns])
    return header, body


def caption(results: BenchResults) -> str:
    """What the figures are: mean (± std over seeds), tokens counted, speedup (with its interval over the examples
    for one seed), the per-example spread, and the mean draft length where it is shown."""
    seeds = max((len(c.per_seed) for c in results.cells), default=0)
    spread = f"mean ± std over {seeds} seeds" if seeds > 1 else "one seed (no spread over seeds)"
    interval = "" if seeds > 1 else f" [{INTERVAL_LEVEL:.0%} interval: bootstrap over the examples]"
    draft_length = "; mean L: draft positions proposed per draft" if _draft_length_differs(results) else ""
    return (
        f"{spread}; tok/s (the tokens it counts, per seed); speedup{interval}: token rate over the target-alone "
        "baseline of the same run, prompts and seed; per example: median [quartiles] of each example's own "
        f"speedup{draft_length}"
    )


def notes(results: BenchResults) -> list[str]:
    """Lines under the table: failed cells, and the conditions when samples of the run differ in them."""
    lines = [f"{cell.key}: failed {cell.failure}" for cell in results.cells if cell.failure]
    if results.mixed_conditions:
        lines.append(
            f"* mixed conditions: {describe_parts(results.conditions)}; the speeds of the configurations "
            "marked * pool samples run under different ones and do not compare"
        )
    return lines


def describe_parts(parts: Sequence[ConditionsPart]) -> str:
    """'threads 2 (30 samples); threads 1 (18 samples)': each part by the conditions that differ between parts."""
    known = [part for part in parts if part.conditions is not None]
    names = sorted({name for part in known for name in part.conditions})
    differing = [name for name in names if len({json.dumps(p.conditions.get(name)) for p in known}) > 1]
    return "; ".join(
        ", ".join(f"{name} {part.conditions.get(name)}" for name in differing) + f" ({part.samples} samples)"
        for part in known
    )


def reference_note(metrics: Sequence[str], references: Sequence[str | None], hint: str) -> str | None:
    """A note when the task's quality metrics need references that (some) examples lack: they would
    otherwise be dropped, or computed on fewer examples, without a word. ``hint``: how to give them."""
    scored = [QUALITY[name] for name in metrics if name in QUALITY]
    missing = sum(reference is None for reference in references)
    if not scored or not missing:
        return None
    names = " and ".join(scored) + (" are" if len(scored) > 1 else " is")
    if missing == len(references):
        return f"no references: {names} not computed; {hint}"
    others = len(references) - missing
    return f"{missing} of {len(references)} examples have no reference; {names} computed on the other {others}"


def rich_table(results: BenchResults, title: str) -> Table:
    header, body = rows(results)
    table = Table(title=title, caption=escape("\n".join([caption(results), *notes(results)])))
    for i, name in enumerate(header):  # the configuration kept whole: it is what a row is read by
        table.add_column(name, justify="left" if i == 0 else "right", overflow="fold", no_wrap=i == 0)
    for cell, line in zip(results.cells, body):
        table.add_row(*line, style="red" if cell.failure else "dim" if cell.cell.verifier == BASELINE else None)
    return table


def category_rows(results: BenchResults) -> tuple[list[str], list[list[str]]] | None:
    """Per-category token rate and speedup (mean over seeds): a row per category, a column per configuration.
    None when the task has no categories."""
    per_cell = [[m for m in cell.per_seed.values()] for cell in results.cells]
    categories = sorted(
        {name for seeds in per_cell for m in seeds for name in m.get("tokens_per_second_by_category", {})}
    )
    if not categories:
        return None
    body = []
    for name in categories:
        line = [name]
        for seeds in per_cell:
            rates = [
                m["tokens_per_second_by_category"][name]
                for m in seeds
                if name in m.get("tokens_per_second_by_category", {})
            ]
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
    signatures = {
        (QUALITY[m], metrics[f"{m}_signature"])
        for c in results.cells
        for metrics in c.per_seed.values()
        for m in ("bleu", "chrf")
        if f"{m}_signature" in metrics
    }
    lines += ["", caption(results) + "."] + [f"\n{line}" for line in notes(results)]
    signature_lines = [f"\n{label} signature (sacrebleu): `{signature}`" for label, signature in sorted(signatures)]
    if (categories := category_rows(results)) is not None:
        header, body = categories
        lines += [
            "",
            "Tokens/s per category (speedup over the baseline):",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ] + ["| " + " | ".join(line) + " |" for line in body]
    return "\n".join(lines + signature_lines) + "\n"


def csv_text(results: BenchResults) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    shown = [name for name, _, _ in _columns(results) if name not in (SPREAD, DRAFT_LENGTH[0])]
    names = shown + list(DRAFTED)
    spread_fields = ("median", "q1", "q3", "min", "max")
    writer.writerow(
        [
            "configuration",
            "verifier",
            "kl",
            "num_drafts",
            "draft_length",
            "temperature",
            "draft_temperatures",
            "drafter",
        ]
        + [f"{n}_{s}" for n in names for s in ("mean", "std")]
        + [f"speedup_per_example_{field}" for field in spread_fields]
        + ["mixed_conditions", "failed"]
    )
    for result in results.cells:
        values = []
        for name in names:
            value = _metric(result, name)
            values += [value.mean, value.std] if value else [None, None]
        spread = result.speedup_spread
        values += [getattr(spread, field) if spread else None for field in spread_fields]
        cell = result.cell
        temps = ",".join(map(str, cell.draft_temperatures)) if cell.draft_temperatures else ""
        writer.writerow(
            [
                cell.key,
                cell.verifier,
                cell.kl,
                cell.num_drafts,
                cell.draft_length,
                cell.temperature,
                temps,
                cell.drafter or "",
            ]
            + values
            + [result.mixed_conditions, result.failure or ""]
        )
    return buffer.getvalue()


def plot(results: BenchResults, path: Path, busy_cpu: str | None = None) -> None:
    """Draw :func:`figure` to ``path`` (the suffix picks the format)."""
    save(figure(results, busy_cpu), path)


BUSY_COLOUR = "#b22222"
NOTE_POINTS = 8


def figure(results: BenchResults, busy_cpu: str | None = None):
    """Speedup of every configuration over the target alone (± std over seeds when there are several),
    the baseline at 1 and a line there, so a slower configuration reads as slower; beside it, speedup
    against quality when the task has a quality metric; above, what was run; below, ``busy_cpu`` (the run's note
    that other jobs kept the CPU busy: its speeds are the moment's), so the picture never travels without it. Each
    verifier keeps its colour (:func:`~specdec_cli.results.plotting.verifier_colour`). A ValueError when nothing
    has samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = "speedup" if any("speedup" in c.summary for c in results.cells) else "tokens_per_second"
    quality = next((n for n in QUALITY if any(n in c.summary for c in results.cells)), None)
    cells = [c for c in results.cells if speed in c.summary or (speed == "speedup" and c.cell.verifier == BASELINE)]
    if not cells:
        raise ValueError("no configuration has samples to draw")
    seeds = max(len(c.per_seed) for c in cells)
    drawn, axes = plt.subplots(
        1, 2 if quality else 1, figsize=(13 if quality else 8, 0.45 * len(cells) + 3), squeeze=False
    )
    drawn.suptitle(_title(results), fontsize=9)
    _plot_speed(axes[0][0], cells, speed, seeds)
    if quality:
        _plot_speed_against_quality(axes[0][1], cells, speed, quality, seeds)
    if busy_cpu is None:
        drawn.tight_layout()
    else:
        characters = int(drawn.get_figwidth() * 72 / (0.6 * NOTE_POINTS))  # a character: about 0.6 of the size wide
        note = textwrap.fill(f"note: {busy_cpu}", int(0.9 * characters))
        drawn.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=NOTE_POINTS, color=BUSY_COLOUR)
        height = (note.count("\n") + 1) * NOTE_POINTS * 1.3 / 72 + 0.1  # inches: its lines and a margin
        drawn.tight_layout(rect=(0, height / drawn.get_figheight(), 1, 1))
    return drawn


def _title(results: BenchResults) -> str:
    """What was run: task, examples and seeds, the token limit, the models, and each part's device and threads."""
    config = results.config
    task = config["task"]["name"] + (
        f" {config['task'].get('lang_pair', '')}" if config["task"]["name"] == "wmt" else ""
    )
    seeds = len(config.get("seeds", [])) or 1
    what = f"{task}: {config['data']['examples']} examples × {seeds} seed{'s' if seeds > 1 else ''}"
    known = [part.conditions for part in results.conditions if part.conditions is not None]
    return describe_run(config["recipe"], what, known)


def _spread_label(seeds: int, intervals: bool = False) -> str:
    """What the error bars are: ± std over seeds, or (``intervals``) one seed's speedup intervals."""
    if seeds > 1:
        return f"± std over {seeds} seeds"
    return f"one seed: {INTERVAL_LEVEL:.0%} interval over the examples" if intervals else "one seed: no spread"


def _value(cell: CellResult, name: str) -> tuple[float, float]:
    """(mean, std over seeds) of a summarized metric; the baseline's speedup is 1 by definition."""
    if name == "speedup" and cell.cell.verifier == BASELINE:
        return 1.0, 0.0
    value = cell.summary[name]
    return value.mean, value.std if value.n > 1 else 0.0


def _plot_speed(axis, cells: list[CellResult], speed: str, seeds: int) -> None:
    """A bar per configuration, top to bottom as in the table, with the speedup = 1 line; error bars over
    several seeds, or with one seed the speedups' intervals over the examples where the results have them."""
    positions = list(range(len(cells)))[::-1]
    means = [_value(cell, speed)[0] for cell in cells]
    errors = _speed_errors(cells, speed, seeds)
    axis.barh(
        positions,
        means,
        xerr=None if errors is None else [[below for below, _ in errors], [above for _, above in errors]],
        capsize=3,
        color=[verifier_colour(cell.cell.verifier) for cell in cells],
    )
    axis.set_yticks(positions, [_label(cell) for cell in cells], fontsize=8)
    if speed == "speedup":
        axis.axvline(1.0, color="black", linewidth=1, linestyle="--")
        tops = [mean + (errors[i][1] if errors else 0.0) for i, mean in enumerate(means)]
        axis.set_xlim(0, max(1.15, max(tops) * 1.1))
    what = "speedup over the target alone" if speed == "speedup" else "tokens per second"
    label = _spread_label(seeds, intervals=errors is not None)
    axis.set(xlabel=f"{what} ({label})", title="speed per configuration")


def _speed_errors(cells: list[CellResult], speed: str, seeds: int) -> list[tuple[float, float]] | None:
    """(below, above) each bar: the std over several seeds; with one seed, the speedup's interval where a cell
    has one (none for the others). None when there is nothing to draw."""
    if seeds > 1:
        return [(std, std) for _, std in (_value(cell, speed) for cell in cells)]
    intervals = [_seed_interval(cell) if speed == "speedup" else None for cell in cells]
    if all(interval is None for interval in intervals):
        return None
    means = [_value(cell, speed)[0] for cell in cells]
    # A percentile interval need not hold the pooled speedup: a bar never reaches past its own end.
    return [
        (0.0, 0.0) if i is None else (max(mean - i[0], 0.0), max(i[1] - mean, 0.0)) for mean, i in zip(means, intervals)
    ]


_MARKERS = "o^Dv<>Ph*X"
"""Configurations of one verifier share its colour and differ by marker."""


def _plot_speed_against_quality(axis, cells: list[CellResult], speed: str, quality: str, seeds: int) -> None:
    seen: dict[str, int] = {}
    for cell in cells:
        if quality not in cell.summary:
            continue
        verifier = cell.cell.verifier
        seen[verifier] = seen.get(verifier, -1) + 1
        marker = "s" if verifier == BASELINE else _MARKERS[seen[verifier] % len(_MARKERS)]
        (y, y_error), (x, x_error) = _value(cell, speed), _value(cell, quality)
        errors = {"xerr": [x_error], "yerr": [y_error], "capsize": 2} if seeds > 1 else {}
        axis.errorbar(
            [x], [y], marker=marker, markersize=7, color=verifier_colour(verifier), label=_label(cell), **errors
        )
    if speed == "speedup":
        axis.axhline(1.0, color="black", linewidth=1, linestyle="--")
    axis.margins(0.15)
    axis.set(
        xlabel=f"{QUALITY[quality]} ({_spread_label(seeds)})",
        ylabel=speed.replace("_", " "),
        title="speed against quality",
    )
    axis.legend(fontsize=7, loc="best")
