"""Plugin parameters (issue 21): types and descriptions read from a constructor's annotations, checked before the
constructor runs, and shown by the listing commands."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional

import pytest

from specdec_cli.parameters import UNCHECKED, parameter_specs, parameters_problem
from specdec_cli.registry import PluginParameterError, VerifierRegistry
from specdec_plugins.speculative import SpeculativeSampling
from tests.conftest import tiny_recipe
from tests.test_cli import _one_error_line, run  # noqa: F401


class Typed:
    name = "typed"

    def __init__(self, *, rate: Annotated[float, "how fast"] = 1.0, count: Optional[int] = None,
                 mode: Literal["a", "b"] = "a", flag: bool = False, free=3, items: list[int] | None = None,
                 later: "NotDefinedAnywhere" = 0):  # noqa: F821 (an annotation only a type checker resolves)  # fmt: skip
        pass


class Resolvable:
    def __init__(self, *, rate: Annotated[float, "how fast"] = 1.0, count: Optional[int] = None,
                 mode: Literal["a", "b"] = "a", flag: bool = False, free=3, items: list[int] | None = None):  # fmt: skip
        pass


def test_types_and_descriptions_come_from_the_annotations():
    specs = parameter_specs(Resolvable)
    assert [(s.name, s.type_name, s.description) for s in specs.values()] == [
        ("rate", "float", "how fast"), ("count", "int | None", None), ("mode", "'a' | 'b'", None),
        ("flag", "bool", None), ("free", None, None), ("items", "list[int] | None", None)]  # fmt: skip
    assert specs["free"].choices is UNCHECKED and specs["items"].choices is UNCHECKED


def test_an_annotation_that_cannot_be_resolved_leaves_the_parameters_unchecked():
    specs = parameter_specs(Typed)
    assert list(specs) == ["rate", "count", "mode", "flag", "free", "items", "later"]
    assert all(spec.choices is UNCHECKED and spec.type_name is None for spec in specs.values())


@pytest.mark.parametrize("params, problem", [
    ({"rate": 2}, None), ({"rate": 0.5}, None), ({"count": None}, None), ({"count": 3}, None), ({"mode": "b"}, None),
    ({"flag": True}, None), ({"free": object()}, None), ({"items": ["anything"]}, None),
    ({"rate": "fast"}, "rate must be a number, got 'fast'"),
    ({"rate": True}, "rate must be a number, got True"),
    ({"count": 2.0}, "count must be a whole number or null, got 2.0"),
    ({"count": False}, "count must be a whole number or null, got False"),
    ({"mode": "c"}, "mode must be 'a' or 'b', got 'c'"),
    ({"flag": 1}, "flag must be true or false, got 1"),
    ({"speed": 1}, "unknown parameter(s) speed; valid parameters: rate, count, mode, flag, free, items"),
])  # fmt: skip
def test_values_are_checked_against_their_types(params, problem):
    assert parameters_problem(Resolvable, (), params) == problem


def test_a_verifier_refuses_an_ill_typed_parameter_before_its_constructor_runs():
    with pytest.raises(PluginParameterError, match="verifier 'mentored': kl must be a number, got 'half'"):
        VerifierRegistry().create("mentored", {"kl": "half"})
    with pytest.raises(PluginParameterError, match="verifier 'speculative': unknown parameter"):
        SpeculativeSampling(strength=1)  # the library path too: the base class checks


def test_an_ill_typed_parameter_on_the_command_line_is_one_line(run, tiny_models, write_recipe):
    recipe = write_recipe(tiny_recipe(tiny_models))
    code, _, err = run(["generate", "-r", str(recipe), "--verifier", "mentored", "--set", "verifier.params.kl=half",
                        "a b"])  # fmt: skip
    assert code == 2
    _one_error_line(err, "verifier 'mentored': kl must be a number, got 'half'")


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
