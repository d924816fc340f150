"""Threads that fit the machine: with no thread count given, a busy CPU runs at one thread at once (measured there
only, as --threads 1 would), and a quiet one times the draft and the target at torch's default and at one thread
and keeps the faster; a figure measured on a busy CPU is said to be one and never cached; a cached figure is
measured again when the load has moved; and a forward slower than any CPU can be is not believed.

The load reading and the timer's clock are given by the tests (the decoder is real, its region timer reads a
clock that advances by a fixed step per reading, set per thread count), so no outcome depends on the machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from specdec_cli.base import timing
from specdec_cli.base.recipe import build_recipe
from specdec_cli.commands import common
from specdec_cli.engine.decoder import SpeculativeDecoder
from specdec_cli.generation import calibration, calibration_figures
from specdec_cli.generation.calibration import CpuLoad, DraftCost
from tests.conftest import bench_on_files, tiny_recipe

PROMPT = [3, 4, 5]
RUNS_PER_MEASUREMENT = 2 * (1 + calibration._REPEATS)  # with the draft and without, each after a warm-up
QUIETER = "a quieter moment gives this machine's own speed"
CHOOSE = "--threads N sets the count and skips this choice"
READ_CPU_LOAD = calibration.cpu_load  # the real reading, kept before any test or fixture replaces it


@pytest.fixture(scope="module")
def decoder(tiny_models) -> SpeculativeDecoder:
    return SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, "llama")))


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """The calibration cache's folder, empty."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    return tmp_path / "calibration"


@pytest.fixture
def load(monkeypatch):
    """load(average, cores=2): from now on the calibration reads this load."""

    def set_load(average: float, cores: int = 2) -> None:
        monkeypatch.setattr(calibration, "cpu_load", lambda: CpuLoad(average, cores))

    return set_load


@pytest.fixture
def default_threads(monkeypatch):
    """torch at 2 threads by default, as a 2-core machine starts, with no OMP_NUM_THREADS (the session sets 1), and
    no count set aside before loading."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(calibration, "_SET_ASIDE", [])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def clock(monkeypatch):
    """clock({threads: seconds}): every reading of the engine's timer is that many seconds after the last at
    torch's current thread count, so a timed region takes exactly that long."""

    def set_steps(seconds_per_reading: dict[int, float]) -> None:
        now = [0.0]

        def read() -> float:
            now[0] += seconds_per_reading[torch.get_num_threads()]
            return now[0]

        monkeypatch.setattr(timing, "perf_counter", read)

    return set_steps


@pytest.fixture
def generations(monkeypatch) -> list[int]:
    """The short generations the calibration runs: torch's thread count during each."""
    calls = []
    original = SpeculativeDecoder.generate_ids
    monkeypatch.setattr(
        SpeculativeDecoder,
        "generate_ids",
        lambda self, *a, **k: calls.append(torch.get_num_threads()) or original(self, *a, **k),
    )
    return calls


def _cached(cache: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in cache.glob("*.json")]


@pytest.mark.usefixtures("default_threads")
def test_on_a_busy_cpu_the_run_takes_one_thread_at_once_and_caches_nothing(decoder, cache, load, clock, generations):
    """Timing two threads too cost a busy 2-core machine 90 s a run (issue 41): the run measures what --threads 1
    measures, and no more."""
    load(3.0)
    clock({2: 0.003, 1: 0.001})
    calibrated = calibration.calibrate(decoder, PROMPT, choose_threads=True)
    note = calibrated.note
    # The run's thread count is returned for the caller to apply: calibrating leaves torch's as it found it.
    assert calibrated.threads == 1 and torch.get_num_threads() == 2 and generations == [1] * RUNS_PER_MEASUREMENT
    assert note.startswith("note: the CPU is busy (load 3.0 on 2 cores): a draft step takes ")
    assert note.endswith(
        "slower than this machine can do (measured now, not cached); this run uses 1 thread, not 2 threads, the "
        f"steady count on a busy CPU ({CHOOSE}); {QUIETER}"
    )
    assert _cached(cache) == []
    torch.set_num_threads(2)
    calibration.note_for(decoder, PROMPT)  # --threads 2: the user's count, measured once
    assert generations == [1] * RUNS_PER_MEASUREMENT + [2] * RUNS_PER_MEASUREMENT  # negative control


@pytest.mark.parametrize(("average", "threads"), [(3.0, 1), (1.0, 2)])
@pytest.mark.usefixtures("default_threads")
def test_generate_takes_one_thread_before_its_models_load_on_a_busy_cpu(
    decoder, cache, load, clock, generations, average, threads
):
    """The warm-up after loading took 28 s at two threads on a busy 2-core machine, 3 s at one: the count is taken
    before the models load (``apply_threads(None, chooses=True)``), and the note still says which it set aside. A
    quiet CPU keeps the default for the calibration to time (negative control)."""
    load(average)
    clock({2: 0.001, 1: 0.002})
    common.apply_threads(None, chooses=True)
    assert torch.get_num_threads() == threads
    note = calibration.note_for(decoder, PROMPT, choose_threads=True)
    if average > 2:
        assert generations == [1] * RUNS_PER_MEASUREMENT and torch.get_num_threads() == 1
        assert note.endswith(
            f"this run uses 1 thread, not 2 threads, the steady count on a busy CPU ({CHOOSE}); {QUIETER}"
        )
    else:
        assert sorted(set(generations)) == [1, 2] and torch.get_num_threads() == 2
    common.apply_threads(None)  # bench and acceptance keep the count they are given, busy or not
    assert torch.get_num_threads() == threads


@pytest.mark.usefixtures("default_threads")
def test_a_cpu_found_busy_only_while_measuring_keeps_the_faster_count_and_names_the_choice(
    decoder, cache, load, clock, generations, monkeypatch
):
    """Under a low load the choice times both counts; repeats far apart then make it a busy CPU's figure."""
    load(0.5)
    clock({2: 0.003, 1: 0.001})
    monkeypatch.setattr(calibration_figures, "_MAX_SPREAD", 0.5)  # every figure's repeats count as far apart
    calibrated = calibration.calibrate(decoder, PROMPT, choose_threads=True)
    note = calibrated.note
    assert calibrated.threads == 1 and torch.get_num_threads() == 2 and sorted(set(generations)) == [1, 2]
    assert note.endswith(f"; this run uses 1 thread, 3.0× as fast here now as 2 threads ({CHOOSE}); {QUIETER}")
    assert _cached(cache) == []


@pytest.mark.usefixtures("default_threads")
def test_on_a_quiet_cpu_the_faster_count_is_cached_with_its_load_and_measured_again_when_the_load_moves(
    decoder, cache, load, clock, generations
):
    load(0.5)
    clock({2: 0.001, 1: 0.002})
    cost = calibration.draft_cost(decoder, PROMPT, choose_threads=True)
    assert generations == [2] * RUNS_PER_MEASUREMENT + [1] * RUNS_PER_MEASUREMENT  # a quiet CPU times both counts
    assert (cost.threads, cost.slower_threads, cost.load, cost.cores) == (2, 1, 0.5, 2)
    assert cost.slower_block_s == pytest.approx(2 * cost.block_s(decoder.draft_length))
    assert torch.get_num_threads() == 2 and _cached(cache) == [dataclasses.asdict(cost)]
    assert calibration.note_for(decoder, PROMPT, choose_threads=True).startswith("note: on this machine (")  # quiet

    clock({2: 0.002, 1: 0.001})  # one thread would now be faster, but the load is about the same: the cache stands
    load(1.4)
    assert calibration.draft_cost(decoder, PROMPT, choose_threads=True) == cost
    assert len(generations) == 2 * RUNS_PER_MEASUREMENT and torch.get_num_threads() == 2

    load(1.5)  # a core's worth more than when measured
    moved = calibration.draft_cost(decoder, PROMPT, choose_threads=True)
    assert len(generations) == 4 * RUNS_PER_MEASUREMENT
    assert (moved.threads, moved.slower_threads, moved.load) == (1, 2, 1.5) and torch.get_num_threads() == 2
    assert _cached(cache) == [dataclasses.asdict(moved)]

    # The next run takes the cached choice, measuring nothing; torch's count is the caller's to set.
    assert calibration.draft_cost(decoder, PROMPT, choose_threads=True) == moved
    assert torch.get_num_threads() == 2 and len(generations) == 4 * RUNS_PER_MEASUREMENT


@pytest.mark.parametrize("fixed_by", ["--threads", "OMP_NUM_THREADS"])
@pytest.mark.usefixtures("default_threads")
def test_a_thread_count_the_user_fixed_is_kept_and_the_note_says_what_to_try(
    decoder, cache, load, clock, generations, monkeypatch, fixed_by
):
    if fixed_by == "OMP_NUM_THREADS":
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    load(4.2)
    clock({2: 0.003, 1: 0.001})
    note = calibration.note_for(decoder, PROMPT, choose_threads=fixed_by == "OMP_NUM_THREADS")
    assert torch.get_num_threads() == 2 and len(generations) == RUNS_PER_MEASUREMENT
    assert note.startswith("note: the CPU is busy (load 4.2 on 2 cores): ")
    assert note.endswith(f"(measured now, not cached); --threads 1 may run faster while it lasts, and {QUIETER}")
    assert _cached(cache) == []


def test_repeats_far_apart_are_a_busy_cpu_even_under_a_low_load(decoder, cache, load, clock, monkeypatch):
    """Another job that started within the load average's minute shows as repeats far apart."""
    load(0.1)
    clock({1: 0.001})
    runs = []
    original = SpeculativeDecoder.generate_ids

    def timed(self, *args, **kwargs):
        tokens, mask, stats = original(self, *args, **kwargs)
        if len(runs) in (6, 7):  # the last two timed runs of the target alone (warm-ups: runs 0 and 4)
            stats = dataclasses.replace(stats, target_time_s=stats.target_time_s * 4)
        runs.append(stats)
        return tokens, mask, stats

    monkeypatch.setattr(SpeculativeDecoder, "generate_ids", timed)
    note = calibration.note_for(decoder, PROMPT)
    assert note.startswith("note: the CPU was busy while measuring (repeats 4.0× apart): a draft step takes ")
    assert note.endswith(f"(measured now, not cached); {QUIETER}")  # at one thread already
    assert _cached(cache) == []


# The figures of the issue: SmolLM2-135M (134.5 M weights) on a busy 2-core AMD EPYC.
SMOLLM2 = 134_515_008


def test_a_135m_model_at_824_ms_a_token_is_not_believed():
    float32, bfloat16 = 4 * SMOLLM2, 2 * SMOLLM2
    assert calibration.slowest_plausible_s(SMOLLM2, float32, positions=1) < 0.824  # the target alone
    assert calibration.slowest_plausible_s(SMOLLM2, bfloat16, positions=1) < 2.08  # the draft step
    # Scoring a block of L + 1 = 5 positions: two FLOPs per weight and position at the floor are the slower.
    assert calibration.slowest_plausible_s(SMOLLM2, float32, positions=5) == pytest.approx(0.1 + 2 * SMOLLM2 * 5 / 1e9)


def _slow_cost(**changes) -> DraftCost:
    """A figure too slow for any CPU to give for the tiny models (a forward of a few thousand weights)."""
    figure = {"target_token_s": 0.824, "target_block_s": 0.9, "draft_s": 0.4, "acceptance": 0.5, "machine": "x"}
    today = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return DraftCost(**figure | {"measured_at": today} | changes)


def test_a_cached_figure_slower_than_the_floors_is_measured_again(decoder, cache, load, clock, generations):
    load(0.2)
    clock({1: 0.001})
    cost = calibration.draft_cost(decoder, PROMPT)
    (entry,) = cache.glob("*.json")
    entry.write_text(json.dumps(dataclasses.asdict(_slow_cost())))
    measured = calibration.draft_cost(decoder, PROMPT)
    assert measured.target_token_s == pytest.approx(cost.target_token_s) and measured.target_token_s < 0.824
    assert len(generations) == 2 * RUNS_PER_MEASUREMENT and _cached(cache) == [dataclasses.asdict(measured)]


@pytest.mark.parametrize(("average", "noted"), [(0.2, False), (3.0, True)])
def test_a_fresh_figure_slower_than_the_floors_is_never_cached(decoder, cache, load, monkeypatch, average, noted):
    """On a quiet CPU no busy job explains it: no figure and no note. On a busy one: this run's note, as a busy
    CPU's figure."""
    load(average)
    monkeypatch.setattr(calibration, "_measure", lambda decoder, ids, machine: _slow_cost(load=average, cores=2))
    note = calibration.note_for(decoder, PROMPT)
    assert (note is not None) == noted and _cached(cache) == []
    if noted:
        assert "a draft step takes 400 ms and the target 824 ms per token alone, 900 ms to score a block" in note


def test_no_floor_is_claimed_for_bfloat16_done_in_software(tiny_models):
    """A bfloat16 draft on a CPU without native bfloat16 may be far slower than its size says; its float32
    target still has its floor."""
    recipe = tiny_recipe(tiny_models, "llama", draft={"dtype": "bfloat16"})
    bfloat16_draft = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    slow_draft = _slow_cost(target_token_s=0.002, target_block_s=0.05, draft_s=0.4)
    assert calibration._plausible(dataclasses.replace(slow_draft, machine="CPU (no native bfloat16)"), bfloat16_draft)
    assert not calibration._plausible(dataclasses.replace(slow_draft, machine="CPU (native bfloat16)"), bfloat16_draft)
    assert not calibration._plausible(
        dataclasses.replace(slow_draft, machine="CPU (no native bfloat16)", target_token_s=0.824), bfloat16_draft
    )


@pytest.mark.parametrize(
    ("cores", "before", "now", "changed"),
    [(2, 0.5, 1.4, False), (2, 0.5, 1.5, True), (2, 3.0, 2.1, False), (16, 1.0, 4.9, False), (16, 1.0, 5.0, True)],
)
def test_a_load_changed_a_lot_is_a_core_s_worth_or_a_quarter_of_the_cores(cores, before, now, changed):
    assert CpuLoad(now, cores).changed_since(before) == changed


@pytest.mark.parametrize(("average", "busy"), [(2.0, False), (2.1, True)])
def test_a_busy_cpu_has_more_runnable_tasks_than_cores(average, busy):
    assert CpuLoad(average, 2).busy == busy


def test_the_load_is_the_systems_1_minute_average_and_none_where_there_is_none(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert READ_CPU_LOAD() == CpuLoad(3.5, 2)
    monkeypatch.delattr(os, "getloadavg")  # Windows
    assert READ_CPU_LOAD() is None


@pytest.mark.parametrize("verifiers", [["--verifier", "speculative,none"], []])
@pytest.mark.usefixtures("default_threads")
def test_generate_without_threads_runs_at_the_faster_count_and_with_them_at_the_user_s(
    run, recipe_path, cache, load, clock, verifiers
):
    load(3.0)
    clock({2: 0.003, 1: 0.001})
    args = ["generate", "-r", recipe_path, "--max-new-tokens", "3", "--json", *verifiers]
    code, out, err = run([*args, "a b"])
    assert code == 0, err
    assert json.loads(out)["environment"]["threads"] == 1
    assert f"; this run uses 1 thread, not 2 threads, the steady count on a busy CPU ({CHOOSE}); " in err
    code, out, err = run([*args, "--threads", "2", "a b"])
    assert code == 0, err
    assert json.loads(out)["environment"]["threads"] == 2
    assert "; --threads 1 may run faster while it lasts, and a quieter moment gives " in err


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.usefixtures("one_thread")  # --threads sets the whole process's count: the next test gets its own back
def test_bench_on_a_busy_cpu_says_its_figures_are_the_moment_s_and_keeps_the_note(
    run, bench_recipe, data, tmp_path, load, threads
):
    load(4.2)
    out = tmp_path / "busy"
    code, _, err = run(
        [*bench_on_files(bench_recipe, data, out, "--verifier", "speculative"), "--threads", str(threads)]
    )
    assert code == 0, err
    note = (
        "the CPU is busy (load 4.2 on 2 cores): speed figures are slower and noisier than this machine's; "
        + ("--threads 1 often gives steadier ones (compare runs only at the same setting), and " if threads > 1 else "")
        + "a quieter moment gives this machine's own figures"
    )
    assert f"note: {note}\n" in err
    assert note in json.loads((out / "results.json").read_text())["notes"]


def test_bench_on_a_quiet_cpu_says_nothing_of_it(run, bench_recipe, data, tmp_path):
    code, _, err = run(bench_on_files(bench_recipe, data, tmp_path / "quiet", "--verifier", "speculative"))
    assert code == 0, err
    assert "busy" not in err
