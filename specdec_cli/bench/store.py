"""A benchmark's results directory: written as it goes, resumable, never silently mixed.

``config.json`` holds what defines the run (recipe, task, data fingerprint, grid, seeds); a
second run in the same directory must have the same, or it is refused, except for the grid's
cells: a run that adds or fixes cells reuses the samples of the cells it shares. ``samples.jsonl`` gets
one line per (cell, seed, example) as soon as it is generated, flushed, so a killed run leaves
a valid directory and a re-run skips what is done. Processes of a distributed run write
``samples.rank<R>.jsonl`` and rank 0 merges them at the end. ``results.json``, ``table.md``
and ``table.csv`` are derived from the samples and rewritten whenever a run stops.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from ..errors import SpecdecError, UsageError

SAMPLES = "samples.jsonl"
CONFIG = "config.json"
LOCK = ".lock"
RECORD_KEYS = {"cell", "seed", "example_id", "index", "stats", "text"}


def sample_key(record: dict) -> tuple[str, int, str]:
    return record["cell"], record["seed"], record["example_id"]


class ResultsStore:
    """Samples of a run, in memory and (with a folder) on disk."""

    def __init__(self, folder: Path | None, config: dict[str, Any], rank: int = 0, world_size: int = 1):
        self.folder = folder
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.records: dict[tuple, dict] = {}
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = _take_lock(folder / (LOCK if world_size == 1 else f"{LOCK}.rank{rank}"))
        config_path = folder / CONFIG
        if config_path.exists():
            saved, current = _read_config(folder), json.loads(json.dumps(config))
            # A grid of other cells over the same recipe, data and seeds reuses every sample it shares
            # (the baseline's above all); anything else would mix runs that do not compare.
            changed = sorted(k for k in set(saved) | set(current) if k != "cells" and saved.get(k) != current.get(k))
            if changed:
                raise UsageError(
                    f"'{folder}' holds results of a different configuration (changed: {', '.join(changed)}); "
                    "use another --output folder, or delete this one to start over"
                )
        if rank == 0:
            config_path.write_text(json.dumps(config, indent=2) + "\n")
        name = SAMPLES if world_size == 1 else f"samples.rank{rank}.jsonl"
        self.dropped_cut_line = _drop_cut_line(folder / name)
        for path in sorted(folder.glob("samples*.jsonl")):
            for record in _read_jsonl(path):
                self.records[sample_key(record)] = record
        self._handle = open(folder / name, "a", encoding="utf-8")

    def done(self, key: tuple) -> bool:
        return key in self.records

    def append(self, record: dict) -> None:
        if self.folder is not None:
            try:
                self._handle.write(json.dumps(record) + "\n")
                self._handle.flush()
            except OSError as error:  # a full disk, a lost mount: what was written stays valid
                raise SpecdecError(
                    f"cannot write to '{self._handle.name}' ({error.strerror}); {len(self.records)} samples are "
                    "kept there: free some space and run the same command to resume"
                ) from None
        self.records[sample_key(record)] = record

    def merge(self, records: list[dict]) -> None:
        """Rank 0 takes the other processes' samples and rewrites one samples.jsonl."""
        for record in records:
            self.records[sample_key(record)] = record
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

    def close(self) -> None:
        if self.folder is not None and not self._handle.closed:
            self._handle.close()
            self._lock.close()  # releases the lock


def load_saved(folder: Path) -> tuple[dict, list[dict]]:
    """config and samples of a results directory (for --report)."""
    if not (folder / CONFIG).exists():
        raise UsageError(f"'{folder}' is not a specdec bench results directory (no {CONFIG})")
    records: dict[tuple, dict] = {}
    for path in sorted(folder.glob("samples*.jsonl")):
        for record in _read_jsonl(path):
            records[sample_key(record)] = record
    return _read_config(folder), list(records.values())


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"'{folder / CONFIG}' is damaged ({error}); delete the folder to start over") from None
    if not isinstance(config, dict) or "cells" not in config:
        raise UsageError(f"'{folder / CONFIG}' is not a specdec bench configuration; use another --output folder")
    return config


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # the last line cut short by a kill: that sample is simply run again
            raise UsageError(f"'{path}' line {number} is not JSON; delete that line (its sample runs again)") from None
        if not isinstance(record, dict) or not RECORD_KEYS <= set(record):
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
