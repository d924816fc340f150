"""Third-party verifier plugins: installed with pip, listed, run end to end; broken ones reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_recipe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _installed(example: str, site: Path) -> Path:
    """The example plugin package ``examples/<example>`` installed with pip into folder ``site``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(EXAMPLES / example),
        ],
        check=True,
        capture_output=True,
    )
    return site


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    return _installed("verifier-plugin", tmp_path_factory.mktemp("plugin-site"))


@pytest.fixture(scope="module")
def drafter_site(tmp_path_factory) -> Path:
    return _installed("drafter-plugin", tmp_path_factory.mktemp("drafter-site"))


def _specdec(args: list[str], site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True, env=env)


def test_installed_plugin_is_listed(plugin_site):
    result = _specdec(["verifiers", "--json"], plugin_site)
    assert result.returncode == 0, result.stderr
    listed = {v["name"]: v for v in json.loads(result.stdout)["verifiers"]}
    assert listed["lenient"]["package"] == "specdec-lenient 0.1.0"
    assert listed["lenient"]["parameters"] == {"leniency": 1.0} and listed["lenient"]["lossless"] is False
    assert {"speculative", "mentored", "specinfer", "spectr", "is-lp", "is-truncated"} <= set(listed)


def test_installed_plugin_runs_in_generate(plugin_site, tiny_models, write_recipe):
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 20})))
    rates = []
    for leniency in ("1.0", "3.0"):
        result = _specdec(
            [
                "generate",
                "-r",
                recipe,
                "--verifier",
                "Lenient",
                "--json",
                "--num-samples",
                "8",
                "--set",
                f"verifier.params.leniency={leniency}",
                "a b c",
            ],
            plugin_site,
        )
        assert result.returncode == 0, result.stderr
        samples = json.loads(result.stdout)["samples"]
        rates.append(
            sum(s["stats"]["accepted_tokens"] for s in samples) / sum(s["stats"]["drafted_tokens"] for s in samples)
        )
    assert rates[1] > rates[0]  # the plugin's parameter reached it


def test_installed_drafter_plugin_is_listed_and_drafts(drafter_site, tiny_models, write_recipe):
    """The example drafter, written from the README's page and installed with pip, drafts in generate."""
    result = _specdec(["drafters", "--json"], drafter_site)
    assert result.returncode == 0, result.stderr
    listed = {d["name"]: d for d in json.loads(result.stdout)["drafters"]}
    assert listed["bigram"]["package"] == "specdec-bigram 0.1.0" and listed["bigram"]["parameters"] == {
        "smoothing": 0.5
    }
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 12})))
    result = _specdec(["generate", "-r", recipe, "--drafter", "bigram", "--json", "a b c a b"], drafter_site)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)["samples"][0]["stats"]
    assert stats["drafted_tokens"] > 0 and stats["draft_forwards"] == 0


def test_plugin_that_fails_to_load_is_reported(tmp_path):
    dist = tmp_path / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[specdec.verifiers]\nbroken = no_such_module:Verifier\n")
    result = _specdec(["verifiers"], tmp_path)
    assert result.returncode == 0
    assert "failed to load" in result.stdout and "broken" in result.stdout and "no_such_module" in result.stdout
