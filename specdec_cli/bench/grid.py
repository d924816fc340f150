"""The benchmark grid: its cells (configurations) and how a comma-list grid expands into them."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from ..base.errors import UsageError
from ..base.recipe import AUTOREGRESSIVE, Recipe, VerifierConfig
from ..plugins.drafter_registry import DrafterRegistry, recipe_draft_rows
from ..plugins.registry import VerifierRegistry
from ..plugins.sweeps import ParameterSweep, shown_value, swept_params

BASELINE = AUTOREGRESSIVE


@dataclass(frozen=True, kw_only=True)
class GridCell:
    """One configuration of the grid; verifier 'none' is the target-only baseline."""

    verifier: str
    kl: float | None
    """The verifier's KL bound D (its ``kl_bound_parameter``), for a verifier that has one."""
    num_drafts: int
    draft_length: int
    temperature: float
    draft_temperatures: tuple[float, ...] | None
    drafter: str | None = None
    """Draft with this drafter only (``--drafter``: the recipe's entries of it, or one with its defaults); None:
    the recipe's drafts."""
    batch_size: int = 1
    """Samples decoded at a time (``--batch-size``); its speedup is over the target alone at the same batch size."""
    draft_length_schedule: str = "constant"
    """How the draft length moves between blocks (``--draft-length-schedule``), starting at ``draft_length``."""
    exact_first: int = 0
    """Tokens of every sample verified by the lossless ``speculation.exact_verifier`` before this cell's verifier
    takes over (``--exact-first``); 0: none."""
    params: tuple[tuple[str, Any], ...] = ()
    """The verifier's swept parameters (``--sweep``), as (parameter, value) pairs."""

    @classmethod
    def baseline(cls, temperature: float, batch_size: int = 1) -> "GridCell":
        return cls(
            verifier=BASELINE,
            kl=None,
            num_drafts=0,
            draft_length=0,
            temperature=temperature,
            draft_temperatures=None,
            batch_size=batch_size,
        )

    @classmethod
    def from_config(cls, spec: dict) -> "GridCell":
        """A cell from a results folder's config.json (JSON made the draft temperatures a list)."""
        temperatures = spec["draft_temperatures"]
        params = tuple(tuple(pair) for pair in spec.get("params", ()))  # JSON made the pairs lists
        return cls(**{**spec, "draft_temperatures": tuple(temperatures) if temperatures else None, "params": params})

    @property
    def key(self) -> str:
        batch = "" if self.batch_size == 1 else f" B={self.batch_size}"  # keys from before batches stay
        if self.verifier == BASELINE:
            return f"baseline T={self.temperature:g}{batch}"
        name = self.verifier if self.kl is None else f"{self.verifier} D={self.kl:g}"
        name += "".join(f" {parameter}={shown_value(value)}" for parameter, value in self.params)
        drafts = "" if self.draft_temperatures is None else " dT=" + ",".join(f"{t:g}" for t in self.draft_temperatures)
        drafter = "" if self.drafter is None else f" drafter={self.drafter}"  # keys from before drafters stay
        # Keys from before schedules stay: a constant length is what every earlier cell ran.
        length = "" if self.draft_length_schedule == "constant" else f" ({self.draft_length_schedule})"
        length += f" exact={self.exact_first}" if self.exact_first else ""  # keys from before exact_first stay
        return (
            f"{name} K={self.num_drafts} L={self.draft_length}{length} T={self.temperature:g}{drafts}{drafter}{batch}"
        )

    @property
    def baseline_key(self) -> str:
        return GridCell.baseline(self.temperature, self.batch_size).key

    def recipe(self, base: Recipe, registry: VerifierRegistry) -> Recipe:
        """The base recipe with this cell's settings; the verifier, resolved once per registry, gets the base's
        parameters it takes."""
        drafting = self.drafting(base)
        if self.verifier == BASELINE:
            return drafting
        chosen = registry.resolve(
            self.verifier,
            base.verifier.params,
            kl_bound=self.kl,
            swept=self.params,
            draft_length=self.draft_length,
            taken_only=True,
        )
        return dataclasses.replace(drafting, verifier=chosen.config)

    def drafting(self, base: Recipe) -> Recipe:
        """The base recipe with this cell's drafts, speculation and sampling settings (the base's verifier section;
        the baseline's own): what counts the cell's draft rows, before its verifier is built."""
        generation = dataclasses.replace(base.generation, temperature=self.temperature)
        if self.verifier == BASELINE:
            return dataclasses.replace(base, generation=generation, verifier=VerifierConfig(name=BASELINE))
        drafts = base.drafts
        if self.draft_temperatures is not None:
            if not base.drafts:
                raise UsageError("--draft-temperatures needs a draft in the recipe to copy")
            drafts = tuple(dataclasses.replace(base.drafts[0], temperature=t) for t in self.draft_temperatures)
        if self.drafter is not None:
            drafts = DrafterRegistry().entries_of(drafts, self.drafter)
        speculation = dataclasses.replace(
            base.speculation,
            num_drafts=self.num_drafts,
            draft_length=self.draft_length,
            draft_length_schedule=self.draft_length_schedule,
            exact_first=self.exact_first,
        )
        return dataclasses.replace(base, drafts=drafts, speculation=speculation, generation=generation)


@dataclass(frozen=True, kw_only=True)
class Grid:
    verifiers: tuple[str, ...]
    kl: tuple[float, ...]
    num_drafts: tuple[int, ...]
    draft_lengths: tuple[int, ...]
    temperatures: tuple[float, ...]
    draft_temperatures: tuple[tuple[float, ...] | None, ...] = (None,)
    drafters: tuple[str | None, ...] = (None,)
    batch_sizes: tuple[int, ...] = (1,)
    draft_length_schedules: tuple[str, ...] = ("constant",)
    exact_first: tuple[int, ...] = (0,)
    sweeps: tuple[ParameterSweep, ...] = ()

    def cells(self, registry: VerifierRegistry, base: Recipe) -> tuple[list[GridCell], list[str]]:
        """Baselines first, then every combination whose verifier takes the cell's draft rows (counted
        from the cell's own recipe over ``base``, as the engine counts them); and why the others were left out."""
        cells = [GridCell.baseline(t, b) for b in self.batch_sizes for t in self.temperatures]
        skipped = []
        drafters = [None if name is None else DrafterRegistry().canonical(name) for name in self.drafters]
        for name in self.verifiers:
            name = registry.canonical(name)
            verifier_class = registry.load_class(name)
            bounds: tuple[float | None, ...] = self.kl if verifier_class.kl_bound_parameter and self.kl else (None,)
            for kl, swept, k, length, schedule, exact, temperature, draft_temps, drafter, batch in itertools.product(
                bounds,
                swept_params(name, self.sweeps),
                self.num_drafts,
                self.draft_lengths,
                self.draft_length_schedules,
                self.exact_first,
                self.temperatures,
                self.draft_temperatures,
                drafters,
                self.batch_sizes,
            ):
                cell = GridCell(
                    verifier=name,
                    kl=kl,
                    num_drafts=k,
                    draft_length=length,
                    draft_length_schedule=schedule,
                    exact_first=exact,
                    temperature=temperature,
                    draft_temperatures=draft_temps,
                    drafter=drafter,
                    batch_size=batch,
                    params=swept,
                )
                rows = recipe_draft_rows(cell.drafting(base))
                reason = registry.refusal(name, rows)
                if reason is not None:
                    skipped.append(reason)
                    continue
                cells.append(cell)
        return cells, sorted(set(skipped))
