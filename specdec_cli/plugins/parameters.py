"""A plugin's parameters: its constructor's keyword arguments, with their types and descriptions (torch-free).

A plugin declares a parameter as a keyword argument of its constructor; its annotation is its type, and a
description goes in ``typing.Annotated``::

    def __init__(self, *, kl: Annotated[float, "the KL bound per position, in nats"] = 0.0): ...

``specdec verifiers`` and ``specdec drafters`` show both. Before a plugin's constructor runs,
:func:`parameters_problem` refuses an unknown parameter and a value of the wrong type (for bool, int, float,
str, None and ``Literal`` annotations and their unions; other annotations are the plugin's own to check), so
the user gets one line that says which and why. A missing required parameter is left to the constructor's own
TypeError, which the registry also reports in one line.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import types
import typing
from dataclasses import dataclass
from typing import Any

from ..base.errors import UsageError

UNCHECKED = object()
"""The annotation of a parameter whose type is not declared, or not one :meth:`ParameterSpec.problem` checks."""

_SIMPLE_TYPES: dict[type, str] = {
    bool: "true or false",
    int: "a whole number",
    float: "a number",
    str: "a string",
    type(None): "null",
}


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

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not of this parameter's type, or None (also where the type is not checked)."""
        if self.choices is UNCHECKED or any(_matches(value, choice) for choice in self.choices):
            return None
        if type(value) is type(self.default) and value == self.default:  # `x: int = None` takes its own default
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
    """Plugin class ``cls``'s parameters, in its constructor's order; a constructor that passes ``**kwargs`` on
    (a subclass of a built-in) has its parents' parameters too."""
    specs: dict[str, ParameterSpec] = {}
    for init in _constructors(cls):
        hints = _hints(init)
        for name, parameter in inspect.signature(init).parameters.items():
            if (
                name == "self"
                or name in specs
                or parameter.kind not in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
            ):
                continue
            annotation, description = _unwrapped(hints.get(name, inspect.Parameter.empty))
            type_name = None if annotation is inspect.Parameter.empty else _type_name(annotation)
            specs[name] = ParameterSpec(name, parameter.default, _choices(annotation), type_name, description)
    return specs


def _constructors(cls: type) -> list[Any]:
    """The ``__init__`` of ``cls``, then each parent's while the one before passes ``**kwargs`` on; the contract's
    base classes and ``object`` take no parameters."""
    inits = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if klass is object or klass.__module__.startswith(f"{__package__}."):
            break
        if init is None:
            continue
        inits.append(init)
        if not _passes_keywords_on(init):
            break
    return inits


def _passes_keywords_on(init: Any) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(init).parameters.values())


@functools.cache
def takes_any_keyword(cls: type) -> bool:
    """Whether ``cls``'s constructors end in a ``**kwargs`` that no parent's names: unknown names are its own."""
    inits = _constructors(cls)
    return bool(inits) and _passes_keywords_on(inits[-1])


class _TypeCheckerNames(dict):
    """The namespace annotations are read in: a name that only a plugin's type checker sees (imported under
    ``TYPE_CHECKING``) reads as a class of that name, so its other annotations and its description still count."""

    def __init__(self, module_names: dict[str, Any]):
        super().__init__()
        self.module_names = module_names

    def __missing__(self, key: str) -> Any:
        if key in self.module_names:
            return self.module_names[key]
        return getattr(builtins, key) if hasattr(builtins, key) else type(key, (), {})


def _hints(init: Any) -> dict[str, Any]:
    module_names = getattr(init, "__globals__", {})
    try:
        return typing.get_type_hints(
            init, globalns=module_names, localns=_TypeCheckerNames(module_names), include_extras=True
        )
    except Exception:  # noqa: BLE001 (an annotation that is not an expression at all: left undeclared)
        return {}


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
    unknown = [] if takes_any_keyword(cls) else sorted(set(params) - set(specs))
    if args or unknown:
        given = ", ".join(unknown) if unknown else "positional arguments"
        return f"unknown parameter(s) {given}; valid parameters: {accepted}"
    # A missing required parameter is the constructor's own TypeError: copy and pickle make instances without any.
    return next(
        (problem for name, value in params.items() if name in specs and (problem := specs[name].problem(value))), None
    )


class PluginParameterError(UsageError, TypeError):
    """An unknown or ill-typed plugin parameter (a TypeError too, as Python callers expect)."""


class PluginParameterValueError(PluginParameterError, ValueError):
    """A plugin's own ValueError about a parameter's value, as one line (still a ValueError)."""


def parameter_defaults(cls: type) -> dict[str, Any]:
    """A plugin class's parameters and their defaults, from its constructor's signature."""
    return {name: spec.default for name, spec in parameter_specs(cls).items()}


def check_parameters(cls: type, kind: str, args: tuple[Any, ...], params: dict[str, Any]) -> None:
    """A PluginParameterError naming plugin class ``cls`` (a ``kind``) when ``args`` and ``params`` do not fit its
    parameters (:func:`parameters_problem`): the base classes call it before a constructor."""
    problem = parameters_problem(cls, args, params)
    if problem is not None:
        raise PluginParameterError(f"{kind} '{cls.name}': {problem}")
