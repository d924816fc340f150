"""A plugin's parameters: its constructor's keyword arguments, with their types and descriptions (torch-free).

A plugin declares a parameter as a keyword argument of its constructor; its annotation is its type, and a
description goes in ``typing.Annotated``::

    def __init__(self, *, kl: Annotated[float, "the KL bound per position, in nats"] = 0.0): ...

``specdec verifiers`` and ``specdec drafters`` show both. Before a plugin's constructor runs,
:func:`parameters_problem` refuses an unknown parameter, a missing required one, and a value of the wrong
type (for bool, int, float, str, None and ``Literal`` annotations and their unions; other annotations are
the plugin's own to check), so the user gets one line that says which and why.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any

UNCHECKED = object()
"""The annotation of a parameter whose type is not declared, or not one :meth:`ParameterSpec.problem` checks."""

_SIMPLE_TYPES: dict[type, str] = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
                                  type(None): "null"}  # fmt: skip


@dataclass(frozen=True)
class ParameterSpec:
    """One constructor parameter of a plugin class."""

    name: str
    default: Any
    """Its default, or ``inspect.Parameter.empty`` when it is required."""
    choices: tuple[Any, ...] | object
    """What its annotation allows: types and ``Literal`` values, or :data:`UNCHECKED`."""
    type_name: str | None
    """Its annotation as a user reads it (``float``, ``int | None``), None where it has none."""
    description: str | None
    """The first string in its ``Annotated`` metadata, None where there is none."""

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not of this parameter's type, or None (also where the type is not checked)."""
        if self.choices is UNCHECKED or any(_matches(value, choice) for choice in self.choices):
            return None
        wanted = " or ".join(_SIMPLE_TYPES[c] if isinstance(c, type) else repr(c) for c in self.choices)
        return f"{self.name} must be {wanted}, got {value!r}"


def _matches(value: Any, choice: Any) -> bool:
    if not isinstance(choice, type):  # a Literal value
        return type(value) is type(choice) and value == choice
    if choice is float:  # an int is a number too; a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if choice is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, choice)


@functools.cache
def parameter_specs(cls: type) -> dict[str, ParameterSpec]:
    """Plugin class ``cls``'s parameters, in its constructor's order."""
    signature = inspect.signature(cls.__init__)
    try:
        hints = typing.get_type_hints(cls.__init__, include_extras=True)
    except Exception:  # noqa: BLE001 (a plugin's annotation naming what only its type checker sees)
        hints = {}
    specs = {}
    for name, parameter in signature.parameters.items():
        if name == "self" or parameter.kind not in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            continue
        annotation, description = _unwrapped(hints.get(name, inspect.Parameter.empty))
        choices = _choices(annotation)
        type_name = None if annotation is inspect.Parameter.empty else _type_name(annotation)
        specs[name] = ParameterSpec(name, parameter.default, choices, type_name, description)
    return specs


def _unwrapped(annotation: Any) -> tuple[Any, str | None]:
    """(the type under ``Annotated``, its first string metadata) of an annotation."""
    if typing.get_origin(annotation) is typing.Annotated:
        text = next((item for item in annotation.__metadata__ if isinstance(item, str)), None)
        return annotation.__origin__, text
    return annotation, None


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | Y``, ``Optional[X]``), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _choices(annotation: Any) -> tuple[Any, ...] | object:
    choices: list[Any] = []
    for member in _members(annotation):
        if typing.get_origin(member) is typing.Literal:
            choices += typing.get_args(member)
        elif member in _SIMPLE_TYPES:
            choices.append(member)
        else:
            return UNCHECKED
    return tuple(choices)


def _type_name(annotation: Any) -> str:
    names = []
    for member in _members(annotation):
        if typing.get_origin(member) is typing.Literal:
            names += [repr(value) for value in typing.get_args(member)]
        elif member is type(None):
            names.append("None")
        else:
            plain = isinstance(member, type) and typing.get_origin(member) is None  # list[int] is not plain
            names.append(member.__name__ if plain else str(member).removeprefix("typing."))
    return " | ".join(names)


def parameters_problem(cls: type, args: tuple[Any, ...], params: dict[str, Any]) -> str | None:
    """What is wrong with constructing plugin class ``cls`` with ``args`` and ``params`` (a message naming
    the parameters it takes), or None."""
    specs = parameter_specs(cls)
    accepted = ", ".join(specs) or "none"
    unknown = sorted(set(params) - set(specs))
    if args or unknown:
        given = ", ".join(unknown) if unknown else "positional arguments"
        return f"unknown parameter(s) {given}; valid parameters: {accepted}"
    missing = [name for name, spec in specs.items() if spec.required and name not in params]
    if missing:
        return f"missing required parameter(s) {', '.join(missing)}"
    return next((problem for name, value in params.items() if (problem := specs[name].problem(value))), None)
