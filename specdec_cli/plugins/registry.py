"""Finding plugins: verifiers (entry-point group ``specdec.verifiers``) and drafters (``specdec.drafters``).

This module imports neither torch nor any plugin until a plugin class is asked for, so listing
the installed verifiers (``specdec verifiers``) and reading a results folder (``bench --report``)
start at once: :meth:`PluginRegistry.describe` keeps what it learned from the plugin classes in a
cache, keyed by the installed entry points and the files of their modules. :class:`PluginRegistry`
finds, loads and describes plugins of one group; :class:`VerifierRegistry` adds what core asks of
verifiers, and :class:`~specdec_cli.plugins.drafter_registry.DrafterRegistry` of drafters.

Plugins are third-party code, and a broken one must not take the command down with it: whatever a module raises on
import (``sys.exit`` included), a class that breaks the contract, or two packages claiming one name becomes a load
failure that ``specdec verifiers`` lists and that using the name reports in one line. stevedore imports each class and
hands what its import raised to :meth:`PluginRegistry.load_failed`, its ``on_load_failure_callback``.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stevedore.extension import ExtensionManager, OnLoadFailureCallbackT

from ..base.errors import SpecdecError, UsageError
from ..base.inputs import cache_dir, write_cache_file
from ..base.recipe import target_alone
from .parameters import PluginParameterError, PluginParameterValueError, parameter_defaults, parameter_specs

if TYPE_CHECKING:
    from .draft_rows import DraftRows
    from .verifiers import BlockVerifier

ENTRY_POINT_GROUP = "specdec.verifiers"
BUILT_IN_DISTRIBUTION = "specdec-cli"
SETTLE_NS = 2 * 10**9
"""A file modified this recently may be edited again within its filesystem's time resolution (two seconds
on FAT) without its modification time changing, so descriptions read from it are not cached."""

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


class PluginFault(SpecdecError):
    """A plugin that broke its contract at run time (an exception, or a result it cannot have made): exit 1."""


# What verifiers raise, under the names their callers already catch.
VerifierParameterError, VerifierParameterValueError, VerifierFault = (
    PluginParameterError,
    PluginParameterValueError,
    PluginFault,
)


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``: what a user is shown of an error that is not theirs."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@dataclass(frozen=True)
class PluginEntry:
    """One entry point of the group, as the distribution that declares it lists it."""

    name: str
    value: str
    """``module:attribute``"""
    distribution: str
    version: str

    @property
    def package(self) -> str:
        return f"{self.distribution} {self.version}"

    @property
    def built_in(self) -> bool:
        return self.distribution.lower().replace("_", "-").replace(".", "-") == BUILT_IN_DISTRIBUTION


class PluginRegistry:
    """The one way plugins of one kind are found: entry points of the group ``group``.

    Names are case-insensitive. :meth:`entry_points` lists what is installed and :meth:`load_class` is the one place a
    plugin class is loaded (by stevedore); tests and embedders override them. A name declared by the built-in
    distribution is always the built-in; a plugin that fails to load (or whose name is taken) is kept with its error,
    so the listing command can show it and using it names the failure. A subclass names its ``kind`` ("verifier"),
    ``group``, ``contract_module`` (the file of its base class, which decides what a description holds), and says
    what it checks and describes of a class.
    """

    group: str
    kind: str
    contract_module: str
    parameters_hint: str
    """How a user changes a plugin's parameters, ending the line of a parameter error."""
    description_types: dict[str, tuple[type, ...]]

    def __init__(self) -> None:
        self._classes: dict[str, type] = {}
        self._failures: dict[str, str] = {}
        self._notes: dict[str, str] = {}
        self._descriptions: dict[str, dict[str, Any]] | None = None

    def entry_points(self) -> list[PluginEntry]:
        """Every installed entry point of the group, as stevedore lists it, with the distribution that declares it."""
        listed = _GroupListing(self.group).list_entry_points()
        return [PluginEntry(point.name, point.value, *declaring) for point, declaring in _declared_by(listed)]

    @functools.cached_property
    def _claims(self) -> _Claims:
        return _resolve(self.entry_points(), self.kind)

    def names(self) -> list[str]:
        """The installed plugins that load (loading each once)."""
        return sorted(name for name in self._claims.winners if self._loads(name))

    def _loads(self, name: str) -> bool:
        try:
            self.load_class(name)
        except UsageError:
            return False
        return True

    def failures(self) -> dict[str, str]:
        """name → why it cannot be used, for installed plugins that failed to load or lost their name;
        a plugin shadowed by a built-in is listed as ``name (package version)``."""
        self.names()
        return {**self._claims.failures, **self._failures}

    def load_class(self, name: str) -> type:
        """The class of installed plugin ``name`` (its entry-point name, lower case), loaded once."""
        if name not in self._classes:
            if name in self._claims.failures:
                raise UsageError(f"{self.kind} '{name}' cannot be used: {self._claims.failures[name]}")
            if name not in self._claims.winners:
                raise UsageError(self._unknown(name))
            if name not in self._failures:
                self._load(name, self._claims.winners[name])
            if name in self._failures:
                raise UsageError(f"{self.kind} '{name}' is installed but failed to load: {self._failures[name]}")
        return self._classes[name]

    def _load(self, name: str, entry: PluginEntry) -> None:
        """Import ``entry`` with stevedore and check its class against the contract, keeping a failure, not raising."""
        extensions = _ChosenEntryPoint(EntryPoint(entry.name, entry.value, self.group), self.load_failed).extensions
        if not extensions:
            return  # load_failed has recorded why
        loaded = extensions[0].plugin
        problem = self.contract_problem(loaded)
        if problem is not None:
            self._failures[name] = problem
            return
        declared = getattr(loaded, "name", None)
        if str(declared).lower() != name:
            # Every message (the base class's included) and every table must use the name users type.
            self._notes[name] = f"its class calls itself {declared!r}; the entry-point name {name!r} is the one used"
            loaded = type(
                loaded.__name__,
                (loaded,),
                {"name": name, "__module__": loaded.__module__, "__qualname__": loaded.__qualname__},
            )
        self._classes[name] = loaded

    def load_failed(self, manager: ExtensionManager, entry_point: EntryPoint, error: BaseException) -> None:
        """stevedore's ``on_load_failure_callback``: importing ``entry_point`` raised ``error``, kept as one line."""
        if isinstance(error, SystemExit):
            reason = f"it called sys.exit({'' if error.code is None else repr(error.code)}) on import"
        else:
            reason = error_line(error)
        self._failures[entry_point.name.lower()] = reason

    def contract_problem(self, loaded: Any) -> str | None:
        """What makes ``loaded`` unusable as a plugin of this kind, in the words of its author's fix, or None."""
        raise NotImplementedError

    def package(self, name: str) -> str:
        """'distribution version' that provides plugin ``name`` (or the module of a class registered otherwise)."""
        entry = self._claims.winners.get(name)
        return entry.package if entry is not None else f"module {self.load_class(name).__module__}"

    def fault(self, name: str, what: str) -> PluginFault:
        """The error for plugin ``name`` doing ``what`` ("returned None instead of a BlockDecision") at run time."""
        return PluginFault(
            f"{self.kind} '{name}' {what}; the plugin is at fault ({self.package(name)}): report it to its author"
        )

    def describe(self) -> dict[str, dict[str, Any]]:
        """name → what core and the CLI read from each installed plugin's class (the keys of
        ``description_types``), without importing the plugins when the cache is current; a plugin
        that fails to load has only its ``error``."""
        if self._descriptions is None:
            # A registry whose loading a test or an embedder overrides describes other classes: its own key.
            registry = f"{type(self).__module__}.{type(self).__qualname__}"
            key, settled = _files_stamp(self.entry_points(), registry, self.contract_module)
            path = cache_dir() / f"{self.kind}s-{key}.json"
            self._descriptions = _read_descriptions(path, self.description_types)
            if self._descriptions is None:
                self._descriptions = {name: self._description(name) for name in self.names()}
                self._descriptions |= {name: {"error": error} for name, error in self.failures().items()}
                if settled:
                    write_cache_file(path, json.dumps(self._descriptions))
        return self._descriptions

    def _description(self, name: str) -> dict[str, Any]:
        cls = self.load_class(name)
        return {
            **self.class_description(cls),
            "parameters": plain_parameters(cls),
            "parameter_docs": parameter_docs(cls),
            "package": self.package(name),
            "note": self._notes.get(name),
        }

    def class_description(self, cls: type) -> dict[str, Any]:
        """What a description holds of ``cls`` besides its parameters, package and note."""
        raise NotImplementedError

    def canonical(self, name: str) -> str:
        """The installed plugin's entry-point name for ``name`` (case-insensitive), or a UsageError."""
        key = name.strip().lower()
        if key not in self.names() and key not in self.failures():
            raise UsageError(self._unknown(name))
        return key

    def _unknown(self, name: str) -> str:
        """The line for a name no installed plugin has: the closest name when one is close (a typo), else them all."""
        close = difflib.get_close_matches(name.strip().lower(), self.names(), n=1)
        if close:
            return f"unknown {self.kind} '{name}'; did you mean '{close[0]}'? (`specdec {self.kind}s` lists them all)"
        installed = ", ".join(self.names()) or "none"
        return f"unknown {self.kind} '{name}'; installed {self.kind}s: {installed} (see `specdec {self.kind}s`)"

    def plugin_class(self, name: str) -> type:
        """The class of the installed plugin ``name`` (case-insensitive)."""
        return self.load_class(self.canonical(name))

    def names_where(self, wanted: Callable[[type], bool]) -> list[str]:
        """Installed plugins whose class satisfies ``wanted`` (for suggestions in messages)."""
        return [name for name in self.names() if wanted(self.load_class(name))]

    def create(self, name: str, params: dict[str, Any] | None = None, set_by: str | None = None) -> Any:
        """An instance of ``name``; a plugin's own ValueError or TypeError about its parameters becomes
        one line for the user (PluginParameterError), naming the plugin; any other exception from
        its constructor is the plugin's fault (PluginFault, the original chained for ``--debug``).
        ``set_by`` names the flag and value that gave the parameters (``--kl -1``): the line then starts
        with them, where it would otherwise end with how to fix the recipe."""
        key = self.canonical(name)
        cls = self.load_class(key)
        try:
            return cls(**(params or {}))
        except PluginParameterError as error:  # the base class's check (check_parameters): it names the plugin
            raise PluginParameterError(self._parameter_line(str(error), params, set_by)) from error
        except SpecdecError:
            raise
        except (ValueError, TypeError) as error:
            reason = str(error).removeprefix(f"{key}: ")
            wrapper = PluginParameterValueError if isinstance(error, ValueError) else PluginParameterError
            raise wrapper(self._parameter_line(f"{self.kind} '{key}': {reason}", params, set_by)) from error
        except Exception as error:
            raise self.fault(key, f"failed to start: {error_line(error)}") from error

    def _parameter_line(self, problem: str, params: dict[str, Any] | None, set_by: str | None) -> str:
        if set_by is not None:
            return f"{set_by}: {problem}"
        return f"{problem} (given {params or {}}; {self.parameters_hint})"


class VerifierRegistry(PluginRegistry):
    """Verifiers: entry points of the group ``specdec.verifiers``, and what core asks of their classes."""

    group = ENTRY_POINT_GROUP
    kind = "verifier"
    contract_module = "verifiers.py"
    parameters_hint = "fix verifier.params in the recipe, or --set verifier.params.NAME=VALUE"
    description_types = DESCRIPTION_TYPES

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


REQUIRED = "<required>"
"""How a description shows a parameter without a default."""


def parameter_docs(cls: type) -> dict[str, dict[str, str | None]]:
    """A plugin class's parameters' types and descriptions, as its listing shows them."""
    return {
        name: {"type": spec.type_name, "description": spec.description} for name, spec in parameter_specs(cls).items()
    }


def class_summary(cls: type) -> str:
    """The first paragraph of a plugin class's own docstring, or else of its module's, on one line (the contract's
    base classes' docstrings describe the contract, not the plugin)."""
    plugin_classes = itertools.takewhile(lambda klass: not klass.__module__.startswith(f"{__package__}."), cls.__mro__)
    texts = (
        text
        for klass in plugin_classes
        for text in (klass.__dict__.get("__doc__"), getattr(sys.modules.get(klass.__module__), "__doc__", None))
    )
    text = next((text for text in texts if text and text.strip()), "")
    return " ".join(inspect.cleandoc(text).split("\n\n")[0].split())


def plain_parameters(cls: type) -> dict[str, Any]:
    """A plugin class's parameters and defaults, each default as JSON can hold it (others as their repr)."""
    return {
        key: REQUIRED if value is inspect.Parameter.empty else value if _plain(value) else repr(value)
        for key, value in parameter_defaults(cls).items()
    }


@dataclass(frozen=True)
class _Claims:
    """Who gets each name: the entry point that provides it, and why the others cannot be used."""

    winners: dict[str, PluginEntry]
    failures: dict[str, str]


def _resolve(entries: list[PluginEntry], kind: str) -> _Claims:
    """The built-in distribution keeps its names; a name two third-party packages declare is nobody's.
    One class declared twice (a project installed under an old name as well) is no conflict."""
    by_name: dict[str, list[PluginEntry]] = {}
    for entry in sorted(entries, key=lambda e: not e.built_in):
        claimants = by_name.setdefault(entry.name.lower(), [])
        if all(other.value != entry.value for other in claimants):
            claimants.append(entry)
    winners: dict[str, PluginEntry] = {}
    failures: dict[str, str] = {}
    for name, (first, *others) in by_name.items():
        if first.built_in:
            winners[name] = first
            for other in others:
                failures[f"{name} ({other.package})"] = (
                    f"'{other.name}' from {other.package} conflicts with the built-in {kind} of "
                    f"{first.distribution}; rename its entry point"
                )
        elif others:
            packages = " and ".join(f"{e.package} ({e.value})" for e in (first, *others))
            failures[name] = f"{packages} both declare it; uninstall one of them, or have one rename its entry point"
        else:
            winners[name] = first
    return _Claims(winners, failures)


class _ChosenEntryPoint(ExtensionManager):
    """stevedore's manager of the one entry point that holds a name: stevedore's own listing of the group would
    import every entry point of that name (a shadowed plugin's too) and misses those a test or an embedder lists."""

    def __init__(self, entry_point: EntryPoint, on_load_failure: OnLoadFailureCallbackT) -> None:
        self.entry_point = entry_point
        try:
            super().__init__(entry_point.group, invoke_on_load=False, on_load_failure_callback=on_load_failure)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: B036, BLE001 (stevedore lets sys.exit and an AssertionError through)
            on_load_failure(self, entry_point, error)
            self.extensions = []

    def list_entry_points(self) -> list[EntryPoint]:
        return [self.entry_point]


class _GroupListing(ExtensionManager):
    """stevedore's list of a group's entry points, from its cache of the environment's (rebuilt when a folder of
    sys.path or an entry_points.txt in it changes), importing none of them: a plugin is imported when it is used."""

    def __init__(self, group: str) -> None:
        super().__init__(group, invoke_on_load=False)

    def _load_plugins(self, *args: Any, **kwargs: Any) -> list:
        return []

    def list_entry_points(self) -> list[EntryPoint]:
        """stevedore's listing; the environment's own where stevedore's cache file holds what no listing can (it
        trusts any JSON it reads there: a damaged file would otherwise take every command down)."""
        try:
            listed = super().list_entry_points()
            if all(_plausible(point, self.namespace) for point in listed):
                return listed
        except Exception:  # noqa: BLE001 (whatever reading a damaged cache file raises)
            pass
        self.ENTRY_POINT_CACHE.pop(self.namespace, None)
        return list(importlib.metadata.entry_points(group=self.namespace))


def _plausible(point: object, group: str) -> bool:
    """An entry point of ``group`` whose value names a module (and an attribute)."""
    return (
        isinstance(point, EntryPoint)
        and point.group == group
        and isinstance(point.name, str)
        and bool(point.name.strip())
        and isinstance(point.value, str)
        and EntryPoint.pattern.match(point.value) is not None
    )


def _declared_by(listed: list[EntryPoint]) -> list[tuple[EntryPoint, tuple[str, str]]]:
    """Each entry point with (distribution, version) of the package that declares it. stevedore's cache keeps no
    distribution: the built-in distribution's own entry points are read first, and the others' only when some
    entry point is not the built-in's (a third-party plugin is installed)."""
    own: dict[tuple[str, str, str], tuple[str, str]] = {}
    try:
        built_in = importlib.metadata.distribution(BUILT_IN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a source tree run without being installed
        pass
    else:
        own = dict.fromkeys(((p.name, p.value, p.group) for p in built_in.entry_points), _package(built_in))
    declared = dict(own)
    packages: dict[int, tuple[str, str]] = {}  # a distribution's metadata is parsed once: it is slow
    for group in {point.group for point in listed if (point.name, point.value, point.group) not in own}:
        for point in importlib.metadata.entry_points(group=group):
            if point.dist is not None:
                if id(point.dist) not in packages:
                    packages[id(point.dist)] = _package(point.dist)
                declared[(point.name, point.value, group)] = packages[id(point.dist)]
    return [(point, declared.get((point.name, point.value, point.group), ("unknown", "?"))) for point in listed]


def _package(distribution: importlib.metadata.Distribution) -> tuple[str, str]:
    """(name, version) of ``distribution``, from one parse of its metadata."""
    metadata = distribution.metadata
    return metadata["Name"], metadata["Version"]


def class_problem(loaded: Any, base: type, flags: tuple[str, ...]) -> str | None:
    """What makes ``loaded`` unusable as a concrete subclass of ``base`` that sets each of ``flags`` to a bool,
    or None."""
    if not (isinstance(loaded, type) and issubclass(loaded, base)):
        kind = "a class" if isinstance(loaded, type) else f"a {type(loaded).__name__}"
        return f"it names {kind}, not a {base.__name__} subclass ({base.__module__})"
    if inspect.isabstract(loaded):
        return f"its class leaves abstract methods unimplemented: {', '.join(sorted(loaded.__abstractmethods__))}"
    for flag in flags:
        if not isinstance(getattr(loaded, flag, None), bool):
            return f"its class does not set {flag} to True or False"
    return None


def _files_stamp(entries: list[PluginEntry], registry: str, contract_module: str) -> tuple[str, bool]:
    """(The cache key of the descriptions, whether no file was modified within :data:`SETTLE_NS`: a later edit then
    changes the key). A plugin installed, removed, upgraded or edited (any file of its top-level package, where its
    class may live in a submodule) gives another key. This module and the plugins' contract (``contract_module``)
    count too, since they decide what a description holds."""
    tops = sorted({entry.value.split(":")[0].split(".")[0] for entry in entries})
    files = [
        Path(__file__),
        Path(__file__).with_name("parameters.py"),
        Path(__file__).with_name(contract_module),
        *(f for top in tops for f in _module_files(top)),
    ]
    stats = []
    for file in files:
        try:
            status = file.stat()
        except OSError:
            continue
        stats.append((str(file), status.st_size, status.st_mtime_ns))
    described = [sys.version, registry, sorted((e.name, e.value, e.package) for e in entries), stats]
    key = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]
    newest = max((mtime for *_, mtime in stats), default=0)
    return key, newest < time.time_ns() - SETTLE_NS


def _module_files(top: str) -> list[Path]:
    """The source files of top-level module or package ``top``, found without importing it."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is not None and spec.submodule_search_locations:
        return sorted(file for folder in spec.submodule_search_locations for file in Path(folder).rglob("*.py"))
    return [Path(spec.origin)] if spec is not None and spec.has_location and spec.origin else []


def _read_descriptions(path: Path, types: dict[str, tuple[type, ...]]) -> dict[str, dict[str, Any]] | None:
    """The cached descriptions, or None when the file is missing, unreadable or of another shape."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and all(_described(info, types) for info in data.values()) else None


def _described(info: Any, types: dict[str, tuple[type, ...]]) -> bool:
    if isinstance(info, dict) and set(info) == {"error"}:
        return isinstance(info["error"], str)
    return (
        isinstance(info, dict)
        and set(info) == set(types)
        and all(isinstance(info[key], kinds) for key, kinds in types.items())
    )


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def load_verifier(name: str, params: dict[str, Any] | None = None) -> BlockVerifier:
    """An instance of the installed verifier ``name`` with ``params``."""
    return VerifierRegistry().create(name, params)
