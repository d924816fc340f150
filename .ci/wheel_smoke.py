"""Smoke checks of an installed wheel (run by .ci/wheel-smoke inside a fresh virtual environment).

Every command's --help, `specdec verifiers` and `specdec drafters` listing their built-ins with no load
failure, a tiny `generate` on a model built from a config (with the model drafter and with prompt
lookup) and a tiny `bench --task wmt` on the newstest2014 sample the wheel ships: each must work from the
wheel alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BUILT_INS = {
    "verifiers": {"speculative", "mentored", "specinfer", "spectr", "is-lp", "is-truncated", "block"},
    "drafters": {"model", "early-exit", "prompt-lookup"},
}
COMMANDS = ["generate", "acceptance", "bench", "verifiers", "drafters"]


def specdec(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"FAILED: specdec {' '.join(args)} (exit {result.returncode})\n{result.stdout}\n{result.stderr}")
    print(f"ok: specdec {' '.join(args)[:70]}")
    return result.stdout


def main() -> None:
    import specdec_cli

    installed = Path(specdec_cli.__file__).resolve()
    if not installed.is_relative_to(Path(sys.prefix).resolve()):
        sys.exit(f"FAILED: imported specdec_cli from {installed}, not from this environment's wheel")
    specdec("--help")
    for command in COMMANDS:
        specdec(command, "--help")
    for kind, built_ins in BUILT_INS.items():
        listed = json.loads(specdec(kind, "--json"))
        names = {row["name"] for row in listed[kind]}
        if listed["failed"] or not built_ins <= names:
            sys.exit(f"FAILED: {kind}: missing {sorted(built_ins - names)}, failed {listed['failed']}")
    with tempfile.TemporaryDirectory() as folder:
        tiny_generate(Path(folder))


def tiny_generate(folder: Path) -> None:
    from transformers.utils import logging

    import specdec_cli
    from specdec_cli.kit.testing import save_tiny_model

    logging.disable_progress_bar()

    target = save_tiny_model(folder / "target", "llama", seed=1)
    draft = save_tiny_model(folder / "draft", "llama", seed=2, layers=1)
    recipe = folder / "tiny.yaml"
    recipe.write_text(
        json.dumps({"target": {"model": str(target), "device": "cpu"}, "draft": {"model": str(draft), "device": "cpu"}})
    )  # JSON is YAML
    os.environ["SPECDEC_CACHE"] = str(folder / "cache")
    out = specdec("generate", "-r", str(recipe), "--max-new-tokens", "8", "--json", "hello world")
    sample = json.loads(out)["samples"][0]
    if not sample["token_ids"]:
        sys.exit("FAILED: the tiny generate produced no tokens")
    specdec("generate", "-r", str(recipe), "--max-new-tokens", "8", "--verifier", "speculative,block,none", "hello")
    specdec("generate", "-r", str(recipe), "--max-new-tokens", "8", "--drafter", "prompt-lookup", "hello hello")
    shipped = Path(specdec_cli.__file__).parent / "bench" / "newstest2014"
    if sorted(path.name for path in shipped.glob("en-*")) != ["en-de.de", "en-de.en", "en-fr.en", "en-fr.fr"]:
        sys.exit(f"FAILED: the wheel lacks the newstest2014 sample under {shipped}")
    bench = folder / "bench"
    specdec(
        "bench", "-r", str(recipe), "--task", "wmt", "--limit", "2", "--max-new-tokens", "4", "--output", str(bench)
    )
    if not (bench / "results.json").is_file():
        sys.exit("FAILED: bench --task wmt wrote no results.json")


if __name__ == "__main__":
    main()
