"""`specdec drafters`: every installed drafter plugin, and any that failed to load."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..drafter_registry import DrafterRegistry
from ..registry import REQUIRED


def drafters(
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the list as JSON.")] = False,
) -> None:
    """List installed drafters: name, what it drafts with, parameters, package; and load failures."""
    described = DrafterRegistry().describe()
    rows = [{"name": name, **{key: info[key] for key in ("summary", "deterministic", "uses_model", "parameters",
                                                          "package", "note")}}
            for name, info in sorted(described.items()) if "error" not in info]  # fmt: skip
    failures = {name: info["error"] for name, info in described.items() if "error" in info}
    if as_json:
        failed = [{"name": name, "error": error} for name, error in sorted(failures.items())]
        typer.echo(json.dumps({"drafters": rows, "failed": failed}, indent=2))
        return
    table = Table(title="installed drafters", caption="a deterministic drafter fills one row, with one-hot laws")
    for column in ("name", "drafts with", "parameters (defaults)", "package"):
        table.add_column(column)
    for row in rows:
        params = ", ".join(f"{k} (required)" if v == REQUIRED else f"{k}={v!r}" for k, v in row["parameters"].items())
        kind = "a model" if row["uses_model"] else "no model" + (", deterministic" if row["deterministic"] else "")
        table.add_row(row["name"], kind, params or "—", row["package"])
    console = Console()
    console.print(table)
    for row in rows:
        console.print(f"[bold]{row['name']}[/]: {row['summary']}", highlight=False)
    for row in rows:
        if row["note"]:
            console.print(f"[yellow]note[/] {row['name']}: {row['note']}", highlight=False)
    for name, error in sorted(failures.items()):
        console.print(f"[red]failed to load[/] {name}: {error}", highlight=False)
