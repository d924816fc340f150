"""`specdec verifiers`: every installed verifier plugin, and any that failed to load."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..verifiers import VerifierRegistry, parameter_defaults


def verifiers(
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the list as JSON.")] = False,
) -> None:
    """List installed verifiers: name, lossless, max drafts, parameters, KL bound, package; and load failures."""
    registry = VerifierRegistry()
    rows = []
    for name in registry.names():
        cls = registry.load_class(name)
        rows.append({
            "name": name,
            "lossless": bool(getattr(cls, "lossless", False)),
            "max_drafts": getattr(cls, "max_drafts", None),
            "parameters": parameter_defaults(cls),
            "kl_bound_parameter": cls.kl_bound_parameter,
            "package": registry.package(name),
        })  # fmt: skip
    failures = registry.failures()
    if as_json:
        failed = [{"name": name, "error": error} for name, error in sorted(failures.items())]
        typer.echo(json.dumps({"verifiers": rows, "failed": failed}, indent=2))
        return
    table = Table(title="installed verifiers", caption="--kl sets the parameter marked (KL bound)")
    for column in ("name", "lossless", "max drafts", "parameters (defaults)", "package"):
        table.add_column(column)
    for row in rows:
        params = ", ".join(f"{k}={v!r}" + (" (KL bound)" if k == row["kl_bound_parameter"] else "")
                           for k, v in row["parameters"].items()) or "—"  # fmt: skip
        max_drafts = "any" if row["max_drafts"] is None else str(row["max_drafts"])
        table.add_row(row["name"], "yes" if row["lossless"] else "no", max_drafts, params, row["package"])
    console = Console()
    console.print(table)
    for name, error in sorted(failures.items()):
        console.print(f"[red]failed to load[/] {name}: {error}", highlight=False)
