"""The `specdec` command: every bad input gives one line and the right exit code; --json; streaming."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_cli.cli import main
from specdec_cli.kit.testing import tiny_model, tiny_tokenizer
from tests.conftest import one_error_line, tiny_recipe


def test_version_and_help(run):
    code, out, _ = run(["--version"])
    assert code == 0 and out.startswith("specdec ")
    code, out, _ = run(["generate", "--help"])
    assert code == 0
    for option in (
        "--recipe",
        "--verifier",
        "--kl",
        "--num-drafts",
        "--draft-length",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--device",
        "--dtype",
        "--set",
        "--prompt-file",
        "--num-samples",
        "--chat",
        "--json",
        "--autoregressive",
    ):
        assert option in out


def test_json_output_schema(run, recipe_path):
    code, out, _ = run(
        ["generate", "-r", recipe_path, "--json", "--num-samples", "2", "--max-new-tokens", "6", "a b c"]
    )
    assert code == 0
    payload = json.loads(out)
    assert payload["recipe"]["generation"]["max_new_tokens"] == 6
    assert payload["recipe"]["verifier"]["name"] == "speculative"
    assert len(payload["samples"]) == 2
    for sample in payload["samples"]:
        assert set(sample) >= {"text", "token_ids", "stats", "prompt", "sample_index"}
        assert 1 <= len(sample["token_ids"]) <= 6
        stats = sample["stats"]
        for key in (
            "target_forwards",
            "draft_forwards",
            "new_tokens",
            "accepted_per_position",
            "block_efficiency",
            "acceptance_rate",
            "draft_time_s",
            "target_time_s",
            "verify_time_s",
            "tokens_per_second",
        ):
            assert key in stats
        assert stats["new_tokens"] == len(sample["token_ids"])
    # Same seed, same output; the recipe's seed is overridable.
    assert (
        json.loads(run(["generate", "-r", recipe_path, "--json", "--max-new-tokens", "6", "a b c"])[1])["samples"][0][
            "token_ids"
        ]
        == payload["samples"][0]["token_ids"]
    )


def test_streams_text_and_prints_stats_on_stderr(run, recipe_path):
    code, out, err = run(["generate", "-r", recipe_path, "--temperature", "0", "--max-new-tokens", "10", "a b c"])
    assert code == 0
    assert out.strip() and set(out.split()) <= {"a", "b", "c", "d", "e"}
    assert "block efficiency" in err and "acceptance rate" in err


def test_prompts_from_file_and_stdin(run, recipe_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a b\n\nc d\n")
    code, out, _ = run(["generate", "-r", recipe_path, "--json", "--prompt-file", str(prompts)])
    assert code == 0 and [s["prompt"] for s in json.loads(out)["samples"]] == ["a b", "c d"]
    code, out, _ = run(["generate", "-r", recipe_path, "--json"], stdin="e d c")
    assert code == 0 and json.loads(out)["samples"][0]["prompt"] == "e d c"


def test_autoregressive_flag_and_verifier_none(run, recipe_path):
    for flags in (["--autoregressive"], ["--verifier", "none"]):
        code, out, _ = run(["generate", "-r", recipe_path, "--json", *flags, "a b"])
        payload = json.loads(out)
        assert code == 0 and payload["autoregressive"] is True
        assert payload["samples"][0]["stats"]["draft_forwards"] == 0


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["-r", "missing.yaml"], 2, "recipe file 'missing.yaml' not found"),
        (["--set", "speculation.draft_lenght=2"], 2, "did you mean 'draft_length'"),
        (["--draft-length", "0"], 2, "--draft-length 0: must be >= 1"),
        (["--num-drafts", "0"], 2, "--num-drafts 0: must be >= 1"),
        (["--temperature", "-1"], 2, "--temperature -1: must be >= 0 and finite (0 = greedy)"),
        (["--top-p", "1.5"], 2, "--top-p 1.5: must be in (0, 1]"),
        (["--set", "speculation.draft_length=0"], 2, "speculation.draft_length: must be >= 1"),
        (["--verifier", "nosuch"], 2, "unknown verifier 'nosuch'; installed verifiers: "),
        (["--num-drafts", "3"], 2, "takes at most 1 draft(s) per position; lower --num-drafts (K × draft configs = 3)"),
        (
            ["--kl", "0.5"],
            2,
            "--kl sets a KL bound, which verifier 'speculative' does not have; verifiers with one: mentored",
        ),
    ],
)
def test_bad_recipe_and_flags(run, recipe_path, args, code, message):
    if args[0] != "-r":
        args = ["-r", recipe_path, *args]
    got, _, err = run(["generate", *args, "a b"])
    assert got == code
    one_error_line(err, message)


def test_yaml_syntax_error(run, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target: {model: x\n")
    code, _, err = run(["generate", "-r", str(path), "a"])
    assert code == 2
    one_error_line(err, "YAML syntax error")
    assert "line " in err


def test_empty_prompt(run, recipe_path):
    code, _, err = run(["generate", "-r", recipe_path, "   "])
    assert code == 2
    one_error_line(err, "the prompt is empty")


def test_no_prompt_at_all(run, recipe_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    try:
        main(["generate", "-r", recipe_path])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2


def test_prompt_longer_than_context(run, recipe_path):
    code, _, err = run(["generate", "-r", recipe_path, " ".join(["a"] * 130)])
    assert code == 2
    one_error_line(err, "the model's context of 128 positions cannot hold")


@pytest.mark.parametrize(("max_new_tokens", "code"), [(100, 2), (20, 0)])
def test_encoder_decoder_context_is_checked_before_generating(run, tiny_models, write_recipe, max_new_tokens, code):
    """BART has 64 positions: 100 new tokens used to stream 63 and then fail with an IndexError."""
    recipe = write_recipe(tiny_recipe(tiny_models, "bart"))
    got, out, err = run(["generate", "-r", str(recipe), "--max-new-tokens", str(max_new_tokens), "a b"])
    assert got == code, err
    if code:
        assert not out
        one_error_line(err, "the decoder's context of 64 positions cannot hold max_new_tokens 100")


def test_model_not_found(run, tiny_models, write_recipe):
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["target"]["model"] = "no-such-org/no-such-model"
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), "a"])
    assert code == 1
    one_error_line(err, "model 'no-such-org/no-such-model' not found")
    assert "could not be reached" in err and "local directory" in err


def test_tokenizer_mismatch(run, tiny_models, write_recipe, tmp_path):
    other = tmp_path / "other-vocab"
    tiny_model("llama", seed=3, layers=1).save_pretrained(other)
    tiny_tokenizer(["<pad>", "</s>", "<unk>", "x", "y", "z", "w", "v"]).save_pretrained(other)
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["draft"]["model"] = str(other)
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), "a"])
    assert code == 1
    one_error_line(err, "does not share the target's tokenizer")


@pytest.mark.parametrize("command", [["generate", "a b"], ["acceptance", "--prompt", "a b", "--num-drafts", "1"]])
@pytest.mark.parametrize("temperature", ["0", "1"])
def test_nan_logits_are_reported(run, tiny_models, write_recipe, tmp_path, command, temperature):
    broken = tmp_path / "nan-target"
    model = tiny_model("llama", seed=1)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.save_pretrained(broken)
    tiny_tokenizer().save_pretrained(broken)
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["target"]["model"] = str(broken)
    code, _, err = run([command[0], "-r", str(write_recipe(recipe)), "--temperature", temperature, *command[1:]])
    assert code == 1
    one_error_line(err, "the target produced NaN or infinite logits")


def test_debug_shows_the_traceback(recipe_path):
    result = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "--debug", "generate", "-r", recipe_path, "--draft-length", "0", "a"],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "Traceback" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "generate", "-r", recipe_path, "--draft-length", "0", "a"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_verifiers_lists_the_builtin(run):
    code, out, _ = run(["verifiers", "--json"])
    listed = {v["name"]: v for v in json.loads(out)["verifiers"]}
    assert code == 0 and listed["speculative"]["lossless"] is True and listed["speculative"]["max_drafts"] == 1


def test_seq2seq_through_the_cli(run, tiny_models, write_recipe):
    path = str(write_recipe(tiny_recipe(tiny_models, "t5")))
    code, out, _ = run(["generate", "-r", path, "--json", "--temperature", "0", "a b c"])
    assert code == 0 and json.loads(out)["samples"][0]["token_ids"]


def test_generate_compares_verifiers_on_the_same_prompts_and_seeds(run, recipe_path):
    """A comma list runs each verifier on the same prompts and seeds: each one's samples equal a run of it alone."""
    same = ["--max-new-tokens", "6", "--num-samples", "2", "--json", "c d e"]  # the comparison's and each single run's
    code, out, err = run(
        ["generate", "-r", recipe_path, "--verifier", "speculative,mentored,none", "--kl", "0.3", *same]
    )
    assert code == 0, err
    payload = json.loads(out)
    rows = {row["label"]: row for row in payload["configurations"]}
    assert list(rows) == ["speculative", "mentored D=0.3", "none"]
    assert rows["none"]["speedup"] == 1.0 and rows["none"]["acceptance_rate"] is None
    assert rows["speculative"]["speedup"] > 0 and 0 <= rows["speculative"]["acceptance_rate"] <= 1
    assert "cpu" in payload["environment"]["device"]
    for label, single in (
        ("speculative", ["--verifier", "speculative"]),
        ("mentored D=0.3", ["--verifier", "mentored", "--kl", "0.3"]),
        ("none", ["--autoregressive"]),
    ):
        code, alone, _ = run(["generate", "-r", recipe_path, *single, *same])
        expected = [(s["token_ids"], s["accepted_mask"]) for s in json.loads(alone)["samples"]]
        assert [(s["token_ids"], s["accepted_mask"]) for s in rows[label]["samples"]] == expected, label
    code, out, _ = run(["generate", "-r", recipe_path, "--verifier", "speculative,block", "--max-new-tokens", "4", "a"])
    words = " ".join(out.split())  # the caption wraps to the table's width
    assert code == 0 and "verifiers compared" in words and "add none to --verifier for speedups" in words


@pytest.mark.parametrize(
    "verifiers, pattern",
    [
        ("mentored,Mentored", "--verifier lists a verifier twice"),
        ("speculative,nosuch", "unknown verifier 'nosuch'"),
        (
            "speculative,block",
            "--kl sets a KL bound, which none of speculative, block has; verifiers with one: mentored",
        ),
        ("none,speculative", "--kl sets a KL bound, which verifier 'speculative' does not have"),
    ],
)
def test_generate_comparison_inputs_are_checked_before_loading(run, recipe_path, verifiers, pattern):
    code, _, err = run(["generate", "-r", recipe_path, "--verifier", verifiers, "--kl", "0.1", "a"])
    assert code == 2
    one_error_line(err, pattern)


def test_stats_table_names_the_configuration_and_skips_draft_rows_for_the_target_alone(run, recipe_path):
    code, _, err = run(["generate", "-r", recipe_path, "--max-new-tokens", "4", "--draft-length", "2", "a b"])
    assert code == 0 and "speculative · L=2 · K=1" in err and "acceptance rate" in err
    assert "accepted draft tokens in" not in err  # not a terminal: no colour, so no colour caption
    code, _, err = run(["generate", "-r", recipe_path, "--max-new-tokens", "4", "--autoregressive", "a b"])
    assert code == 0 and "target alone" in err and "acceptance rate" not in err and "block efficiency" not in err


@pytest.mark.parametrize("command", ["generate", "acceptance", "bench", "verifiers"])
def test_help_shows_placeholders_and_defaults_not_python_types(run, command):
    code, out, _ = run([command, "--help"])
    assert code == 0
    for noise in ("<bool>", "<str>", "<int", "<float", "<list", "<path>"):
        assert noise not in out, noise
    if command != "verifiers":
        assert "default recipe" in out


@pytest.mark.parametrize(
    "args", [["--help"], ["generate", "--help"], ["verifiers"], ["bench", "--report", "benchmarks/results/wmt_default"]]
)
def test_listing_help_and_reports_never_import_torch(args, tmp_path):
    """These paths run no model, so they must start fast: neither torch nor transformers is imported
    (`verifiers` reads the plugins' description cache, which its first run writes)."""
    script = (
        "import sys; from specdec_cli.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    env = {**os.environ, "SPECDEC_CACHE": str(tmp_path)}
    for _ in range(2):  # the first run may fill the cache
        result = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
            timeout=120,
        )
    assert result.stdout.strip().splitlines()[-1] == "heavy: []", result.stdout[-500:] + result.stderr[-500:]
