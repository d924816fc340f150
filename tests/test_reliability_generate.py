"""`generate` under stops, failures and conflicting flags.

Ctrl-C or SIGTERM prints what finished (texts, table or JSON with ``"interrupted": true``) and exits
130; a comparison counts only the (prompt, sample) rounds every configuration finished. Conflicting
flags are one line and exit 2. A reader that leaves (``| head``) ends the run quietly.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from specdec_cli.base.errors import NonFiniteLogitsError
from specdec_cli.engine.decoder import DecodingRun
from specdec_cli.generation import calibration, calibration_figures
from tests.conftest import one_error_line

PROMPTS = ["a b", "c d", "e a", "b c", "d e", "a c"]
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for `yes` in `yes | head`


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return str(path)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specdec_cli", "generate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop_at(process: subprocess.Popen, finished: re.Pattern, signum: int) -> tuple[str, str]:
    """Send ``signum`` once a stdout line matches ``finished`` (the run goes on meanwhile); its whole output."""
    seen = []
    for line in process.stdout:  # blocks until the next line, or the end of a run that never printed it
        seen.append(line)
        if finished.search(line):
            process.send_signal(signum)
            break
    out = process.stdout.read()  # what the line reader already buffered, then the rest (stderr is a few lines)
    err = process.stderr.read()
    process.wait(timeout=300)
    return "".join(seen) + out, err


def _interrupted_count(err: str, planned: int) -> int:
    match = re.search(rf"interrupted after (\d+) of {planned} samples", err)
    assert match, err
    return int(match.group(1))


def test_a_stopped_comparison_prints_the_rounds_that_finished(recipe_path, prompt_file):
    """Each round's texts are printed as it finishes; the first round's last text is the signal's cue.
    (SIGTERM is turned into Ctrl-C's KeyboardInterrupt; the in-process tests below raise that directly.)"""
    process = _start(
        ["-r", recipe_path, "--prompt-file", prompt_file, "--verifier", "speculative,none", "--max-new-tokens", "24"]
    )
    out, err = _stop_at(process, re.compile(r"prompt 1\.1 . none"), signal.SIGTERM)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    rounds = _interrupted_count(err, len(PROMPTS))
    assert 1 <= rounds < len(PROMPTS)
    assert "verifiers compared" in out and f"{rounds} sample(s) per configuration" in out
    # A stop while a round's texts print may leave its last text unprinted; never a text past it.
    assert rounds - 1 <= len(re.findall(r"prompt \d\.\d . none", out)) <= rounds, out


def test_a_stopped_generation_prints_the_table_of_the_samples_that_finished(recipe_path, prompt_file):
    process = _start(["-r", recipe_path, "--prompt-file", prompt_file, "--max-new-tokens", "24"])
    out, err = _stop_at(process, re.compile(r"prompt 2, sample 1"), signal.SIGTERM)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    finished = _interrupted_count(err, len(PROMPTS))
    assert 1 <= finished < len(PROMPTS)
    assert "speculative · L=3 · K=1" in err and "block efficiency" in err
    assert (f"mean of {finished}" in err) == (finished > 1)


def _stop_before_sample(monkeypatch, number: int, error: BaseException) -> None:
    """Raise ``error`` as the ``number``-th sample starts (warm-up and calibration runs do not count: they decode
    ids through ``generate_ids``, whose job has no prompt text)."""
    original = DecodingRun._join
    calls = itertools.count(1)

    def stopping(self, jobs, *args):
        if any(job.prompt and next(calls) == number for job in jobs):
            raise error
        return original(self, jobs, *args)

    monkeypatch.setattr(DecodingRun, "_join", stopping)


@pytest.mark.parametrize(
    ("verifiers", "stop_at", "kept"),
    [
        (["--verifier", "speculative,none"], 4, 1),  # in round 2, after speculative finished it: round 2 is not counted
        (["--verifier", "speculative,none"], 1, 0),
        ([], 3, 2),
    ],
)
def test_stopped_json_holds_the_complete_samples(run, recipe_path, monkeypatch, verifiers, stop_at, kept):
    args = ["generate", "-r", recipe_path, "--max-new-tokens", "5", "--json", *verifiers]
    code, whole, _ = run([*args, "--prompt-file", "-"], stdin="a b\nc d\ne a\n")
    assert code == 0
    _stop_before_sample(monkeypatch, stop_at, KeyboardInterrupt())
    code, out, err = run([*args, "--prompt-file", "-"], stdin="a b\nc d\ne a\n")
    assert code == 130, err
    assert f"interrupted after {kept} of 3 samples" in err
    stopped, whole = json.loads(out), json.loads(whole)
    assert stopped["interrupted"] is True and whole["interrupted"] is False
    groups = (
        [(s["samples"], w["samples"]) for s, w in zip(stopped["configurations"], whole["configurations"])]
        if verifiers
        else [(stopped["samples"], whole["samples"])]
    )
    assert len(groups) == (2 if verifiers else 1)
    for samples, complete in groups:  # the same samples as the uninterrupted run's first ones, and no others
        assert [s["token_ids"] for s in samples] == [s["token_ids"] for s in complete[:kept]]


@pytest.mark.parametrize("verifiers", [["--verifier", "speculative,none"], []])
def test_a_runtime_error_in_a_later_sample_prints_no_partial_json(run, recipe_path, monkeypatch, verifiers):
    """Documented choice: JSON on stdout means the run ended by itself or by the user's stop; after a
    failure stdout stays empty, so a consumer never takes part of a run for all of it."""
    _stop_before_sample(monkeypatch, 2, NonFiniteLogitsError("the target produced NaN or infinite logits"))
    code, out, err = run(
        ["generate", "-r", recipe_path, "--max-new-tokens", "4", "--json", *verifiers, "--prompt-file", "-"],
        stdin="a b\nc d\n",
    )
    assert code == 1 and out == ""
    notes = [line for line in err.splitlines() if line.startswith("note: ")]  # the draft-cost note may come first
    one_error_line(err.replace("\n".join(notes), ""), "NaN or infinite logits")


CONFLICTS = [
    (
        "--verifier speculative,block,none --autoregressive ab",
        "--autoregressive runs the target alone; it cannot be combined with "
        "--verifier speculative,block,none: drop one",
    ),
    ("--verifier speculative --autoregressive ab", "it cannot be combined with --verifier speculative: drop one"),
    ("--autoregressive --kl 0.1 ab", "--kl sets a KL bound, which the target alone does not have"),
    ("--verifier none --kl 0.1 ab", "--kl sets a KL bound, which the target alone does not have"),
    ("--set verifier.name=none --kl 0.1 ab", "--kl sets a KL bound, which the target alone does not have"),
    ("--autoregressive --draft-length 2 ab", "--draft-length has no effect on the target alone"),
    ("--verifier none --num-drafts 2 ab", "--num-drafts has no effect on the target alone"),
    ("--field text ab", "--field names the prompt field of a .jsonl --prompt-file"),
    ("--prompt-file {dir}/source.txt --field text", "--field names the prompt field of a .jsonl --prompt-file"),
    ("--verifier , ab", "--verifier lists no verifier"),
    ("--threads 0 ab", "--threads must be at least 1, got 0"),
    ("--threads -2 --verifier speculative,none ab", "--threads must be at least 1, got -2"),
]


@pytest.mark.parametrize(("flags", "message"), CONFLICTS, ids=lambda v: v[:50])
def test_conflicting_flags_are_one_line_and_exit_2(run, inputs, flags, message):
    code, out, err = run(["generate", "-r", inputs["recipe"], *flags.format(**inputs).split()])
    assert code == 2, (out, err)
    one_error_line(err, message)


def test_redundant_flags_that_agree_still_run(run, recipe_path):
    code, out, err = run(
        [
            "generate",
            "-r",
            recipe_path,
            "--autoregressive",
            "--verifier",
            "none",
            "--json",
            "--max-new-tokens",
            "3",
            "a b",
        ]
    )
    assert code == 0, err
    assert json.loads(out)["autoregressive"] is True


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("verifiers", [["--verifier", "speculative,none"], []])
def test_threads_is_applied_and_recorded(run, recipe_path, restore_threads, verifiers):
    code, out, err = run(
        ["generate", "-r", recipe_path, "--threads", "2", "--json", "--max-new-tokens", "3", *verifiers, "a b"]
    )
    assert code == 0, err
    assert json.loads(out)["environment"]["threads"] == 2  # the session's default is 1 (conftest)


@pytest.mark.parametrize("verifiers", [["--verifier", "speculative,none"], []])
def test_recalibrate_measures_the_draft_cost_again(run, recipe_path, monkeypatch, tmp_path, verifiers):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    # A busy CI machine measures slow, with repeats far apart: the figure is cached all the same here.
    monkeypatch.setattr(calibration, "_plausible", lambda cost, decoder: True)
    monkeypatch.setattr(calibration_figures, "_MAX_SPREAD", math.inf)
    monkeypatch.setattr(calibration, "cpu_load", lambda: calibration.CpuLoad(0.0, 2))
    args = ["generate", "-r", recipe_path, "--max-new-tokens", "3", *verifiers, "a b"]
    assert run(args)[0] == 0
    (cached,) = (tmp_path / "cache" / "calibration").glob("*.json")
    os.utime(cached, (0, 0))
    code, _, err = run([*args[:-1], "--recalibrate", "a b"])
    assert code == 0, err
    assert cached.stat().st_mtime > 0  # written again: measured anew


@pytest.mark.parametrize("verifiers", [["--verifier", "speculative,none"], []])
def test_a_busy_cpu_is_said_in_the_note_and_its_figure_not_cached(run, recipe_path, monkeypatch, tmp_path, verifiers):
    """The figures of a busy CPU are not the machine's: the note says so and what to do, and nothing is cached
    (at one thread, the session's, there is no thread count to try)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "cpu_load", lambda: calibration.CpuLoad(4.2, 2))
    code, _, err = run(["generate", "-r", recipe_path, "--max-new-tokens", "3", *verifiers, "a b"])
    assert code == 0, err
    (note,) = [line for line in err.splitlines() if line.startswith("note: ")]
    assert note.startswith("note: the CPU is busy (load 4.2 on 2 cores): a draft step takes "), note
    assert note.endswith("(measured now, not cached); a quieter moment gives this machine's own speed"), note
    assert not (tmp_path / "cache" / "calibration").exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--prompt-file", "{prompts}"],  # streamed text: rich's rule between samples meets the closed pipe first
        ["--prompt-file", "{prompts}", "--verifier", "speculative,none", "--json"],  # buffered: the last flush meets it
    ],
)
def test_a_reader_that_leaves_ends_the_run_quietly(recipe_path, prompt_file, flags):
    """`specdec generate … | head -1`: the pipe closes under the writer; no traceback, the shell's 141."""
    process = _start(["-r", recipe_path, "--max-new-tokens", "6", *[f.format(prompts=prompt_file) for f in flags]])
    process.stdout.close()  # the reader is gone before the first write
    err = process.stderr.read()
    process.wait(timeout=300)
    assert process.returncode == BROKEN_PIPE_EXIT, err
    assert "Traceback" not in err and "Exception ignored" not in err and "Error" not in err, err
