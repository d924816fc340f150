"""`specdec generate --batch-size B`: the same samples as batch 1, shown whole as each finishes, with the
run's throughput; bad uses are one line before any model loads."""

from __future__ import annotations

import json

import pytest

from tests.conftest import one_error_line, specdec_args, tiny_recipe


def _prompt_file(tmp_path) -> str:
    path = tmp_path / "prompts.txt"
    path.write_text("a b c\nd\n")
    return str(path)


def test_a_batch_gives_batch_ones_samples_with_its_throughput(run, recipe_path, tmp_path):
    args = specdec_args(
        "generate", recipe_path, "--json", num_samples=3, max_new_tokens=8, prompt_file=_prompt_file(tmp_path)
    )
    code, out, err = run([*args, "--batch-size", "4"])
    assert code == 0, err
    batched = json.loads(out)
    alone = json.loads(run(args)[1])
    assert len(batched["samples"]) == 6
    assert [s["token_ids"] for s in batched["samples"]] == [s["token_ids"] for s in alone["samples"]]
    assert [(s["prompt"], s["sample_index"]) for s in batched["samples"]] == [
        (s["prompt"], s["sample_index"]) for s in alone["samples"]
    ]
    throughput = batched["throughput"]
    assert throughput["batch_size"] == 4 and throughput["tokens_per_s"] > 0
    assert throughput["new_tokens"] == sum(len(s["token_ids"]) for s in batched["samples"])


def test_a_batch_shows_each_sample_whole(run, recipe_path, tmp_path):
    args = specdec_args("generate", recipe_path, num_samples=2, max_new_tokens=6, prompt_file=_prompt_file(tmp_path))
    code, out, err = run([*args, "--batch-size", "2"])
    assert code == 0, err
    samples = json.loads(run([*args, "--json"])[1])["samples"]
    texts = {(s["prompt"], s["sample_index"]): s["text"] for s in samples}
    shown = out.split("\n")
    headers = [i for i, line in enumerate(shown) if "prompt" in line and "sample" in line]
    assert len(headers) == 4 and "batch size 2" in err
    for (prompt, sample), text in texts.items():  # each sample's whole text on the line after its own header
        header = next(
            i for i in headers if f"prompt {['a b c', 'd'].index(prompt) + 1}, sample {sample + 1}" in shown[i]
        )
        assert shown[header + 1].strip() == text.strip()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--batch-size", "2", "--verifier", "speculative,none"], "--batch-size decodes one configuration at a time"),
    ],
)
def test_bad_batch_uses_are_one_line(run, recipe_path, args, message):
    code, _, err = run(["generate", "-r", recipe_path, *args, "a b"])
    assert code == 2
    one_error_line(err, message)


def test_a_target_that_cannot_batch_is_one_line(run, tiny_models, write_recipe):
    path = str(write_recipe(tiny_recipe(tiny_models, "bart")))
    code, _, err = run(["generate", "-r", path, "--batch-size", "2", "a b"])
    assert code == 2
    one_error_line(err, "use --batch-size 1")
