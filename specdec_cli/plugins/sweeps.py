"""A verifier parameter swept over values (``--sweep NAME.PARAMETER=V1,V2,…`` on ``acceptance`` and ``bench``):
one row or cell per value, so lossy rules compare at matched divergence rather than at matched knob values.

Values are read as YAML, as ``--set`` reads them (``0.5``, ``tv``, ``true``), and each is tried on the verifier's
constructor before any model loads: a value it refuses is named by the flag, in one line.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from ..base.errors import UsageError
from ..base.recipe import parse_value
from .parameters import parameter_defaults
from .registry import VerifierRegistry

__all__ = ["ParameterSweep", "parse_sweeps", "shown_value", "swept_params"]


@dataclass(frozen=True)
class ParameterSweep:
    verifier: str
    """The verifier's canonical name."""
    parameter: str
    values: tuple[Any, ...]


def parse_sweeps(texts: list[str], registry: VerifierRegistry, params: dict[str, Any]) -> tuple[ParameterSweep, ...]:
    """``--sweep`` values (``NAME.PARAMETER=V1,V2``) as sweeps, each value made into an instance of the verifier with
    the recipe's parameters ``params`` it takes (a UsageError in the flag's words for anything wrong)."""
    sweeps = []
    for text in texts:
        target, equals, listed = text.partition("=")
        name, dot, parameter = target.strip().partition(".")
        values = [parse_value(part.strip(), f"--sweep {text}") for part in listed.split(",") if part.strip()]
        if not (equals and dot and parameter and values):
            raise UsageError(f"--sweep expects VERIFIER.PARAMETER=V1,V2,… (e.g. ensemble.weight=0.2,0.5), got '{text}'")
        name = registry.canonical(name)
        taken = parameter_defaults(registry.verifier_class(name))
        if parameter not in taken:
            raise UsageError(
                f"--sweep {text}: verifier '{name}' has no parameter '{parameter}' "
                f"(it takes: {', '.join(taken) or 'none'})"
            )
        if parameter == registry.verifier_class(name).kl_bound_parameter:
            raise UsageError(f"--sweep {text}: {parameter} is {name}'s KL bound; give its values with --kl")
        if len({shown_value(value) for value in values}) < len(values):  # two values, one row label or cell key
            raise UsageError(f"--sweep {text}: a value is given twice; give each value once")
        if any(sweep.verifier == name and sweep.parameter == parameter for sweep in sweeps):
            raise UsageError(f"--sweep names {name}.{parameter} twice; give its values in one list")
        sweep = ParameterSweep(name, parameter, tuple(values))
        for value in values:
            registry.resolve(name, params, swept=((parameter, value),), taken_only=True, set_by=f"--sweep {text}")
        sweeps.append(sweep)
    return tuple(sweeps)


def swept_params(name: str, sweeps: tuple[ParameterSweep, ...]) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the values ``sweeps`` give verifier ``name``'s parameters, as (parameter, value) pairs in
    the sweeps' order: ``[()]`` for a verifier nothing sweeps."""
    own = [sweep for sweep in sweeps if sweep.verifier == name]
    return [
        tuple(zip((sweep.parameter for sweep in own), values)) for values in itertools.product(*(s.values for s in own))
    ]


def shown_value(value: Any) -> str:
    """A swept value as row labels and cell keys show it (``0.5``, ``tv``)."""
    return f"{value:g}" if isinstance(value, float) else str(value)
