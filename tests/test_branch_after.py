"""The model drafter's ``branch_after: d`` (issue #43): one path for a block's first d tokens, then K continuations.

Exact enumeration on a 3-token vocabulary (the joint law of the rows is no longer a product: the kit's
specdec_cli/kit/dependent_rows.py enumerates the delayed process, and check_verifier holds every rule that declares
``dependent_drafts`` to it): SpecInfer, traversal and sample matching keep the target's law on such rows; copies
reported under the draft law (negative control) and is-lp on such rows (why it is refused) do not, and is-lp
declaring ``dependent_drafts`` fails the kit.
SpecInfer's device path (what a GPU runs) decides such blocks as its CPU walk does. The drafter's proposal: rows
share their first d tokens under one-hot laws, then branch, within their own entry. Through
``specdec generate``: the first tokens follow the target's law (chi-square) for traversal at K = 2 and 4 and SpecInfer
at K = 4, with a misreporting drafter failing the same test at K = 4; the rules that need independent rows and a
bad ``branch_after`` are one line before any model loads.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.randomness import Draws
from specdec_cli.base.recipe import build_recipe
from specdec_cli.base.sampling import SamplingParams, sampling_law
from specdec_cli.kit.conformance import ConformanceError, check_verifier
from specdec_cli.kit.dependent_rows import LENGTH, largest_gap
from specdec_cli.kit.testing import (
    EOS_ID,
    chi_square_p_value,
    exact_sequence_law,
    random_distributions,
)
from specdec_cli.plugins.drafting import DraftRequest, one_hot_laws
from specdec_cli.plugins.registry import load_verifier
from specdec_cli.plugins.verifiers import device_path
from specdec_plugins.is_lp import ImportanceSamplingLP
from specdec_plugins.model_drafter import _DraftTable
from tests.conftest import one_error_line, tiny_recipe

# --------------------------------------------------------------------------- exact enumeration (the kit's)


@pytest.mark.parametrize("verifier", ["specinfer", "traversal", "match"])
@pytest.mark.parametrize("num_rows, branch_after", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_rows_that_branch_late_keep_the_target_law(verifier, num_rows, branch_after):
    assert largest_gap(load_verifier(verifier), num_rows, branch_after) < 1e-12


def test_negative_control_copies_reported_under_the_draft_law_are_lossy_for_specinfer():
    """A copy of x tested again under p after x was rejected makes the residual (cur - p)+ instead of cur."""
    assert largest_gap(load_verifier("specinfer"), 2, 1, copies_as_drawn=True) > 1e-3


def test_a_rule_for_independent_rows_is_lossy_on_them():
    """Why is-lp and is-truncated refuse such rows: their pair selection weighs x2 as drawn independently of x1.
    (SpecTr, defined for K draws of one law, would stop at the copies' one-hot laws.)"""
    assert largest_gap(load_verifier("is-lp"), 2, 2) > 1e-2


class _IsLpClaimingDependentRows(ImportanceSamplingLP):
    name = "is-lp-dependent"
    dependent_drafts = True


def test_the_kit_fails_a_rule_that_declares_dependent_drafts_and_is_lossy_on_them():
    with pytest.raises(ConformanceError, match=r"is-lp-dependent: declares dependent_drafts, but on K = 2 rows"):
        check_verifier(_IsLpClaimingDependentRows, samples=300)


def copied_block(seed: int, num_rows: int = 4, branch_after: int = 2, vocab: int = 6):
    """A block as the drafter makes it: one law and row 1's tokens before ``branch_after``, copies under one-hot
    laws, then each row's own draws → (target_probs ``[K, L+1, V]``, draft_probs ``[K, L, V]``, tokens ``[K, L]``)."""
    generator = torch.Generator().manual_seed(seed)
    target = random_distributions(generator, (num_rows, LENGTH + 1, vocab), sparsity=0.0)  # [K, L+1, V]
    draft = random_distributions(generator, (num_rows, LENGTH, vocab), sparsity=0.0)  # [K, L, V]
    shared = slice(None, branch_after + 1)  # the laws after the prefixes the rows share (0..d tokens)
    target[:, shared], draft[:, shared] = target[:1, shared], draft[:1, shared]
    tokens = torch.multinomial(draft.flatten(0, 1), 1, generator=generator).view(num_rows, LENGTH)  # [K, L]
    tokens[1:, :branch_after] = tokens[:1, :branch_after]
    draft[1:, :branch_after] = one_hot_laws(tokens[1:, :branch_after], vocab).to(draft.dtype)
    return target, draft, tokens


def test_specinfers_device_path_decides_copied_rows_as_its_cpu_walk():
    """What a GPU runs (every problem solved at once) commits what the CPU's walk commits, from the same draws."""
    verifier, lengths = load_verifier("specinfer"), Counter()
    for seed in range(60):
        block, draws = copied_block(seed), Draws.create(key=seed)
        walked = verifier.verify_block(*block, draws)
        with device_path():
            solved = verifier.verify_block(*block, draws)
        accepted = int(walked.num_accepted)
        assert int(solved.num_accepted) == accepted
        assert torch.equal(solved.tokens[: accepted + 1], walked.tokens[: accepted + 1])
        lengths[accepted] += 1
    assert len(lengths) == LENGTH + 1, lengths  # blocks ended at every position, the copied ones included


# --------------------------------------------------------------------------- the drafter's proposal


def test_rows_share_their_first_tokens_then_branch_within_their_entry(tiny_models):
    """Two entries of one model (one joined drafter, 2 K rows): the first entry's rows carry its first row's first 2
    tokens under one-hot laws, then draw alone from one law; the second entry's rows stay independent."""
    num_rows, batch = 3, 8
    recipe = tiny_recipe(tiny_models, verifier={"name": "specinfer"}, speculation={"num_drafts": num_rows})
    draft = recipe.pop("draft")
    recipe["drafts"] = [{**draft, "params": {"branch_after": 2}}, {**draft, "temperature": 0.7}]
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    (drafter,) = decoder.drafters
    assert drafter.rows == 2 * num_rows and not drafter.independent_rows
    prompt = decoder.encode_prompt("a b c d")
    drafter.remove_sequences([])
    drafter.add_sequences([prompt] * batch, [prompt] * batch, None)
    uniforms = torch.rand(batch, LENGTH, 2 * num_rows, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        proposal = drafter.propose(DraftRequest([prompt] * batch, [LENGTH] * batch, uniforms, sampling_law))
    tokens, laws = proposal.tokens[:, :num_rows], proposal.laws[:, :num_rows]  # [B, K, L], [B, K, L, V]: entry 1
    assert torch.equal(tokens[:, 1:, :2], tokens[:, :1, :2].expand(-1, num_rows - 1, -1))
    assert torch.equal(laws[:, 1:, :2], one_hot_laws(tokens[:, 1:, :2], laws.shape[-1]))
    assert laws[:, 0, :2].amax(-1).lt(1).all()  # the first row reports the law it drew from
    torch.testing.assert_close(laws[:, :, 2], laws[:, :1, 2].expand(-1, num_rows, -1))  # one prefix, one law
    assert (tokens[:, :, 2] != tokens[:, :1, 2]).any()  # the rows branch
    assert proposal.laws[:, num_rows:, 0].amax(-1).lt(1).all()  # entry 2: no copies


# --------------------------------------------------------------------------- through the CLI

PROMPT, DEPTH, SAMPLES = "e e a", 3, 1200
DRAFT_TEMPERATURE = 0.5
"""The target's own checkpoint drafts at this temperature: close enough to the target that blocks reach the branch
(about 0.8 of the draft tokens are accepted), far enough that its law is told apart from the target's."""


def copies_reported_as_drawn(table: _DraftTable, t: int, copied: tuple[list[int], list[int]]) -> None:
    """The tokens copied, the laws left as the copies' own forwards gave them (the draft law, not the one-hot)."""
    rows, sources = copied
    if rows:
        table.tokens[rows, t] = table.tokens[sources, t]


def laws_copied_without_tokens(table: _DraftTable, t: int, copied: tuple[list[int], list[int]]) -> None:
    """One-hot laws at the first row's token, while each copy keeps the token its own forward drew."""
    rows, sources = copied
    if rows:
        table.laws[rows, t] = one_hot_laws(table.tokens[sources, t], table.laws.shape[-1]).to(table.laws.dtype)


def branching_recipe(models, verifier: str, num_drafts: int, branch_after) -> dict:
    recipe = tiny_recipe(
        models,
        verifier={"name": verifier},
        speculation={"draft_length": LENGTH, "num_drafts": num_drafts},
        generation={"max_new_tokens": DEPTH + 1},  # the first block then drafts L = 3 tokens: 2 shared, 1 branched
    )
    draft = {"model": str(models["llama-target"]), "device": "cpu", "temperature": DRAFT_TEMPERATURE}
    recipe.pop("draft")
    recipe["drafts"] = [{**draft, "params": {"branch_after": branch_after}}]
    return recipe


@pytest.fixture(scope="module")
def first_token_laws(tiny_models) -> dict[str, dict]:
    """The exact laws of the first tokens: the target's, and its checkpoint's at the draft's temperature."""
    recipe = branching_recipe(tiny_models, "specinfer", 1, 0)
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe), autoregressive=True)
    prompt = decoder.encode_prompt(PROMPT)
    return {
        role: exact_sequence_law(
            decoder.target.model, prompt, DEPTH, SamplingParams(temperature), decoder.vocab_size, {EOS_ID}
        )
        for role, temperature in (("target", 1.0), ("draft", DRAFT_TEMPERATURE))
    }


@pytest.mark.parametrize(
    "verifier, num_drafts, misreport",
    [
        ("traversal", 2, None),
        ("traversal", 4, None),
        ("specinfer", 4, None),
        ("traversal", 4, laws_copied_without_tokens),
        ("specinfer", 4, copies_reported_as_drawn),
    ],
    ids=["traversal-2", "traversal-4", "specinfer-4", "traversal-4-lossy", "specinfer-4-lossy"],
)
def test_the_first_tokens_follow_the_target_law_through_the_cli(
    tiny_models, write_recipe, run, monkeypatch, first_token_laws, verifier, num_drafts, misreport
):
    """`specdec generate` with branch_after 2: chi-square of the first 3 tokens against the target's law, and against
    the draft's (power). Negative controls: a drafter that misreports the copies' laws fails the same test. Traversal
    reads only the law of a node's owner, and a copy is never one, so only copies whose tokens differ from the first
    row's can mislead it: at K = 2 such a bug is too rare at this draft to fail 1200 samples reliably (p from 2e-3 to
    4e-2 over three seeds), at K = 4 it fails them by far."""
    if misreport is not None:
        monkeypatch.setattr(_DraftTable, "copy_rows", misreport)
    recipe = write_recipe(branching_recipe(tiny_models, verifier, num_drafts, 2))
    code, out, err = run(
        ["generate", "-r", str(recipe), "--json", "--num-samples", str(SAMPLES), "--batch-size", "64", PROMPT]
    )
    assert code == 0, err
    counts = Counter(tuple(sample["token_ids"][:DEPTH]) for sample in json.loads(out)["samples"])
    target = chi_square_p_value(counts, first_token_laws["target"])
    assert target < 1e-3 if misreport is not None else target > 1e-3
    assert chi_square_p_value(counts, first_token_laws["draft"]) < 1e-6


def early_exit_recipe(models) -> dict:
    """SpecInfer at K = 4 over rows of the early-exit drafter (the target's first layer) that branch after 2 tokens."""
    recipe = branching_recipe(models, "specinfer", 4, 2)
    recipe["drafts"] = [{"early_exit": 1, "params": {"branch_after": 2}}]
    return recipe


def early_exit_first_tokens(recipe: dict, write_recipe, run) -> tuple[Counter, dict, dict]:
    """`specdec generate` of the recipe: the counts of its samples' first DEPTH tokens, and the exact laws of those
    tokens at T = 1 by the target and by the early exit."""
    code, out, err = run(
        ["generate", "-r", str(write_recipe(recipe)), "--json", "--num-samples", str(SAMPLES), "--batch-size", "64"]
        + [PROMPT]
    )
    assert code == 0, err
    counts = Counter(tuple(sample["token_ids"][:DEPTH]) for sample in json.loads(out)["samples"])
    decoder = SpeculativeDecoder.from_recipe(build_recipe(recipe))
    prompt = decoder.encode_prompt(PROMPT)
    laws = [
        exact_sequence_law(model, prompt, DEPTH, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
        for model in (decoder.target.model, decoder.drafts[0].model.model)
    ]
    return counts, *laws


def test_early_exit_rows_branch_after_their_shared_tokens_and_keep_the_target_law(tiny_models, write_recipe, run):
    """The early-exit drafter takes branch_after as the model drafter does (its rows copy through the same table, which
    the negative control below misreports): through `specdec generate` the first tokens follow the target's law, not
    the early exit's own (the test's power)."""
    recipe = early_exit_recipe(tiny_models)
    (drafter,) = SpeculativeDecoder.from_recipe(build_recipe(recipe)).drafters
    assert drafter.name == "early-exit" and drafter.branch_after == 2 and not drafter.independent_rows
    counts, target_law, early_exit_law = early_exit_first_tokens(recipe, write_recipe, run)
    assert chi_square_p_value(counts, target_law) > 1e-3
    assert chi_square_p_value(counts, early_exit_law) < 1e-6


def test_negative_control_early_exit_copies_reported_under_the_draft_law_fail_the_same_test(
    tiny_models, write_recipe, run, monkeypatch
):
    monkeypatch.setattr(_DraftTable, "copy_rows", copies_reported_as_drawn)
    counts, target_law, _ = early_exit_first_tokens(early_exit_recipe(tiny_models), write_recipe, run)
    assert chi_square_p_value(counts, target_law) < 1e-3


# --------------------------------------------------------------------------- refusals, before any model loads


@pytest.mark.parametrize(
    "verifier, drafter", [("spectr", "model"), ("is-lp", "model"), ("is-truncated", "model"), ("spectr", "early-exit")]
)
def test_rules_that_need_independent_rows_refuse_them_in_one_line(tiny_models, write_recipe, run, verifier, drafter):
    recipe = branching_recipe(tiny_models, verifier, 2, 2)
    if drafter == "early-exit":
        recipe["drafts"] = [{"early_exit": 1, "params": {"branch_after": 2}}]
    code, _, err = run(["generate", "-r", str(write_recipe(recipe)), PROMPT])
    assert code == 2
    one_error_line(err, f"verifier '{verifier}' needs independent draft rows")
    assert "use match, specinfer, traversal, or branch_after: 0" in err


@pytest.mark.parametrize("value, message", [(-1, "branch_after must be a whole number >= 0"), ("two", "whole number")])
def test_a_bad_branch_after_is_one_line(tiny_models, write_recipe, run, value, message):
    recipe = write_recipe(branching_recipe(tiny_models, "specinfer", 2, value))
    code, _, err = run(["generate", "-r", str(recipe), PROMPT])
    assert code == 2
    one_error_line(err, message)


@pytest.mark.parametrize("num_drafts", [2, 1])
def test_acceptance_refuses_rows_that_share_a_prefix_and_takes_one_row(tiny_models, write_recipe, run, num_drafts):
    """`specdec acceptance` evaluates every position with K independent candidates: with branch_after it would be
    wrong at a block's first d positions, so at K = 2 it refuses in one line; at K = 1 nothing is copied and it runs
    (the check can pass)."""
    recipe = write_recipe(branching_recipe(tiny_models, "specinfer", num_drafts, 2))
    arguments = ["acceptance", "-r", str(recipe), "--num-drafts", str(num_drafts), "--verifier", "specinfer"]
    code, _, err = run([*arguments, "--max-new-tokens", "2", "--json", PROMPT])
    if num_drafts == 1:
        assert code == 0, err
    else:
        assert code == 2
        one_error_line(err, "drafts.0: drafter 'model' shares a block's first tokens across its rows (branch_after)")
