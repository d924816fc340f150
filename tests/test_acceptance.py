"""`specdec acceptance` on tiny models: values, the theory's orderings, agreement with the engine, drafter sections."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.acceptance import OPTIMUM, AcceptanceAnalysis, AcceptanceRequest, AcceptanceRow
from specdec_cli.base.randomness import sample_key
from specdec_cli.base.recipe import build_recipe
from specdec_cli.plugins.registry import VerifierRegistry
from tests.conftest import LOOKUP_PROMPTS, TRIGRAM_LOOKUP, one_error_line, recipe_with_drafts, tiny_recipe

PROMPTS = ["a b c", "d e", "e e a b", "c"]


def mentored_row(kl: float) -> str:
    return AcceptanceRow("mentored", kl_bound=kl).label


KL_VALUES = (0.0, 0.05, 0.2, 1.0)
OTHER_DEFAULTS = ("typical", "threshold", "fuzzy", "cactus", "match")
"""Verifiers whose default parameters make a rule with another acceptance than speculative sampling's."""


@pytest.fixture(scope="module")
def report(tiny_models):
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 12}))
    request = AcceptanceRequest(verifiers=tuple(VerifierRegistry().names()), num_drafts=(1, 2, 3), kl_values=KL_VALUES)
    return AcceptanceAnalysis(recipe, request).run(PROMPTS)


def _values(report, row, k):
    label = row.label if isinstance(row, AcceptanceRow) else row
    return torch.tensor([v for p in report.prompts for v in p.values[label][k]], dtype=torch.float64)


def test_values_are_probabilities_and_k1_is_sum_of_min(report):
    speculative = _values(report, "speculative", 1)
    assert len(speculative) == sum(p.positions for p in report.prompts) > 20
    for row in report.rows:
        for k in report.num_drafts:
            if report.cell(row, k) is not None:
                values = _values(report, row, k)
                assert bool(((values >= -1e-12) & (values <= 1 + 1e-12)).all()), (row, k)
    # K = 1: every token-level verifier but mentored with D > 0 gives Σ min(p, q) = the speculative value; so does
    # the ensemble at its lossless default (transformers' None). The rules of OTHER_DEFAULTS are other rules at
    # theirs: SGLang's thresholds and sample matching are lossless and accept Σ p·q, FSD accepts only where Div ≤ 0,
    # Cactus is lossy.
    for row in report.rows:
        if report.cell(row, 1) is not None and row.kl_bound in (None, 0.0) and row.verifier not in OTHER_DEFAULTS:
            torch.testing.assert_close(_values(report, row, 1), speculative, atol=1e-7, rtol=0)


def test_the_theorys_orderings_hold_position_by_position(report):
    for k in (2, 3):
        optimum = _values(report, OPTIMUM, k)
        for row in ("is-lp", "is-truncated", "spectr", "specinfer"):
            assert bool((_values(report, row, k) <= optimum + 1e-7).all()), (row, k)
    torch.testing.assert_close(_values(report, "is-lp", 2), _values(report, OPTIMUM, 2), atol=1e-7, rtol=0)


def test_mentored_rows_trade_kl_for_acceptance(report):
    accepted = [_values(report, mentored_row(d), 1) for d in KL_VALUES]
    divergence = [torch.tensor([v for p in report.prompts for v in p.kl[mentored_row(d)]]) for d in KL_VALUES]
    for lower, higher in zip(accepted, accepted[1:]):
        assert bool((higher >= lower - 1e-9).all())
    for bound, values in zip(KL_VALUES, divergence):
        assert bool((values <= bound * (1 + 1e-3) + 1e-9).all())
    assert accepted[-1].mean() > accepted[0].mean() + 0.1


def test_single_draft_verifiers_have_no_multi_draft_cells(report):
    assert report.cell("speculative", 2) is None
    assert "verifier 'speculative' takes at most 1 draft(s)" in report.unavailable[("speculative", 2)]


def test_block_level_verifiers_say_why_they_have_no_cell(report):
    for k in report.num_drafts:
        assert report.cell("block", k) is None
        assert "block decides whole blocks: a per-token acceptance is not defined" in report.unavailable[("block", k)]


@pytest.mark.parametrize("name", ["speculative", "mentored"])
def test_analytic_acceptance_matches_the_engine(tiny_models, name):
    """At the first position of each prompt, the engine accepts as often as the analysis says."""
    params = {"kl": 0.2} if name == "mentored" else {}
    recipe = build_recipe(
        tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 2}, verifier={"name": name, "params": params})
    )
    request = AcceptanceRequest(verifiers=(name,), num_drafts=(1,), kl_values=(0.2,))
    analysis = AcceptanceAnalysis(recipe, request)
    row = mentored_row(0.2) if name == "mentored" else name
    first_positions = [p.values[row][1][0] for p in analysis.run(PROMPTS).prompts]
    expected = sum(first_positions) / len(first_positions)
    decoder = SpeculativeDecoder.from_recipe(recipe)
    samples = 1200
    # 64 samples at a time: each keeps its own key, and decides as it would alone (tests/test_batch_engine.py).
    results = decoder.generate(PROMPTS, num_samples=samples, batch_size=64)
    accepted = sum(result.stats.accepted_per_position[:1] == [1] for result in results)
    assert len(results) == samples * len(PROMPTS)
    measured = accepted / (samples * len(PROMPTS))
    stderr = (expected * (1 - expected) / (samples * len(PROMPTS))) ** 0.5
    assert abs(measured - expected) < 4 * stderr


def test_interrupt_keeps_the_computed_prompts(tiny_models):
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 4}))
    analysis = AcceptanceAnalysis(recipe, AcceptanceRequest(verifiers=("speculative",), num_drafts=(1,)))
    seen = []

    def stop_after_two(result):
        seen.append(result)
        if len(seen) == 2:
            raise KeyboardInterrupt

    report = analysis.run(PROMPTS, on_prompt=stop_after_two)
    assert report.interrupted and len(report.prompts) == 2
    assert report.cell("speculative", 1).count == sum(p.positions for p in report.prompts)


def test_different_temperature_drafts(tiny_models):
    recipe = tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 6})
    draft = recipe.pop("draft")
    recipe["drafts"] = [{**draft, "temperature": 1.0}, {**draft, "temperature": 1.5}]
    analysis = AcceptanceAnalysis(
        build_recipe(recipe), AcceptanceRequest(verifiers=("specinfer", "spectr"), num_drafts=(1, 2))
    )
    report = analysis.run(PROMPTS[:2])
    assert not report.identical_drafts
    assert report.cell("specinfer", 2) is not None
    assert report.cell("spectr", 2) is None and "identical drafts" in report.unavailable[("spectr", 2)]
    # The tiny vocabulary lets the exact different-drafts optimum run; no scheme exceeds it anywhere.
    for prompt in report.prompts:
        for optimum, reached in zip(prompt.values[OPTIMUM][2], prompt.values["specinfer"][2]):
            assert reached <= optimum + 1e-9
    assert report.cell(OPTIMUM, 2).mean >= report.cell("specinfer", 2).mean


def test_different_drafts_optimum_says_why_it_is_missing(tiny_models):
    recipe = tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 4})
    draft = recipe.pop("draft")
    recipe["drafts"] = [{**draft, "temperature": 1.0}, {**draft, "temperature": 1.5}]
    analysis = AcceptanceAnalysis(build_recipe(recipe), AcceptanceRequest(verifiers=("specinfer",), num_drafts=(3,)))
    report = analysis.run(PROMPTS[:1])
    assert report.cell(OPTIMUM, 3) is None and "K > 2 different drafts" in report.unavailable[(OPTIMUM, 3)]


def test_cli_table_json_csv_and_plot(run, tiny_models, write_recipe, tmp_path):
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 5})))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question_id": 1, "turns": ["a b c"]}\n{"question_id": 2, "turns": ["d e"]}\n')
    out, picture = tmp_path / "out", tmp_path / "plot.png"
    code, stdout, _ = run(
        [
            "acceptance",
            "-r",
            recipe,
            "--prompt-file",
            str(prompts),
            "--num-drafts",
            "1,2",
            "--kl",
            "0,0.3",
            "--output",
            str(out),
            "--plot",
            str(picture),
        ]
    )
    assert code == 0
    assert "optimum" in stdout and "mentored D=0.3" in stdout and "K=2" in stdout
    payload = json.loads((out / "acceptance.json").read_text())
    assert payload["seed"] == 0 and payload["recipe"]["generation"]["max_new_tokens"] == 5
    assert {"torch", "transformers", "device", "specdec", "git", "peak_memory_mib"} <= set(payload["environment"])
    assert [p["prompt"] for p in payload["prompts"]] == ["a b c", "d e"]
    rows = list(csv.DictReader((out / "acceptance.csv").open()))
    assert {"optimum", "speculative", "mentored D=0.3"} <= {r["row"] for r in rows}
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, stdout, _ = run(
        [
            "acceptance",
            "-r",
            recipe,
            "--prompt",
            "a b",
            "--verifier",
            "speculative,spectr",
            "--num-drafts",
            "1,2",
            "--json",
        ]
    )
    payload = json.loads(stdout)
    assert code == 0 and payload["rows"] == ["optimum", "speculative", "spectr"]
    assert payload["table"]["spectr"]["2"]["mean"] <= payload["table"]["optimum"]["2"]["mean"] + 1e-9


def test_cli_bad_lists(run, tiny_models, write_recipe):
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama")))
    code, _, err = run(["acceptance", "-r", recipe, "--prompt", "a", "--num-drafts", "1,two"])
    assert code == 2 and "--num-drafts expects a comma list of int values" in err
    code, _, err = run(["acceptance", "-r", recipe, "--prompt", "a", "--verifier", "nosuch"])
    assert code == 2 and "unknown verifier 'nosuch'" in err


def test_cli_limit_shuffle_and_prompt_arguments(run, tiny_models, write_recipe, tmp_path):
    from specdec_cli.base.inputs import subset

    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 3})))
    prompts = ["a", "b c", "d e a", "c c", "e"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    code, out, err = run(
        [
            "acceptance",
            "-r",
            recipe,
            "--prompt-file",
            str(tmp_path / "p.txt"),
            "--limit",
            "2",
            "--shuffle",
            "--shuffle-seed",
            "3",
            "--verifier",
            "speculative",
            "--num-drafts",
            "1",
            "--json",
        ]
    )
    assert code == 0, err
    assert [p["prompt"] for p in json.loads(out)["prompts"]] == subset(prompts, 2, True, 3) != prompts[:2]
    code, out, _ = run(
        ["acceptance", "-r", recipe, "a b", "c", "--verifier", "speculative", "--num-drafts", "1", "--json"]
    )
    assert code == 0 and [p["prompt"] for p in json.loads(out)["prompts"]] == ["a b", "c"]


def test_cli_leaves_out_verifiers_that_cannot_apply_and_derives_the_kl_grid(run, tiny_models, write_recipe):
    recipe = str(write_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 6})))
    code, out, err = run(["acceptance", "-r", recipe, "a b c", "--num-drafts", "1,2", "--json"])
    assert code == 0, err
    payload = json.loads(out)
    assert "block" not in payload["rows"] and "speculative" in payload["rows"] and "spectr" in payload["rows"]
    assert "left out: block (decides whole blocks" in err
    bounds = payload["request"]["kl"]
    assert len(bounds) == 3 and bounds[0] < bounds[1] < bounds[2]
    assert [f"mentored D={b:g}" for b in bounds] == [row for row in payload["rows"] if row.startswith("mentored")]
    assert "0.1, 0.3 and 1 × the pair's mean KL(q‖p)" in err
    code, _, err = run(["acceptance", "-r", recipe, "a", "--verifier", "block", "--num-drafts", "1"])
    assert code == 2 and "no verifier has a per-token acceptance for these drafts: block" in err


# --------------------------------------------------------------------------- drafters (issue 21)


def _lookup_law(haystack: list[int], size: int, offset: int) -> int | None:
    """By brute force: the token ``offset`` places after the latest earlier occurrence of the haystack's last
    ``size`` tokens (offset 1: prompt lookup's proposal), or None where there is none (or it lies past the end)."""
    tail = haystack[-size:]
    for end in range(len(haystack) - 2, size - 2, -1):
        if haystack[end - size + 1 : end + 1] == tail:
            return haystack[end + offset] if end + offset < len(haystack) else None
    return None


def _brute_force_lookup(analysis, prompts, offset: int) -> tuple[float, float]:
    """(mean of q(looked-up token), 0 on a miss; share of hits) over every position of each prompt's continuation."""
    values, hits = [], 0
    target = analysis.decoder.target
    for index, prompt in enumerate(prompts):
        ids = analysis.decoder.encode_prompt(prompt)
        tokens, _, _ = analysis.decoder.generate_ids(ids, sample_key(0, index, 0))
        law = analysis.target_law(ids, tokens)  # [T, V]
        before = ids + target.decoder_start_ids if target.is_encoder_decoder else ids
        for position in range(len(tokens)):
            looked_up = _lookup_law(before + tokens[:position], 3, 1)
            hits += looked_up is not None
            token = _lookup_law(before + tokens[:position], 3, offset) if looked_up is not None else None
            values.append(0.0 if token is None else float(law[position, token]))
    return sum(values) / len(values), hits / len(values)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_prompt_lookup_acceptance_is_q_of_the_looked_up_token(tiny_models, family):
    """K = 1 through speculative: at each position q of the token the lookup proposes, 0 where it misses; the
    coverage is the share of hits. A wrong law (q of the token after the proposed one) does not match."""
    recipe = build_recipe(recipe_with_drafts(tiny_models, family, [TRIGRAM_LOOKUP], generation={"max_new_tokens": 14}))
    analysis = AcceptanceAnalysis(recipe, AcceptanceRequest(verifiers=("speculative",), num_drafts=(1,)))
    report = analysis.run(LOOKUP_PROMPTS)
    expected, hit_share = _brute_force_lookup(analysis, LOOKUP_PROMPTS, offset=1)
    assert 0 < hit_share < 1, "the prompts must make the lookup both hit and miss"
    assert report.cell("speculative", 1).mean == pytest.approx(expected, abs=1e-12)
    assert report.coverage == pytest.approx(hit_share, abs=1e-12)
    wrong, _ = _brute_force_lookup(analysis, LOOKUP_PROMPTS, offset=2)
    assert abs(report.cell("speculative", 1).mean - wrong) > 1e-3
    assert report.cell(OPTIMUM, 1).mean == pytest.approx(expected, abs=1e-12)  # one draft: Σ min(p, q) is optimal


def test_drafter_sections_each_on_its_own(run, tiny_models, write_recipe):
    """--drafter model,prompt-lookup: a section each; the model's equals a run with the model entry alone."""
    sections = {"generation": {"max_new_tokens": 8}}
    both = write_recipe(recipe_with_drafts(tiny_models, "llama", ["draft", TRIGRAM_LOOKUP], **sections))
    model_only = write_recipe(recipe_with_drafts(tiny_models, "llama", ["draft"], **sections))
    args = [*LOOKUP_PROMPTS, "--verifier", "speculative,specinfer", "--num-drafts", "1,2", "--json"]
    code, out, err = run(["acceptance", "-r", str(both), "--drafter", "model,prompt-lookup", *args])
    assert code == 0, err
    payload = json.loads(out)
    assert payload["drafters"] == ["model", "prompt-lookup"]
    model, lookup = payload["sections"]
    assert (model["drafter"], lookup["drafter"]) == ("model", "prompt-lookup")
    code, out, err = run(["acceptance", "-r", str(model_only), *args])
    assert code == 0, err
    alone = json.loads(out)
    assert model["table"] == alone["table"] and model["coverage"] == alone["coverage"] == 1.0
    assert [p["values"] for p in model["prompts"]] == [p["values"] for p in alone["prompts"]]
    assert 0 < lookup["coverage"] < 1
    code, out, err = run(["acceptance", "-r", str(both), "--drafter", "model,prompt-lookup", *args[:-1]])
    assert code == 0, err
    assert "drafter model" in out and "drafter prompt-lookup" in out and "coverage" in out


def test_mixed_model_and_lookup_rows_go_through_specinfer(run, tiny_models, write_recipe, tmp_path):
    """No --drafter: the entries together, K = 2 rows of different laws; speculative is left out with its reason."""
    recipe = write_recipe(
        recipe_with_drafts(tiny_models, "llama", ["draft", TRIGRAM_LOOKUP], generation={"max_new_tokens": 8})
    )
    out_folder, picture = tmp_path / "out", tmp_path / "plot.png"
    code, out, err = run(
        [
            "acceptance",
            "-r",
            str(recipe),
            *LOOKUP_PROMPTS,
            "--verifier",
            "speculative,specinfer,spectr",
            "--num-drafts",
            "2",
            "--json",
            "--output",
            str(out_folder),
            "--plot",
            str(picture),
        ]
    )
    assert code == 0, err
    assert "left out: speculative (verifier 'speculative' takes at most 1 draft(s)" in err
    assert "spectr (" in err and "identical" in err.split("spectr (")[1]
    payload = json.loads(out)
    assert payload["rows"] == ["optimum", "specinfer"] and payload["drafter"] is None
    assert payload["identical_drafts"] is False and payload["coverage"] == 1.0  # the model row always proposes
    for prompt in payload["prompts"]:
        for optimum, reached in zip(prompt["values"][OPTIMUM]["2"], prompt["values"]["specinfer"]["2"]):
            assert 0 <= reached <= optimum + 1e-9
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {row["drafter"] for row in csv.DictReader((out_folder / "acceptance.csv").open())} == {""}


@pytest.mark.parametrize(
    "value, message",
    [
        ("early-exit", "--drafter early-exit drafts with a model that the recipe does not name"),
        ("nosuch", "unknown drafter 'nosuch'"),
        ("model,Model", "--drafter lists model more than once"),
        (",", "--drafter expects a comma list of str values"),
    ],
)
def test_a_drafter_that_cannot_work_here_is_one_line(run, tiny_models, write_recipe, value, message):
    recipe = write_recipe(tiny_recipe(tiny_models, "llama"))
    code, _, err = run(["acceptance", "-r", str(recipe), "a b", "--drafter", value])
    assert code == 2
    one_error_line(err, message)


def test_derived_kl_bounds_come_from_the_first_entry_with_a_model_whatever_the_drafter_order(
    run,
    tiny_models,
    write_recipe,
):
    recipe = write_recipe(
        recipe_with_drafts(tiny_models, "llama", ["draft", TRIGRAM_LOOKUP], generation={"max_new_tokens": 8})
    )
    tables = {}
    for order in ("model,prompt-lookup", "prompt-lookup,model"):
        code, out, err = run(
            [
                "acceptance",
                "-r",
                str(recipe),
                *LOOKUP_PROMPTS,
                "--drafter",
                order,
                "--verifier",
                "mentored",
                "--num-drafts",
                "1",
                "--json",
            ]
        )
        assert code == 0, err
        assert "× the pair's mean KL(q‖p)" in err
        tables[order] = {section["drafter"]: section["table"] for section in json.loads(out)["sections"]}
    assert tables["model,prompt-lookup"] == tables["prompt-lookup,model"]
