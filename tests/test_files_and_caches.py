"""Results folders, the hub and the GGUF cache as a user meets them: a changed folder names the keys that differ,
a resume says what it reuses, a finished run leaves no lock, a hub id without a network fails at once with the
way out, and a GGUF file converts once per content, without a progress bar unless --verbose."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from specdec_cli.base.errors import UsageError
from specdec_cli.models import loading
from specdec_cli.models.gguf_cache import cached_gguf_conversion, content_digest
from specdec_cli.results.store import LOCK, SAMPLES, ResultsStore
from tests.conftest import acceptance_of_one_prompt, bench_on_files, one_error_line, tiny_recipe


@pytest.fixture
def data(tmp_path) -> dict[str, str]:
    source, reference = tmp_path / "source.txt", tmp_path / "reference.txt"
    source.write_text("a b\nc d\n")
    reference.write_text("e\nd\n")
    return {"source": str(source), "reference": str(reference)}


@pytest.fixture
def recipe(tiny_models, write_recipe) -> str:
    return str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 3})))


# --------------------------------------------------------------------------- a changed results folder


def test_a_changed_folder_names_each_key_that_differs_with_both_values(run, recipe, data, tmp_path):
    out = tmp_path / "out"
    assert run(bench_on_files(recipe, data, out))[0] == 0
    fingerprint = json.loads((out / "config.json").read_text())["data"]["fingerprint"]
    code, _, err = run(bench_on_files(recipe, data, out, "--limit", "1", "--max-new-tokens", "2"))
    assert code == 2
    changed = json.loads((out / "config.json").read_text())  # unchanged on disk: the run was refused
    assert changed["data"]["fingerprint"] == fingerprint
    one_error_line(
        err,
        f"'{out}' holds results of a different configuration (changed: data.examples (2 → 1), data.fingerprint "
        f'("{fingerprint}" → "',
    )
    assert "), recipe.generation.max_new_tokens (3 → 2)); use another --output folder, or delete this one" in err


def test_many_changes_show_the_first_few_and_how_many_more(tmp_path):
    saved = {"cells": [], "seeds": [0], "recipe": {"a": 1, "b": [1, 2], "c": "x" * 60}, "data": {"n": 1}}
    current = {"cells": [1], "seeds": [0, 1], "recipe": {"a": 2, "b": [1, 3], "d": None}, "data": {"n": 2}}
    ResultsStore(tmp_path, saved).close()
    with pytest.raises(UsageError) as refused:
        ResultsStore(tmp_path, current)
    assert str(refused.value) == (
        f"'{tmp_path}' holds results of a different configuration (changed: data.n (1 → 2), recipe.a (1 → 2), "
        f'recipe.b[1] (2 → 3), recipe.c ("{"x" * 38}… → absent), recipe.d (absent → null) and 1 more); '
        "use another --output folder, or delete this one to start over"
    )


# --------------------------------------------------------------------------- a resumed run


def test_a_resumed_bench_says_how_many_samples_it_reuses(run, recipe, data, tmp_path):
    out = tmp_path / "out"
    code, _, err = run(bench_on_files(recipe, data, out))
    assert code == 0 and "resuming" not in err, err  # a new folder: nothing to reuse
    lines = (out / SAMPLES).read_text().splitlines(keepends=True)
    (out / SAMPLES).write_text("".join(lines[:3]))  # a run killed after 3 of its 4 samples
    code, _, err = run(bench_on_files(recipe, data, out))
    assert code == 0, err
    assert f"note: resuming '{out}': 3 of 4 samples already done, 1 to run\n" in err
    assert (
        f"resuming '{out}': 3 of 4 samples already done, 1 to run"
        in json.loads((out / "results.json").read_text())["notes"]
    )


# --------------------------------------------------------------------------- the lock


@pytest.mark.parametrize("command", ["bench", "acceptance"])
def test_a_finished_run_leaves_no_lock(run, recipe, data, tmp_path, command):
    out = tmp_path / "out"
    arguments = {
        "bench": bench_on_files(recipe, data, out),
        "acceptance": acceptance_of_one_prompt(recipe, "--output", str(out)),
    }
    code, _, err = run(arguments[command])
    assert code == 0, err
    assert not (out / LOCK).exists() and (out / SAMPLES).is_file()


def test_a_refused_folder_gets_no_lock_and_a_stale_lock_is_taken_and_removed(tmp_path):
    ResultsStore(tmp_path, {"recipe": 1}).close()
    (tmp_path / LOCK).write_text("12345")  # left by a killed run: its process is gone, so is its lock
    with pytest.raises(UsageError):
        ResultsStore(tmp_path, {"recipe": 2})
    assert not (tmp_path / LOCK).exists()
    (tmp_path / LOCK).write_text("12345")
    store = ResultsStore(tmp_path, {"recipe": 1})
    assert (tmp_path / LOCK).read_text() == str(os.getpid())
    store.close()
    assert not (tmp_path / LOCK).exists()


def test_a_lock_on_a_file_its_holder_removed_is_taken_again(tmp_path, monkeypatch):
    """A run that opened the lock file just before its holder removed it and finished would win a lock on a file no
    longer in the folder, beside a third run locking the new one."""
    import fcntl

    flock, replaced = fcntl.flock, []

    def holder_finishes_first(handle, operation):
        if not replaced:  # between this run's open and its lock: the holder removes the file, a third run makes one
            (tmp_path / LOCK).unlink()
            (tmp_path / LOCK).write_text("")
            replaced.append(os.stat(tmp_path / LOCK).st_ino)
        flock(handle, operation)

    (tmp_path / LOCK).write_text("")
    monkeypatch.setattr(fcntl, "flock", holder_finishes_first)
    store = ResultsStore(tmp_path, {"recipe": 1})
    assert os.fstat(store._lock.fileno()).st_ino == replaced[0] == os.stat(tmp_path / LOCK).st_ino
    store.close()


# --------------------------------------------------------------------------- a hub id without a network


NOT_CACHED = (
    "model 'someone/no-such-model' not found: it is not a local path, not in the Hugging Face cache, and the Hub "
    "could not be reached "
)
WAY_OUT = {
    False: "(offline); download it on a connected machine and set HF_HUB_OFFLINE=1 to use the local cache only, or "
    "point model: at a local directory saved with save_pretrained (or a .gguf file)",
    True: "(HF_HUB_OFFLINE is set); download it on a connected machine, or point model: at a local directory saved "
    "with save_pretrained (or a .gguf file)",
}


@pytest.fixture
def hub(monkeypatch):
    """hub(offline): the hub switched on as a user has it, or off as HF_HUB_OFFLINE=1 does (the tests' setting).
    This machine has no network, so the real path runs: huggingface_hub used to retry for 27 s."""
    from huggingface_hub import constants

    def switch(offline: bool) -> None:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")

    loading._hub_answers.cache_clear()
    yield switch
    loading._hub_answers.cache_clear()


def _timed_generate(run, recipe: Path) -> tuple[int, str, float]:
    started = time.monotonic()
    code, _, err = run(["generate", "-r", str(recipe), "--max-new-tokens", "2", "a"])
    return code, err, time.monotonic() - started


@pytest.mark.parametrize("offline", [False, True])
def test_a_hub_id_without_a_network_fails_at_once_with_the_way_out(run, tiny_models, write_recipe, hub, offline):
    hub(offline)
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["target"]["model"] = "someone/no-such-model"
    code, err, elapsed = _timed_generate(run, write_recipe(recipe))
    assert code == 1
    one_error_line(err, NOT_CACHED + WAY_OUT[offline])
    assert "Retrying" not in err
    assert elapsed < loading.HUB_PROBE_TIMEOUT_S + 1.0, elapsed


def test_a_cached_hub_model_loads_at_once_without_a_network(run, tiny_models, write_recipe, hub):
    from huggingface_hub import constants

    hub(False)
    repository = Path(constants.HF_HUB_CACHE) / "models--someone--cached-model"
    commit = "0" * 40
    shutil.copytree(tiny_models["llama-target"], repository / "snapshots" / commit, dirs_exist_ok=True)
    (repository / "refs").mkdir(exist_ok=True)
    (repository / "refs" / "main").write_text(commit)
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["target"]["model"] = "someone/cached-model"
    code, err, elapsed = _timed_generate(run, write_recipe(recipe))
    assert code == 0, err
    assert "Retrying" not in err and elapsed < 15, elapsed  # huggingface_hub took 141 s here, retrying each file


# --------------------------------------------------------------------------- the GGUF conversion cache


def test_the_same_gguf_content_in_two_places_converts_once(tiny_gguf, tmp_path, monkeypatch, capsys):
    """Two virtual environments each install the file: one conversion, keyed by the content; a file whose content
    changed gets a new one; no progress bar (the tests switch transformers' bars off, as the CLI does)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    copies = [tmp_path / "venv-a" / tiny_gguf.name, tmp_path / "venv-b" / tiny_gguf.name]
    for copy in copies:
        copy.parent.mkdir()
        shutil.copyfile(tiny_gguf, copy)
    converted = {cached_gguf_conversion(str(copy.parent), copy.name, {}) for copy in copies}
    assert len(converted) == 1 and list((tmp_path / "cache" / "gguf").iterdir()) == [Path(*converted)]
    assert "Converting" not in capsys.readouterr().err
    with open(copies[1], "r+b") as handle:  # the same size and name, other weights in its last tensor
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\x00\x00\x80\x3f")
    changed = cached_gguf_conversion(str(copies[1].parent), copies[1].name, {})
    assert changed not in converted
    assert sorted((tmp_path / "cache" / "gguf").iterdir()) == sorted(map(Path, {*converted, changed}))


def test_a_remembered_digest_is_trusted_only_when_plausible(tiny_gguf, tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert content_digest(tiny_gguf) == digest
    [memo] = (tmp_path / "gguf-digests").iterdir()
    assert memo.read_text() == digest + "\n"
    memo.write_text("half a digest")
    assert content_digest(tiny_gguf) == digest and memo.read_text() == digest + "\n"
    memo.write_text("f" * 64)  # plausible: taken without reading the file again
    assert content_digest(tiny_gguf) == "f" * 64


def test_the_conversion_bar_shows_only_when_the_libraries_bars_are_on(tiny_gguf, tmp_path, monkeypatch, capsys):
    from transformers.utils import logging

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    logging.enable_progress_bar()  # as --verbose leaves it
    try:
        cached_gguf_conversion(str(tiny_gguf.parent), tiny_gguf.name, {})
    finally:
        logging.disable_progress_bar()
    assert "Converting and de-quantizing GGUF tensors" in capsys.readouterr().err


def test_an_unreadable_gguf_file_is_one_line(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr("builtins.open", _refusing_open(gguf))
    with pytest.raises(loading.ModelLoadError, match=f"cannot read the GGUF file '{gguf}' .Permission denied."):
        content_digest(gguf)


def _refusing_open(refused: Path):
    """``open`` that refuses ``refused`` as a file without read permission does (root reads whatever the mode)."""
    original = open

    def refusing(file, *args, **kwargs):
        if Path(file) == refused:
            raise PermissionError(13, "Permission denied", str(refused))
        return original(file, *args, **kwargs)

    return refusing


def test_a_lock_file_whose_identity_never_holds_still_is_one_error_not_a_loop(tmp_path, monkeypatch):
    """A filesystem whose file identities change between two looks (some network mounts) would make the lock's
    retry, meant for a finished run removing the file, spin forever."""
    import itertools
    import os

    from specdec_cli.base.errors import SpecdecError
    from specdec_cli.results import store as results_store

    inodes = itertools.count()
    real_stat = os.stat
    monkeypatch.setattr(
        results_store.os, "stat", lambda path, *a, **k: os.stat_result((0, next(inodes), *real_stat(path)[2:]))
    )
    with pytest.raises(SpecdecError, match=r"kept changing under this run \(20 tries\); give an --output folder on a"):
        results_store._take_lock(tmp_path / ".lock")
