"""What a listing shows of a plugin class, and the cache that keeps it so that listing imports no plugin.

A registry's descriptions are kept in one JSON file of the cache folder, named by a key of everything they are read
from: the installed entry points, the files of the plugins' top-level packages, the registry's own class, and the
files of ``specdec_cli/plugins/`` (the contracts and the registry, which decide what a description holds). A file is
written whole or not at all; one that is unreadable or of another shape than the registry's description types is
rebuilt, and none is written while a file it was read from may still change without its stamp changing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.inputs import cache_dir, write_cache_file
from .discovery import PluginEntry
from .parameters import parameter_defaults, parameter_specs

SETTLE_NS = 2 * 10**9
"""A file modified this recently may be edited again within its filesystem's time resolution (two seconds
on FAT) without its modification time changing, so descriptions read from it are not cached."""
REQUIRED = "<required>"
"""How a description shows a parameter without a default."""

Descriptions = dict[str, dict[str, Any]]
"""name → what a listing shows of the plugin (a registry's description types), or only its ``error``."""


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


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


@dataclass(frozen=True)
class DescriptionCache:
    """The file that keeps one registry's descriptions, for one state of everything they are read from."""

    path: Path
    settled: bool
    """No file they are read from changed within :data:`SETTLE_NS`: a later edit then changes the key."""
    types: dict[str, tuple[type, ...]]
    """key → the types its value may have, in a description of a plugin that loads."""

    @classmethod
    def of(
        cls, kind: str, entries: list[PluginEntry], registry: str, types: dict[str, tuple[type, ...]]
    ) -> DescriptionCache:
        """The cache of the descriptions of ``kind`` plugins ``entries``, as the registry named ``registry`` (a
        test's or an embedder's registry may describe other classes) makes them."""
        key, settled = _files_stamp(entries, registry)
        return cls(cache_dir() / f"{kind}s-{key}.json", settled, types)

    def read(self) -> Descriptions | None:
        """The kept descriptions, or None when the file is missing, unreadable or of another shape."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and all(map(self._described, data.values())) else None

    def write(self, descriptions: Descriptions) -> None:
        """Keep ``descriptions`` (atomically), unless a file they were read from may still change unseen."""
        if self.settled:
            write_cache_file(self.path, json.dumps(descriptions))

    def _described(self, info: Any) -> bool:
        if isinstance(info, dict) and set(info) == {"error"}:
            return isinstance(info["error"], str)
        return (
            isinstance(info, dict)
            and set(info) == set(self.types)
            and all(isinstance(info[key], kinds) for key, kinds in self.types.items())
        )


def _files_stamp(entries: list[PluginEntry], registry: str) -> tuple[str, bool]:
    """(The cache key of the descriptions, whether no file was modified within :data:`SETTLE_NS`). A plugin installed,
    removed, upgraded or edited (any file of its top-level package, where its class may live in a submodule) gives
    another key, and so does an edit of this folder's files."""
    tops = sorted({entry.value.split(":")[0].split(".")[0] for entry in entries})
    files = [*sorted(Path(__file__).parent.glob("*.py")), *(f for top in tops for f in _module_files(top))]
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
