"""Discovery with stevedore: a group's entry points, who gets each name, and loading the one that holds a name.

Listing imports no plugin: an ``ExtensionManager`` over the group reads stevedore's cache of the environment's entry
points. Loading imports one: an ``ExtensionManager`` over the single entry point that holds the name, whose
load-failure callback is handed whatever the import raised (``sys.exit`` included). stevedore's cache keeps no
distribution, and a name's claims need one (a built-in keeps its names, two third-party packages declaring one name
lose it): the built-in distribution's own entry points are read from its metadata, and the other distributions'
only when a third-party plugin is installed.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Any

from stevedore.extension import ExtensionManager, OnLoadFailureCallbackT

BUILT_IN_DISTRIBUTION = "specdec-cli"


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


@dataclass(frozen=True)
class Claims:
    """Who gets each name: the entry point that provides it, and why the others cannot be used."""

    winners: dict[str, PluginEntry]
    failures: dict[str, str]


def installed_entries(group: str) -> list[PluginEntry]:
    """Every installed entry point of ``group``, as stevedore lists it, with the distribution that declares it."""
    listed = _GroupListing(group).list_entry_points()
    return [PluginEntry(point.name, point.value, *declaring) for point, declaring in _declared_by(listed)]


def resolve_claims(entries: list[PluginEntry], kind: str) -> Claims:
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
    return Claims(winners, failures)


def load_entry(entry: PluginEntry, group: str, on_load_failure: OnLoadFailureCallbackT) -> Any | None:
    """What ``entry`` names, imported by stevedore (its module alone), or None once ``on_load_failure`` knows why."""
    extensions = _ChosenEntryPoint(EntryPoint(entry.name, entry.value, group), on_load_failure).extensions
    return extensions[0].plugin if extensions else None


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
