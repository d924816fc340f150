"""`specdec drafters`: every installed drafter plugin, and any that failed to load."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..plugins.drafter_registry import DrafterRegistry
from . import listing


def drafters(
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the list as JSON.")] = False,
) -> None:
    """List installed drafters: name, what it drafts with, package, what each does, its parameters; load failures."""
    rows, failures = listing.listed(
        DrafterRegistry().describe(),
        ("summary", "deterministic", "uses_model", "parameters", "parameter_docs", "package", "note"),
    )
    table = Table(title="installed drafters", caption="a deterministic drafter fills one row, with one-hot laws")
    for column in ("name", "drafts with", "package"):
        table.add_column(column)
    for row in rows:
        kind = "a model" if row["uses_model"] else "no model" + (", deterministic" if row["deterministic"] else "")
        table.add_row(row["name"], kind, row["package"])
    listing.show(
        "drafter",
        rows,
        failures,
        as_json,
        table,
        "set them in a draft entry's params, or with --set drafts.N.params.NAME=VALUE",
    )
