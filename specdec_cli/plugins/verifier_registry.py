"""Verifiers: the entry-point group ``specdec.verifiers``, the contract's check of a verifier class, and what core
asks of a verifier (whether it takes a run's drafts, its KL bound, the rule optimal under a divergence), each
answer one line naming the plugin when the plugin's own code raises."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..base.errors import SpecdecError, UsageError
from ..base.recipe import VerifierConfig, target_alone
from .descriptions import class_summary
from .parameters import PluginParameterError, PluginParameterValueError, parameter_defaults
from .plugin_registry import PluginFault, PluginRegistry, class_problem, error_line

if TYPE_CHECKING:
    from .draft_rows import DraftRows
    from .verifiers import BlockVerifier

ENTRY_POINT_GROUP = "specdec.verifiers"

DESCRIPTION_TYPES: dict[str, tuple[type, ...]] = {
    "lossless": (bool,),
    "max_drafts": (int, type(None)),
    "identical_drafts": (bool,),
    "token_level": (bool,),
    "kl_bound_parameter": (str, type(None)),
    "summary": (str,),
    "parameters": (dict,),
    "parameter_docs": (dict,),
    "package": (str,),
    "note": (str, type(None)),
}
"""What :meth:`VerifierRegistry.describe` gives for a verifier that loads; a cache entry of another shape is rebuilt."""

# What verifiers raise, under the names their callers already catch.
VerifierParameterError, VerifierParameterValueError, VerifierFault = (
    PluginParameterError,
    PluginParameterValueError,
    PluginFault,
)


@dataclass(frozen=True)
class ResolvedVerifier:
    """A verifier resolved once (:meth:`VerifierRegistry.resolve`): its name, the parameters it was built with (the
    recipe's, its KL bound, a sweep point), and the instance they built, checked and told the run's draft length.
    The command's check, the recipe's check, the decoder and every row or cell of a comparison take this value."""

    name: str
    """The installed verifier's name, as the registry spells it."""
    params: dict[str, Any]
    """Every parameter the instance was built with: what a recipe's ``verifier.params`` gives it."""
    kl_bound: float | None
    """The KL bound ``--kl`` gave it (on its ``kl_bound_parameter``); None: none was given."""
    swept: tuple[tuple[str, Any], ...]
    """The (parameter, value) pairs a ``--sweep`` point set; empty: none."""
    draft_length: int | None
    """The draft length L it was told (:meth:`~.verifiers.BlockVerifier.set_draft_length`); None: not told (a
    verifier used without a run's blocks, as ``acceptance`` uses it)."""
    verifier: BlockVerifier

    @property
    def config(self) -> VerifierConfig:
        """The recipe's ``verifier`` section that builds this verifier."""
        return VerifierConfig(name=self.name, params=dict(self.params))

    @property
    def bound(self) -> float | None:
        """The KL bound it runs at: the one given, else its parameter's value; None for a rule without one."""
        parameter = type(self.verifier).kl_bound_parameter
        if parameter is None:
            return None
        return self.params.get(parameter, parameter_defaults(type(self.verifier))[parameter])


class VerifierRegistry(PluginRegistry):
    """Verifiers: entry points of the group ``specdec.verifiers``, and what core asks of their classes."""

    group = ENTRY_POINT_GROUP
    kind = "verifier"
    parameters_hint = "fix verifier.params in the recipe, or --set verifier.params.NAME=VALUE"
    description_types = DESCRIPTION_TYPES

    def __init__(self, extra: Mapping[str, type] | None = None) -> None:
        self._resolved: dict[tuple[str, str], dict[int | None, ResolvedVerifier]] = {}
        """What :meth:`resolve` built, by name and parameters, then by the draft length it was told (None: none)."""
        super().__init__(extra)

    def add(self, name: str, cls: type) -> None:
        super().add(name, cls)
        self._resolved = {key: built for key, built in self._resolved.items() if key[0] != name.strip().lower()}

    def resolve(
        self,
        name: str,
        params: Mapping[str, Any],
        *,
        kl_bound: float | None = None,
        swept: tuple[tuple[str, Any], ...] = (),
        draft_length: int | None = None,
        taken_only: bool = False,
        set_by: str | None = None,
    ) -> ResolvedVerifier:
        """Verifier ``name`` with ``params`` (a recipe's ``verifier.params``; with ``taken_only``, only those it takes,
        as a run comparing several verifiers gives each the recipe's), its KL bound set to ``kl_bound`` and the sweep
        point ``swept`` over them, built, checked and told ``draft_length`` once per registry.

        Asked again for the same parameters, it returns the same instance: one told this length, else one told
        none yet (a command's check, which knows no length, built it), which is told it now; ``draft_length`` None
        takes any. Every refusal is one line (``set_by``, the flag that gave the parameters, starts it); a KL bound
        for a rule without one is --kl's refusal."""
        canonical = self.canonical(name)
        given = self.params_for(canonical, dict(params)) if taken_only else dict(params)
        if kl_bound is not None:
            given = self.with_kl_bound(canonical, given, kl_bound)
        given = {**given, **dict(swept)}
        by_length = self._resolved.setdefault((canonical, json.dumps(given, sort_keys=True, default=repr)), {})
        known = by_length.get(draft_length) or (next(iter(by_length.values()), None) if draft_length is None else None)
        if known is None:
            untold = by_length.pop(None, None)
            verifier = self.create(canonical, given, set_by=set_by) if untold is None else untold.verifier
            if draft_length is not None:
                self.told_draft_length(verifier, draft_length)
            known = by_length[draft_length] = ResolvedVerifier(canonical, given, None, (), draft_length, verifier)
        return dataclasses.replace(known, kl_bound=kl_bound, swept=tuple(swept))

    def contract_problem(self, loaded: Any) -> str | None:
        from .verifiers import BlockVerifier  # imports torch, which loading any plugin did already

        problem = class_problem(loaded, BlockVerifier, ("lossless", "identical_drafts", "token_level"))
        if problem is not None:
            return problem
        if not hasattr(loaded, "max_drafts"):
            return "its class does not set max_drafts (drafts per position it takes: an int >= 1, or None for any)"
        drafts = loaded.max_drafts
        if drafts is not None and (isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1):
            return f"its class sets max_drafts = {drafts!r}; set an int >= 1, or None for any number of drafts"
        optimal = getattr(loaded, "optimal_under", {})
        if not isinstance(optimal, dict) or not all(isinstance(settings, dict) for settings in optimal.values()):
            return f"its optimal_under is {optimal!r}; set a dict of divergence name → dict of parameters"
        bound = loaded.kl_bound_parameter
        if bound is not None and bound not in parameter_defaults(loaded):
            parameters = ", ".join(parameter_defaults(loaded))
            return f"its kl_bound_parameter {bound!r} is not one of its parameters ({parameters})"
        return None

    def class_description(self, cls: type) -> dict[str, Any]:
        return {
            "lossless": cls.lossless,
            "max_drafts": cls.max_drafts,
            "identical_drafts": cls.identical_drafts,
            "token_level": cls.token_level,
            "kl_bound_parameter": cls.kl_bound_parameter,
            "summary": class_summary(cls),
        }

    def verifier_class(self, name: str) -> type[BlockVerifier]:
        """The class of the installed verifier ``name`` (case-insensitive)."""
        return self.plugin_class(name)

    def revisions(self, names: list[str]) -> dict[str, tuple[str, ...]]:
        """Each verifier of ``names`` (the target alone left out) → what changed in its decisions since its first
        release (its class's ``revisions``), for a results folder to record and compare."""
        return {self.canonical(name): self.verifier_class(name).revisions for name in names if not target_alone(name)}

    def told_draft_length(self, verifier: BlockVerifier, draft_length: int) -> None:
        """``verifier.set_draft_length(draft_length)``: its ValueError is one line naming it and the setting; any
        other exception is its fault."""
        try:
            verifier.set_draft_length(draft_length)
        except SpecdecError:
            raise
        except ValueError as error:
            reason = str(error).removeprefix(f"{verifier.name}: ")
            raise UsageError(
                f"verifier '{verifier.name}': {reason} (speculation.draft_length is {draft_length})"
            ) from error
        except Exception as error:
            raise self.fault(verifier.name, f"raised {error_line(error)} in set_draft_length") from error

    def refusal(self, name: str, rows: DraftRows) -> str | None:
        """Why verifier ``name`` cannot take these draft rows (None if it can): its class's
        ``reason_to_refuse``, where a plugin's own exception becomes one line naming the plugin."""
        cls = self.verifier_class(name)
        if rows.dependent and not cls.dependent_drafts:
            takers = ", ".join(self.names_where(lambda verifier: verifier.dependent_drafts))
            return (
                f"verifier '{cls.name}' needs independent draft rows, and drafter '{rows.dependent[0]}' copies its "
                f"first row's first tokens into the others (branch_after); use {takers}, or branch_after: 0"
            )
        try:
            return cls.reason_to_refuse(rows.count, rows.identical_laws)
        except SpecdecError:
            raise
        except Exception as error:
            raise self.fault(self.canonical(name), f"raised {error_line(error)} in reason_to_refuse") from error

    def params_for(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``params`` (a recipe's verifier.params) that verifier ``name`` takes.

        A run that compares several verifiers gives each the parameters it has: ``max_support``
        reaches ``is-lp`` whichever verifier the recipe names.
        """
        accepted = parameter_defaults(self.verifier_class(name))
        return {key: value for key, value in params.items() if key in accepted}

    def with_kl_bound(self, name: str, params: dict[str, Any], bound: float) -> dict[str, Any]:
        """``params`` with verifier ``name``'s KL bound set to ``bound`` (a UsageError if it has none)."""
        parameter = self.verifier_class(name).kl_bound_parameter
        if parameter is None:
            raise self.no_kl_bound([name])
        return {**params, parameter: bound}

    def optimal_name(self, divergence: str) -> str | None:
        """The installed verifier that is optimal under ``divergence`` (it names it in ``optimal_under``), a built-in
        before any plugin's; None where none is. A plugin that fails to load is passed over."""
        built_in = {entry.name for entry in self.entry_points() if entry.built_in}
        for name in sorted(self.names(), key=lambda name: name not in built_in):
            try:
                cls = self.verifier_class(name)
            except SpecdecError:
                continue
            if divergence in cls.optimal_under and cls.kl_bound_parameter is not None:
                return name
        return None

    def optimal_rule(self, divergence: str, bound: float, name: str | None = None) -> "BlockVerifier | None":
        """An instance of the rule optimal under ``divergence`` (``name``, or :meth:`optimal_name`'s) at the bound
        ``bound``, or None where none is installed."""
        name = name or self.optimal_name(divergence)
        if name is None:
            return None
        cls = self.verifier_class(name)
        return self.create(name, {**cls.optimal_under[divergence], cls.kl_bound_parameter: bound})

    def no_kl_bound(self, names: list[str]) -> UsageError:
        """The refusal of --kl for a run whose verifiers ``names`` have no KL bound: the flag would be ignored."""
        bounded = ", ".join(self.names_where(lambda cls: cls.kl_bound_parameter is not None)) or "none installed"
        which = f"verifier '{names[0]}' does not have" if len(names) == 1 else f"none of {', '.join(names)} has"
        return UsageError(f"--kl sets a KL bound, which {which}; verifiers with one: {bounded}")


def load_verifier(name: str, params: dict[str, Any] | None = None) -> BlockVerifier:
    """An instance of the installed verifier ``name`` with ``params``."""
    return VerifierRegistry().create(name, params)
