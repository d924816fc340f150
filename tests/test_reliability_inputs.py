"""What users hand in (issue 19, §3): prompt files, datasets, recipes, sampling settings, GGUF files, the cache.

Bad input of each kind is one line and exit 2 before any model loads (the table, as in
``tests/test_bad_inputs.py``; ``{dir}`` holds the files ``files`` writes). Inputs that used to be read
wrongly must now run and give what they say; the GGUF cache must not keep what a killed run left.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec_cli.base.errors import RecipeError, SpecdecError
from specdec_cli.base.inputs import cache_dir
from specdec_cli.base.recipe import check_expanded_size
from specdec_cli.base.sampling import SamplingParams, sampling_law
from specdec_cli.bench.tasks import DataSource, load_examples
from specdec_cli.models.gguf_cache import STALE_STAGING_AFTER_S, cached_gguf_conversion, remove_stale_staging
from tests.conftest import one_error_line, tiny_recipe

BOM = "\ufeff"


def _billion_laughs(levels: int = 9) -> str:
    """Nine aliases deep, nine wide: 9**9 values once expanded, from a few hundred bytes of YAML."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


FILES: dict[str, str | bytes] = {
    "number.jsonl": "5\n",
    "string.jsonl": '"a prompt"\n',  # holds the word 'prompt': it was looked up as a field of a string
    "list.jsonl": '["prompt"]\n',
    "null-line.jsonl": "null\n",
    "bool.jsonl": "true\n",
    "NUMBER.JSONL": "7\n",
    "blank-lines.jsonl": '{"prompt": "a b"}\n\n7\n',  # line numbers count the blank line
    "dict-field.jsonl": '{"prompt": {"text": "a b"}}\n',
    "utf16.txt": "a b\n".encode("utf-16-le"),  # no BOM: valid UTF-8 with a NUL after every letter
    "prompts.json": '["a b", "c d"]\n',
    "bom-only.txt": BOM + "\n",
    "reference-number.jsonl": '{"text": "a b", "reference": "c d"}\n{"text": "c d", "reference": 5}\n',
    "categories.jsonl": '{"turns": ["a b"], "category": "writing"}\n{"turns": ["c d"], "category": 3}\n',
    "id-list.jsonl": '{"id": [1], "text": "a b"}\n',
    "id-bool.jsonl": '{"id": true, "text": "a b"}\n',
    "dolly-context.jsonl": '{"instruction": "a b", "context": 5, "response": "c d"}\n',
    "dict-reference.jsonl": '{"text": "a b", "ref": {"x": 1}}\n',
    "DATA.JSONL": '{"text": "a b", "reference": 5}\n',
    "nul.txt": "a\x00b\n",
    "empty-text.jsonl": '{"text": "a b"}\n{"text": "  "}\n',
    "empty-turn.jsonl": '{"turns": ["", "a b"]}\n',
    "self.yaml": "a: &a [*a]\n",
    "deep.yaml": "a: " + "[" * 5000 + "]" * 5000 + "\n",
}


@pytest.fixture
def files(inputs):
    folder = Path(inputs["dir"])
    for name, content in FILES.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return inputs


NOT_AN_OBJECT = "not a JSON object; each line must be one object such as"
PROMPT_FILES = [
    (
        "generate -r {recipe} --prompt-file {dir}/number.jsonl",
        '{dir}/number.jsonl line 1 is a number, %s {{"prompt": "..."}}' % NOT_AN_OBJECT,
    ),
    ("generate -r {recipe} --prompt-file {dir}/string.jsonl", "line 1 is a string, " + NOT_AN_OBJECT),
    ("generate -r {recipe} --prompt-file {dir}/list.jsonl", "line 1 is a list, " + NOT_AN_OBJECT),
    ("generate -r {recipe} --prompt-file {dir}/null-line.jsonl", "line 1 is null, " + NOT_AN_OBJECT),
    ("acceptance -r {recipe} --prompt-file {dir}/bool.jsonl", "line 1 is true or false, " + NOT_AN_OBJECT),
    ("acceptance -r {recipe} --prompt-file {dir}/string.jsonl", "line 1 is a string, " + NOT_AN_OBJECT),
    ("generate -r {recipe} --prompt-file {dir}/NUMBER.JSONL", "NUMBER.JSONL line 1 is a number, " + NOT_AN_OBJECT),
    ("generate -r {recipe} --prompt-file {dir}/blank-lines.jsonl", "blank-lines.jsonl line 3 is a number"),
    (
        "generate -r {recipe} --prompt-file {dir}/dict-field.jsonl",
        "'prompt' must be text or a list of texts, got {{'text': 'a b'}}",
    ),
    (
        "generate -r {recipe} --prompt-file {dir}/utf16.txt",
        "--prompt-file '{dir}/utf16.txt' holds NUL bytes (UTF-16 text or a binary file?); save it as UTF-8 text",
    ),
    ("generate -r {recipe} --prompt-file {dir}/prompts.json", "is a .json file; give JSON lines (.jsonl: one object"),
    ("generate -r {recipe} --prompt-file {dir}", "--prompt-file '{dir}' is a folder; give a text file"),
    ("generate -r {recipe} --prompt-file {dir}/bom-only.txt", "has no prompts"),
    (
        "acceptance -r {recipe} --prompt-file {dir}/source.txt --field text",
        "--field names the prompt field of a .jsonl --prompt-file; drop it, or give a .jsonl file",
    ),
    ("acceptance -r {recipe} --prompt ab --prompt-file - --field text", "--field names the prompt field"),
]
DATASETS = [
    (
        "bench -r {recipe} --dataset {dir}/number.jsonl --source-field text",
        '{dir}/number.jsonl line 1 is a number, %s {{"text": "..."}}' % NOT_AN_OBJECT,
    ),
    ("bench -r {recipe} --dataset {dir}/list.jsonl --source-field text", "line 1 is a list, " + NOT_AN_OBJECT),
    (
        "bench -r {recipe} --dataset {dir}/reference-number.jsonl --source-field text",
        "{dir}/reference-number.jsonl line 2: 'reference' must be a JSON string, got 5; write it in quotes (\"5\") on "
        "every line",
    ),
    ("bench -r {recipe} --dataset {dir}/DATA.JSONL --source-field text", "'reference' must be a JSON string, got 5"),
    (
        "bench -r {recipe} --task spec-bench --dataset {dir}/categories.jsonl",
        "{dir}/categories.jsonl line 2: 'category' must be a JSON string, got 3",
    ),
    (
        "bench -r {recipe} --dataset {dir}/dict-reference.jsonl --source-field text --reference-field ref",
        "'ref' must be a JSON string, got {{'x': 1}}; give one string on every line",
    ),
    (
        "bench -r {recipe} --dataset {dir}/id-list.jsonl --source-field text",
        "line 1: 'id' must be a string or an integer, got [1]",
    ),
    ("bench -r {recipe} --dataset {dir}/id-bool.jsonl --source-field text", "'id' must be a string or an integer"),
    ("bench -r {recipe} --task dolly --dataset {dir}/dolly-context.jsonl", "'context' must be a JSON string, got 5"),
    ("bench -r {recipe} --source {dir}/nul.txt", "--source file '{dir}/nul.txt' holds NUL bytes"),
    (
        "bench -r {recipe} --dataset {dir}/empty-text.jsonl --source-field text",
        "{dir}/empty-text.jsonl line 2: 'text' is empty; give some text or delete the line",
    ),
    ("bench -r {recipe} --task spec-bench --dataset {dir}/empty-turn.jsonl", "line 1: 'turns' is empty"),
    ("generate -r {recipe} --prompt-file {dir}/empty-turn.jsonl", "empty-turn.jsonl line 1: 'turns' is empty"),
    ("bench -r {recipe} --source {dir}/source.txt --reference {dir}", "--reference file '{dir}' is a folder"),
]
RECIPES = [
    ("generate -r {dir}/self.yaml ab", "{dir}/self.yaml contains itself through a YAML alias"),
    ("generate -r {dir}/deep.yaml ab", "{dir}/deep.yaml is nested too deeply to be a recipe setting"),
    ("generate -r {recipe} --temperature inf ab", "--temperature inf: must be >= 0 and finite (0 = greedy)"),
    ("generate -r {recipe} --set drafts.0.temperature=.inf ab", "drafts.0.temperature: must be >= 0 and finite"),
    (
        "bench -r {recipe} --source {dir}/source.txt --temperature 1,inf",
        "--temperature inf: must be >= 0 and finite (0 = greedy)",
    ),
]


@pytest.mark.parametrize(("command", "message"), PROMPT_FILES + DATASETS + RECIPES, ids=lambda v: v[:70])
def test_bad_input_gives_one_line_and_exit_2(run, files, command, message):
    code, out, err = run(command.format(**files).split())
    assert code == 2, (out, err)
    one_error_line(err, message.format(**files))


# --------------------------------------------------------------------------- inputs that now read right


def _generated_prompts(run, recipe: str, *args: str, stdin: str | None = None) -> list[str]:
    code, out, err = run(
        ["generate", "-r", recipe, "--autoregressive", "--max-new-tokens", "1", "--json", *args], stdin=stdin
    )
    assert code == 0, err
    return [sample["prompt"] for sample in json.loads(out)["samples"]]


@pytest.mark.parametrize(
    ("name", "content", "prompts"),
    [
        ("bom.txt", BOM + "a b\r\nc d\r\n", ["a b", "c d"]),  # Windows: a BOM and CRLF line ends
        ("BOM.JSONL", BOM + '{"prompt": "a b"}\n{"text": "c d"}\n\n', ["a b", "c d"]),
        ("upper.Jsonl", '{"turns": ["c d", "e"]}\n', ["c d"]),
    ],
)
def test_prompt_files_with_a_bom_or_an_upper_case_suffix_give_their_prompts(
    run, recipe_path, tmp_path, name, content, prompts
):
    path = tmp_path / name
    path.write_bytes(content.encode())
    assert _generated_prompts(run, recipe_path, "--prompt-file", str(path)) == prompts


def test_stdin_with_a_bom_gives_its_text(run, recipe_path):
    assert _generated_prompts(run, recipe_path, stdin=BOM + "a b") == ["a b"]
    assert _generated_prompts(run, recipe_path, "--prompt-file", "-", stdin=BOM + "a b\nc d\n") == ["a b", "c d"]


def test_data_files_with_a_bom_or_an_upper_case_suffix_give_their_examples(tmp_path):
    (tmp_path / "source.txt").write_text(BOM + "a b\n")
    (tmp_path / "reference.txt").write_text(BOM + "c d\n")
    (tmp_path / "DATA.JSONL").write_text(BOM + '{"text": "a b", "reference": "c d", "id": 7, "category": null}\n')
    aligned = load_examples(
        DataSource(source_file=tmp_path / "source.txt", reference_file=tmp_path / "reference.txt")
    ).examples
    dataset = load_examples(DataSource(dataset=tmp_path / "DATA.JSONL", source_field="text")).examples
    assert [(e.source, e.reference) for e in aligned] == [("a b", "c d")]
    assert [(e.id, e.source, e.reference, e.category) for e in dataset] == [("7", "a b", "c d", None)]


# --------------------------------------------------------------------------- recipes: YAML that expands


def test_a_billion_laughs_recipe_is_refused_at_once(tmp_path):
    """It hung the tool (killed after 90 s); run in a subprocess so a regression fails instead of hanging."""
    recipe = tmp_path / "laughs.yaml"
    recipe.write_text(_billion_laughs())
    flow = "[" + ", ".join(line.split(": ", 1)[1] for line in _billion_laughs().splitlines()) + "]"
    commands = [["generate", "-r", str(recipe), "ab"], ["generate", "--set", f"verifier.params.x={flow}", "ab"]]
    for command, source in zip(commands, [str(recipe), "--set verifier.params.x"]):
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "specdec_cli", *command], capture_output=True, text=True, timeout=20
        )
        assert result.returncode == 2 and time.monotonic() - started < 20, result.stderr
        one_error_line(result.stderr, f"{source} expands to more than 10000 values through its YAML aliases")


def test_the_expansion_check_is_fast_and_lets_shared_settings_through():
    laughs = {"x": [[["x"] * 9] * 9] * 9}
    for _ in range(6):
        laughs = {"x": [laughs] * 9}  # nine shared references per level, as YAML aliases load
    started = time.monotonic()
    with pytest.raises(RecipeError, match="expands to more than 10000 values"):
        check_expanded_size(laughs, "recipe")
    assert time.monotonic() - started < 1
    shared = {"temperature": 0.5}
    check_expanded_size({"drafts": [shared, shared, shared]}, "recipe")  # an alias used a few times is fine


@pytest.mark.parametrize("where", ["set", "file"])
def test_numbers_in_scientific_notation_are_numbers(run, recipe_path, where):
    """YAML 1.1 reads 1e-3 (no dot) as text, which was refused as 'expected a number'."""
    flags = ["--set", "generation.temperature=1e-3"]
    if where == "file":
        path = Path(recipe_path)
        path.write_text(path.read_text().replace("temperature: 1.0", "temperature: 1e-3"))
        flags = []
    code, out, err = run(["generate", "-r", recipe_path, "--json", "--max-new-tokens", "2", *flags, "a b"])
    assert code == 0, err
    assert json.loads(out)["recipe"]["generation"]["temperature"] == 1e-3


# --------------------------------------------------------------------------- sampling settings that underflow


@pytest.mark.parametrize(
    "flags",
    [
        ["--temperature", "1e-40"],  # logits / T overflowed float32: reported as the model's NaN logits
        ["--temperature", "1e-50"],  # rounds to 0 in float32
        ["--temperature", "1e-40", "--top-k", "2"],
        ["--top-p", "1e-50"],  # rounds to 0 in float32: no token was kept
        ["--temperature", "1e-30", "--top-p", "1e-50"],
    ],
)
def test_tiny_temperatures_and_top_p_sample_as_greedy(run, recipe_path, flags):
    def tokens(*extra: str) -> list[list[int]]:
        code, out, err = run(["generate", "-r", recipe_path, "--json", "--max-new-tokens", "6", *extra, "a b"])
        assert code == 0, err
        return [sample["token_ids"] for sample in json.loads(out)["samples"]]

    assert tokens(*flags) == tokens("--temperature", "0")


def test_the_law_is_finite_for_any_temperature_and_unchanged_for_ordinary_ones():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 8  # [rows, V]
    for temperature in (0.3, 0.7, 1.0, 2.5):
        probs, finite = sampling_law(logits, SamplingParams(temperature, top_k=20))  # [rows, V], [rows]
        scaled = (logits.double() / temperature).masked_fill(logits < logits.topk(20).values[:, -1:], -torch.inf)
        torch.testing.assert_close(probs.double(), scaled.softmax(-1), atol=1e-6, rtol=1e-5)
        assert finite.all()
    huge = torch.tensor([[3e38, 1e38, -3e38], [1.0, 1.0 + 2**-20, 0.0]])  # [rows, V]: large, and close logits
    for temperature in (1e-45, 1e-40, 1e-30, 1e-7, 0.5):
        probs, finite = sampling_law(huge, SamplingParams(temperature))
        assert finite.all() and torch.isfinite(probs).all(), temperature
    nan_row = torch.tensor([[float("nan"), 1.0, 2.0], [float("inf"), 0.0, 0.0]])  # [rows, V]: still the model's fault
    assert not sampling_law(nan_row, SamplingParams(1e-40))[1].any()


# --------------------------------------------------------------------------- the cache folder


def test_an_empty_specdec_cache_means_the_default_folder(run, tmp_path, monkeypatch):
    """It wrote the cache files into the working directory."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_CACHE", "")
    assert cache_dir() == tmp_path / "home" / ".cache" / "specdec"
    code, _, err = run(["verifiers"])
    assert code == 0, err
    assert list((tmp_path / "work").iterdir()) == []
    assert any(cache_dir().iterdir())
    monkeypatch.setenv("SPECDEC_CACHE", "~/elsewhere")
    assert cache_dir() == tmp_path / "home" / "elsewhere"


# --------------------------------------------------------------------------- GGUF files


def _staging(cache: Path, owner: str, age_s: float = 0) -> Path:
    folder = cache / "gguf" / f".converting-{owner}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)  # a conversion cut off mid-save
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def _stale_and_live_staging(cache: Path) -> tuple[list[Path], list[Path]]:
    """Staging folders a killed run leaves (its process gone; an older version's, a day old), and ones
    that may still be written (this process's; another host's; an older version's, fresh)."""
    host = socket.gethostname()
    stale = [_staging(cache, f"{_dead_pid()}-{host}-ab12cd34"), _staging(cache, "x1y2z3w4", STALE_STAGING_AFTER_S + 60)]
    live = [
        _staging(cache, f"{os.getpid()}-{host}-live0000"),
        _staging(cache, f"{_dead_pid()}-other-host-ab12cd34"),
        _staging(cache, "fresh123"),
    ]
    return stale, live


def test_stale_staging_folders_are_removed_and_live_ones_kept(tmp_path):
    stale, live = _stale_and_live_staging(tmp_path)
    remove_stale_staging(tmp_path / "gguf")
    assert [path.exists() for path in stale + live] == [False] * len(stale) + [True] * len(live)


@pytest.mark.parametrize("named_by", ["model", "gguf_file"])
def test_a_gguf_recipe_converts_once_and_removes_what_killed_runs_left(
    run, tiny_gguf, tiny_models, write_recipe, tmp_path, monkeypatch, named_by
):
    """A conversion killed mid-save left ~540 MB behind that later runs never removed."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    stale, live = _stale_and_live_staging(cache)
    recipe = tiny_recipe(tiny_models, "llama", draft=None)
    recipe["target"] = (
        {"model": str(tiny_gguf), "device": "cpu"}
        if named_by == "model"
        else {"model": str(tiny_gguf.parent), "gguf_file": tiny_gguf.name, "device": "cpu"}
    )
    code, out, err = run(
        [
            "generate",
            "-r",
            str(write_recipe(recipe)),
            "--autoregressive",
            "--temperature",
            "0",
            "--max-new-tokens",
            "4",
            "--json",
            "a b",
        ]
    )
    assert code == 0, err
    converted = [p for p in (cache / "gguf").iterdir() if not p.name.startswith(".")]
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()
    assert [path.exists() for path in stale + live] == [False] * len(stale) + [True] * len(live)
    assert len(json.loads(out)["samples"][0]["token_ids"]) >= 1


@pytest.mark.parametrize(
    ("fault", "expected"),
    [(KeyboardInterrupt(), KeyboardInterrupt), (OSError(28, "No space left on device"), SpecdecError)],
)
def test_an_interrupted_or_failed_conversion_leaves_no_staging_folder(
    tiny_gguf, tmp_path, monkeypatch, fault, expected
):
    """Ctrl-C (or SIGTERM, which the CLI turns into it) while saving left the staging folder; a full disk was a
    traceback."""
    from transformers import PreTrainedModel

    def save_part_then_fail(model, folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise fault

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_part_then_fail)
    with pytest.raises(expected) as raised:
        cached_gguf_conversion(str(tiny_gguf.parent), tiny_gguf.name, {})
    assert list((tmp_path / "gguf").iterdir()) == []
    if expected is SpecdecError:
        folder = tmp_path / "gguf"
        assert str(raised.value).startswith(f"could not save the converted model in the cache folder '{folder}'")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            {"model": "{folder}", "gguf_file": "missing.gguf"},
            "no such GGUF file 'missing.gguf' in '{folder}' (target.gguf_file in the recipe); check the file name "
            "and the folder, or give the .gguf file's own path as model:",
        ),
        (
            {"model": "{folder}/no-such-folder", "gguf_file": "tiny.gguf"},
            "no such file or folder '{folder}/no-such-folder' (target.model in the recipe)",
        ),
        ({"model": "nobody/no-such-repo", "gguf_file": "tiny.gguf"}, "model 'nobody/no-such-repo/tiny.gguf' not found"),
    ],
)
def test_a_missing_gguf_file_is_one_line(run, tiny_gguf, tiny_models, write_recipe, target, message):
    folder = str(tiny_gguf.parent)
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["target"] = {key: value.format(folder=folder) for key, value in target.items()} | {"device": "cpu"}
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), "--autoregressive", "a b"])
    assert code == (1 if target["model"].startswith("nobody/") else 2)  # a path is checked before anything loads
    one_error_line(err, message.format(folder=folder))
