"""What `specdec verifiers` and `specdec drafters` share: the rows, JSON, the parameters table, notes and failures."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

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
    table = Table(title=f"{kind} parameters", caption=hint)
    for column in (kind, "parameter", "type", "default", "description"):
        table.add_column(column)
    for row in rows:
        for name, default in row["parameters"].items():
            docs = row["parameter_docs"].get(name, {})
            flag = " (--kl sets it)" if name == marked(row) else ""
            table.add_row(
                row["name"],
                name,
                docs.get("type") or "—",
                "required" if default == REQUIRED else repr(default),
                (docs.get("description") or "—") + flag,
            )
    return table
