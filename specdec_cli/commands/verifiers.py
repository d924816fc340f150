"""`specdec verifiers`: every installed verifier plugin, and any that failed to load."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..plugins.registry import VerifierRegistry
from . import listing


def verifiers(
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print the list as JSON.")] = False,
) -> None:
    """List installed verifiers: name, lossless, max drafts, package, what each does, its parameters; load failures."""
    rows, failures = listing.listed(
        VerifierRegistry().describe(),
        ("lossless", "max_drafts", "summary", "parameters", "parameter_docs", "kl_bound_parameter", "package", "note"),
    )
    table = Table(title="installed verifiers", caption="--kl sets the KL bound of a verifier that has one")
    for column in ("name", "lossless", "max drafts", "KL bound", "package"):
        table.add_column(column)
    for row in rows:
        max_drafts = "any" if row["max_drafts"] is None else str(row["max_drafts"])
        bound = row["kl_bound_parameter"] or "—"
        table.add_row(row["name"], "yes" if row["lossless"] else "no", max_drafts, bound, row["package"])
    listing.show(
        "verifier",
        rows,
        failures,
        as_json,
        table,
        "set them in the recipe's verifier.params, or with --set verifier.params.NAME=VALUE",
        marked=lambda row: row["kl_bound_parameter"],
    )
