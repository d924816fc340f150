"""Exact first, lossy after (``speculation.exact_first`` N, ``--exact-first N``): the first N tokens of every sample
are verified by a lossless rule, so they follow the target's law whatever the run's verifier; blocks never straddle
N; the batch changes nothing; bench takes it as a grid axis and acceptance as what such a run accepts; bad uses are
one line before any model loads.

The lossy rule here is the ensemble at weight 0 (the target's share): it accepts every draft token."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams
from specdec_cli.engine.drafted import Drafted
from specdec_cli.kit.testing import EOS_ID, chi_square_p_value, exact_sequence_law, keyed_samples
from specdec_cli.models.pool import ModelPool
from specdec_cli.plugins.verifiers import device_path
from tests.conftest import bench_on_files, one_error_line, read_samples, specdec_args, tiny_recipe

PROMPT = "a b c d"
ACCEPT_ALL = {"name": "ensemble", "params": {"weight": 0}}
"""A lossy rule that accepts every draft token (transformers' assistant_ensemble_weight 0: none of the target)."""


def _recipe(tiny_models, exact_first: int, max_new_tokens: int, **speculation) -> dict:
    return tiny_recipe(
        tiny_models,
        verifier=ACCEPT_ALL,
        speculation={"draft_length": 3, "exact_first": exact_first, **speculation},
        generation={"max_new_tokens": max_new_tokens, "temperature": 1.0},
    )


def _decoder(tiny_models, exact_first: int, max_new_tokens: int, **speculation) -> SpeculativeDecoder:
    return SpeculativeDecoder.from_recipe(
        build_recipe(_recipe(tiny_models, exact_first, max_new_tokens, **speculation))
    )


def test_the_first_tokens_follow_the_target_law_and_the_rest_the_lossy_rule(tiny_models):
    """With exact_first 3 the law of the first 3 tokens is the target's; without it (the negative control) the
    same check rejects it, and with it the whole 5 tokens are not the target's law (the lossy rule decides after)."""
    first, depth, samples = 3, 5, 1500
    exact = _decoder(tiny_models, first, depth)
    prompt_ids = exact.encode_prompt(PROMPT)
    target = exact.target.model
    law = {
        n: exact_sequence_law(target, prompt_ids, n, SamplingParams(1.0), exact.vocab_size, {EOS_ID})
        for n in (first, depth)
    }
    for exact_first, first_law_holds in ((first, True), (0, False)):
        results = keyed_samples(exact.with_config(exact_first=exact_first), PROMPT, samples, batch_size=100)
        opening = chi_square_p_value(Counter(tuple(r.token_ids[:first]) for r in results), law[first])
        whole = chi_square_p_value(Counter(tuple(r.token_ids) for r in results), law[depth])
        assert (opening > 1e-3) if first_law_holds else (opening < 1e-6), (exact_first, opening)
        assert whole < 1e-6, (exact_first, whole)


def _blocks(decoder: SpeculativeDecoder, samples: int) -> list[tuple[int, list[int], list[bool]]]:
    """(where it starts, tokens, accepted mask) of every committed block of ``samples`` samples, in a batch of 4."""
    generated: Counter = Counter()
    blocks = []

    def on_block(prompt_index: int, sample_index: int, tokens: list[int], accepted: list[bool]) -> None:
        blocks.append((generated[sample_index], tokens, accepted))
        generated[sample_index] += len(tokens)

    decoder.generate(PROMPT, samples, on_block, batch_size=4)
    return blocks


def test_no_block_straddles_exact_first(tiny_models):
    """A block that starts before N commits no draft token at N or past it (its bonus token, from q, may land at N).
    The draft is the target itself, so the exact rule accepts every draft token and only the cap can end a block
    before N: from 4 with N = 5 and L = 3, one draft token and the bonus."""
    first = 5
    recipe = _recipe(tiny_models, first, 12, draft_length=3)
    recipe["draft"]["model"] = recipe["target"]["model"]
    blocks = _blocks(SpeculativeDecoder.from_recipe(build_recipe(recipe)), samples=8)
    before = [(start, tokens, accepted) for start, tokens, accepted in blocks if start < first]
    for start, tokens, accepted in before:
        assert start + sum(accepted) <= first and start + len(tokens) <= first + 1, (start, tokens, accepted)
    assert any(start == 4 and accepted == [True, False] for start, _, accepted in before), "a block capped at N"


def test_batches_give_the_same_tokens_with_both_phases_in_one_step(tiny_models, monkeypatch, conversions):
    """A sequence's draws depend on its own key only: batch 3 gives batch 1's tokens, though its steps hold sequences
    of both phases (each decided by its own rule), and each step still reads the device once."""
    phases: list[set[bool]] = []  # each step's: its sequences' phases
    grouped = Drafted.groups

    def recorded(self, exact):
        phases.append(set(exact))
        return grouped(self, exact)

    monkeypatch.setattr(Drafted, "groups", recorded)
    decoder = _decoder(tiny_models, 4, 10)
    alone = keyed_samples(decoder, PROMPT, 9, batch_size=1)
    phases.clear()
    conversions.clear()
    with device_path():
        batched = sorted(keyed_samples(decoder, PROMPT, 9, batch_size=3), key=lambda r: r.prompt_index)
    assert sum(conversions.values()) <= len(phases), dict(conversions)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.accepted_mask for r in batched] == [r.accepted_mask for r in alone]
    assert {True, False} in phases, "some step held sequences of both phases"


@pytest.mark.xdist_group("compile")  # on the worker that has compiled the tiny models' steps
def test_compile_compiles_both_rules_and_a_lossless_verifier_changes_nothing(tiny_models):
    compiled = _decoder(tiny_models, 2, 6, compile=True)
    assert compiled.exact_verifier.lossless and not compiled.verifier.lossless
    assert compiled.steps.verify_exact != compiled.exact_verifier.verify  # torch.compile'd, lazily
    assert compiled.steps.verify != compiled.verifier.verify
    lossless = compiled.with_config(verifier="speculative", compile=False)
    assert lossless.exact_verifier is None and lossless.exact_first == 0
    assert "changes nothing for verifier 'speculative'" in lossless.exact_first_note


# --------------------------------------------------------------------------- the commands


@pytest.fixture
def lossy_recipe(tiny_models, write_recipe) -> str:
    return str(write_recipe(_recipe(tiny_models, 0, 6)))


def test_bench_takes_exact_first_as_an_axis_and_resumes_older_folders(run, lossy_recipe, data, tmp_path):
    """A cell per value, the key naming only a nonzero one; a folder written before the axis (its cells without
    exact_first) resumes, its samples reused."""
    out = tmp_path / "out"
    args = bench_on_files(lossy_recipe, data, out, limit=2)
    code, _, err = run(args)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    for cell in config["cells"]:
        del cell["exact_first"]  # as a folder written before the axis has them
    (out / "config.json").write_text(json.dumps(config))
    before = read_samples(out)
    code, _, err = run([*args, "--exact-first", "0,4"])
    assert code == 0, err
    assert "4 of 6 samples already done" in err
    samples = read_samples(out)
    assert samples[:4] == before
    assert {s["cell"] for s in samples} == {"baseline T=1", "ensemble K=1 L=3 T=1", "ensemble K=1 L=3 exact=4 T=1"}
    cells = {json.dumps(cell, sort_keys=True) for cell in json.loads((out / "config.json").read_text())["cells"]}
    assert sum('"exact_first": 4' in cell for cell in cells) == 1
    code, _, err = run([*args, "--exact-first", "0,4"])
    assert code == 0 and "6 of 6 samples already done" in err, err


def _acceptance(run, recipe: str, *extra: str) -> dict:
    args = specdec_args("acceptance", recipe, "--json", *extra, "a b c", num_drafts=1, verifier="speculative,ensemble")
    code, out, err = run(args)
    assert code == 0, err
    return json.loads(out)


def test_acceptance_takes_the_exact_rules_values_before_n_and_spends_after(run, lossy_recipe, tmp_path):
    first = 3
    plain = _acceptance(run, lossy_recipe)["prompts"][0]
    content = _acceptance(run, lossy_recipe, "--exact-first", str(first), "--output", str(tmp_path / "out"))
    exact = content["prompts"][0]
    assert exact["positions"] > first + 1
    lossless, lossy = exact["values"]["speculative"]["1"], exact["values"]["ensemble"]["1"]
    assert lossy[:first] == lossless[:first] and lossy[first:] == plain["values"]["ensemble"]["1"][first:]
    assert min(lossy[first:]) > 0.99 > max(lossless[first:]), "the lossy rule accepts every draft token after N"
    assert exact["kl"]["ensemble"] == plain["kl"]["ensemble"][first:]
    assert exact["spent"]["ensemble"] == {name: values[first:] for name, values in plain["spent"]["ensemble"].items()}
    assert content["request"]["exact_first"] == first and content["exact_first"] == first
    assert "count positions >= 3 only" in content["exact_note"]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["request"]["exact_first"] == first


def test_acceptance_writes_no_exact_first_when_it_is_off(run, lossy_recipe, tmp_path):
    _acceptance(run, lossy_recipe, "--output", str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "exact_first" not in saved["request"] and "exact_first" not in saved["recipe"]["speculation"]


@pytest.mark.parametrize("command", ["generate", "bench", "acceptance"])
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--exact-first", "-1"], "--exact-first -1: must be >= 0"),
        (
            ["--exact-first", "2", "--set", "speculation.exact_verifier=typical"],
            "speculation.exact_verifier: verifier 'typical' is lossy; name a lossless verifier (speculative, ",
        ),
        (
            ["--exact-first", "2", "--set", "speculation.exact_verifier=nope"],
            "speculation.exact_verifier: unknown verifier 'nope'; installed verifiers: ",
        ),
    ],
)
def test_bad_uses_are_one_line_before_any_model_loads(run, lossy_recipe, data, monkeypatch, command, extra, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the check")

    monkeypatch.setattr(ModelPool, "target", no_loading)
    args = {
        "generate": specdec_args("generate", lossy_recipe, "a b"),
        "bench": bench_on_files(lossy_recipe, data, None),
        "acceptance": specdec_args("acceptance", lossy_recipe, "a b"),
    }[command]
    code, _, err = run([*args, *extra])
    assert code == 2, err
    one_error_line(err, message)
