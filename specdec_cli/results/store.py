"""A results folder: written as it goes, resumable, never silently mixed (bench and acceptance).

``config.json`` holds what defines the run (for bench: recipe, task, data fingerprint, grid,
seeds); a second run in the same folder must have the same, or it is refused, except for the
config keys its :class:`RecordKind` lets change (bench's grid cells: a run that adds or fixes
cells reuses the samples of the cells it shares). ``samples.jsonl`` gets one line per record (a
bench (cell, seed, example), an acceptance prompt) as soon as it is made, flushed, so a killed run
leaves a valid folder and a re-run skips what is done. Processes of a distributed run write
``samples.rank<R>.jsonl`` and rank 0 merges them at the end. The summaries (``results.json``,
``acceptance.json``, tables) are derived from the records and rewritten whenever a run stops.
Every file that is rewritten rather than appended to is replaced at once
(:func:`~specdec_cli.base.inputs.write_atomically`): a full disk or a kill while writing leaves its
previous version.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.errors import SpecdecError, UsageError
from ..base.inputs import check_writable_folder, write_atomically

SAMPLES = "samples.jsonl"
CONFIG = "config.json"
LOCK = ".lock"
RANDOMNESS = "randomness"
"""The config key that names the randomness scheme the samples were drawn under (absent: the stateful
generator of specdec before keyed randomness)."""
RULES = "rules"
"""The config key that gives each verifier the folder's samples ran its revision
(:meth:`~specdec_cli.plugins.verifiers.BlockVerifier.revision`); absent: written before revisions were recorded,
when every verifier was at its first."""

# The keys that tell which command wrote a config.json (see commands/bench.py and commands/acceptance.py).
_WRITERS = {"bench": frozenset({"cells", "seeds"}), "acceptance": frozenset({"request", "prompts"})}
# What bench --report reads of a bench config.json (a type, [shape of each item], {key: shape}).
_NUMBER = (int, float)
_BENCH_CONFIG = {
    "recipe": {"target": dict, "generation": {"max_new_tokens": int}},  # what the reports and plots read
    "task": {"name": str, "metrics": [str], "per_category": bool},
    "data": {"examples": int},
    "cells": [
        {
            "verifier": str,
            "kl": (*_NUMBER, type(None)),
            "num_drafts": int,
            "draft_length": int,
            "temperature": _NUMBER,
            "draft_temperatures": ([_NUMBER], type(None)),
        }
    ],
    "seeds": [int],
}


@dataclass(frozen=True)
class RecordKind:
    """What a results folder holds: how a record is keyed, the fields every record has, and the
    config keys a re-run may change (the rest must match, or the folder is refused)."""

    key: Callable[[dict], tuple]
    fields: frozenset[str]
    may_change: tuple[str, ...] = ()
    shape: dict[str, Any] = field(default_factory=dict)
    """JSON types of some fields (see :func:`_fits`): a record whose fields have others is refused."""
    optional: dict[str, Any] = field(default_factory=dict)
    """JSON types of fields a record may lack (older folders did not write them)."""


def sample_key(record: dict) -> tuple[str, int, str]:
    return record["cell"], record["seed"], record["example_id"]


_SAMPLE_SHAPE = {
    "cell": str,
    "seed": int,
    "example_id": str,
    "index": int,
    "stats": dict,
    "text": str,
    "reference": (str, type(None)),
}
BENCH_SAMPLES = RecordKind(
    sample_key, frozenset(_SAMPLE_SHAPE), ("cells",), _SAMPLE_SHAPE, optional={"conditions": (dict, type(None))}
)


class ResultsStore:
    """Records of a run (``kind``), in memory and (with a folder) on disk."""

    def __init__(
        self,
        folder: Path | None,
        config: dict[str, Any],
        rank: int = 0,
        world_size: int = 1,
        kind: RecordKind = BENCH_SAMPLES,
        revisions: dict[str, tuple[str, ...]] | None = None,
    ):
        """``revisions``: each verifier of the run → what changed in its decisions (its class's ``revisions``)."""
        from ..base.randomness import SCHEME  # here: the listing and report paths must not import torch

        self.folder = folder
        self.revisions = revisions or {}
        rules = {name: len(changes) + 1 for name, changes in self.revisions.items()}
        self.config = {**config, RANDOMNESS: SCHEME, RULES: rules}
        self.rank = rank
        self.world_size = world_size
        self.kind = kind
        self.records: dict[tuple, dict] = {}
        self.dropped_cut_line = False
        self._config_pending = False
        if folder is None:
            return
        check_writable_folder(folder, "--output")
        self._lock_path = folder / (LOCK if world_size == 1 else f"{LOCK}.rank{rank}")
        self._lock = _take_lock(self._lock_path)
        try:
            self._open(folder, kind)
        except BaseException:
            self._release_lock()  # a refused folder stays free for the next run
            raise

    def _open(self, folder: Path, kind: RecordKind) -> None:
        """Compare the folder's configuration with this run's, read its records, open the samples file."""
        saved, current = _read_config(folder), json.loads(json.dumps(self.config))
        if saved is not None:
            _check_same_run(folder, saved, current, kind)
            _check_rules(folder, saved, current, self.revisions)
            # The rules of verifiers this run leaves out stay recorded, for the run that brings them back.
            self.config[RULES] = current[RULES] = {**_saved_rules(saved), **current[RULES]}
        # Written with the first record (or at close): a run that fails before it pins nothing.
        self._config_pending = self.rank == 0 and saved != current
        path = folder / (SAMPLES if self.world_size == 1 else f"samples.rank{self.rank}.jsonl")
        try:
            self.dropped_cut_line = _drop_cut_line(path)
            for records_path in sorted(folder.glob("samples*.jsonl")):
                for record in _read_jsonl(records_path, kind):
                    self.records[kind.key(record)] = record
            self._handle = open(path, "a", encoding="utf-8")
        except OSError as error:  # a samples file that is a folder, or not readable or writable
            raise UsageError(
                f"cannot use '{error.filename or path}' ({error.strerror}); make it a writable file "
                "or give another --output folder"
            ) from None

    def done(self, key: tuple) -> bool:
        return key in self.records

    def resume_note(self, done: int, total: int, unit: str = "samples") -> str | None:
        """What a resumed run reuses of its folder (None: no folder, or nothing done there yet)."""
        if self.folder is None or not done:
            return None
        return f"resuming '{self.folder}': {done} of {total} {unit} already done, {total - done} to run"

    def append(self, record: dict) -> None:
        if self.folder is not None:
            with self._disk_errors():
                self._write_config()
                self._handle.write(json.dumps(record) + "\n")
                self._handle.flush()
        self.records[self.kind.key(record)] = record

    def merge(self, records: list[dict]) -> None:
        """Rank 0 takes the other processes' samples and rewrites one samples.jsonl."""
        for record in records:
            self.records[self.kind.key(record)] = record
        if self.folder is None:
            return
        self._handle.close()
        ordered = sorted(self.records.values(), key=lambda r: (r["cell"], r["seed"], r["index"]))
        with self._disk_errors():
            write_atomically(self.folder / SAMPLES, "".join(json.dumps(record) + "\n" for record in ordered))
        for path in self.folder.glob("samples.rank*.jsonl"):
            path.unlink()

    def _write_config(self) -> None:
        if self._config_pending:
            write_atomically(self.folder / CONFIG, json.dumps(self.config, indent=2) + "\n")
            self._config_pending = False

    @contextmanager
    def _disk_errors(self) -> Iterator[None]:
        """One line for a full disk or a lost mount: what was written stays valid (appended lines, or
        the previous version of a rewritten file)."""
        try:
            yield
        except OSError as error:
            raise SpecdecError(
                f"cannot write to '{self.folder}' ({error.strerror}); {len(self.records)} samples are kept there: "
                "free some space and run the same command to resume"
            ) from None

    def close(self) -> None:
        if self.folder is None or self._handle.closed:
            return
        try:
            with self._disk_errors():
                self._write_config()
        finally:
            self._handle.close()
            self._release_lock()

    def _release_lock(self) -> None:
        """Remove the lock file, then free the lock: a finished folder keeps only its results. Removed while
        held, so no other run can hold a lock on this file any more (:func:`_take_lock` checks for that)."""
        with suppress(OSError):  # a folder that turned read-only: the file stays, and the next run takes it
            self._lock_path.unlink()
        self._lock.close()


def load_saved(folder: Path) -> tuple[dict, list[dict]]:
    """config and samples of a bench results folder (for --report); one line for any other folder."""
    config = _read_config(folder)
    if config is None:
        raise UsageError(f"'{folder}' is not a specdec bench results directory (no {CONFIG})")
    writer = _writer(config)
    if writer not in (None, "bench"):
        raise UsageError(
            f"'{folder}' holds {writer} results (written by specdec {writer}); bench --report reads "
            "the folders that bench --output writes"
        )
    records: dict[tuple, dict] = {}
    for path in sorted(folder.glob("samples*.jsonl")):
        try:
            for record in _read_jsonl(path, BENCH_SAMPLES):
                records[sample_key(record)] = record
        except OSError as error:
            raise UsageError(f"cannot read '{path}' ({error.strerror}); make it a readable file") from None
    if writer is None or not _fits(config, _BENCH_CONFIG):
        raise UsageError(f"'{folder / CONFIG}' is not a specdec bench configuration; give a bench --output folder")
    return config, list(records.values())


def _check_same_run(folder: Path, saved: dict, current: dict, kind: RecordKind) -> None:
    """Refuse a folder of another command, or of another configuration than the keys ``kind`` lets change."""
    writer = _writer(saved)
    if writer is not None and writer != _writer(current):
        raise UsageError(
            f"'{folder}' holds {writer} results (written by specdec {writer}); give specdec "
            f"{_writer(current)} another --output folder"
        )
    if saved.get(RANDOMNESS) != current.get(RANDOMNESS):
        # Resumed samples would be drawn differently from the saved ones: the run would not be one run.
        raise UsageError(
            f"'{folder}' was written by another version of specdec, which drew its samples under the randomness "
            f"scheme '{saved.get(RANDOMNESS, 'torch-generator')}', not '{current.get(RANDOMNESS)}'; give a new "
            "--output folder (this one stays as it is)"
        )
    # A grid of other cells over the same recipe, data and seeds reuses every sample it shares
    # (the baseline's above all); anything else would mix runs that do not compare. Rules: _check_rules.
    ignored = {*kind.may_change, RULES}
    fixed = [{key: value for key, value in config.items() if key not in ignored} for config in (saved, current)]
    changed = _differences(*fixed)
    if changed:
        raise UsageError(
            f"'{folder}' holds results of a different configuration (changed: {_changes_text(changed)}); "
            "use another --output folder, or delete this one to start over"
        )


def _check_rules(folder: Path, saved: dict, current: dict, revisions: dict[str, tuple[str, ...]]) -> None:
    """Refuse a folder whose samples of a verifier this run has ran another revision of its rule: resumed samples
    would be decided otherwise than the saved ones under the same name."""
    before = _saved_rules(saved)
    for name, revision in current[RULES].items():
        old = before.get(name, revision)
        if old != revision:
            changes = revisions[name][min(old, revision) - 1 : max(old, revision) - 1]
            raise UsageError(
                f"'{folder}' holds samples of verifier '{name}' as revision {old} of its rule decided them, and this "
                f"specdec runs revision {revision} ({'; '.join(changes)}); give a new --output folder (this one "
                "stays as it is)"
            )


def _saved_rules(saved: dict) -> dict[str, int]:
    """Each verifier of a saved configuration → the revision its samples ran; a folder written before revisions were
    recorded ran every verifier it names (bench's cells, acceptance's request) at its first."""
    if RULES in saved:
        return dict(saved[RULES])
    names = [cell.get("verifier") for cell in saved.get("cells", [])] + saved.get("request", {}).get("verifiers", [])
    return {name: 1 for name in names if isinstance(name, str) and name != "none"}


_ABSENT = object()
"""The value of a configuration key that one of two configurations lacks."""
_SHOWN_CHANGES = 5
_SHOWN_VALUE_CHARS = 40


def _differences(saved: Any, current: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, saved value, current value) of each leaf where two JSON configurations differ, in key
    order; mappings are compared key by key, lists of one length item by item (``cells[2].kl``)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        keys = sorted(set(saved) | set(current))
        pairs = [(f"{path}.{key}" if path else key, saved.get(key, _ABSENT), current.get(key, _ABSENT)) for key in keys]
    elif isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        pairs = [(f"{path}[{index}]", old, new) for index, (old, new) in enumerate(zip(saved, current))]
    else:
        return [] if saved == current else [(path, saved, current)]
    return [change for key, old, new in pairs for change in _differences(old, new, key)]


def _changes_text(changes: list[tuple[str, Any, Any]]) -> str:
    """'recipe.generation.max_new_tokens (128 → 64), data.examples (8 → 4)', the first few and how many more."""
    shown = ", ".join(f"{key} ({_value_text(old)} → {_value_text(new)})" for key, old, new in changes[:_SHOWN_CHANGES])
    more = len(changes) - _SHOWN_CHANGES
    return f"{shown} and {more} more" if more > 0 else shown


def _value_text(value: Any) -> str:
    text = "absent" if value is _ABSENT else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= _SHOWN_VALUE_CHARS else text[: _SHOWN_VALUE_CHARS - 1] + "…"


def _writer(config: dict) -> str | None:
    """The command that writes configurations like ``config`` (None: none of specdec's)."""
    return next((name for name, keys in _WRITERS.items() if keys <= config.keys()), None)


def _read_config(folder: Path) -> dict | None:
    """The folder's config.json (None if it has none); one line if it cannot be read or is not a mapping."""
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise UsageError(f"cannot read '{path}' ({error.strerror}); make it readable or use another folder") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(
            f"'{path}' is damaged ({error}); if the samples beside it came from this same command, delete just "
            f"{CONFIG} and run the command again (they are kept), else use another folder"
        ) from None
    if not isinstance(config, dict):
        raise UsageError(f"'{path}' is not a specdec results configuration (not a JSON mapping); use another folder")
    return config


def _fits(value: Any, shape: Any) -> bool:
    """Whether the JSON ``value`` has ``shape``: a type or tuple of types (``bool`` only where named), a
    one-item list (a list of items of that shape), a mapping (at least these keys, of these shapes), or a
    tuple that mixes them (any one of them)."""
    if isinstance(shape, dict):
        return isinstance(value, dict) and all(key in value and _fits(value[key], sub) for key, sub in shape.items())
    if isinstance(shape, list):
        return isinstance(value, list) and all(_fits(item, shape[0]) for item in value)
    if isinstance(shape, tuple):
        return any(_fits(value, option) for option in shape)
    return isinstance(value, shape) and (shape is bool or not isinstance(value, bool))


def _read_jsonl(path: Path, kind: RecordKind) -> list[dict]:
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # the last line cut short by a kill: that sample is simply run again
            raise UsageError(f"'{path}' line {number} is not JSON; delete that line (its sample runs again)") from None
        if not _is_record(record, kind):
            raise UsageError(f"'{path}' line {number} is not a sample record; delete that line (its sample runs again)")
        records.append(record)
    return records


def _is_record(record: Any, kind: RecordKind) -> bool:
    """Whether a JSON line is a record of ``kind``: its fields, of their types, and a key that can key."""
    if not isinstance(record, dict) or not kind.fields <= record.keys() or not _fits(record, kind.shape):
        return False
    if not _fits(record, {name: shape for name, shape in kind.optional.items() if name in record}):
        return False
    try:
        hash(kind.key(record))
    except TypeError:  # a key field holding a list or a mapping
        return False
    return True


def _drop_cut_line(path: Path) -> bool:
    """Cut a last line without its newline (a run killed mid-write, a full disk) so that the next
    record starts on a line of its own; True if there was one."""
    if not path.exists():
        return False
    with open(path, "rb+") as handle:
        data = handle.read()
        if not data or data.endswith(b"\n"):
            return False
        handle.truncate(data.rfind(b"\n") + 1)
    return True


_LOCK_TRIES = 20
"""Finished runs removing the lock file between this run's open and its check: a few races at most; more means a
filesystem whose file identities do not hold still."""


def _take_lock(path: Path):
    """An exclusive lock on ``path`` for as long as the returned file stays open (the OS frees it if
    the process dies): a second run writing the same folder is refused, naming the holder. A lock won on
    a file that its holder removed as it finished (:meth:`ResultsStore._release_lock`) guards nothing: the
    file now at ``path`` is taken instead."""
    for _ in range(_LOCK_TRIES):
        handle = _locked_file(path)
        with suppress(OSError):  # no file at path any more: the loop opens a new one
            named, held = os.stat(path), os.fstat(handle.fileno())
            if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                break
        handle.close()
    else:
        raise SpecdecError(
            f"the lock file '{path}' kept changing under this run ({_LOCK_TRIES} tries); give an --output folder on a "
            "local disk"
        )
    with suppress(OSError):  # the pid only names the holder to a refused run: a full disk may keep it out
        os.ftruncate(handle.fileno(), 0)
        os.write(handle.fileno(), str(os.getpid()).encode())  # unbuffered: nothing left to fail at close
    return handle


def _locked_file(path: Path):
    """``path`` opened (made if absent) and locked, or one line saying why it cannot be."""
    try:
        handle = open(path, "a+", encoding="utf-8", errors="replace")
    except OSError as error:  # a folder of that name, a read-only file
        raise UsageError(
            f"cannot open the lock file '{path}' ({error.strerror}); remove it (specdec makes a new "
            "one) or give another --output folder"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        handle.seek(0)
        holder = handle.read(64).strip() or "unknown"
        handle.close()
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise UsageError(
                f"'{path.parent}' is being written by another specdec run (pid {holder}); wait for it "
                "to finish or give another --output folder"
            ) from None
        # The filesystem's condition, not a wrong input: a runtime failure (exit 1).
        raise SpecdecError(
            f"cannot lock '{path}' ({error.strerror}): its filesystem does not support file locks, "
            "which keep two runs from mixing their results; give an --output folder on a local "
            "disk"
        ) from None
    return handle
