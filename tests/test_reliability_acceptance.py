"""`specdec acceptance` with sizes that cannot be allocated (one line naming the option to lower), a full disk, and
drafter sections killed mid-run."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from tests.conftest import (
    LOOKUP_PROMPTS,
    TRIGRAM_LOOKUP,
    acceptance_of_one_prompt,
    one_error_line,
    recipe_with_drafts,
    specdec_args,
    start_specdec,
    wait_for_samples,
)


def test_a_draft_count_that_cannot_fit_in_memory_is_one_line(run, inputs):
    # 596 GiB of draft laws: more than any machine's, reached without 10^8 drafts (a list of each took 30-50 s).
    args = f"acceptance -r {inputs['recipe']} --prompt ab --num-drafts 100000 --max-new-tokens 100000"
    code, out, err = run(args.split())
    assert code == 2, (out, err)
    one_error_line(err, "lower --num-drafts or --max-new-tokens")


def test_a_full_disk_while_writing_the_summary_keeps_the_old_one_and_prints_the_table(
    run, inputs, monkeypatch, tmp_path
):
    import errno

    from specdec_cli.results import store as results_store

    out = tmp_path / "out"
    args = acceptance_of_one_prompt(inputs["recipe"], "--max-new-tokens", "3", "--output", str(out))
    assert run(args)[0] == 0
    before = (out / "acceptance.json").read_text()

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results_store, "write_atomically", full_disk)
    monkeypatch.setattr("specdec_cli.acceptance.report.write_atomically", full_disk)
    code, out_text, err = run(args)
    assert code == 1
    assert "token-level acceptance probability" in out_text  # the table came first
    resumed, failed = [line for line in err.splitlines() if line.strip()]  # every prompt was done: nothing runs
    assert resumed == f"note: resuming '{out}': 1 of 1 prompts already done, 0 to run"
    one_error_line(failed, "could not write the summary")
    assert (out / "acceptance.json").read_text() == before


def test_killed_drafter_sections_resume_to_the_same_records(run, tiny_models, write_recipe, tmp_path):
    """--drafter model,prompt-lookup writes a record per (section, prompt): a run stopped by SIGINT, resumed and
    killed by SIGKILL (each a real process, between or inside a prompt's records), resumes to the records and
    summary of a run never stopped."""
    recipe = write_recipe(
        recipe_with_drafts(tiny_models, "llama", ["draft", TRIGRAM_LOOKUP], generation={"max_new_tokens": 10})
    )
    (tmp_path / "prompts.txt").write_text(
        "".join(f"{prompt} {i % 3 * 'e '}\n" for i, prompt in enumerate(LOOKUP_PROMPTS * 2))
    )

    compared = {"drafter": "model,prompt-lookup", "verifier": "speculative,specinfer", "num_drafts": "1,2"}

    def args(output: Path) -> list[str]:
        return specdec_args("acceptance", recipe, prompt_file=tmp_path / "prompts.txt", output=output, **compared)

    code, _, err = run(args(tmp_path / "reference"))
    assert code == 0, err
    killed = tmp_path / "killed"
    for signum, count in ((signal.SIGINT, 3), (signal.SIGKILL, 7)):  # mid-way through a prompt's two records, or later
        process = start_specdec(args(killed))
        wait_for_samples(killed, count, process)
        process.send_signal(signum)
        process.communicate(timeout=120)
        assert process.returncode in (0, 130, -signal.SIGKILL)  # 0: it finished before the signal landed
    code, _, err = run(args(killed))
    assert code == 0, err
    assert re.search(rf"note: resuming '{re.escape(str(killed))}': [1-6] of 6 prompts already done, [0-5] to run", err)
    assert _records(killed) == _records(tmp_path / "reference")
    summary = [json.loads((folder / "acceptance.json").read_text()) for folder in (killed, tmp_path / "reference")]
    assert summary[0]["sections"] == summary[1]["sections"] and summary[0]["drafters"] == ["model", "prompt-lookup"]


def _records(folder: Path) -> list[dict]:
    records = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    return sorted(records, key=lambda record: (record["drafter"], record["prompt_index"]))
