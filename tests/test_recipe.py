"""Recipes: reading, validation with field paths, overrides."""

from __future__ import annotations

import pytest

from specdec_cli.base.errors import RecipeError
from specdec_cli.base.recipe import (
    apply_overrides,
    build_recipe,
    load_recipe,
    read_recipe_file,
    shipped_recipe_names,
    target_alone,
)
from specdec_cli.commands.common import RecipeOptions

BASE = {"target": {"model": "some/target"}, "draft": {"model": "some/draft"}}


def test_defaults_and_single_draft_become_a_list():
    recipe = build_recipe(BASE)
    assert recipe.drafts[0].model == "some/draft"
    assert recipe.verifier.name == "speculative"
    assert (recipe.speculation.draft_length, recipe.speculation.num_drafts) == (4, 1)
    assert recipe.generation.temperature == 1.0 and recipe.seed == 0


@pytest.mark.parametrize("name, alone", [("none", True), (" None ", True), ("NONE", True), ("speculative", False)])
def test_the_target_alone_is_decided_once_from_the_verifier_name(name, alone):
    recipe = build_recipe({**BASE, "verifier": {"name": name}})
    assert target_alone(name) is alone and recipe.decoding_config().speculative is not alone


def test_several_drafts_with_their_own_temperature():
    recipe = build_recipe({"target": {"model": "t"}, "drafts": [{"model": "d"}, {"model": "d", "temperature": 1.5}]})
    assert [d.temperature for d in recipe.drafts] == [None, 1.5]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"speculation": {"draft_lenght": 3}}, r"unknown key 'speculation.draft_lenght'; did you mean 'draft_length'"),
        ({"generaton": {}}, r"unknown key 'generaton'; did you mean 'generation'"),
        ({"speculation": {"draft_length": 0}}, r"speculation.draft_length: must be >= 1"),
        ({"speculation": {"num_drafts": 0}}, r"speculation.num_drafts: must be >= 1"),
        ({"speculation": {"draft_length": "four"}}, r"speculation.draft_length: expected an integer, got str 'four'"),
        ({"generation": {"temperature": -0.5}}, r"generation.temperature: must be >= 0"),
        ({"generation": {"top_p": 0}}, r"generation.top_p: must be in \(0, 1\]"),
        ({"generation": {"top_p": 1.5}}, r"generation.top_p: must be in \(0, 1\]"),
        ({"generation": {"top_k": True}}, r"generation.top_k: expected an integer"),
        ({"draft": {"model": "d", "temperature": -1}}, r"drafts.0.temperature: must be >= 0"),
        ({"target": {"model": "t", "dtype": "float8"}}, r"target.dtype: must be one of"),
        ({"target": {"model": "t", "device": "gpu"}}, r"target.device: must be auto, cpu, cuda"),
        ({"target": {"dtype": "auto"}}, r"target.model: is required"),
        ({"draft": {"early_exit": 3, "model": "d"}}, r"drafts.0: give either 'model' or 'early_exit'"),
        ({"drafts": [{"model": "d"}]}, r"either 'draft:' .* or 'drafts:'"),
        ({"seed": 1.5}, r"seed: expected an integer"),
        ({"generation": {"stop": ["###", ""]}}, r"^generation.stop.1: must not be empty$"),
        ({"generation": {"stop": "###"}}, r"^generation.stop: expected a list, got str '###'$"),
        ({"generation": {"stop": [5]}}, r"^generation.stop.0: expected a string, got int 5$"),
        (
            {"speculation": {"draft_length_schedule": "adaptive"}},
            r"^speculation.draft_length_schedule: must be one of constant, heuristic$",
        ),
        ({"speculation": [1, 2]}, r"^speculation: expected a mapping of keys, got list \[1, 2\]$"),
    ],
)
def test_bad_values_name_their_field(change, message):
    with pytest.raises(RecipeError, match=message):
        build_recipe({**BASE, **change})


def test_missing_target():
    with pytest.raises(RecipeError, match="no 'target:' section"):
        build_recipe({"draft": {"model": "d"}})


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("target:\n  model: x\ndraft: {model: [unclosed\n")
    with pytest.raises(RecipeError, match=r"YAML syntax error in .*broken.yaml at line \d+"):
        read_recipe_file(path)


def test_missing_and_unreadable_recipe(tmp_path):
    with pytest.raises(RecipeError, match="recipe file 'nope.yaml' not found.*shipped recipes: .*default"):
        read_recipe_file("nope.yaml")
    with pytest.raises(RecipeError, match="cannot read recipe file"):
        read_recipe_file(tmp_path)  # a directory
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        read_recipe_file(tmp_path / "list.yaml")


def test_overrides_parse_yaml_values_and_index_lists():
    data = {"target": {"model": "t"}, "drafts": [{"model": "d"}, {"model": "d"}]}
    out = apply_overrides(data, ["generation.top_k=50", "drafts.1.temperature=1.5", "verifier.params.kl=0.2"])
    assert out["generation"]["top_k"] == 50
    assert out["drafts"][1]["temperature"] == 1.5
    assert out["verifier"]["params"] == {"kl": 0.2}
    assert "generation" not in data  # the input is not modified
    with pytest.raises(RecipeError, match="--set expects key.path=value"):
        apply_overrides(data, ["generation.top_k"])
    with pytest.raises(RecipeError, match="index from 0 to 1"):
        apply_overrides(data, ["drafts.5.temperature=1"])


def test_command_line_flags_override_the_recipe(write_recipe):
    path = write_recipe({**BASE, "verifier": {"name": "mentored", "params": {"kl": 0.5}}})
    options = RecipeOptions(
        recipe=str(path),
        temperature=0.0,
        top_k=5,
        num_drafts=2,
        device="cpu",
        dtype="float32",
        sets=["generation.top_p=0.9", "seed=7"],
        verifier="speculative",
    )
    recipe = options.resolve()
    assert recipe.generation.temperature == 0.0 and recipe.generation.top_k == 5 and recipe.generation.top_p == 0.9
    assert recipe.speculation.num_drafts == 2 and recipe.seed == 7
    assert recipe.target.device == recipe.drafts[0].device == "cpu"
    assert recipe.drafts[0].dtype == "float32"
    # A different verifier drops the parameters written for the old one; --kl sets its own.
    assert recipe.verifier.name == "speculative" and recipe.verifier.params == {}
    assert RecipeOptions(recipe=str(path), kl=0.1).resolve().verifier.params == {"kl": 0.1}


@pytest.mark.parametrize("name", shipped_recipe_names())
def test_shipped_recipes_are_valid(name):
    recipe = load_recipe(name)
    assert recipe.target.model and recipe.drafts


def test_the_default_recipe_is_the_offline_gguf():
    assert load_recipe().target.model.endswith(".gguf")
    assert len(shipped_recipe_names()) >= 4


def test_stop_texts_and_the_draft_length_schedule_are_recipe_settings():
    recipe = build_recipe(
        {**BASE, "generation": {"stop": ["###", "\n\n"]}, "speculation": {"draft_length_schedule": "heuristic"}}
    )
    assert recipe.generation.stop == ("###", "\n\n")
    assert recipe.speculation.draft_length_schedule == "heuristic"
    assert recipe.to_dict()["generation"]["stop"] == ("###", "\n\n")
    config = recipe.decoding_config().replace(stop=["END"], draft_length_schedule="constant")
    assert config.generation.stop == ("END",) and config.speculation.draft_length_schedule == "constant"
    assert config.replace(stop="END").generation.stop == ("END",)  # one string is one stop text


def test_a_recipe_without_the_new_settings_reads_as_before():
    """Results folders compare ``to_dict()``: the new keys at their defaults are left out, so folders written before
    them still resume."""
    recipe = build_recipe(BASE)
    assert recipe.generation.stop == () and recipe.speculation.draft_length_schedule == "constant"
    data = recipe.to_dict()
    assert "stop" not in data["generation"] and "draft_length_schedule" not in data["speculation"]
    assert set(data["speculation"]) == {"draft_length", "num_drafts", "kv_cache", "static_cache", "compile"}


@pytest.mark.parametrize("overrides", [[], ["verifier=block"]])
def test_a_verifier_written_as_its_name_is_its_name(write_recipe, overrides):
    recipe = load_recipe(write_recipe({**BASE, "verifier": "specinfer"}), overrides)
    assert recipe.verifier.name == ("block" if overrides else "specinfer") and recipe.verifier.params == {}


def test_a_verifier_written_as_its_name_takes_flags_and_parameters(write_recipe):
    path = str(write_recipe({**BASE, "verifier": "mentored"}))
    assert RecipeOptions(recipe=path, verifier="block").resolve().verifier.name == "block"
    assert RecipeOptions(recipe=path, kl=0.2).resolve().verifier.params == {"kl": 0.2}
    assert load_recipe(path, ["verifier.params.kl=0.3"]).verifier.params == {"kl": 0.3}


@pytest.mark.parametrize(
    ("section", "flags", "message"),
    [
        (
            {"speculation": [1, 2]},
            {"draft_length": 3},
            "speculation: must be a mapping of keys (such as draft_length: …), not list [1, 2]; fix 'speculation:' in "
            "the recipe",
        ),
        (
            {"generation": "fast"},
            {"temperature": 0.5},
            "generation: must be a mapping of keys (such as temperature: …), not str 'fast'; fix 'generation:' in the "
            "recipe",
        ),
        (
            {"target": ["t"]},
            {"device": "cpu"},
            "target: must be a mapping of keys (such as device: …), not list ['t']; fix 'target:' in the recipe",
        ),
    ],
)
def test_a_flag_into_a_section_that_is_not_a_mapping_says_the_section_must_be_one(
    write_recipe, section, flags, message
):
    path = str(write_recipe({**BASE, **section}))
    with pytest.raises(RecipeError) as raised:
        RecipeOptions(recipe=path, **flags).resolve()
    assert str(raised.value) == message
    setting = f"{next(iter(section))}.x=1"
    with pytest.raises(RecipeError, match="must be a mapping of keys"):  # --set into it too
        load_recipe(path, [setting])


def test_stop_flags_add_to_the_recipes_stop_texts(write_recipe):
    written = str(write_recipe({**BASE, "generation": {"stop": ["###"]}}))
    assert RecipeOptions(recipe=written, stop=["END", "\n\n"]).resolve().generation.stop == ("###", "END", "\n\n")
    assert RecipeOptions(recipe=str(write_recipe(BASE)), stop=["END"]).resolve().generation.stop == ("END",)
    assert (
        RecipeOptions(recipe=written, draft_length_schedule="heuristic").resolve().speculation
        == build_recipe({**BASE, "speculation": {"draft_length_schedule": "heuristic"}}).speculation
    )
