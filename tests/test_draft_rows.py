"""One rule for "which draft rows, and are their laws identical" (issue 19, item 2).

The engine, bench's grid and acceptance all ask :mod:`specdec_cli.plugins.draft_rows`; these tests hold
them to the same answers, and run the bench command a new user tried on a two-draft recipe.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from specdec_cli.base.errors import UsageError
from specdec_cli.base.recipe import build_recipe
from specdec_cli.bench.grid import Grid, GridCell
from specdec_cli.engine.decoder import SpeculativeDecoder
from specdec_cli.plugins.draft_rows import DraftRows, round_robin
from specdec_cli.plugins.drafter_registry import draft_law, recipe_draft_rows
from specdec_cli.plugins.registry import VerifierRegistry
from tests.conftest import bench_on_files, tiny_recipe


def _two_draft_recipe(models, temperatures=(1.0, 1.5), **sections) -> dict:
    """A tiny recipe mapping with one draft config per temperature (None: the target's), like default-two-drafts."""
    data = tiny_recipe(models, "llama", **sections)
    draft = data.pop("draft")
    data["drafts"] = [{**draft, "temperature": t} for t in temperatures]
    return data


def _recipe(models, **sections):
    return build_recipe(_two_draft_recipe(models, **sections))


@pytest.mark.parametrize(
    ("temperatures", "num_drafts", "count", "identical"),
    [
        ((1.0,), 3, 3, True),
        ((1.0, 1.5), 1, 2, False),
        ((1.0, 1.5), 2, 4, False),
        ((1.0, 1.0), 2, 4, True),
        ((None, 1.0), 1, 2, True),
    ],  # a left-out temperature is the target's (1.0): the same law
)
def test_the_recipe_rule(tiny_models, temperatures, num_drafts, count, identical):
    recipe = _recipe(tiny_models, temperatures=temperatures, speculation={"num_drafts": num_drafts})
    assert recipe_draft_rows(recipe) == DraftRows(count=count, identical_laws=identical)


def test_round_robin_rows_are_identical_only_while_one_law_is_used():
    assert round_robin(["a", "b"], 1) == DraftRows(count=1, identical_laws=True)
    assert round_robin(["a", "b"], 2) == DraftRows(count=2, identical_laws=False)
    assert round_robin(["a", "a"], 4) == DraftRows(count=4, identical_laws=True)


def test_a_draft_law_ignores_nothing_but_where_the_sampling_settings_come_from(tiny_models):
    """A setting written out equal to the target's is the same law as one left out; any other differs."""
    recipe = _recipe(tiny_models, temperatures=(1.0, None))  # the target samples at T = 1
    written, left_out = (draft_law(d, recipe.generation) for d in recipe.drafts)
    assert written == left_out
    other_top_k = dataclasses.replace(recipe.drafts[1], top_k=5)
    other_dtype = dataclasses.replace(recipe.drafts[1], dtype="bfloat16")
    assert draft_law(other_top_k, recipe.generation) != left_out != draft_law(other_dtype, recipe.generation)


@pytest.mark.parametrize("temperatures", [(1.0, 1.5), (1.0, 1.0)])
@pytest.mark.parametrize("num_drafts", [1, 2])
def test_engine_and_grid_agree_with_the_rule(tiny_models, temperatures, num_drafts):
    """The grid keeps exactly the cells whose decoder the engine builds."""
    registry = VerifierRegistry()
    recipe = _recipe(tiny_models, temperatures=temperatures)
    grid = Grid(
        verifiers=("spectr", "specinfer", "speculative"),
        kl=(),
        num_drafts=(num_drafts,),
        draft_lengths=(2,),
        temperatures=(1.0,),
    )
    cells, _ = grid.cells(registry, recipe)
    kept = {c.verifier for c in cells[1:]}
    for name in grid.verifiers:
        cell = GridCell(
            verifier=name, kl=None, num_drafts=num_drafts, draft_length=2, temperature=1.0, draft_temperatures=None
        )
        if name in kept:
            assert (
                SpeculativeDecoder.from_recipe(cell.recipe(recipe, registry), registry=registry).verifier.name == name
            )
        else:
            with pytest.raises(UsageError):
                SpeculativeDecoder.from_recipe(cell.recipe(recipe, registry), registry=registry)
    assert ("spectr" in kept) == (temperatures[0] == temperatures[1])
    assert "specinfer" in kept and "speculative" not in kept  # two configs: at least two rows


def test_bench_skips_the_cells_the_engine_refuses_on_two_drafts(run, tiny_models, write_recipe, data, tmp_path):
    """The command a new user tried: it stopped before any sample with "grid cell 'spectr K=1 …' needs
    identical drafts"; the cells are now skipped with a note and the others run."""
    recipe = _two_draft_recipe(tiny_models, generation={"max_new_tokens": 4})
    out = tmp_path / "out"
    args = bench_on_files(
        str(write_recipe(recipe)), data, out, verifier="specinfer,spectr,speculative", num_drafts="1,2", limit=2
    )
    code, _, err = run(args)
    assert code == 0, err
    assert "skipped: verifier 'spectr' needs identical drafts" in err
    assert "skipped: verifier 'speculative' takes at most 1 draft(s)" in err
    cells = {c["key"] for c in json.loads((out / "results.json").read_text())["cells"]}
    assert cells == {"baseline T=1", "specinfer K=1 L=3 T=1", "specinfer K=2 L=3 T=1"}
