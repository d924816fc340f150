"""What `specdec verifiers` and `specdec drafters` share: the rows, JSON, the parameters table, notes and failures."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..plugins.registry import REQUIRED


def listed(described: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> tuple[list[dict], dict[str, str]]:
    """(one row per plugin that loads, with ``keys`` of its description; name → error of those that do not)."""
    rows = [
        {"name": name, **{key: info[key] for key in keys}}
        for name, info in sorted(described.items())
        if "error" not in info
    ]
    failures = {name: info["error"] for name, info in sorted(described.items()) if "error" in info}
    return rows, failures


def show(
    kind: str,
    rows: list[dict],
    failures: dict[str, str],
    as_json: bool,
    table: Table,
    hint: str,
    marked: Callable[[dict], str | None] = lambda row: None,
) -> None:
    """Print the plugins of ``kind`` as JSON, or ``table`` (filled by the caller) followed by each one's summary,
    a table of every parameter (type, default, description; the parameter ``marked(row)`` names flagged, ``hint``
    says how to set them), notes and load failures."""
    if as_json:
        failed = [{"name": name, "error": error} for name, error in failures.items()]
        typer.echo(json.dumps({f"{kind}s": rows, "failed": failed}, indent=2))
        return
    console = Console()
    console.print(table)
    for row in rows:
        console.print(f"[bold]{row['name']}[/]: {row['summary']}", highlight=False)
    console.print(_parameters_table(kind, rows, hint, marked))
    for row in rows:
        if row["note"]:
            console.print(f"[yellow]note[/] {row['name']}: {row['note']}", highlight=False)
    for name, error in failures.items():
        console.print(f"[red]failed to load[/] {name}: {error}", highlight=False)


def _parameters_table(kind: str, rows: list[dict], hint: str, marked: Callable[[dict], str | None]) -> Table:
    """A row per parameter: the plugin and the parameter whole (never folded: they are what a user types), then its
    type and default above its description, the one column that wraps, so the table reads at 80 columns."""
    table = Table(title=f"{kind} parameters", caption=hint)
    table.add_column(kind, no_wrap=True)
    table.add_column("parameter", no_wrap=True)
    table.add_column("type, default: description", ratio=1)
    for row in rows:
        for name, default in row["parameters"].items():
            docs = row["parameter_docs"].get(name, {})
            shown_default = "required" if default == REQUIRED else f"default {default!r}"
            flag = " (--kl sets it)" if name == marked(row) else ""
            # Text, not markup: a default or a description may hold brackets ([1, 2]).
            about = Text.assemble(
                (f"{docs.get('type') or '—'}, {shown_default}", "dim"), "\n", (docs.get("description") or "—") + flag
            )
            table.add_row(Text(row["name"]), Text(name), about)
    return table
