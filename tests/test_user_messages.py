"""Messages in the user's words (issue 33): a value that came from a flag is named by the flag, a sweep on generate
points to the commands that sweep, --plot makes its folder, and the last bad-input cases a probe found (a verifier
written as its name, --kl that no verifier of the run takes, a recipe section that is not a mapping, Ctrl-C on
acceptance, a listing read by `head`). Every refusal is checked word for word, before any model loads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from specdec_cli.base.recipe import load_recipe
from specdec_cli.bench.grid import Grid, GridCell
from specdec_cli.plugins.registry import VerifierRegistry
from tests.conftest import (
    BASELINE_CELL,
    BENCH_DATA,
    SPECULATIVE_CELL,
    acceptance_of_one_prompt,
    interruptible,
    one_error_line,
    read_samples,
    start_specdec,
    tiny_recipe,
    wait_for_samples,
    wait_until_importing_the_commands,
)

FLAG_VALUES = [  # (flag and value, the one line's text after "error: ")
    ("--draft-length 0", "--draft-length 0: must be >= 1"),
    ("--num-drafts 0", "--num-drafts 0: must be >= 1"),
    ("--temperature -0.5", "--temperature -0.5: must be >= 0 and finite (0 = greedy)"),
    ("--max-new-tokens 0", "--max-new-tokens 0: must be >= 1"),
    ("--top-k -1", "--top-k -1: must be >= 0 (0 = off)"),
    ("--top-p 1.5", "--top-p 1.5: must be in (0, 1]"),
    ("--device tpu", "--device 'tpu': must be auto, cpu, cuda or cuda:N"),
    ("--dtype float8", "--dtype 'float8': must be one of auto, float32, bfloat16, float16"),
    ("--draft-length-schedule fast", "--draft-length-schedule 'fast': must be one of constant, heuristic"),
    ("--stop=", "--stop '': must not be empty"),
    ("--verifier mentored --kl -1", "--kl -1: verifier 'mentored': kl must be a finite number >= 0 (nats), got -1.0"),
]
COMMANDS = {  # each command's arguments around the flag; bench's sweep flags take the same values as one-item lists
    "generate": "generate -r {recipe} {flag} ab",
    "bench": "bench -r {recipe} %s {flag}" % BENCH_DATA,
    "acceptance": "acceptance -r {recipe} --prompt ab {flag}",
}
# The flags a command does not have.
NOT_TAKEN = {
    "acceptance": {"--draft-length 0", "--draft-length-schedule fast", "--stop="},
}


@pytest.fixture
def missing_models(tmp_path, write_recipe, inputs):
    """``inputs`` with a recipe whose models cannot load (folders whose config.json names no model, so the recipe's
    check of its paths lets them by): a refusal that came after a model load would be "cannot load model" and
    exit 1, so exit 2 with the expected line shows it came first."""
    for name in ("no-target", "no-draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    recipe = {
        "target": {"model": str(tmp_path / "no-target"), "device": "cpu"},
        "draft": {"model": str(tmp_path / "no-draft"), "device": "cpu"},
        "speculation": {"draft_length": 3},
        "generation": {"max_new_tokens": 4},
    }
    return {**inputs, "recipe": str(write_recipe(recipe))}


def test_the_missing_models_pass_the_recipes_check_and_fail_to_load(run, missing_models):
    """Negative control of ``missing_models``: without a bad flag the run gets as far as loading, and fails there."""
    code, _, err = run(COMMANDS["generate"].format(flag="", **missing_models).split())
    assert code == 1
    one_error_line(err, "from its local directory: Unrecognized model in ")


@pytest.mark.parametrize(
    ("command", "flag", "message"),
    [(command, *row) for command in COMMANDS for row in FLAG_VALUES if row[0] not in NOT_TAKEN.get(command, ())],
    ids=lambda value: value.split(":")[0],
)
def test_a_bad_value_from_a_flag_is_named_by_the_flag(run, missing_models, command, flag, message):
    args = COMMANDS[command].format(flag="{flag}", **missing_models).split()
    args[args.index("{flag}") : args.index("{flag}") + 1] = flag.split()
    code, _, err = run(args)
    assert code == 2, err
    one_error_line(err, message)
    assert err.strip() == f"error: {message}"


def test_a_grid_value_is_named_by_its_flag(run, missing_models):
    bench = f"bench -r {{recipe}} {BENCH_DATA} --temperature 1,-0.5".format(**missing_models).split()
    code, _, err = run(bench)
    assert code == 2 and err.strip() == "error: --temperature -0.5: must be >= 0 and finite (0 = greedy)"
    code, _, err = run([*bench[:-2], "--draft-length-schedule", "constant,adaptive"])
    assert code == 2
    assert err.strip() == "error: --draft-length-schedule 'adaptive': must be one of constant, heuristic"


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (["--set", "speculation.draft_length=0"], "speculation.draft_length: must be >= 1"),
        (["--set", "generation.top_p=2"], "generation.top_p: must be in (0, 1]"),
        (["--set", "generation.stop=['']"], "generation.stop.0: must not be empty"),
        (
            ["--verifier", "mentored", "--set", "verifier.params.kl=-1"],
            "verifier 'mentored': kl must be a finite number >= 0 (nats), got -1 (given {'kl': -1}; fix "
            "verifier.params in the recipe, or --set verifier.params.NAME=VALUE)",
        ),
    ],
)
def test_a_bad_value_from_the_recipe_or_set_keeps_the_recipes_path(run, missing_models, where, message):
    code, _, err = run(["generate", "-r", missing_models["recipe"], *where, "ab"])
    assert code == 2 and err.strip() == f"error: {message}"


@pytest.mark.parametrize(
    ("flag", "value", "sweeps"),
    [
        ("--kl", "0.1,0.2", "specdec bench or specdec acceptance"),
        ("--num-drafts", "1,2", "specdec bench or specdec acceptance"),
        ("--draft-length", "2,4", "specdec bench"),
        ("--temperature", "0,1", "specdec bench"),
        ("--draft-length-schedule", "constant,heuristic", "specdec bench"),
    ],
)
def test_a_sweep_on_generate_points_to_the_commands_that_sweep(run, missing_models, flag, value, sweeps):
    code, _, err = run(["generate", "-r", missing_models["recipe"], flag, value, "ab"])
    assert code == 2
    assert err.strip() == f"error: {flag} takes one value on generate; to sweep {value} use {sweeps}"


def test_one_value_on_generate_is_still_parsed_as_a_number(run, missing_models):
    code, _, err = run(["generate", "-r", missing_models["recipe"], "--draft-length", "two", "ab"])
    assert code == 2
    one_error_line(err, "Invalid value for '--draft-length'")


@pytest.mark.parametrize(
    ("command", "verifiers"),
    [
        ("bench -r {recipe} %s --kl 0.1 --verifier speculative,block" % BENCH_DATA, "none of speculative, block has"),
        ("bench -r {recipe} %s --kl 0.1" % BENCH_DATA, "verifier 'speculative' does not have"),
        ("acceptance -r {recipe} --prompt ab --kl 0.1 --verifier speculative", "verifier 'speculative' does not have"),
        ("acceptance -r {recipe} --prompt ab --kl 0.1,0.2 --verifier specinfer,speculative", "none of specinfer, "),
    ],
)
def test_kl_that_no_verifier_of_the_run_takes_is_refused(run, missing_models, command, verifiers):
    """generate refuses --kl for a verifier without a KL bound; bench and acceptance ignored it without a word."""
    code, _, err = run(command.format(**missing_models).split())
    assert code == 2
    one_error_line(err, f"error: --kl sets a KL bound, which {verifiers}")
    assert err.strip().endswith("; verifiers with one: mentored")


def test_kl_in_a_grid_with_a_verifier_that_takes_it_runs_only_there(missing_models):
    """The grid's --kl values reach the verifiers with a KL bound; the others run once, without them."""
    registry = VerifierRegistry()
    grid = Grid(
        verifiers=("speculative", "mentored"), kl=(0.1,), num_drafts=(1,), draft_lengths=(3,), temperatures=(1,)
    )
    cells, _ = grid.cells(registry, load_recipe(missing_models["recipe"]))
    assert [cell.key for cell in cells] == ["baseline T=1", "speculative K=1 L=3 T=1", "mentored D=0.1 K=1 L=3 T=1"]


def test_a_recipe_whose_verifier_is_its_name_runs_with_another_verifier(run, tiny_models, write_recipe):
    """`verifier: speculative` with --verifier block used to end in AttributeError: 'str' object has no attribute
    'get'."""
    recipe = write_recipe(tiny_recipe(tiny_models, verifier="speculative"))
    for flags in (["--verifier", "block"], []):
        code, out, err = run(["generate", "-r", str(recipe), *flags, "--max-new-tokens", "3", "--json", "a b"])
        assert code == 0, err
        assert json.loads(out)["recipe"]["verifier"]["name"] == (flags[1] if flags else "speculative")


def test_a_speculation_list_with_draft_length_says_the_section_must_be_a_mapping(run, write_recipe):
    recipe = write_recipe({"target": {"model": "t"}, "speculation": [1, 2]})
    code, _, err = run(["generate", "-r", str(recipe), "--draft-length", "3", "ab"])
    assert code == 2
    assert err.strip() == (
        "error: speculation: must be a mapping of keys (such as draft_length: …), not list [1, 2]; fix "
        "'speculation:' in the recipe"
    )


def test_the_target_alone_refuses_a_draft_length_schedule(run, missing_models):
    code, _, err = run(
        ["generate", "-r", missing_models["recipe"], "--autoregressive", "--draft-length-schedule", "heuristic", "a"]
    )
    assert code == 2
    assert err.strip() == (
        "error: --draft-length-schedule has no effect on the target alone (--verifier none, --autoregressive); drop "
        "it, or compare the two: --verifier speculative,none"
    )


# --------------------------------------------------------------------------- --plot


def test_plot_makes_its_folder_as_output_does(run, tiny_models, write_recipe, tmp_path):
    recipe = write_recipe(tiny_recipe(tiny_models, generation={"max_new_tokens": 3}))
    plot = tmp_path / "new" / "deeper" / "acceptance.png"
    code, _, err = run(acceptance_of_one_prompt(recipe, "--plot", str(plot)))
    assert code == 0, err
    assert plot.is_file() and plot.stat().st_size > 0


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("{dir}/source.txt/plot.png", "the --plot folder '{dir}/source.txt' is a file; give a folder"),
        (
            "/proc/specdec-plots/plot.png",
            "cannot write to the --plot folder '/proc/specdec-plots' (No such file or directory); give a writable "
            "folder",
        ),
    ],
)
def test_plot_in_a_place_that_cannot_be_written_is_one_line(run, missing_models, plot, message):
    for command in (["acceptance", "--prompt", "ab"], ["bench", *BENCH_DATA.format(**missing_models).split()]):
        code, _, err = run([*command, "-r", missing_models["recipe"], "--plot", plot.format(**missing_models)])
        assert code == 2
        assert err.strip() == f"error: {message.format(**missing_models)}"


# --------------------------------------------------------------------------- the draft length schedule in bench


def test_the_schedule_is_a_grid_axis_and_a_constant_one_keeps_the_old_keys(missing_models):
    base = load_recipe(missing_models["recipe"])
    grid = Grid(
        verifiers=("speculative",),
        kl=(),
        num_drafts=(1,),
        draft_lengths=(3,),
        temperatures=(1.0,),
        draft_length_schedules=("constant", "heuristic"),
    )
    cells, _ = grid.cells(VerifierRegistry(), base)
    assert [cell.key for cell in cells] == [
        "baseline T=1",
        "speculative K=1 L=3 T=1",
        "speculative K=1 L=3 (heuristic) T=1",
    ]
    registry = VerifierRegistry()
    assert [cell.recipe(base, registry).speculation.draft_length_schedule for cell in cells[1:]] == [
        "constant",
        "heuristic",
    ]
    # A results folder written before schedules: its cells read back as constant ones, under the same keys.
    for written, key in ((BASELINE_CELL, "baseline T=1"), (SPECULATIVE_CELL, "speculative K=1 L=3 T=1")):
        cell = GridCell.from_config(written)
        assert cell.draft_length_schedule == "constant" and cell.key == key


def test_bench_takes_stop_texts_and_the_schedule_axis(run, tiny_models, write_recipe, inputs, tmp_path):
    recipe = write_recipe(tiny_recipe(tiny_models, generation={"max_new_tokens": 3}))
    out = tmp_path / "out"
    data = BENCH_DATA.format(**inputs).split()
    flags = ["--draft-length-schedule", "constant,heuristic", "--stop", "zzz", "--limit", "1", "--json"]
    code, stdout, err = run(["bench", "-r", str(recipe), *data, "--output", str(out), *flags])
    assert code == 0, err
    results = json.loads(stdout)
    assert results["config"]["recipe"]["generation"]["stop"] == ["zzz"]
    keys = [cell["key"] for cell in results["cells"]]
    assert keys == ["baseline T=1", "speculative K=1 L=3 T=1", "speculative K=1 L=3 (heuristic) T=1"]
    assert {record["cell"] for record in read_samples(out)} == set(keys)


# --------------------------------------------------------------------------- Ctrl-C and closed pipes


@pytest.mark.parametrize("moment", ["starting", "running"])
def test_acceptance_stopped_by_ctrl_c_exits_130_with_its_records_whole(tiny_models, write_recipe, tmp_path, moment):
    """Ctrl-C while the commands are imported, or between prompts: exit 130 (as bench and generate), never death
    by the signal or a traceback; every record written is whole."""
    recipe = write_recipe(tiny_recipe(tiny_models, generation={"max_new_tokens": 12}))
    (tmp_path / "prompts.txt").write_text("".join(f"p{i} a b\n" for i in range(8)))
    out = tmp_path / "out"
    args = ["acceptance", "-r", str(recipe), "--prompt-file", str(tmp_path / "prompts.txt"), "--output", str(out)]
    process = start_specdec(args)
    if moment == "running":
        wait_for_samples(out, 1, process)
    else:
        wait_until_importing_the_commands(process)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    if (out / "samples.jsonl").exists():
        assert all(record["prompt_index"] >= 0 for record in read_samples(out))


@pytest.mark.parametrize("command", [["verifiers"], ["verifiers", "--json"], ["drafters"], ["--help"]])
def test_a_listing_whose_reader_left_exits_0_quietly(command):
    """`specdec verifiers | head -1`: the reader took what it wanted; the listing used to exit 1."""
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec_cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    process.stdout.close()  # the reader is gone before the first write
    err = process.stderr.read()
    process.wait(timeout=120)
    assert process.returncode == 0, err
    assert err == ""


def test_a_results_folder_written_before_schedules_resumes_without_running_again(
    run, tiny_models, write_recipe, inputs, tmp_path
):
    recipe = write_recipe(tiny_recipe(tiny_models, generation={"max_new_tokens": 3}))
    out = tmp_path / "out"
    args = ["bench", "-r", str(recipe), *BENCH_DATA.format(**inputs).split(), "--output", str(out), "--limit", "1"]
    code, _, err = run(args)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    for cell in config["cells"]:  # as a folder written before the schedule existed holds them
        del cell["draft_length_schedule"]
    assert (
        "draft_length_schedule" not in config["recipe"]["speculation"] and "stop" not in config["recipe"]["generation"]
    )
    (out / "config.json").write_text(json.dumps(config))
    samples = (out / "samples.jsonl").read_text()
    code, _, err = run(args)
    assert code == 0, err
    assert (out / "samples.jsonl").read_text() == samples  # every sample reused, none run again
