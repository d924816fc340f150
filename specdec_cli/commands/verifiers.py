"""`specdec verifiers`: every installed verifier plugin, and any that failed to load."""

from __future__ import annotations

import importlib.metadata
import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from stevedore import extension

from ..verifiers import ENTRY_POINT_GROUP, parameter_defaults


def _packages_by_entry_point() -> dict[str, str]:
    """'distribution version' of each verifier entry point (stevedore's cache does not keep it)."""
    found = {}
    for dist in importlib.metadata.distributions():
        for entry_point in dist.entry_points:
            if entry_point.group == ENTRY_POINT_GROUP:
                found[entry_point.name] = f"{dist.metadata['Name']} {dist.version}"
    return found


def verifiers(
    as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
) -> None:
    """List installed verifiers: name, lossless, max drafts, parameters, package; and load failures."""
    failures: list[tuple[str, str]] = []
    manager = extension.ExtensionManager(
        ENTRY_POINT_GROUP,
        invoke_on_load=False,
        on_load_failure_callback=lambda _manager, entry_point, error: failures.append(
            (entry_point.name, f"{type(error).__name__}: {error}")
        ),
    )
    packages = _packages_by_entry_point()
    rows = []
    for ext in sorted(manager, key=lambda e: e.name):
        cls = ext.plugin
        rows.append({
            "name": ext.name,
            "lossless": bool(getattr(cls, "lossless", False)),
            "max_drafts": getattr(cls, "max_drafts", None),
            "parameters": parameter_defaults(cls),
            "package": packages.get(ext.name, ext.entry_point.value),
        })  # fmt: skip
    if as_json:
        typer.echo(json.dumps({"verifiers": rows, "failed": [{"name": n, "error": e} for n, e in failures]}, indent=2))
        return
    table = Table(title="installed verifiers")
    for column in ("name", "lossless", "max drafts", "parameters (defaults)", "package"):
        table.add_column(column)
    for row in rows:
        params = ", ".join(f"{k}={v!r}" for k, v in row["parameters"].items()) or "—"
        max_drafts = "any" if row["max_drafts"] is None else str(row["max_drafts"])
        table.add_row(row["name"], "yes" if row["lossless"] else "no", max_drafts, params, row["package"])
    console = Console()
    console.print(table)
    for name, error in failures:
        console.print(f"[red]failed to load[/] {name}: {error}", highlight=False)
