"""What an acceptance run produces: typed rows, per-prompt values, and the report over all prompts.

A prompt's values are written to a results folder as one record each (``samples.jsonl``), so
a run resumes where it stopped; :meth:`PromptAcceptance.to_record` and
:meth:`PromptAcceptance.from_record` are that record's format.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..base.recipe import DraftConfig, Recipe
from ..plugins.drafter_registry import DrafterRegistry
from ..plugins.sweeps import ParameterSweep, shown_value
from ..results.store import RecordKind

OPTIMUM = "optimum"


@dataclass(frozen=True, kw_only=True)
class AcceptanceRequest:
    verifiers: tuple[str, ...]
    """Verifier names; one with a KL bound expands to one row per value of ``kl_values``, and to one per value of
    each of its ``sweeps`` (every combination)."""
    num_drafts: tuple[int, ...] = (1, 2, 4)
    kl_values: tuple[float, ...] | None = None
    """None: derived from the pair's measured KL(q ‖ p) (see ``AcceptanceAnalysis.derive_kl_values``)."""
    sweeps: tuple[ParameterSweep, ...] = ()
    exact_first: int = 0
    """A lossy row's first N positions of each continuation are the exact rule's (``speculation.exact_verifier``), as a
    run with ``speculation.exact_first`` N verifies them; its spent divergence counts the positions from N on."""


@dataclass(frozen=True)
class DrafterSection:
    """Draft entries evaluated together: the recipe's entries of one drafter (``--drafter NAME``), or every entry."""

    drafter: str | None
    """The drafter's name, or None: every entry of the recipe (no ``--drafter``)."""
    drafts: tuple[DraftConfig, ...]

    @classmethod
    def of_recipe(cls, recipe: Recipe, drafters: list[str]) -> list[DrafterSection]:
        """A section per name of ``drafters`` (the recipe's entries of it, as generate's ``--drafter`` takes them),
        or one of every entry when there is none; each entry checked against its drafter (a UsageError naming
        what cannot work), before any model loads."""
        registry = DrafterRegistry()
        if not drafters:
            sections = [cls(None, recipe.drafts)]
        else:
            sections = [cls(registry.canonical(name), registry.entries_of(recipe.drafts, name)) for name in drafters]
        for section in sections:
            registry.check_entries(section.drafts)
        return sections


@dataclass(frozen=True)
class AcceptanceRow:
    """A row of the table: the optimum, a verifier, or a verifier at one KL bound D and at one value of each
    parameter ``--sweep`` sweeps."""

    verifier: str
    kl_bound: float | None = None
    params: tuple[tuple[str, Any], ...] = ()
    """(parameter, value) for each swept parameter."""

    @property
    def label(self) -> str:
        bound = "" if self.kl_bound is None else f" D={self.kl_bound:g}"
        return self.verifier + bound + "".join(f" {name}={shown_value(value)}" for name, value in self.params)


@dataclass(frozen=True)
class Estimate:
    """A mean over positions with its standard error (NaN for a single position)."""

    mean: float
    stderr: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "Estimate | None":
        if not values:
            return None
        mean = sum(values) / len(values)
        if len(values) < 2:
            return cls(mean, float("nan"), 1)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        return cls(mean, math.sqrt(variance / len(values)), len(values))


@dataclass(kw_only=True)
class PromptAcceptance:
    """Per-position values for one prompt and one drafter section: ``values[label][K]``, ``kl[label]`` (a
    verifier's ``output_kl``, at the first K it takes), and why a (label, K) cell has no value."""

    prompt: str
    prompt_index: int
    positions: int
    values: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    kl: dict[str, list[float]] = field(default_factory=dict)
    unavailable: dict[tuple[str, int], str] = field(default_factory=dict)
    drafter: str | None = None
    """The section's drafter (``--drafter``); None: every entry of the recipe."""
    covered: int | None = None
    """Positions where at least one of the section's entries proposed; None: every position (each entry drafts
    with a model, as every section did before drafters without one)."""
    spent: dict[str, dict[str, list[float]]] | None = None
    """Each lossy row's divergence at K = 1 beyond ``kl``: ``spent[label][measure]`` per position for each measure
    of :data:`SPENT_MEASURES` but KL; None when no row has one (and in records of before). With ``exact_first`` N,
    these and ``kl`` hold the positions from N on (the lossy part)."""

    def record(self, row: AcceptanceRow, num_drafts: int, values: list[float] | None, reason: str) -> None:
        """The row's values at ``num_drafts`` drafts, or (values None) why there are none."""
        if values is None:
            self.unavailable[(row.label, num_drafts)] = reason
        else:
            self.values.setdefault(row.label, {})[num_drafts] = values

    def to_record(self) -> dict:
        """The results folder's line for this prompt ('label|K' keys for the unavailable cells)."""
        record = dataclasses.asdict(self)
        record["unavailable"] = {f"{label}|{k}": why for (label, k), why in self.unavailable.items()}
        for optional in _OPTIONAL_FIELDS:  # left out when None: such records are those of before drafters
            if record[optional] is None:
                del record[optional]
        return record

    @classmethod
    def from_record(cls, record: dict) -> "PromptAcceptance":
        """The inverse of :meth:`to_record` (JSON turned the K keys into text)."""
        values = {label: {int(k): v for k, v in by_k.items()} for label, by_k in record["values"].items()}
        unavailable = {}
        for key, why in record["unavailable"].items():
            label, _, k = key.rpartition("|")
            unavailable[(label, int(k))] = why
        return cls(
            prompt=record["prompt"],
            prompt_index=record["prompt_index"],
            positions=record["positions"],
            values=values,
            kl=record["kl"],
            unavailable=unavailable,
            **{name: record.get(name) for name in _OPTIONAL_FIELDS},
        )


SPENT_MEASURES = ("kl", "tv", "optimum_at_kl", "optimum_at_tv")
"""What a lossy rule's output law costs at each position, and what the best rule gets for that cost: KL(q ‖ π) and
TV(q, π) of its output law π, and the most any rule accepts within that KL (the installed KL-optimal rule, at that
position's own KL) or within that TV (1 − TV(q, p) + TV(q, π))."""

_OPTIONAL_FIELDS = {"drafter": str, "covered": int, "spent": dict}
"""PromptAcceptance's fields that a record holds only when they are not None."""

PROMPT_RECORDS = RecordKind(
    lambda record: (record.get("drafter"), record["prompt_index"]),
    frozenset({"prompt", "prompt_index", "positions", "values", "kl", "unavailable"}),
    optional=_OPTIONAL_FIELDS,
)


@dataclass(kw_only=True)
class AcceptanceReport:
    """One drafter section's values over the prompts."""

    rows: list[AcceptanceRow]
    num_drafts: list[int]
    prompts: list[PromptAcceptance] = field(default_factory=list)
    unavailable: dict[tuple[str, int], str] = field(default_factory=dict)
    """(row label, K) → why that cell has no value (e.g. a single-draft verifier at K = 2)."""
    identical_drafts: bool = True
    interrupted: bool = False
    drafter: str | None = None
    """The section's drafter (``--drafter``); None: every entry of the recipe."""
    optimal: dict[str, list[str]] = field(default_factory=dict)
    """Divergence name → the labels of the rows that are the optimal rule under it (the installed verifier that
    names it in ``optimal_under``, with the settings that make it so), for the plot."""
    exact_first: int = 0
    """The request's ``exact_first``: a lossy row's first N positions are ``exact_verifier``'s."""
    exact_verifier: str | None = None
    """The exact rule's name (``speculation.exact_verifier``); None without ``exact_first``."""

    def add(self, result: PromptAcceptance) -> None:
        self.prompts.append(result)
        self.unavailable.update(result.unavailable)

    def cell(self, row: AcceptanceRow | str, num_drafts: int) -> Estimate | None:
        label = row.label if isinstance(row, AcceptanceRow) else row
        return Estimate.of([v for p in self.prompts for v in p.values.get(label, {}).get(num_drafts, [])])

    def kl(self, row: AcceptanceRow | str) -> Estimate | None:
        return self.spent(row, "kl")

    def spent(self, row: AcceptanceRow | str, measure: str) -> Estimate | None:
        """The mean of a row's ``measure`` (one of :data:`SPENT_MEASURES`) over the positions, or None."""
        label = row.label if isinstance(row, AcceptanceRow) else row
        if measure == "kl":
            return Estimate.of([v for p in self.prompts for v in p.kl.get(label, [])])
        return Estimate.of([v for p in self.prompts for v in (p.spent or {}).get(label, {}).get(measure, [])])

    def _exact_fields(self) -> dict:
        return {"exact_first": self.exact_first, "exact_verifier": self.exact_verifier, "exact_note": self.exact_note()}

    def exact_note(self) -> str:
        """What ``exact_first`` does to the lossy rows' values, in a sentence (the table's footnote, the JSON's)."""
        n, name = self.exact_first, self.exact_verifier
        return (
            f"exact first {n}: a lossy row's first {n} positions of each continuation are verified by {name}, so its "
            f"acceptance there is {name}'s; its spent KL(q‖π), TV(q,π) and the best at them count positions >= {n} "
            "only (the lossy part)"
        )

    @property
    def positions(self) -> int:
        return sum(p.positions for p in self.prompts)

    @property
    def coverage(self) -> float | None:
        """The share of positions where at least one of the section's entries proposed (None: no position yet)."""
        if not self.positions:
            return None
        return sum(p.positions if p.covered is None else p.covered for p in self.prompts) / self.positions

    def to_dict(self) -> dict:
        table = {}
        for row in self.rows:
            table[row.label] = {
                str(k): dataclasses.asdict(c) if (c := self.cell(row, k)) else None for k in self.num_drafts
            }
            for measure in SPENT_MEASURES:
                if (value := self.spent(row, measure)) is not None:
                    table[row.label][measure] = dataclasses.asdict(value)
        return {
            "drafter": self.drafter,
            "coverage": self.coverage,
            "rows": [row.label for row in self.rows],
            "num_drafts": self.num_drafts,
            "table": table,
            "unavailable": {f"{label}|{k}": why for (label, k), why in self.unavailable.items()},
            "identical_drafts": self.identical_drafts,
            **(self._exact_fields() if self.exact_first else {}),
            "interrupted": self.interrupted,
            "prompts": [p.to_record() for p in self.prompts],
        }
