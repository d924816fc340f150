"""Plugin parameters (issue 21): types and descriptions read from a constructor's annotations, checked before the
constructor runs, and shown by the listing commands."""

from __future__ import annotations

import copy
import json
from typing import Annotated, Literal, Optional

import pytest

from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.parameters import UNCHECKED, parameter_specs, parameters_problem
from specdec_cli.plugins.registry import PluginParameterError, VerifierRegistry
from specdec_plugins.early_exit_drafter import EarlyExitDrafter
from specdec_plugins.speculative import SpeculativeSampling
from tests.conftest import one_error_line, tiny_recipe


class Typed:
    name = "typed"

    def __init__(
        self,
        *,
        rate: Annotated[float, "how fast"] = 1.0,
        count: Optional[int] = None,
        mode: Literal["a", "b"] = "a",
        flag: bool = False,
        free=3,
        items: list[int] | None = None,
        later: "NotDefinedAnywhere" = 0,  # noqa: F821 (deliberately undefined: the test annotates with an unknown name)
    ):
        pass


class Resolvable:
    def __init__(
        self,
        *,
        rate: Annotated[float, "how fast"] = 1.0,
        count: Optional[int] = None,
        mode: Literal["a", "b"] = "a",
        flag: bool = False,
        free=3,
        items: list[int] | None = None,
    ):
        pass


def test_types_and_descriptions_come_from_the_annotations():
    specs = parameter_specs(Resolvable)
    assert [(s.name, s.type_name, s.description) for s in specs.values()] == [
        ("rate", "float", "how fast"),
        ("count", "int | None", None),
        ("mode", "'a' | 'b'", None),
        ("flag", "bool", None),
        ("free", None, None),
        ("items", "list[int] | None", None),
    ]
    assert specs["free"].choices is UNCHECKED and specs["items"].choices is UNCHECKED


def test_a_name_only_a_type_checker_sees_leaves_that_parameter_unchecked_and_the_others_as_declared():
    specs = parameter_specs(Typed)
    assert list(specs) == ["rate", "count", "mode", "flag", "free", "items", "later"]
    assert (specs["rate"].type_name, specs["rate"].description) == ("float", "how fast")
    assert specs["later"].type_name == "NotDefinedAnywhere" and specs["later"].choices is UNCHECKED
    assert parameters_problem(Typed, (), {"rate": "fast", "later": object()}) == "rate must be a number, got 'fast'"


class Passing(Resolvable):
    """A subclass that passes its keywords on, as a subclass of a built-in does."""

    def __init__(self, *, extra: Annotated[int, "one more"] = 1, **params):
        super().__init__(**params)


class Open:
    def __init__(self, **options):
        pass


def test_keywords_passed_on_take_the_parents_parameters_and_an_open_constructor_takes_any_name():
    assert list(parameter_specs(Passing)) == ["extra", "rate", "count", "mode", "flag", "free", "items"]
    assert parameters_problem(Passing, (), {"rate": "fast"}) == "rate must be a number, got 'fast'"
    assert parameters_problem(Passing, (), {"speed": 1}).startswith("unknown parameter(s) speed")
    assert parameters_problem(Open, (), {"anything": 1}) is None


class DefaultOfAnotherType:
    def __init__(self, *, size: int = None, layers: int):  # noqa: RUF013 (as plugins write it)
        pass


def test_a_parameter_takes_its_own_default_and_a_missing_one_is_left_to_the_constructor():
    assert parameters_problem(DefaultOfAnotherType, (), {"size": None}) is None
    assert parameters_problem(DefaultOfAnotherType, (), {}) is None  # copy and pickle call __new__ without any
    copy.deepcopy(SpeculativeSampling())
    copy.deepcopy(EarlyExitDrafter(layers=2))
    with pytest.raises(PluginParameterError, match="drafter 'early-exit': .*'layers'"):  # Python's words, one line
        DrafterRegistry().create("early-exit", {})


@pytest.mark.parametrize(
    "params, problem",
    [
        ({"rate": 2}, None),
        ({"rate": 0.5}, None),
        ({"count": None}, None),
        ({"count": 3}, None),
        ({"mode": "b"}, None),
        ({"flag": True}, None),
        ({"free": object()}, None),
        ({"items": ["anything"]}, None),
        ({"rate": "fast"}, "rate must be a number, got 'fast'"),
        ({"rate": True}, "rate must be a number, got True"),
        ({"count": 2.0}, "count must be a whole number or null, got 2.0"),
        ({"count": False}, "count must be a whole number or null, got False"),
        ({"mode": "c"}, "mode must be 'a' or 'b', got 'c'"),
        ({"flag": 1}, "flag must be true or false, got 1"),
        ({"speed": 1}, "unknown parameter(s) speed; valid parameters: rate, count, mode, flag, free, items"),
    ],
)
def test_values_are_checked_against_their_types(params, problem):
    assert parameters_problem(Resolvable, (), params) == problem


def test_a_verifier_refuses_an_ill_typed_parameter_before_its_constructor_runs():
    with pytest.raises(PluginParameterError, match="verifier 'mentored': kl must be a number, got 'half'"):
        VerifierRegistry().create("mentored", {"kl": "half"})
    with pytest.raises(PluginParameterError, match="verifier 'speculative': unknown parameter"):
        SpeculativeSampling(strength=1)  # the library path too: the base class checks


def test_an_ill_typed_parameter_on_the_command_line_is_one_line(run, tiny_models, write_recipe):
    recipe = write_recipe(tiny_recipe(tiny_models))
    code, _, err = run(
        ["generate", "-r", str(recipe), "--verifier", "mentored", "--set", "verifier.params.kl=half", "a b"]
    )
    assert code == 2
    one_error_line(err, "verifier 'mentored': kl must be a number, got 'half'")


@pytest.mark.parametrize("command, kind", [("verifiers", "verifier"), ("drafters", "drafter")])
def test_the_listings_show_each_parameter_with_its_type_and_description(run, command, kind):
    code, out, _ = run([command, "--json"])
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)[command]}
    for row in rows.values():
        assert row["summary"], row["name"]
        for name in row["parameters"]:
            docs = row["parameter_docs"][name]
            assert docs["type"] and docs["description"], (row["name"], name)
    code, out, _ = run([command])
    assert code == 0 and f"{kind} parameters" in out
    expected = "the bound D on KL" if kind == "verifier" else "the longest n-gram looked up"
    assert expected in " ".join(out.replace("│", " ").split())  # a narrow terminal wraps the cell
