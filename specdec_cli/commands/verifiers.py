"""`specdec verifiers`: every installed verifier plugin, and any that failed to load."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ..registry import VerifierRegistry


def verifiers(
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the list as JSON.")] = False,
) -> None:
    """List installed verifiers: name, lossless, max drafts, parameters, KL bound, package; and load failures."""
    described = VerifierRegistry().describe()
    rows = [{"name": name, **{key: info[key] for key in ("lossless", "max_drafts", "parameters", "kl_bound_parameter",
                                                          "package", "note")}}
            for name, info in sorted(described.items()) if "error" not in info]  # fmt: skip
    failures = {name: info["error"] for name, info in described.items() if "error" in info}
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
    for row in rows:
        if row["note"]:
            console.print(f"[yellow]note[/] {row['name']}: {row['note']}", highlight=False)
    for name, error in sorted(failures.items()):
        console.print(f"[red]failed to load[/] {name}: {error}", highlight=False)
