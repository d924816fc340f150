"""A verifier whose decisions changed says so (``revisions``), and a results folder written under another revision
of a rule it holds samples of is refused on resume with one line naming the rule and what changed, instead of
mixing two rules' samples under one name. Folders of rules that did not change, written before revisions were
recorded, keep resuming."""

from __future__ import annotations

import json

import pytest

from specdec_cli.base.errors import UsageError
from specdec_cli.base.randomness import SCHEME
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.results.store import CONFIG, RANDOMNESS, RULES, ResultsStore
from tests.conftest import acceptance_of_one_prompt, one_error_line, specdec_args

CHANGED = ("ensemble", "typical", "threshold", "fuzzy", "fly")
"""The rules issue #40 made decide as their sources do."""


def test_the_changed_rules_are_at_revision_two_and_the_others_at_one():
    registry = VerifierRegistry()
    for name in registry.names():
        cls = registry.verifier_class(name)
        assert cls.revision() == (2 if name in CHANGED else 1), name
        assert all(isinstance(line, str) and line for line in cls.revisions)


def _bench_config(verifier: str) -> dict:
    return {"recipe": {}, "cells": [{"verifier": verifier}], "seeds": [0]}


def _saved(folder, config: dict) -> None:
    folder.mkdir()
    (folder / CONFIG).write_text(json.dumps({**config, RANDOMNESS: SCHEME}))


def test_a_folder_from_before_revisions_with_a_changed_rule_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "old"
    _saved(folder, _bench_config("ensemble"))
    revisions = VerifierRegistry().revisions(["ensemble"])
    with pytest.raises(UsageError) as refused:
        ResultsStore(folder, _bench_config("ensemble"), revisions=revisions)
    line = str(refused.value)
    assert "holds samples of verifier 'ensemble' as revision 1 of its rule decided them" in line
    assert "runs revision 2 (weight is transformers' assistant_ensemble_weight" in line
    assert "give a new --output folder" in line and "\n" not in line


def test_a_folder_from_before_revisions_with_unchanged_rules_resumes_and_records_them(tmp_path):
    folder = tmp_path / "old"
    _saved(folder, _bench_config("speculative"))
    store = ResultsStore(folder, _bench_config("speculative"), revisions=VerifierRegistry().revisions(["speculative"]))
    store.append({"cell": "c", "seed": 0, "example_id": "e", "index": 0, "stats": {}, "text": "", "reference": None})
    store.close()
    assert json.loads((folder / CONFIG).read_text())[RULES] == {"speculative": 1}


def test_a_rule_left_out_of_a_run_stays_recorded_for_the_run_that_brings_it_back(tmp_path):
    """A folder at ensemble's revision 1 (recorded) that a speculative-only run resumes keeps ensemble's record, so
    a later ensemble run is still refused."""
    folder = tmp_path / "old"
    _saved(folder, {**_bench_config("speculative"), RULES: {"speculative": 1, "ensemble": 1}})
    store = ResultsStore(folder, _bench_config("speculative"), revisions=VerifierRegistry().revisions(["speculative"]))
    store.append({"cell": "c", "seed": 0, "example_id": "e", "index": 0, "stats": {}, "text": "", "reference": None})
    store.close()
    assert json.loads((folder / CONFIG).read_text())[RULES] == {"speculative": 1, "ensemble": 1}
    with pytest.raises(UsageError, match="verifier 'ensemble' as revision 1"):
        ResultsStore(folder, _bench_config("speculative"), revisions=VerifierRegistry().revisions(["ensemble"]))


@pytest.mark.parametrize("verifier", ["ensemble", "speculative"])
def test_acceptance_refuses_a_folder_of_a_changed_rule_and_resumes_an_unchanged_one(run, inputs, tmp_path, verifier):
    """Written now, then made as a folder from before revisions were recorded (no 'rules' in config.json)."""
    out = tmp_path / "acceptance"
    args = [*acceptance_of_one_prompt(inputs["recipe"], "--max-new-tokens", "3", "--output", str(out))]
    args[args.index("--verifier") + 1] = verifier
    code, _, err = run(args)
    assert code == 0, err
    config = json.loads((out / CONFIG).read_text())
    assert config[RULES] == {verifier: 2 if verifier in CHANGED else 1}
    del config[RULES]
    (out / CONFIG).write_text(json.dumps(config))
    code, _, err = run(args)
    if verifier in CHANGED:
        assert code == 2
        one_error_line(err, f"holds samples of verifier '{verifier}' as revision 1 of its rule decided them")
    else:
        assert code == 0, err


def test_bench_records_each_cells_rule(run, inputs, tmp_path):
    out = tmp_path / "bench"
    files = {"source": f"{inputs['dir']}/source.txt", "reference": f"{inputs['dir']}/reference.txt"}
    args = specdec_args(
        "bench",
        inputs["recipe"],
        "--output",
        str(out),
        source=files["source"],
        reference=files["reference"],
        template="{source}",
        verifier="speculative,fly",
        limit=1,
        max_new_tokens=4,
    )
    code, _, err = run(args)
    assert code == 0, err
    assert json.loads((out / CONFIG).read_text())[RULES] == {"speculative": 1, "fly": 2}
