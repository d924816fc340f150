"""A benchmark's results directory: written as it goes, resumable, never silently mixed.

``config.json`` holds what defines the run (recipe, task, data fingerprint, grid, seeds); a
second run in the same directory must have the same, or it is refused. ``samples.jsonl`` gets
one line per (cell, seed, example) as soon as it is generated, flushed, so a killed run leaves
a valid directory and a re-run skips what is done. Processes of a distributed run write
``samples.rank<R>.jsonl`` and rank 0 merges them at the end. ``results.json``, ``table.md``
and ``table.csv`` are derived from the samples and rewritten whenever a run stops.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import UsageError

SAMPLES = "samples.jsonl"
CONFIG = "config.json"


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
        config_path = folder / CONFIG
        if config_path.exists():
            saved, current = json.loads(config_path.read_text()), json.loads(json.dumps(config))
            if saved != current:
                changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
                raise UsageError(
                    f"'{folder}' holds results of a different configuration (changed: {', '.join(changed)}); "
                    "use another --output folder, or delete this one to start over"
                )
        elif rank == 0:
            config_path.write_text(json.dumps(config, indent=2) + "\n")
        for path in sorted(folder.glob("samples*.jsonl")):
            for record in _read_jsonl(path):
                self.records[sample_key(record)] = record
        name = SAMPLES if world_size == 1 else f"samples.rank{rank}.jsonl"
        self._handle = open(folder / name, "a", encoding="utf-8")

    def done(self, key: tuple) -> bool:
        return key in self.records

    def append(self, record: dict) -> None:
        self.records[sample_key(record)] = record
        if self.folder is not None:
            self._handle.write(json.dumps(record) + "\n")
            self._handle.flush()

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


def load_saved(folder: Path) -> tuple[dict, list[dict]]:
    """config and samples of a results directory (for --report)."""
    if not (folder / CONFIG).exists():
        raise UsageError(f"'{folder}' is not a specdec bench results directory (no {CONFIG})")
    records: dict[tuple, dict] = {}
    for path in sorted(folder.glob("samples*.jsonl")):
        for record in _read_jsonl(path):
            records[sample_key(record)] = record
    return json.loads((folder / CONFIG).read_text()), list(records.values())


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill: that sample is simply run again
    return records
