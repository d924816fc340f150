"""Bad input, command by command: one line that says what is wrong, exit 2, no traceback, no model loaded.

Each row is (command and arguments, text the one error line must hold). ``{dir}`` stands for a
folder of prepared files (see ``inputs``) and ``{recipe}`` for a tiny llama recipe. Every case
fails before a model loads, so the table runs in seconds. Cases that must *succeed* where they
used to fail follow the table.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import BENCH_DATA, acceptance_of_one_prompt, one_error_line, tiny_recipe

GENERATE = [
    ("generate -r {recipe} --verifier mentored --kl inf ab", "kl must be a finite number >= 0"),
    ("generate -r {recipe} --verifier mentored --kl nan ab", "kl must be a finite number >= 0"),
    (
        "generate -r {recipe} --verifier mentored --kl -1 ab",
        "--kl -1: verifier 'mentored': kl must be a finite number >= 0",
    ),
    ("generate -r {recipe} --verifier is-lp --set verifier.params.max_support=0 ab", "max_support must be >= 1"),
    ("generate -r {recipe} --verifier is-truncated --num-drafts 2 --set verifier.params.alphabet=0 ab", "alphabet"),
    ("generate -r {recipe} --verifier is-truncated --num-drafts 2 --set verifier.params.s=x ab", "is-truncated"),
    ("generate -r {recipe} --device mps ab", "no MPS"),
    ("generate -r {recipe} --device cuda:0 ab", "no CUDA GPU"),
    ("generate -r {recipe} --device tpu ab", "--device 'tpu': must be auto, cpu, cuda or cuda:N"),
    ("generate -r {recipe} --dtype float8 ab", "--dtype 'float8': must be one of"),
    ("generate -r {recipe} --set generation.temperature.x=1 ab", "'generation.temperature' is a float, not a mapping"),
    ("generate -r {recipe} --set drafts.5.temperature=1 ab", "use an index from 0 to 0"),
    ("generate -r {recipe} --set generation=3 ab", "generation: expected a mapping"),
    ("generate -r {recipe} --top-k -1 ab", "--top-k -1: must be >= 0"),
    ("generate -r {recipe} --top-p 0 ab", "--top-p 0: must be in (0, 1]"),
    ("generate -r {recipe} --max-new-tokens 0 ab", "--max-new-tokens 0: must be >= 1"),
    ("generate -r {recipe} --draft-length 100000 ab", "lower --draft-length"),
    ("generate -r {recipe} --prompt-file {dir}/null.jsonl", "'prompt' must be text or a list of texts, got None"),
    ("generate -r {recipe} --prompt-file {dir}/empty-turns.jsonl", "'turns' must be text or a list of texts, got []"),
    ("generate -r {recipe} --prompt-file {dir}/number-turns.jsonl", "got [5]"),
    ("generate -r {recipe} --prompt-file {dir}/other-field.jsonl", "name the prompt field with --field"),
    ("generate -r {recipe} --prompt-file {dir}/other-field.jsonl --field nosuch", "has no 'nosuch' field"),
    ("generate -r {recipe} --prompt-file {dir}/binary.txt", "is not UTF-8 text"),
    ("generate -r {recipe} --prompt-file {dir}/missing.txt", "cannot read --prompt-file"),
    ("generate -r {dir}/binary.txt ab", "recipe file"),
    ("generate -r {dir}/list.yaml ab", "must be a YAML mapping of keys"),
]
ACCEPTANCE = [
    ("acceptance -r {recipe} --prompt ab --kl -1", "--kl -1: verifier 'mentored': kl must be a finite number >= 0"),
    ("acceptance -r {recipe} --prompt ab --kl inf", "kl must be a finite number >= 0"),
    ("acceptance -r {recipe} --prompt ab --num-drafts 0", "--num-drafts 0: must be >= 1"),
    ("acceptance -r {recipe} --prompt ab --num-drafts two", "--num-drafts expects a comma list of int"),
    ("acceptance -r {recipe} --prompt-file {dir}/null.jsonl", "'prompt' must be text"),
    (
        "acceptance -r {recipe} --prompt ab --verifier is-lp --set verifier.params.max_support=0",
        "max_support must be >= 1",
    ),
    ("acceptance -r {recipe} --prompt ab --verifier nosuch", "unknown verifier 'nosuch'"),
    ("acceptance -r {recipe} --prompt ab --device mps", "no MPS"),
    ("acceptance -r {recipe} --prompt ab --output {dir}/source.txt", "--output '{dir}/source.txt' is a file"),
    ("acceptance -r {recipe} --prompt ab --plot {dir}/plot.txt", "name a .png, .pdf, .svg file"),
    (
        "acceptance -r {recipe} --prompt ab --plot {dir}/source.txt/plot.png",
        "the --plot folder '{dir}/source.txt' is a file",
    ),
]
BENCH_ON_DATA = "bench -r {recipe} %s " % BENCH_DATA  # then the options of the row
BENCH = [
    (BENCH_ON_DATA + "--temperature -1", "--temperature -1: must be >= 0 and finite (0 = greedy)"),
    (BENCH_ON_DATA + "--draft-temperatures=-1", "drafts.0.temperature: must be >= 0"),
    (BENCH_ON_DATA + "--draft-length 0", "--draft-length 0: must be >= 1"),
    (BENCH_ON_DATA + "--num-drafts 0", "--num-drafts 0: must be >= 1"),
    (
        BENCH_ON_DATA + "--verifier is-lp,speculative --set verifier.params.max_support=0",
        "grid cell 'is-lp K=1 L=3 T=1': verifier 'is-lp': max_support must be >= 1",
    ),
    (BENCH_ON_DATA + "--verifier mentored --kl -1", "--kl -1: verifier 'mentored': kl must be a finite number >= 0"),
    (
        BENCH_ON_DATA + "--verifier spectr --num-drafts 2 --draft-temperatures 1.0,1.2",
        "no speculative configuration to compare with the baseline (skipped: verifier 'spectr' needs identical drafts",
    ),
    (BENCH_ON_DATA + "--verifier nosuch", "unknown verifier 'nosuch'"),
    (BENCH_ON_DATA + "--draft-length x", "--draft-length expects a comma list of int"),
    ("bench -r {recipe} --dataset {dir}/duplicate-ids.jsonl --source-field text", "examples 1 and 2 share the id '1'"),
    ("bench -r {recipe} --dataset {dir}/null.jsonl --source-field prompt", "'prompt' must be text"),
    ("bench -r {recipe} --source {dir}/binary.txt", "is not UTF-8 text"),
    ("bench -r {recipe} --source {dir}/source.txt --reference {dir}/short.txt", "the files must be aligned"),
    ("bench -r {recipe} --task nosuch", "unknown task 'nosuch'"),
    ("bench -r {recipe} --lang-pair enfr %s" % BENCH_DATA, "--lang-pair expects SRC-TGT"),
    (BENCH_ON_DATA + "--output {dir}/source.txt", "is a file; give a folder"),
    (BENCH_ON_DATA + "--plot {dir}/plot.jpeg", "name a .png, .pdf, .svg file"),
    ("bench --report {dir}", "is not a specdec bench results directory"),
    ("bench --report {dir}/damaged-config", "config.json' is damaged"),
    ("bench --report {dir}/empty-record", "line 1 is not a sample record; delete that line"),
]


PARSER = [  # the option parser's own errors: one line too, naming the command's help
    ("generate --num-samples x ab", "Invalid value for '--num-samples'"),
    ("generate --nosuch ab", "No such option: --nosuch"),
    ("bench --limit 0", "--limit must be at least 1, got 0"),
    ("acceptance --prompt", "requires an argument"),
    ("verifiers --nosuch", "No such option: --nosuch (see `specdec verifiers --help`)"),
    ("nosuchcommand", "No such command 'nosuchcommand'"),
]


@pytest.mark.parametrize(("command", "message"), GENERATE + ACCEPTANCE + BENCH + PARSER, ids=lambda v: v[:60])
def test_bad_input_gives_one_line_and_exit_2(run, inputs, command, message):
    code, out, err = run(command.format(**inputs).split())
    assert code == 2, (out, err)
    one_error_line(err, message.format(**inputs))


def test_the_table_covers_every_command():
    rows = GENERATE + ACCEPTANCE + BENCH + PARSER
    assert {row[0].split()[0] for row in rows} >= {"generate", "acceptance", "bench", "verifiers"} and len(rows) >= 40


def test_world_size_without_torchrun_is_one_line(run, inputs, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    code, _, err = run(["bench", "-r", inputs["recipe"], "--source", f"{inputs['dir']}/source.txt"])
    assert code == 2
    one_error_line(err, "WORLD_SIZE=2 is set without RANK")


def test_an_unwritable_cache_is_refused_before_the_conversion(tmp_path, monkeypatch):
    """The GGUF conversion takes a minute on the default model: the cache is checked first."""
    from specdec_cli.base.errors import UsageError
    from specdec_cli.models.gguf_cache import cached_gguf_conversion

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "not-a-folder"))
    with pytest.raises(UsageError, match="cannot write to the cache folder .SPECDEC_CACHE."):
        cached_gguf_conversion(str(tmp_path), "model.gguf", {})


def test_a_damaged_safetensors_file_is_one_line(run, tiny_models, write_recipe, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["llama-target"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    recipe = tiny_recipe(tiny_models, "llama")
    recipe["target"]["model"] = str(broken)
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), "a b"])
    assert code == 1
    one_error_line(err, "weights in")


def test_binary_stdin_is_one_line(run, inputs):
    """A C locale hands undecodable bytes over as lone surrogates rather than raising."""
    code, _, err = run(["generate", "-r", inputs["recipe"]], stdin="a \udcff b")
    assert code == 2
    one_error_line(err, "standard input is not UTF-8 text")


@pytest.mark.parametrize(
    "flags",
    [
        ["--verifier", "mentored", "--kl", "0.00001"],  # used to reach the verifier as the text '1e-05'
        ["--temperature", "0.00001"],
        ["--top-p", "1e-9"],
        ["--set", "drafts.0.temperature=0.5"],  # the recipe says 'draft:', which is drafts.0
    ],
)
def test_flags_keep_their_types_and_draft_is_drafts_0(run, inputs, flags):
    code, out, err = run(["generate", "-r", inputs["recipe"], "--json", "--max-new-tokens", "3", *flags, "a b"])
    assert code == 0, err
    recipe = json.loads(out)["recipe"]
    if "--kl" in flags:
        assert recipe["verifier"]["params"]["kl"] == 1e-5
    if "--top-p" in flags:
        assert recipe["generation"]["top_p"] == 1e-9
    if "--set" in flags:
        assert recipe["drafts"][0]["temperature"] == 0.5


def test_a_plot_that_fails_never_hides_the_table(run, inputs, monkeypatch, tmp_path):
    from specdec_cli.acceptance import report

    def broken_plot(path, results, content=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "plot", broken_plot)
    code, out, err = run(
        acceptance_of_one_prompt(inputs["recipe"], "--max-new-tokens", "3", "--plot", str(tmp_path / "plot.png"))
    )
    assert code == 1
    assert "token-level acceptance probability" in out  # the table came first
    one_error_line(err, "could not write the plot")
