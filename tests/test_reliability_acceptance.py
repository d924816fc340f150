"""`specdec acceptance` with sizes that cannot be allocated: one line naming the option to lower."""

from __future__ import annotations

from tests.test_bad_inputs import inputs  # noqa: F401  (the prepared files and recipe)
from tests.test_cli import _one_error_line, run  # noqa: F401  (the CLI fixture)


def test_a_draft_count_that_cannot_fit_in_memory_is_one_line(run, inputs):  # noqa: F811
    code, out, err = run(f"acceptance -r {inputs['recipe']} --prompt ab --num-drafts 100000000".split())
    assert code == 2, (out, err)
    _one_error_line(err, "lower --num-drafts or --max-new-tokens")


def test_a_full_disk_while_writing_the_summary_keeps_the_old_one_and_prints_the_table(run, inputs, monkeypatch, tmp_path):  # noqa: F811
    import errno

    from specdec_cli import results_store

    out = tmp_path / "out"
    args = ["acceptance", "-r", inputs["recipe"], "--prompt", "a b", "--num-drafts", "1", "--verifier", "speculative",
            "--max-new-tokens", "3", "--output", str(out)]  # fmt: skip
    assert run(args)[0] == 0
    before = (out / "acceptance.json").read_text()

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results_store, "write_atomically", full_disk)
    monkeypatch.setattr("specdec_cli.acceptance.report.write_atomically", full_disk)
    code, out_text, err = run(args)
    assert code == 1
    assert "token-level acceptance probability" in out_text  # the table came first
    _one_error_line(err, "could not write the summary")
    assert (out / "acceptance.json").read_text() == before
