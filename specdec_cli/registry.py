"""Finding verifier plugins: the entry-point group ``specdec.verifiers``, read through stevedore.

This module imports neither torch nor any plugin until a verifier class is asked for, so listing
the installed verifiers (``specdec verifiers``) and reading a results folder (``bench --report``)
start at once: :meth:`VerifierRegistry.describe` keeps what it learned from the plugin classes in a
cache, keyed by the installed entry points and the modification times of their modules.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stevedore import extension

from .errors import UsageError
from .inputs import cache_dir, write_cache_file

if TYPE_CHECKING:
    from .verifiers import BlockVerifier

ENTRY_POINT_GROUP = "specdec.verifiers"


class VerifierParameterError(UsageError, TypeError):
    """An unknown or ill-typed verifier parameter (a TypeError too, as Python callers expect)."""


class VerifierParameterValueError(VerifierParameterError, ValueError):
    """A verifier's own ValueError about a parameter's value, as one line (still a ValueError)."""


def parameter_defaults(cls: type) -> dict[str, Any]:
    """A verifier class's parameters and their defaults, from its constructor's signature."""
    signature = inspect.signature(cls.__init__)
    return {
        name: p.default
        for name, p in signature.parameters.items()
        if name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


class VerifierRegistry:
    """The one way verifiers are found: entry points of the group ``specdec.verifiers``, through stevedore.

    Names are case-insensitive. :meth:`load_class` is the one place a plugin class is loaded;
    tests and embedders override it. A plugin that fails to import is kept with its error, so
    ``specdec verifiers`` can show it and using it names the failure.
    """

    group = ENTRY_POINT_GROUP

    def __init__(self) -> None:
        self._manager: extension.ExtensionManager | None = None
        self._failures: dict[str, str] = {}
        self._descriptions: dict[str, dict[str, Any]] | None = None

    def _extensions(self) -> extension.ExtensionManager:
        if self._manager is None:
            def failed(_manager, entry_point, error) -> None:
                self._failures[entry_point.name] = f"{type(error).__name__}: {error}"

            self._manager = extension.ExtensionManager(
                self.group, invoke_on_load=False, on_load_failure_callback=failed
            )
        return self._manager

    def names(self) -> list[str]:
        """The installed verifiers that load."""
        return sorted(set(self._extensions().names()))

    def failures(self) -> dict[str, str]:
        """name → error, for installed plugins that failed to load."""
        self._extensions()
        return dict(self._failures)

    def load_class(self, name: str) -> type[BlockVerifier]:
        if name in self.failures():
            raise UsageError(f"verifier '{name}' is installed but failed to load: {self._failures[name]}")
        return self._extensions()[name].plugin

    def package(self, name: str) -> str:
        """'distribution version' that provides verifier ``name`` (stevedore does not keep it)."""
        for dist in importlib.metadata.distributions():
            if any(ep.group == self.group and ep.name == name for ep in dist.entry_points):
                return f"{dist.metadata['Name']} {dist.version}"
        return self._extensions()[name].entry_point.value

    def describe(self) -> dict[str, dict[str, Any]]:
        """name → what core and the CLI read from each installed verifier's class (lossless, max_drafts,
        identical_drafts, token_level, kl_bound_parameter, parameters, package), without importing the
        plugins when the cache is current; a plugin that fails to load has only its ``error``."""
        if self._descriptions is None:
            path = cache_dir() / f"verifiers-{_entry_points_key(self.group)}.json"
            try:
                self._descriptions = json.loads(path.read_text())
            except (OSError, ValueError):
                self._descriptions = {name: self._description(name) for name in self.names()}
                self._descriptions |= {name: {"error": error} for name, error in self.failures().items()}
                write_cache_file(path, json.dumps(self._descriptions))
        return self._descriptions

    def _description(self, name: str) -> dict[str, Any]:
        cls = self.load_class(name)
        parameters = {key: value if _plain(value) else repr(value) for key, value in parameter_defaults(cls).items()}
        return {"lossless": bool(getattr(cls, "lossless", False)), "max_drafts": getattr(cls, "max_drafts", None),
                "identical_drafts": cls.identical_drafts, "token_level": cls.token_level,
                "kl_bound_parameter": cls.kl_bound_parameter, "parameters": parameters,
                "package": self.package(name)}  # fmt: skip

    def canonical(self, name: str) -> str:
        """The installed verifier's entry-point name for ``name`` (case-insensitive), or a UsageError."""
        key = name.strip().lower()
        if key not in self.names() and key not in self.failures():
            installed = ", ".join(self.names()) or "none"
            raise UsageError(f"unknown verifier '{name}'; installed verifiers: {installed} (see `specdec verifiers`)")
        return key

    def verifier_class(self, name: str) -> type[BlockVerifier]:
        """The class of the installed verifier ``name`` (case-insensitive)."""
        return self.load_class(self.canonical(name))

    def names_where(self, wanted: Callable[[type[BlockVerifier]], bool]) -> list[str]:
        """Installed verifiers whose class satisfies ``wanted`` (for suggestions in messages)."""
        return [name for name in self.names() if wanted(self.load_class(name))]

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
            bounded = ", ".join(self.names_where(lambda cls: cls.kl_bound_parameter is not None)) or "none installed"
            raise UsageError(f"--kl sets a KL bound, which verifier '{name}' does not have; "
                             f"verifiers with one: {bounded}")  # fmt: skip
        return {**params, parameter: bound}

    def create(self, name: str, params: dict[str, Any] | None = None) -> BlockVerifier:
        """An instance of ``name``; a plugin's own ValueError or TypeError about its parameters becomes
        one line for the user (VerifierParameterError), naming the verifier."""
        key = self.canonical(name)
        cls = self.load_class(key)
        try:
            return cls(**(params or {}))
        except VerifierParameterError:
            raise
        except (ValueError, TypeError) as error:
            reason = str(error).removeprefix(f"{key}: ")
            wrapper = VerifierParameterValueError if isinstance(error, ValueError) else VerifierParameterError
            raise wrapper(
                f"verifier '{key}': {reason} (given {params or {}}; fix verifier.params in the recipe, "
                "or --set verifier.params.NAME=VALUE)"
            ) from error


def _entry_points_key(group: str) -> str:
    """A hash of the group's entry points and their modules' modification times: a plugin installed,
    removed or edited gives another key, so a stale description is never read."""
    parts: list[Any] = [sys.version]
    for entry_point in extension.ExtensionManager.make_test_instance([], namespace=group).list_entry_points():
        module = entry_point.value.split(":")[0]
        try:
            spec = importlib.util.find_spec(module)
            origin = spec.origin if spec is not None else None
            stamp = os.stat(origin).st_mtime_ns if origin else None
        except (ImportError, OSError, ValueError):
            stamp = None
        parts.append([entry_point.name, entry_point.value, stamp])
    return hashlib.sha256(json.dumps(sorted(parts, key=str)).encode()).hexdigest()[:16]


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
