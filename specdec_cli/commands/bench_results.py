"""What ``specdec bench`` leaves behind: where its results go, the table or JSON it prints, the summaries it
writes to the results folder and the plot."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Optional

import typer
from rich.console import Console

from ..base.errors import SpecdecError
from ..base.inputs import write_atomically
from ..bench import report
from ..bench.results import BenchResults
from . import common, options


@dataclass(frozen=True, kw_only=True)
class Output:
    """Where the results go: the results folder (None: nowhere), stdout as JSON or a table, a plot; or the folder
    whose results to show again."""

    help_panel: ClassVar[str] = "Results"
    folder: options.OutputOption = None
    report_folder: Annotated[
        Optional[Path],
        typer.Option(
            "--report", metavar="FOLDER", help="Show the results of a results folder again, without running models."
        ),
    ] = None
    plot: Annotated[
        Optional[Path],
        typer.Option(metavar="FILE.png", help="Draw speedup (or token rate) against quality to this PNG."),
    ] = None
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print results.json instead of the table.")] = (
        False
    )
    allow_mixed_conditions: Annotated[
        bool,
        typer.Option(
            "--allow-mixed-conditions",
            metavar="",
            help="Resume an --output folder whose samples ran with other threads, device or versions (the results "
            "flag the mix).",
        ),
    ] = False


def above_the_bar(line: str) -> None:
    """``line`` on stderr while the progress bar shows: written to ``sys.stderr``, which a bar on a terminal replaces
    with a proxy that prints each line above the bar; a Console of our own writes past that proxy, so its line
    landed on the bar's (a resumed run's "note: resuming …" right after "ETA -:--:--")."""
    sys.stderr.write(line + "\n")


def finish(results: BenchResults, output: Output, kept: int, busy_cpu: str | None) -> None:
    """Show the results and write them to the folder, the plot noting ``busy_cpu``; stopped: exit 130, a failed cell:
    exit 1."""
    if results.interrupted:
        where = (
            f"kept in '{output.folder}'; run the same command to resume"
            if output.folder is not None
            else "done, but nothing was saved (no --output): pass --output FOLDER to be able to resume"
        )
        note = f"interrupted: {kept} samples {where}"
    else:
        note = ""
    show(results, output, note)
    if output.folder is not None:
        _write_summaries(output.folder, results)
    plot(results, output, busy_cpu)  # last: a failing plot never costs the table or the summaries
    if results.interrupted:
        raise typer.Exit(130)
    if any(cell.failure for cell in results.cells):
        raise typer.Exit(1)  # each failed cell's line came as it failed; a run with one is not a success


def _write_summaries(folder: Path, results: BenchResults) -> None:
    """results.json and the tables, after the table is shown: a full disk costs them, never the table."""
    summaries = {
        "results.json": json.dumps(results.to_dict(), indent=2) + "\n",
        "table.md": report.markdown(results),
        "table.csv": report.csv_text(results),
    }
    for name, text in summaries.items():
        try:
            write_atomically(folder / name, text)  # a failed write leaves the previous summary whole
        except OSError as error:
            raise SpecdecError(
                f"could not write '{folder / name}' ({error.strerror}); the samples are kept: free "
                f"some space and run `specdec bench --report {folder}` to see them again"
            ) from None


def show(results: BenchResults, output: Output, note: str) -> None:
    if output.as_json:
        sys.stdout.write(json.dumps(results.to_dict(), indent=2) + "\n")
    else:
        config = results.config
        title = f"specdec bench: {config['task']['name']}, {config['data']['examples']} examples"
        console = Console(width=None if sys.stdout.isatty() else 200)
        console.print(report.rich_table(results, title))
        if (categories := report.category_table(results)) is not None:
            console.print(categories)
    if note:
        Console(stderr=True).print(note, highlight=False, soft_wrap=True)


def plot(results: BenchResults, output: Output, busy_cpu: str | None = None) -> None:
    """The plot, if asked for, with the run's ``busy_cpu`` note on it (None: a quiet CPU, or a folder shown again
    with --report); a stopped run's plot that fails is a note, so the stop keeps its exit code 130."""
    if output.plot is None:
        return
    try:
        common.write_plot(lambda: report.plot(results, output.plot, busy_cpu), output.plot)
    except SpecdecError as error:
        if not results.interrupted:
            raise
        Console(stderr=True).print(f"note: {error}", highlight=False, soft_wrap=True)
