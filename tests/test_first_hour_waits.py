"""Long waits say what they are doing (issue 41, a newcomer's first hour): converting the GGUF weights, loading a
model, measuring the machine and compiling model steps each name themselves once they pass two seconds, on a
terminal (a transient spinner) and off it (one stderr line), where a redirected first run used to print nothing for
172 s. Shorter waits pass in silence; the library says nothing unless someone listens."""

from __future__ import annotations

import io
import time
from contextlib import nullcontext

import pytest
import torch
from rich.console import Console

from specdec_cli.base import waits
from specdec_cli.base.recipe import build_recipe
from specdec_cli.commands.progress import WAIT_SAID_AFTER_S, LongWaitsOnStderr
from specdec_cli.engine.decoder import SpeculativeDecoder
from specdec_cli.engine.session import ModelSession
from specdec_cli.engine.steps import compiling_steps
from specdec_cli.generation import calibration
from specdec_cli.generation.calibration import CpuLoad
from specdec_cli.kit.testing import tiny_model, tiny_tokenizer
from specdec_cli.models.loading import LoadedModel
from tests.conftest import tiny_recipe

VOCAB = 8


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    text = io.StringIO()
    return Console(file=text, force_terminal=terminal, width=200), text


@pytest.fixture
def said(monkeypatch) -> list[str]:
    """What the waits within the test name, in order (the only listener while it runs)."""
    heard: list[str] = []
    monkeypatch.setattr(waits, "_listeners", [lambda what: heard.append(what) or nullcontext()])
    return heard


def test_off_a_terminal_a_wait_past_the_threshold_is_one_line_and_a_short_one_is_none():
    console, text = _console(terminal=False)
    listener = LongWaitsOnStderr(console, after_s=0.2)
    with waits.listening(listener):
        with waits.waiting("a short wait"):
            pass
        for _ in range(2):  # the same wait again: said once in a run
            with waits.waiting("converting the weights"):
                time.sleep(0.4)
                with waits.waiting("reading a file"):  # nested: each said as it comes due
                    time.sleep(0.4)
    time.sleep(0.3)  # a timer left running would say the short wait now
    assert text.getvalue() == "converting the weights…\nreading a file…\n"
    assert WAIT_SAID_AFTER_S == 2.0  # the CLI's threshold: the "every wait over 2 s"


def test_on_a_terminal_a_spinner_says_the_innermost_wait_and_goes():
    console, text = _console(terminal=True)
    listener = LongWaitsOnStderr(console, after_s=0)
    with waits.listening(listener), waits.waiting("loading the target model"):
        time.sleep(0.2)
        with waits.waiting("converting the weights"):
            time.sleep(0.3)
            assert listener._status is not None
    assert listener._status is None  # transient: nothing stays on the terminal's last line
    shown = text.getvalue()
    assert "loading the target model…" in shown and "converting the weights…" in shown


def test_on_a_terminal_the_commands_own_status_keeps_its_line(monkeypatch):
    """generate's "Loading models…" spinner already says what loading does: no second spinner fights it."""
    console, text = _console(terminal=True)
    outer, _ = _console(terminal=True)
    listener = LongWaitsOnStderr(console, after_s=0)
    with outer.status("Loading models…"), waits.listening(listener), waits.waiting("loading the target model"):
        time.sleep(0.2)
    assert text.getvalue() == "" and listener._status is None


def test_the_library_says_nothing_unless_someone_listens(monkeypatch, capsys):
    monkeypatch.setattr(waits, "_listeners", [])
    with waits.waiting("converting the weights"):
        pass
    assert capsys.readouterr() == ("", "")


def test_generate_off_a_terminal_says_it_loads_and_measures(run, recipe_path, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "cpu_load", lambda: CpuLoad(0.5, 2))  # a quiet CPU: the figure is cached
    with waits.listening(LongWaitsOnStderr(after_s=0)):  # every wait said: the tiny models load in a moment
        code, _, err = run(["generate", "-r", recipe_path, "--max-new-tokens", "3", "--json", "a b"])
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("loading the target model '") and lines[0].endswith("'…")
    assert lines[1].startswith("loading the draft model '")
    assert "measuring what the draft and the target cost on this machine" in err
    assert "(once: cached for later runs)…" in err


def test_a_gguf_conversion_says_it_is_done_once_and_where_it_is_kept(run, tiny_gguf, tiny_models, write_recipe):
    recipe = tiny_recipe(tiny_models, "llama", draft=None)
    recipe["target"] = {"model": str(tiny_gguf), "device": "cpu"}
    args = ["generate", "-r", str(write_recipe(recipe)), "--autoregressive", "--max-new-tokens", "2", "--json", "a"]
    for converted in (False, True):
        with waits.listening(LongWaitsOnStderr(after_s=0)):
            code, _, err = run(args)
        assert code == 0, err
        assert ("converting the GGUF weights of tiny.gguf to floats, once: later runs load them from " in err) == (
            not converted
        )


@torch.inference_mode()
@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_step_of_a_new_shape_is_said_and_one_run_before_is_not(said, compiled):
    model = LoadedModel(tiny_model("llama", seed=3), tiny_tokenizer(), "llama", False)
    session = ModelSession(model, VOCAB, use_cache=True, headroom=32, compiled=compiled)
    if compiled:  # eager in place of torch.compile: what is said is under test here, not the compiler
        session.steps.forward = model.model.forward
    session.add([[3, 4, 5]], [[3, 4, 5]])
    session.forward(None, torch.tensor([[6]]), 1)  # prefill (eager, the prompt's length) and the first step
    session.forward(None, torch.tensor([[7]]), 1)  # the same shape again
    session.forward(None, torch.tensor([[7, 5]]), 2)  # a new shape: two ids
    assert said == ([compiling_steps()] * 2 if compiled else [])
    assert "compiled kernels are cached in " in compiling_steps()


def test_the_measurement_says_whether_a_later_run_keeps_it(said, tiny_models, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    decoder = SpeculativeDecoder.from_recipe(build_recipe(tiny_recipe(tiny_models, "llama")))
    for average in (3.0, 0.5):
        monkeypatch.setattr(calibration, "cpu_load", lambda average=average: CpuLoad(average, 2))
        calibration.draft_cost(decoder, [3, 4, 5], recalibrate=True)
    assert said[-2:] == [
        "measuring what the draft and the target cost here for this run only (the CPU is busy: load 3.0 on 2 cores)",
        "measuring what the draft and the target cost on this machine (once: cached for later runs)",
    ]


def test_progress_off_a_terminal_is_a_line_every_half_minute(capsys):
    """A bar cannot redraw in a log: a long run says its tokens, time and ETA there, at most every 30 s."""
    from specdec_cli.commands.progress import PlainProgress

    now = [0.0]
    progress = PlainProgress("samples", total=1000, completed=100, clock=lambda: now[0])
    for _ in range(6):
        now[0] += 10.0
        progress.advance(50)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "samples: 250/1000 tokens, 0:30 elapsed, ETA 2:30",
        "samples: 400/1000 tokens, 1:00 elapsed, ETA 2:00",
    ]
