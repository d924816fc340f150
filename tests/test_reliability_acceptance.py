"""`specdec acceptance` with sizes that cannot be allocated: one line naming the option to lower."""

from __future__ import annotations

from tests.test_bad_inputs import inputs  # noqa: F401  (the prepared files and recipe)
from tests.test_cli import _one_error_line, run  # noqa: F401  (the CLI fixture)


def test_a_draft_count_that_cannot_fit_in_memory_is_one_line(run, inputs):  # noqa: F811
    code, out, err = run(f"acceptance -r {inputs['recipe']} --prompt ab --num-drafts 100000000".split())
    assert code == 2, (out, err)
    _one_error_line(err, "lower --num-drafts or --max-new-tokens")
