"""The compile cache: what ``--compile`` compiled for a model, kept under specdec's cache directory
(:func:`~specdec_cli.base.inputs.cache_dir`), so that a machine compiles a model's steps once.

Two things are kept, in ``<cache>/compile/``:

- inductor's own caches (its FX graphs, AOT autograd entries, the C++ kernels it built) in ``inductor/``, instead
  of inductor's default in the temporary directory, which the machine empties. Inductor names each of them by
  what it was compiled from (the traced graph, with its shapes, dtypes and device, torch's version, inductor's
  settings), so a block shape or a dtype never reuses another's. A user's own ``TORCHINDUCTOR_CACHE_DIR`` is left
  as it is.
- one entry per model, ``<key digest>.json``: the artifacts that ``torch.compiler.save_cache_artifacts`` recorded
  as the model's steps compiled, added to those the entry held (an entry only grows), named by a :class:`CompileKey`
  (torch, transformers and Python versions, the model's class and configuration, dtype and device). Loaded before
  the model's first compiled step, it puts its graphs back into inductor's caches (a damaged inductor file among
  them included) and says what was reused.

An entry is written whole or not at all (:func:`~specdec_cli.base.inputs.write_cache_file`) and trusted only when it
is plausible: its own key equal to the model's, its digest that of its artifacts, and torch able to read
them. Anything else is one note (:attr:`CompileCacheUse.note`), and the model's steps compile afresh and replace it.
A torch that does not serialise its artifacts as specdec reads them (:data:`ARTIFACTS_KEPT`: the API is private, and
of torch 2.7 on) gets that note and no entry; its steps still compile, with inductor's caches under specdec's.

What stays on every start: dynamo traces each step's Python again (its guards decide whether a compiled graph
fits); the cache spares inductor's compilation, not the tracing (benchmarks/results/compile_cache_cpu/).
"""

from __future__ import annotations

import atexit
import base64
import binascii
import dataclasses
import hashlib
import json
import os
import platform
import threading
from collections import defaultdict
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from ..base.inputs import cache_dir, write_cache_file

try:  # torch's serialised compile artifacts: private, and of torch 2.7 on (the project takes torch >= 2.2)
    from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    ARTIFACTS_KEPT = all(
        hasattr(CacheArtifactManager, method) for method in ("populate_caches", "_ensure_cache_artifacts_registered")
    )
except ImportError:
    ARTIFACTS_KEPT = False
"""Whether this torch serialises what it compiled as specdec reads it; without, every start compiles (inductor's own
caches under specdec's directory still serve it), and importing the engine never fails for want of it."""

if TYPE_CHECKING:
    from torch.compiler._cache import CacheArtifact

__all__ = ["CompileCacheUse", "CompileKey", "compile_cache_dir", "prepare", "save", "uses"]

ENTRY_FORMAT = 1
"""The layout of an entry's JSON; another is not read (it is rebuilt)."""


@dataclass(frozen=True)
class CompileKey:
    """What a model's compiled steps depend on, besides the shapes inductor keys itself."""

    torch: str
    transformers: str
    python: str
    model: str  # the model's class
    configuration: str  # sha256 of its configuration's JSON
    dtype: str
    device: str

    @classmethod
    def of(cls, model: torch.nn.Module) -> CompileKey:
        parameter = next(model.parameters())
        configuration = model.config.to_json_string(use_diff=False)
        return cls(
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            model=type(model).__name__,
            configuration=hashlib.sha256(configuration.encode()).hexdigest(),
            dtype=str(parameter.dtype),
            device=str(parameter.device),
        )

    def digest(self) -> str:
        fields = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(fields.encode()).hexdigest()[:24]


@dataclass
class CompileCacheUse:
    """One model's entry in this process: what was found, and what of it was put back into inductor's caches."""

    key: CompileKey
    entry: Path
    reused: dict[str, int] = dataclasses.field(default_factory=dict)
    """Artifacts loaded from the entry, by kind (inductor, aot_autograd, pgo, …); empty: nothing was reused."""
    note: str | None = None
    """Why an entry that was there was not trusted (it is rebuilt); None: it was read, or there was none."""
    noted: bool = False
    """Whether :attr:`note` has been said (with the first compile wait: once, not with every new shape)."""
    held: dict[str, CacheArtifact] = dataclasses.field(default_factory=dict)
    """The artifacts the entry holds (as loaded or last written), by kind/name: a save with nothing new leaves it."""

    def summary(self) -> str:
        """One line for the CLI's ``--verbose``: what this run got from the entry."""
        if self.note:
            return self.note
        if self.reused:
            counts = ", ".join(f"{count} {kind}" for kind, count in sorted(self.reused.items()))
            return f"compile cache: {self.key.model} reused {counts} artifacts from {self.entry}"
        return f"compile cache: nothing to reuse for {self.key.model} yet; its steps compile into {self.entry}"


_uses: dict[CompileKey, CompileCacheUse] = {}
_lock = threading.Lock()


def compile_cache_dir() -> Path:
    """Where compiled steps are kept: ``<specdec cache>/compile``. Removing it clears the compile cache."""
    return cache_dir() / "compile"


def prepare(model: torch.nn.Module) -> CompileCacheUse:
    """Before ``model``'s first compiled step: inductor's caches under specdec's cache directory, and the model's
    entry loaded into them. Once per key and process; later calls return the first's use."""
    key = CompileKey.of(model)
    with _lock:
        if key not in _uses:
            if not _uses:
                _keep_inductor_cache()
                atexit.register(save)
            entry = compile_cache_dir() / f"{key.digest()}.json"
            use = CompileCacheUse(key, entry)
            if ARTIFACTS_KEPT:
                _load(use)
            else:
                use.note = (
                    f"torch {torch.__version__} does not serialise what it compiles as specdec reads it: no entry kept"
                )
            _uses[key] = use
        return _uses[key]


def uses() -> list[CompileCacheUse]:
    """Every model's entry this process prepared: what the CLI's ``--verbose`` reports (each one's
    :meth:`CompileCacheUse.summary`)."""
    return list(_uses.values())


def save() -> None:
    """Add the artifacts this process has recorded so far to every prepared entry that lacks some of them (each
    entry gets all of them: a model's graphs are among them, and inductor's keys keep the others from ever matching
    it). An entry only grows: a warm run records only some of what it looks up, and what it leaves out stays."""
    with _lock:
        if not (_uses and ARTIFACTS_KEPT):
            return
        serialised = torch.compiler.save_cache_artifacts()
        if serialised is None:
            return
        recorded = _read(serialised[0])
        for use in _uses.values():
            if recorded.keys() - use.held.keys():
                use.held = {**use.held, **recorded}
                write_cache_file(use.entry, json.dumps(_entry(use.key, _written(use.held))))


def _read(artifacts: bytes) -> dict[str, CacheArtifact]:
    """Every artifact in torch's serialised ``artifacts``, by kind/name. Each ``save_cache_artifacts`` appends one
    group per kind to what the process serialised before, and torch's own reader (``load_cache_artifacts``) keeps
    only the last group of each kind: read here group by group. ValueError: torch could not read them."""
    CacheArtifactManager._ensure_cache_artifacts_registered()
    try:
        groups = AppendingByteSerializer.to_list(artifacts, deserialize_fn=_deserialize_single_cache)
    except Exception as error:  # torch's reader raises whatever its bytes lead to (it catches Exception too)
        raise ValueError(f"torch could not read its artifacts: {error!r}") from error
    return {f"{kind}/{artifact.key}": artifact for kind, group in groups for artifact in group}


def _by_kind(held: dict[str, CacheArtifact]) -> dict[str, list[CacheArtifact]]:
    grouped: defaultdict[str, list[CacheArtifact]] = defaultdict(list)
    for name, artifact in held.items():
        grouped[name.split("/", 1)[0]].append(artifact)
    return dict(grouped)


def _written(held: dict[str, CacheArtifact]) -> bytes:
    """``held`` serialised as torch does, one group per kind (so that torch's reader, too, finds all of them)."""
    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend(_by_kind(held).items())
    return serializer.to_bytes()


def _keep_inductor_cache() -> None:
    """Point inductor's caches under specdec's, unless the user chose a directory for them."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from torch._inductor.utils import clear_caches

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # inductor writes its default into the environment the first time it looks (a wait message may have asked).
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir() / "inductor")
        clear_caches()  # the directories inductor remembered are the default's


def _entry(key: CompileKey, artifacts: bytes) -> dict[str, Any]:
    return {
        "format": ENTRY_FORMAT,
        "key": dataclasses.asdict(key),
        "sha256": hashlib.sha256(artifacts).hexdigest(),
        "artifacts": base64.b64encode(artifacts).decode("ascii"),
    }


def _load(use: CompileCacheUse) -> None:
    """Read ``use``'s entry into inductor's caches; an implausible one is noted and removed (rebuilt by this run)."""
    if not use.entry.exists():
        return
    try:
        held = _read(_plausible_artifacts(json.loads(use.entry.read_bytes()), use.key))
        info = CacheArtifactManager.populate_caches(_by_kind(held))
    except (OSError, ValueError, KeyError, TypeError, binascii.Error) as error:
        why = (
            error.strerror
            if isinstance(error, OSError)
            else f"{error} missing"
            if isinstance(error, KeyError)
            else error
        )
        use.note = f"the compile cache entry {use.entry} was unusable ({why}) and is rebuilt"
        with suppress(OSError):
            use.entry.unlink(missing_ok=True)
        return
    use.reused = {kind: len(names) for kind, names in info.artifacts.items() if names}
    use.held = held


def _plausible_artifacts(entry: Any, key: CompileKey) -> bytes:
    """The artifacts of ``entry`` (its parsed JSON), if it is an entry of this format for ``key`` whose digest
    matches; else ValueError (KeyError, TypeError: a field missing or of another kind) saying what is wrong."""
    if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT:
        raise ValueError("not an entry of this specdec's format")
    if entry["key"] != dataclasses.asdict(key):
        raise ValueError("its key is another model's")
    artifacts = base64.b64decode(entry["artifacts"], validate=True)
    if not artifacts or hashlib.sha256(artifacts).hexdigest() != entry["sha256"]:
        raise ValueError("its artifacts do not match their digest")
    return artifacts
