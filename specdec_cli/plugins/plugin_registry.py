"""A registry of one kind of plugin: its names, its classes loaded one at a time, their instances and descriptions.

A name is an entry point's (:mod:`.discovery` lists and loads them with stevedore) or one added in-process with
:meth:`PluginRegistry.add` (tests, embedders: no distribution, no subclass). Either way the class meets the
contract's check before it is used, and a class that fails it is a listed failure, not the end of the command.
Looking up one name imports that plugin alone; listing or describing them all loads them all, or reads their
descriptions from the cache (:mod:`.descriptions`) without importing torch or a plugin.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint
from typing import Any

from stevedore.extension import ExtensionManager

from ..base.errors import SpecdecError, UsageError
from .descriptions import DescriptionCache, Descriptions, parameter_docs, plain_parameters
from .discovery import Claims, PluginEntry, installed_entries, load_entry, resolve_claims
from .parameters import PluginParameterError, PluginParameterValueError


class PluginFault(SpecdecError):
    """A plugin that broke its contract at run time (an exception, or a result it cannot have made): exit 1."""


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``: what a user is shown of an error that is not theirs."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


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


class PluginRegistry:
    """The one way plugins of one kind are found: entry points of the group ``group``, and classes added in-process.

    Names are case-insensitive. :meth:`load_class` is the one place a plugin class is loaded. A name declared by the
    built-in distribution is always the built-in; a plugin that fails to load (or whose name is taken) is kept with
    its error, so the listing command can show it and using it names the failure. A subclass names its ``kind``
    ("verifier") and ``group``, and says what it checks (:meth:`contract_problem`) and describes of a class.
    """

    group: str
    kind: str
    parameters_hint: str
    """How a user changes a plugin's parameters, ending the line of a parameter error."""
    description_types: dict[str, tuple[type, ...]]

    def __init__(self, extra: Mapping[str, type] | None = None) -> None:
        """``extra``: name → class, each added as :meth:`add` adds it."""
        self._classes: dict[str, type] = {}
        self._failures: dict[str, str] = {}
        self._notes: dict[str, str] = {}
        self._descriptions: Descriptions | None = None
        self._added: dict[str, type] = {}
        for name, cls in (extra or {}).items():
            self.add(name, cls)

    def add(self, name: str, cls: type) -> None:
        """Make ``cls`` the plugin ``name`` of this registry, as if an installed entry point named it: it meets the
        same contract check when first used (one that fails it is listed in :meth:`failures`, and using it is the
        same one-line refusal), and a class calling itself otherwise runs under ``name``. It takes the name over
        an installed plugin's."""
        key = name.strip().lower()
        self._added[key] = cls
        self._classes.pop(key, None)
        self._failures.pop(key, None)
        self._notes.pop(key, None)
        self._descriptions = None

    def entry_points(self) -> list[PluginEntry]:
        """Every installed entry point of the group, with the distribution that declares it."""
        return installed_entries(self.group)

    @functools.cached_property
    def _claims(self) -> Claims:
        return resolve_claims(self.entry_points(), self.kind)

    def names(self) -> list[str]:
        """The installed or added plugins that load (loading each once)."""
        return [name for name in sorted({*self._claims.winners, *self._added}) if self._loads(name)]

    def _loads(self, name: str) -> bool:
        try:
            self.load_class(name)
        except UsageError:
            return False
        return True

    def failures(self) -> dict[str, str]:
        """name → why it cannot be used, for plugins that failed to load or lost their name; a plugin shadowed by
        a built-in is listed as ``name (package version)``."""
        self.names()
        claimed = {name: why for name, why in self._claims.failures.items() if name not in self._added}
        return {**claimed, **self._failures}

    def load_class(self, name: str) -> type:
        """The class of plugin ``name`` (its entry-point name, lower case), loaded once: its module alone is
        imported."""
        if name not in self._classes:
            if name not in self._added:
                if name in self._claims.failures:
                    raise UsageError(f"{self.kind} '{name}' cannot be used: {self._claims.failures[name]}")
                if name not in self._claims.winners:
                    raise UsageError(self._unknown(name))
            if name not in self._failures:
                self._load(name)
            if name in self._failures:
                raise UsageError(f"{self.kind} '{name}' is installed but failed to load: {self._failures[name]}")
        return self._classes[name]

    def _load(self, name: str) -> None:
        """Load ``name`` (an added class, or its entry point with stevedore) and check it against the contract,
        keeping a failure, not raising."""
        if name in self._added:
            loaded = self._added[name]
        else:
            loaded = load_entry(self._claims.winners[name], self.group, self.load_failed)
            if loaded is None:
                return  # load_failed has recorded why
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

    def class_description(self, cls: type) -> dict[str, Any]:
        """What a description holds of ``cls`` besides its parameters, package and note."""
        raise NotImplementedError

    def package(self, name: str) -> str:
        """'distribution version' that provides plugin ``name`` (or the module of a class added in-process)."""
        entry = None if name in self._added else self._claims.winners.get(name)
        return entry.package if entry is not None else f"module {self.load_class(name).__module__}"

    def fault(self, name: str, what: str) -> PluginFault:
        """The error for plugin ``name`` doing ``what`` ("returned None instead of a BlockDecision") at run time."""
        return PluginFault(
            f"{self.kind} '{name}' {what}; the plugin is at fault ({self.package(name)}): report it to its author"
        )

    def describe(self) -> Descriptions:
        """name → what core and the CLI read from each plugin's class (the keys of ``description_types``), without
        importing the installed plugins when the cache is current; a plugin that fails to load has only its
        ``error``."""
        if self._descriptions is None:
            # A test's or an embedder's registry may load other classes: its type and added names key its own file.
            registry = f"{type(self).__module__}.{type(self).__qualname__} {sorted(self._added)}"
            cache = DescriptionCache.of(self.kind, self.entry_points(), registry, self.description_types)
            installed = cache.read()
            if installed is None:
                installed = self._installed_descriptions()
                cache.write(installed)
            added = {
                name: self._description(name) if self._loads(name) else {"error": self._failures[name]}
                for name in sorted(self._added)
            }
            self._descriptions = installed | added
        return self._descriptions

    def _installed_descriptions(self) -> Descriptions:
        """The descriptions of the installed plugins that load, and the failures of the others (loading them all)."""
        loaded = {name: self._description(name) for name in self.names() if name not in self._added}
        return loaded | {name: {"error": error} for name, error in self.failures().items() if name not in self._added}

    def _description(self, name: str) -> dict[str, Any]:
        cls = self.load_class(name)
        return {
            **self.class_description(cls),
            "parameters": plain_parameters(cls),
            "parameter_docs": parameter_docs(cls),
            "package": self.package(name),
            "note": self._notes.get(name),
        }

    def canonical(self, name: str) -> str:
        """The plugin's entry-point name for ``name`` (case-insensitive), or a UsageError; looking it up loads no
        plugin."""
        key = name.strip().lower()
        if key in self._added or key in self._claims.winners or key in self._claims.failures:
            return key
        raise UsageError(self._unknown(name))

    def _unknown(self, name: str) -> str:
        """The line for a name no plugin has: the closest name when one is close (a typo), else them all."""
        close = difflib.get_close_matches(name.strip().lower(), self.names(), n=1)
        if close:
            return f"unknown {self.kind} '{name}'; did you mean '{close[0]}'? (`specdec {self.kind}s` lists them all)"
        installed = ", ".join(self.names()) or "none"
        return f"unknown {self.kind} '{name}'; installed {self.kind}s: {installed} (see `specdec {self.kind}s`)"

    def plugin_class(self, name: str) -> type:
        """The class of the plugin ``name`` (case-insensitive)."""
        return self.load_class(self.canonical(name))

    def names_where(self, wanted: Callable[[type], bool]) -> list[str]:
        """Plugins whose class satisfies ``wanted`` (for suggestions in messages)."""
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
