"""A results folder: written as it goes, resumable, never silently mixed (bench and acceptance).

``config.json`` holds what defines the run (for bench: recipe, task, data fingerprint, grid,
seeds); a second run in the same folder must have the same, or it is refused, except for the
config keys its :class:`RecordKind` lets change (bench's grid cells: a run that adds or fixes
cells reuses the samples of the cells it shares). ``samples.jsonl`` gets one line per record (a
bench (cell, seed, example), an acceptance prompt) as soon as it is made, flushed, so a killed run
leaves a valid folder and a re-run skips what is done. Processes of a distributed run write
``samples.rank<R>.jsonl`` and rank 0 merges them at the end. The summaries (``results.json``,
``acceptance.json``, tables) are derived from the records and rewritten whenever a run stops.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SpecdecError, UsageError
from .inputs import check_writable_folder

SAMPLES = "samples.jsonl"
CONFIG = "config.json"
LOCK = ".lock"


@dataclass(frozen=True)
class RecordKind:
    """What a results folder holds: how a record is keyed, the fields every record has, and the
    config keys a re-run may change (the rest must match, or the folder is refused)."""

    key: Callable[[dict], tuple]
    fields: frozenset[str]
    may_change: tuple[str, ...] = ()


def sample_key(record: dict) -> tuple[str, int, str]:
    return record["cell"], record["seed"], record["example_id"]


BENCH_SAMPLES = RecordKind(sample_key, frozenset({"cell", "seed", "example_id", "index", "stats", "text"}), ("cells",))


class ResultsStore:
    """Records of a run (``kind``), in memory and (with a folder) on disk."""

    def __init__(self, folder: Path | None, config: dict[str, Any], rank: int = 0, world_size: int = 1,
                 kind: RecordKind = BENCH_SAMPLES):  # fmt: skip
        self.folder = folder
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.kind = kind
        self.records: dict[tuple, dict] = {}
        self.dropped_cut_line = False
        self._config_pending = False
        if folder is None:
            return
        check_writable_folder(folder, "--output")
        self._lock = _take_lock(folder / (LOCK if world_size == 1 else f"{LOCK}.rank{rank}"))
        config_path = folder / CONFIG
        saved, current = None, json.loads(json.dumps(config))
        if config_path.exists():
            saved = _read_config(folder)
            # A grid of other cells over the same recipe, data and seeds reuses every sample it shares
            # (the baseline's above all); anything else would mix runs that do not compare.
            changed = sorted(k for k in set(saved) | set(current)
                             if k not in kind.may_change and saved.get(k) != current.get(k))  # fmt: skip
            if changed:
                raise UsageError(
                    f"'{folder}' holds results of a different configuration (changed: {', '.join(changed)}); "
                    "use another --output folder, or delete this one to start over"
                )
        # Written with the first record (or at close): a run that fails before it pins nothing.
        self._config_pending = rank == 0 and saved != current
        name = SAMPLES if world_size == 1 else f"samples.rank{rank}.jsonl"
        self.dropped_cut_line = _drop_cut_line(folder / name)
        for path in sorted(folder.glob("samples*.jsonl")):
            for record in _read_jsonl(path, kind.fields):
                self.records[kind.key(record)] = record
        self._handle = open(folder / name, "a", encoding="utf-8")

    def done(self, key: tuple) -> bool:
        return key in self.records

    def append(self, record: dict) -> None:
        if self.folder is not None:
            self._write_config()
            try:
                self._handle.write(json.dumps(record) + "\n")
                self._handle.flush()
            except OSError as error:  # a full disk, a lost mount: what was written stays valid
                raise SpecdecError(
                    f"cannot write to '{self._handle.name}' ({error.strerror}); {len(self.records)} samples are "
                    "kept there: free some space and run the same command to resume"
                ) from None
        self.records[self.kind.key(record)] = record

    def merge(self, records: list[dict]) -> None:
        """Rank 0 takes the other processes' samples and rewrites one samples.jsonl."""
        for record in records:
            self.records[self.kind.key(record)] = record
        if self.folder is None:
            return
        self._handle.close()
        merged = self.folder / f"{SAMPLES}.tmp"
        with open(merged, "w", encoding="utf-8") as handle:
            for record in sorted(self.records.values(), key=lambda r: (r["cell"], r["seed"], r["index"])):
                handle.write(json.dumps(record) + "\n")
        os.replace(merged, self.folder / SAMPLES)
        for path in self.folder.glob("samples.rank*.jsonl"):
            path.unlink()

    def _write_config(self) -> None:
        if self._config_pending:
            (self.folder / CONFIG).write_text(json.dumps(self.config, indent=2) + "\n")
            self._config_pending = False

    def close(self) -> None:
        if self.folder is not None and not self._handle.closed:
            self._write_config()
            self._handle.close()
            self._lock.close()  # releases the lock


def load_saved(folder: Path) -> tuple[dict, list[dict]]:
    """config and samples of a results directory (for --report)."""
    if not (folder / CONFIG).exists():
        raise UsageError(f"'{folder}' is not a specdec bench results directory (no {CONFIG})")
    records: dict[tuple, dict] = {}
    for path in sorted(folder.glob("samples*.jsonl")):
        for record in _read_jsonl(path, BENCH_SAMPLES.fields):
            records[sample_key(record)] = record
    config = _read_config(folder)
    if "cells" not in config:
        raise UsageError(f"'{folder / CONFIG}' is not a specdec bench configuration; give a bench --output folder")
    return config, list(records.values())


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"'{folder / CONFIG}' is damaged ({error}); delete the folder to start over") from None
    if not isinstance(config, dict):
        raise UsageError(f"'{folder / CONFIG}' is not a specdec configuration; use another --output folder")
    return config


def _read_jsonl(path: Path, fields: frozenset[str]) -> list[dict]:
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # the last line cut short by a kill: that sample is simply run again
            raise UsageError(f"'{path}' line {number} is not JSON; delete that line (its sample runs again)") from None
        if not isinstance(record, dict) or not fields <= set(record):
            raise UsageError(f"'{path}' line {number} is not a sample record; delete that line (its sample runs again)")
        records.append(record)
    return records


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


def _take_lock(path: Path):
    """An exclusive lock on ``path`` for as long as the returned file stays open (the OS frees it if
    the process dies): a second run writing the same folder is refused, naming the holder."""
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise UsageError(
            f"'{path.parent}' is being written by another specdec run (pid {holder}); wait for it to finish "
            "or give another --output folder"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
