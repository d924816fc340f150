"""Finding drafter plugins: the entry-point group ``specdec.drafters`` (torch-free, like the verifiers')."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ..base.errors import SpecdecError, UsageError
from ..base.recipe import DraftConfig, GenerationConfig, ModelConfig, Recipe
from .descriptions import class_summary
from .draft_rows import DraftRows, drafter_key, every_config
from .plugin_registry import PluginRegistry, class_problem, error_line

DRAFTER_GROUP = "specdec.drafters"
DEFAULT_DRAFTER = "model"
"""What a draft entry that names no drafter drafts with (a bare ``model:``, as every recipe before drafters)."""
EARLY_EXIT_DRAFTER = "early-exit"
"""What a draft entry with ``early_exit: N`` and no drafter drafts with (its ``layers`` parameter is N)."""

DRAFTER_DESCRIPTION_TYPES: dict[str, tuple[type, ...]] = {
    "deterministic": (bool,),
    "uses_model": (bool,),
    "own_vocabulary": (bool,),
    "summary": (str,),
    "parameters": (dict,),
    "parameter_docs": (dict,),
    "package": (str,),
    "note": (str, type(None)),
}


class DrafterRegistry(PluginRegistry):
    """Drafters: entry points of the group ``specdec.drafters``."""

    group = DRAFTER_GROUP
    kind = "drafter"
    parameters_hint = "fix the draft entry's params in the recipe, or --set drafts.N.params.NAME=VALUE"
    description_types = DRAFTER_DESCRIPTION_TYPES

    def contract_problem(self, loaded: Any) -> str | None:
        from .drafting import Drafter  # imports torch, which loading any plugin did already

        return class_problem(loaded, Drafter, ("deterministic", "uses_model", "own_vocabulary"))

    def class_description(self, cls: type) -> dict[str, Any]:
        return {
            "deterministic": cls.deterministic,
            "uses_model": cls.uses_model,
            "own_vocabulary": cls.own_vocabulary,
            "summary": class_summary(cls),
        }

    def entry_drafter(self, entry: DraftConfig) -> tuple[str, dict[str, Any]]:
        """(drafter name, parameters) of a draft entry: a bare ``model:`` is the model drafter, a bare
        ``early_exit: N`` the early-exit drafter with ``layers: N`` (the recipes from before drafters)."""
        name = (
            self.canonical(entry.drafter)
            if entry.drafter is not None
            else (EARLY_EXIT_DRAFTER if entry.early_exit is not None else DEFAULT_DRAFTER)
        )
        if name != EARLY_EXIT_DRAFTER or entry.early_exit is None:
            return name, dict(entry.params)
        layers = entry.params.get("layers", entry.early_exit)
        if layers != entry.early_exit:
            raise UsageError(f"a draft entry sets early_exit: {entry.early_exit} and params.layers: {layers}; keep one")
        return name, {**entry.params, "layers": entry.early_exit}

    def entry_deterministic(self, entry: DraftConfig) -> bool:
        """Whether the entry's drafter is deterministic (fills one row)."""
        return self.plugin_class(self.entry_drafter(entry)[0]).deterministic

    def entry_unjudged(self, entry: DraftConfig) -> bool:
        """Whether the entry's drafter samples without reporting judged laws (:attr:`DraftRows.unjudged`)."""
        cls = self.plugin_class(self.entry_drafter(entry)[0])
        return not (cls.deterministic or cls.reports_judged_laws)

    def dependent_rows(self, name: str, params: dict[str, Any], num_drafts: int) -> bool:
        """Whether drafter ``name`` with ``params`` fills rows that are not independent samples
        (:attr:`DraftRows.dependent`): ``num_drafts`` > 1 sampled rows, of an instance that says so."""
        if num_drafts < 2 or self.plugin_class(name).deterministic:
            return False
        return not self.create(name, params).independent_rows

    def dependent_entries(
        self, drafters: Sequence[tuple[str, dict[str, Any]]], num_drafts: int
    ) -> list[tuple[int, str]]:
        """(index, name) of each of the (name, parameters) ``drafters`` whose rows are not independent samples
        (:meth:`dependent_rows`), in their order."""
        return [
            (index, name)
            for index, (name, params) in enumerate(drafters)
            if self.dependent_rows(name, params, num_drafts)
        ]

    def check_entries(self, entries: tuple[DraftConfig, ...]) -> None:
        """Each entry's drafter is installed, takes its parameters and its model fields: a UsageError naming the
        entry otherwise (before any model loads)."""
        for index, entry in enumerate(entries):
            name, params = self.entry_drafter(entry)
            drafter = self.create(name, params)
            problem = self.guarded(name, "entry_problem", drafter.entry_problem, entry)
            if problem is not None:
                raise UsageError(f"drafts.{index}: {problem}")

    def entries_of(self, entries: tuple[DraftConfig, ...], name: str) -> tuple[DraftConfig, ...]:
        """``entries`` narrowed to drafter ``name`` (``--drafter``): its entries, or one entry of it with its defaults
        where there is none, unless it drafts with a model, which an entry must name (a UsageError then)."""
        key = self.canonical(name)
        kept = tuple(entry for entry in entries if self.entry_drafter(entry)[0] == key)
        if kept:
            return kept
        if self.plugin_class(key).uses_model:
            raise UsageError(
                f"--drafter {key} drafts with a model that the recipe does not name; add a draft entry "
                f"for it (drafts: [{{drafter: {key}, ...}}]), or choose another drafter"
            )
        return (DraftConfig(drafter=key),)

    def guarded(self, name: str, what: str, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` of drafter ``name``: an exception of the plugin's own is its fault, one line naming it
        (the original chained for ``--debug``); running out of memory is not."""
        try:
            return method(*args)
        except (SpecdecError, MemoryError):
            raise
        except Exception as error:
            if any(words in str(error).lower() for words in ("out of memory", "can't allocate memory")):
                raise
            raise self.fault(name, f"raised {error_line(error)} in {what}") from error


def draft_law(draft: DraftConfig, generation: GenerationConfig, drafters: DrafterRegistry | None = None) -> Hashable:
    """What decides the law of a recipe's draft: its drafter and parameters (``drafters`` resolves them), the
    model it loads, and its sampling settings, a left-out one taking the target's (``generation``)."""
    model = tuple((f.name, getattr(draft, f.name)) for f in dataclasses.fields(ModelConfig))
    sampling = tuple(
        generation_value if own is None else own
        for own, generation_value in (
            (draft.temperature, generation.temperature),
            (draft.top_k, generation.top_k),
            (draft.top_p, generation.top_p),
        )
    )
    return drafter_key(*(drafters or DrafterRegistry()).entry_drafter(draft)), model, sampling


def recipe_draft_rows(recipe: Recipe, drafters: DrafterRegistry | None = None) -> DraftRows:
    """The rows a recipe's blocks verify at most, known before any model loads (a block whose drafter proposes
    nothing verifies fewer)."""
    drafters = drafters or DrafterRegistry()
    laws = [draft_law(draft, recipe.generation, drafters) for draft in recipe.drafts]
    deterministic = [drafters.entry_deterministic(draft) for draft in recipe.drafts]
    unjudged = [drafters.entry_drafter(draft)[0] for draft in recipe.drafts if drafters.entry_unjudged(draft)]
    num_drafts = recipe.speculation.num_drafts
    entries = [drafters.entry_drafter(draft) for draft in recipe.drafts]
    dependent = [name for _, name in drafters.dependent_entries(entries, num_drafts)]
    return every_config(laws, num_drafts, deterministic, unjudged, dependent)
