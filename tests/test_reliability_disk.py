"""Caches and results folders on disk: what a busy machine, a damaged file, a full disk, a folder of
another command or a filesystem without locks does to them. Each case ends in a trustworthy figure,
an intact folder, or one line that says what to do; never a traceback or a folder called damaged
that is not.
"""

from __future__ import annotations

import builtins
import dataclasses
import errno
import fcntl
import io
import json
import math
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from specdec_cli.base.recipe import build_recipe
from specdec_cli.engine.decoder import SpeculativeDecoder
from specdec_cli.generation import calibration
from tests.conftest import BENCH_DATA, one_error_line, tiny_recipe

PROMPT = [3, 4, 5]


@pytest.fixture(scope="module")
def decoder(tiny_models) -> SpeculativeDecoder:
    """A tiny speculative decoder whose one-layer draft (float32, like the target) is the smaller model."""
    return SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, "llama")))


def _now(offset: timedelta = timedelta(0)) -> str:
    return (datetime.now(timezone.utc) + offset).isoformat(timespec="seconds")


# A figure a quiet machine gives: a draft step well below the target's block forward.
GOOD = {
    "target_token_s": 0.02,
    "target_block_s": 0.03,
    "draft_s": 0.008,
    "acceptance": 0.5,
    "machine": "x",
    "measured_at": _now(),
}


def _good_cost(**changes) -> calibration.DraftCost:
    return calibration.DraftCost(**GOOD | changes)


@pytest.fixture
def measurements(monkeypatch, tmp_path) -> list:
    """The calibration cache in ``tmp_path``; each measurement returns :func:`_good_cost` and is counted."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(calibration, "_measure", lambda decoder, ids, machine: calls.append(1) or _good_cost())
    return calls


def _cache_entry(tmp_path: Path) -> Path:
    (entry,) = (tmp_path / "calibration").iterdir()
    return entry


def test_calibration_takes_the_least_of_several_timed_runs_and_dates_it(decoder, tmp_path, monkeypatch):
    """A busy moment during one timed run (here: its draft time ×50) does not become the machine's figure."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(
        "specdec_cli.generation.calibration._plausible", lambda cost, decoder: True
    )  # a busy CI machine measures slow
    runs = []
    original = SpeculativeDecoder.generate_ids

    def timed(self, *args, **kwargs):
        tokens, mask, stats = original(self, *args, **kwargs)
        if len(runs) == 1:  # the first timed run with the draft (the one before is the untimed warm-up)
            stats = dataclasses.replace(stats, draft_time_s=stats.draft_time_s * 50)
        runs.append(stats)
        return tokens, mask, stats

    monkeypatch.setattr(SpeculativeDecoder, "generate_ids", timed)
    cost = calibration.draft_cost(decoder, PROMPT)
    assert len(runs) == 2 * (1 + calibration._REPEATS)  # a few short generations, no more
    steps = [s.draft_time_s / s.draft_forwards for s in runs[2 : 1 + calibration._REPEATS]]
    assert cost.draft_s == pytest.approx(min(steps)) and cost.draft_s < runs[1].draft_time_s / runs[1].draft_forwards
    assert timedelta(0) <= datetime.now(timezone.utc) - datetime.fromisoformat(cost.measured_at) < timedelta(minutes=5)
    assert json.loads(_cache_entry(tmp_path).read_text()) == dataclasses.asdict(cost)
    assert calibration.draft_cost(decoder, PROMPT) == cost and len(runs) == 8  # cached
    calibration.note_for(decoder, PROMPT, recalibrate=True)  # asked: measured again
    assert len(runs) == 16 and json.loads(_cache_entry(tmp_path).read_text())["measured_at"] >= cost.measured_at


BAD_CACHE = [  # (what, cache file content)
    ("a null field", json.dumps(GOOD | {"draft_s": None})),
    ("a text field", json.dumps(GOOD | {"target_token_s": "0.02"})),
    ("a bool field", json.dumps(GOOD | {"acceptance": True})),
    ("a list", json.dumps([GOOD])),
    ("a string", json.dumps("0.02")),
    ("a number", "3"),
    ("a missing key", json.dumps({k: v for k, v in GOOD.items() if k != "acceptance"})),
    ("an unknown key", json.dumps(GOOD | {"extra": 1})),
    ("an older format (no date)", json.dumps({k: v for k, v in GOOD.items() if k != "measured_at"})),
    ("a negative time", json.dumps(GOOD | {"draft_s": -0.008})),
    ("a zero time", json.dumps(GOOD | {"target_block_s": 0})),
    ("a NaN time", json.dumps(GOOD | {"target_token_s": math.nan})),
    ("an infinite time", json.dumps(GOOD | {"draft_s": math.inf})),
    ("an acceptance over 1", json.dumps(GOOD | {"acceptance": 1.5})),
    ("a date 31 days old", json.dumps(GOOD | {"measured_at": _now(-timedelta(days=31))})),
    ("a date in the future", json.dumps(GOOD | {"measured_at": _now(timedelta(days=2))})),
    ("a date without its time zone", json.dumps(GOOD | {"measured_at": "2026-01-01T00:00:00"})),
    ("a date that is not one", json.dumps(GOOD | {"measured_at": "yesterday"})),
    ("a busy machine's figure", json.dumps(GOOD | {"draft_s": 0.13, "target_block_s": 0.06})),
    ("cut-off JSON", json.dumps(GOOD)[:40]),
    ("bytes that are not UTF-8", "\udcff"),
]


@pytest.mark.parametrize(("what", "content"), BAD_CACHE, ids=[row[0] for row in BAD_CACHE])
def test_a_calibration_cache_that_cannot_be_right_is_measured_again(decoder, measurements, tmp_path, what, content):
    calibration.draft_cost(decoder, PROMPT)
    entry = _cache_entry(tmp_path)
    entry.write_bytes(content.encode("utf-8", errors="surrogateescape"))
    cost = calibration.draft_cost(decoder, PROMPT)
    assert len(measurements) == 2, what
    assert cost == _good_cost(measured_at=cost.measured_at)
    assert json.loads(entry.read_text()) == dataclasses.asdict(cost)  # rebuilt
    assert calibration.draft_cost(decoder, PROMPT) == cost and len(measurements) == 2  # and then trusted


def test_a_trustworthy_cached_figure_is_used_and_recalibrate_measures_again(decoder, measurements, tmp_path):
    calibration.draft_cost(decoder, PROMPT)
    entry = _cache_entry(tmp_path)
    entry.write_text(json.dumps(GOOD | {"measured_at": _now(-timedelta(days=29))}))
    assert calibration.draft_cost(decoder, PROMPT).measured_at[:10] == _now(-timedelta(days=29))[:10]
    assert len(measurements) == 1
    calibration.note_for(decoder, PROMPT, recalibrate=True)
    assert len(measurements) == 2 and json.loads(entry.read_text())["measured_at"][:10] == _now()[:10]


def test_a_fresh_measurement_that_cannot_be_right_is_neither_cached_nor_noted(decoder, tmp_path, monkeypatch):
    """Measured while the machine was busy: no note (it would say speculation cannot pay), nothing cached."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    busy = _good_cost(draft_s=0.15, target_token_s=0.05, target_block_s=0.06)
    monkeypatch.setattr(calibration, "_measure", lambda decoder, ids, machine: busy)
    assert calibration.draft_cost(decoder, PROMPT) is None
    assert calibration.note_for(decoder, PROMPT) is None
    assert not (tmp_path / "calibration").exists() or not any((tmp_path / "calibration").iterdir())


def test_a_bfloat16_draft_slower_than_a_float32_target_is_believed(tiny_models, tmp_path, monkeypatch):
    """On a CPU without native bfloat16 such a draft really is slower: that figure is the note's point."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    recipe = tiny_recipe(tiny_models, "llama", draft={"dtype": "bfloat16"})
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    slow = _good_cost(draft_s=0.074, target_token_s=0.06, target_block_s=0.07, machine="CPU (no native bfloat16)")
    monkeypatch.setattr(calibration, "_measure", lambda decoder, ids, machine: slow)
    note = calibration.note_for(decoder, PROMPT)
    assert "a draft step takes 74 ms" in note and f"measured {slow.measured_at[:10]}" in note
    assert "--recalibrate measures again" in note


class _HalfThenFull:
    """A file that takes half of what it is given, then fails as a full disk does."""

    def __init__(self, handle):
        self._handle = handle

    def write(self, text: str) -> int:
        self._handle.write(text[: len(text) // 2])
        self._handle.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._handle.close()


@pytest.fixture
def full_disk_for(monkeypatch):
    """full_disk_for(name): from now on, writing a file ``name`` (or a temporary file for it) fills the
    disk; full_disk_for(None): the disk has room again."""
    real_open = builtins.open

    def tight_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        writing = isinstance(file, (str, Path)) and any(c in mode for c in "wxa")
        return _HalfThenFull(handle) if writing and full[0] in Path(file).name else handle

    def arm(name: str | None) -> None:
        full[0] = name
        for module in (builtins, io):  # io.open: what pathlib's write_text opens with
            monkeypatch.setattr(module, "open", real_open if name is None else tight_open)

    full: list = [None]
    return arm


def test_a_full_disk_while_replacing_a_file_leaves_the_old_one(tmp_path, full_disk_for):
    from specdec_cli.base.inputs import write_atomically

    path = tmp_path / "results.json"
    path.write_text('{"old": true}\n')
    full_disk_for("results.json")
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, json.dumps({"new": list(range(1000))}))
    assert path.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary file left behind


def test_a_full_disk_while_a_rerun_adds_cells_keeps_config_json(run, inputs, full_disk_for):
    folder = Path(inputs["dir"]) / "out"
    bench = f"bench -r {{recipe}} {BENCH_DATA} --max-new-tokens 3 --output {folder}".format(**inputs).split()
    code, _, err = run(bench)
    assert code == 0, err
    before = (folder / "config.json").read_text()
    full_disk_for("config.json")
    code, _, err = run([*bench, "--verifier", "speculative,mentored", "--kl", "0.1"])
    assert code == 1
    resumed, failed = [
        line for line in err.splitlines() if line.strip()
    ]  # the run reuses the first one's samples, then cannot add its own
    assert resumed == f"note: resuming '{folder}': 4 of 6 samples already done, 2 to run"
    one_error_line(failed, "No space left on device")
    assert (folder / "config.json").read_text() == before
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    code, out, err = run(["bench", "--report", str(folder)])  # the folder still loads
    assert code == 0 and "speculative K=1 L=3 T=1" in out, err
    full_disk_for(None)
    code, _, err = run([*bench, "--verifier", "speculative,mentored", "--kl", "0.1"])
    assert code == 0, err
    assert len(json.loads((folder / "config.json").read_text())["cells"]) == 3


BENCH_CONFIG = {
    "recipe": {},
    "task": {"name": "wmt", "lang_pair": "en-fr", "metrics": [], "per_category": False, "template": None},
    "data": {"examples": 2, "fingerprint": "0"},
    "cells": [],
    "seeds": [0],
}
SAMPLE = {"cell": "baseline T=1", "seed": 0, "example_id": "0", "index": 0, "stats": {}, "text": "a", "reference": None}
FOLDERS = {  # folder name -> {file name: content}; a None content makes a folder of that name
    "lock-dir": {".lock": None},
    "lock-dangling": {},  # its .lock is a link to a file in a folder that does not exist (made below)
    "acceptance-folder": {
        "config.json": {"recipe": {}, "request": {}, "prompts": "0123"},
        "samples.jsonl": [
            {"prompt": "a", "prompt_index": 0, "positions": 1, "values": {}, "kl": {}, "unavailable": {}}
        ],
    },
    "bench-folder": {"config.json": BENCH_CONFIG},
    "config-list": {"config.json": [BENCH_CONFIG]},
    "config-cells-3": {"config.json": {"cells": 3}},
    "config-seeds-text": {"config.json": BENCH_CONFIG | {"seeds": "0"}},
    "config-cell-shape": {"config.json": BENCH_CONFIG | {"cells": [{"verifier": "speculative", "num_drafts": 1}]}},
    "config-task-null": {"config.json": BENCH_CONFIG | {"task": None}},
    "config-dir": {"config.json": None},
    "config-cut": {"config.json": json.dumps(BENCH_CONFIG)[:30], "samples.jsonl": [SAMPLE]},
    "record-list": {"config.json": BENCH_CONFIG, "samples.jsonl": [[1, 2], SAMPLE]},
    "record-unhashable": {"config.json": BENCH_CONFIG, "samples.jsonl": [SAMPLE | {"cell": ["baseline"]}, SAMPLE]},
    "record-null-stats": {"config.json": BENCH_CONFIG, "samples.jsonl": [SAMPLE | {"stats": None}, SAMPLE]},
    "record-number-text": {"config.json": BENCH_CONFIG, "samples.jsonl": [SAMPLE | {"text": 5}, SAMPLE]},
    "samples-only-unhashable": {"samples.jsonl": [SAMPLE | {"seed": {"a": 1}}, SAMPLE]},
    "samples-dir": {"config.json": BENCH_CONFIG, "samples.jsonl": None},
    "samples-dir-only": {"samples.jsonl": None},
}
BENCH_OUT = "bench -r {recipe} %s --output {dir}/" % BENCH_DATA
ACCEPTANCE_OUT = "acceptance -r {recipe} --prompt ab --output {dir}/"
REPORT = "bench --report {dir}/"
READ_ONLY = "/proc/specdec-test/out"  # /proc takes no new folders, not even from root
DISK = [  # (command, the one error line must hold)
    (
        REPORT + "acceptance-folder",
        "'{dir}/acceptance-folder' holds acceptance results (written by specdec acceptance); bench --report reads",
    ),
    (BENCH_OUT + "acceptance-folder", "holds acceptance results (written by specdec acceptance); give specdec bench"),
    (ACCEPTANCE_OUT + "bench-folder", "holds bench results (written by specdec bench); give specdec acceptance"),
    (BENCH_OUT + "lock-dir", "cannot open the lock file '{dir}/lock-dir/.lock' (Is a directory); remove it"),
    (ACCEPTANCE_OUT + "lock-dir", "cannot open the lock file '{dir}/lock-dir/.lock' (Is a directory)"),
    (BENCH_OUT + "lock-dangling", "cannot open the lock file '{dir}/lock-dangling/.lock' (No such file"),
    (REPORT + "config-list", "config-list/config.json' is not a specdec results configuration"),
    (BENCH_OUT + "config-list", "config-list/config.json' is not a specdec results configuration"),
    (REPORT + "config-cells-3", "is not a specdec bench configuration; give a bench --output folder"),
    (REPORT + "config-seeds-text", "is not a specdec bench configuration"),
    (REPORT + "config-cell-shape", "is not a specdec bench configuration"),
    (REPORT + "config-task-null", "is not a specdec bench configuration"),
    (REPORT + "config-dir", "cannot read '{dir}/config-dir/config.json' (Is a directory)"),
    (BENCH_OUT + "config-dir", "cannot read '{dir}/config-dir/config.json' (Is a directory)"),
    (REPORT + "config-cut", "config-cut/config.json' is damaged (Expecting"),
    (BENCH_OUT + "config-cut", "if the samples beside it came from this same command, delete just config.json"),
    (REPORT + "record-list", "samples.jsonl' line 1 is not a sample record; delete that line"),
    (REPORT + "record-unhashable", "samples.jsonl' line 1 is not a sample record"),
    (REPORT + "record-null-stats", "samples.jsonl' line 1 is not a sample record"),
    (REPORT + "record-number-text", "samples.jsonl' line 1 is not a sample record"),
    (BENCH_OUT + "samples-only-unhashable", "samples.jsonl' line 1 is not a sample record"),
    (REPORT + "samples-dir", "cannot read '{dir}/samples-dir/samples.jsonl' (Is a directory)"),
    (BENCH_OUT + "samples-dir-only", "cannot use '{dir}/samples-dir-only/samples.jsonl' (Is a directory)"),
    ("bench -r {recipe} %s --output %s" % (BENCH_DATA, READ_ONLY), f"cannot write to --output '{READ_ONLY}'"),
    ("acceptance -r {recipe} --prompt ab --output " + READ_ONLY, f"cannot write to --output '{READ_ONLY}'"),
]


@pytest.fixture
def folders(inputs):
    """The prepared results folders of :data:`FOLDERS` beside ``inputs``' files."""
    root = Path(inputs["dir"])
    for name, files in FOLDERS.items():
        (root / name).mkdir()
        for file_name, content in files.items():
            path = root / name / file_name
            if content is None:
                path.mkdir()
            elif file_name.endswith(".jsonl"):
                path.write_text("".join(json.dumps(record) + "\n" for record in content))
            else:
                path.write_text(content if isinstance(content, str) else json.dumps(content))
    (root / "lock-dangling" / ".lock").symlink_to(root / "no" / "such" / "lock")
    return inputs


@pytest.mark.parametrize(("command", "message"), DISK, ids=lambda v: v[:70])
def test_a_folder_that_cannot_be_used_is_one_line(run, folders, command, message):
    code, out, err = run(command.format(**folders).split())
    assert code == 2, (out, err)
    one_error_line(err, message.format(**folders))


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [  # a filesystem without locks is the machine's condition (exit 1); a folder another run holds, a usage error
        (errno.ENOLCK, 1, "its filesystem does not support file locks"),
        (errno.EOPNOTSUPP, 1, "give an --output folder on a local disk"),
        (errno.ENOSYS, 1, "does not support file locks, which keep two runs from mixing their results"),
        (errno.EWOULDBLOCK, 2, "is being written by another specdec run (pid unknown)"),
        (errno.EAGAIN, 2, "is being written by another specdec run"),
    ],
)
def test_a_lock_refused_says_why(run, inputs, monkeypatch, error, code, message):
    def refuse(handle, operation):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", refuse)
    got, _, err = run((BENCH_OUT + "out").format(**inputs).split())
    assert got == code
    one_error_line(err, message)


def test_bench_report_on_a_folder_acceptance_wrote_names_it(run, inputs, tmp_path):
    folder = tmp_path / "acceptance-out"
    command = ACCEPTANCE_OUT + "acceptance-out --num-drafts 1 --verifier speculative"
    code, _, err = run(command.format(**inputs).split())
    assert code == 0, err
    code, _, err = run(["bench", "--report", str(folder)])
    assert code == 2
    one_error_line(err, f"'{folder}' holds acceptance results (written by specdec acceptance)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permissions say")
@pytest.mark.parametrize("command", ["bench --report {dir}/bench-folder", BENCH_OUT + "bench-folder"])
def test_a_folder_without_permissions_is_one_line(run, folders, command):
    folder = Path(folders["dir"]) / "bench-folder"
    (folder / "samples.jsonl").write_text("")
    (folder / ".lock").write_text("")
    for path in (folder / "config.json", folder / "samples.jsonl", folder / ".lock"):
        path.chmod(0o000)
    try:
        code, out, err = run(command.format(**folders).split())
    finally:
        for path in folder.iterdir():
            path.chmod(0o644)
    assert code == 2, (out, err)
    one_error_line(err, "Permission denied")
