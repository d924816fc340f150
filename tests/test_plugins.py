"""Third-party plugins installed with pip: listed, run end to end, and a broken one reported beside them.

The two example plugins are installed into one folder, beside a distribution whose entry point names a missing
module, and one process on that folder runs every command the tests read (``specdec ARGS`` in turn, each as the
CLI runs it): starting Python, torch and the plugins once instead of once a command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_recipe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SESSION = """
import contextlib, io, json, sys
from specdec_cli.cli import main

def specdec(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return [code, out.getvalue(), err.getvalue()]

commands = json.loads(open(sys.argv[1]).read())
ran = {name: specdec(args) for name, args in commands.items()}
open(sys.argv[2], "w").write(json.dumps(ran))
"""
"""Runs the commands of a JSON file (name → args) in this process and writes name → [exit code, stdout, stderr]."""


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """A folder holding the example verifier and drafter plugins installed with pip, and a broken distribution."""
    site = tmp_path_factory.mktemp("plugin-site")
    examples = [str(EXAMPLES / "verifier-plugin"), str(EXAMPLES / "drafter-plugin")]
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*pip, str(site), *examples], check=True, capture_output=True)
    dist = site / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[specdec.verifiers]\nbroken = no_such_module:Verifier\n")
    return site


@pytest.fixture(scope="module")
def ran(plugin_site, tiny_models, tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """name → (exit code, stdout, stderr) of each command, all run in one process with ``plugin_site`` on its path."""
    folder = tmp_path_factory.mktemp("plugin-runs")
    lenient, bigram = folder / "lenient.yaml", folder / "bigram.yaml"
    lenient.write_text(yaml.safe_dump(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 20})))
    bigram.write_text(yaml.safe_dump(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 12})))
    commands = {
        "verifiers": ["verifiers", "--json"],
        "verifiers table": ["verifiers"],
        "drafters": ["drafters", "--json"],
        "bigram": ["generate", "-r", str(bigram), "--drafter", "bigram", "--json", "a b c a b"],
        **{
            f"leniency {leniency}": [
                *("generate", "-r", str(lenient), "--verifier", "Lenient", "--json", "--num-samples", "8"),
                *("--set", f"verifier.params.leniency={leniency}", "a b c"),
            ]
            for leniency in ("1.0", "3.0")
        },
    }
    (folder / "commands.json").write_text(json.dumps(commands))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), os.environ.get("PYTHONPATH", "")])}
    session = [sys.executable, "-c", SESSION, str(folder / "commands.json"), str(folder / "ran.json")]
    done = subprocess.run(session, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return {name: tuple(result) for name, result in json.loads((folder / "ran.json").read_text()).items()}


def _succeeded(ran: dict[str, tuple[int, str, str]], name: str) -> str:
    code, out, err = ran[name]
    assert code == 0, err
    return out


def test_installed_plugin_is_listed(ran):
    listed = {v["name"]: v for v in json.loads(_succeeded(ran, "verifiers"))["verifiers"]}
    assert listed["lenient"]["package"] == "specdec-lenient 0.1.0"
    assert listed["lenient"]["parameters"] == {"leniency": 1.0} and listed["lenient"]["lossless"] is False
    assert {"speculative", "mentored", "specinfer", "spectr", "is-lp", "is-truncated"} <= set(listed)


def test_installed_plugin_runs_in_generate(ran):
    rates = []
    for leniency in ("1.0", "3.0"):
        samples = json.loads(_succeeded(ran, f"leniency {leniency}"))["samples"]
        rates.append(
            sum(s["stats"]["accepted_tokens"] for s in samples) / sum(s["stats"]["drafted_tokens"] for s in samples)
        )
    assert rates[1] > rates[0]  # the plugin's parameter reached it


def test_installed_drafter_plugin_is_listed_and_drafts(ran):
    """The example drafter, written from the README's page and installed with pip, drafts in generate."""
    listed = {d["name"]: d for d in json.loads(_succeeded(ran, "drafters"))["drafters"]}
    assert listed["bigram"]["package"] == "specdec-bigram 0.1.0" and listed["bigram"]["parameters"] == {
        "smoothing": 0.5
    }
    stats = json.loads(_succeeded(ran, "bigram"))["samples"][0]["stats"]
    assert stats["drafted_tokens"] > 0 and stats["draft_forwards"] == 0


def test_plugin_that_fails_to_load_is_reported(ran):
    """Listed by name with its error, in the table and in the JSON, while the plugins beside it work."""
    out = _succeeded(ran, "verifiers table")
    assert "failed to load" in out and "broken" in out and "no_such_module" in out
    [failed] = json.loads(_succeeded(ran, "verifiers"))["failed"]
    assert failed["name"] == "broken" and "no_such_module" in failed["error"]
