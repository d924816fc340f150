"""Recipes: YAML files that name everything a run needs, read into frozen dataclasses (:mod:`.recipe_config`).

Reading goes YAML's safe loader → overrides (``--set a.b=c`` and the CLI's named flags)
→ :func:`build_recipe`, which checks every key and type against the dataclasses below
and reports problems with their field path (``speculation.draft_length: must be >= 1``)
and a did-you-mean for unknown keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from .errors import RecipeError
from .recipe_config import (
    AUTOREGRESSIVE,
    DRAFT_LENGTH_SCHEDULES,
    DTYPES,
    DecodingConfig,
    DraftConfig,
    GenerationConfig,
    ModelConfig,
    Recipe,
    SpeculationConfig,
    VerifierConfig,
    field_names,
    sampling_problems,
    target_alone,
)

__all__ = [
    "AUTOREGRESSIVE",
    "DRAFT_LENGTH_SCHEDULES",
    "DTYPES",
    "DecodingConfig",
    "DraftConfig",
    "GenerationConfig",
    "MAX_RECIPE_VALUES",
    "ModelConfig",
    "Recipe",
    "SpeculationConfig",
    "VerifierConfig",
    "apply_overrides",
    "build_recipe",
    "check_expanded_size",
    "load_recipe",
    "read_recipe_file",
    "sampling_problems",
    "set_path",
    "shipped_recipe_names",
    "target_alone",
    "validate",
]

# --------------------------------------------------------------------------- reading


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, also reading 1e-3 and 5E+2 as numbers: YAML 1.1, which PyYAML follows, wants a
    dot in a float, so ``temperature: 1e-3`` would be the text '1e-3' and refused as "not a number"."""


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RecipeLoader)


def shipped_recipe_names() -> list[str]:
    folder = importlib.resources.files("specdec_cli.recipes")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def read_recipe_file(recipe: str | Path | None) -> dict[str, Any]:
    """The raw mapping of a recipe file, or of a shipped recipe named without ``.yaml``."""
    if recipe is None:
        recipe = "default"
    path = Path(recipe)
    if not path.exists() and str(recipe) in shipped_recipe_names():
        text = (importlib.resources.files("specdec_cli.recipes") / f"{recipe}.yaml").read_text()
        source = f"shipped recipe '{recipe}'"
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RecipeError(
                f"recipe file '{recipe}' not found; give a YAML file path or one of the shipped recipes: "
                + ", ".join(shipped_recipe_names())
            ) from None
        except OSError as error:
            raise RecipeError(f"cannot read recipe file '{recipe}': {error.strerror}") from None
        except UnicodeDecodeError:
            raise RecipeError(f"recipe file '{recipe}' is not UTF-8 text; a recipe is a YAML file") from None
        source = str(recipe)
    try:
        data = _parse_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise RecipeError(f"YAML syntax error in {source}{where}: {problem}") from None
    except RecursionError:
        raise _too_deep(source) from None
    check_expanded_size(data, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"{source} must be a YAML mapping of keys (target:, draft:, ...), not a {type(data).__name__}"
        )
    return _expand_shorthands(data)


def _expand_shorthands(data: dict[str, Any]) -> dict[str, Any]:
    """``verifier: NAME`` is short for ``verifier: {name: NAME}``: expanded when a recipe is read (so flags and
    ``--set verifier.params.…`` find the mapping) and when it is built (``--set verifier=NAME``)."""
    if isinstance(data.get("verifier"), str):
        return {**data, "verifier": {"name": data["verifier"]}}
    return data


MAX_RECIPE_VALUES = 10_000
"""Most values a recipe (or one --set value) may hold once its YAML aliases are expanded: a recipe
is a few dozen settings, while nested aliases (the "billion laughs" pattern) expand exponentially and
would hang every later step that walks the recipe."""


def check_expanded_size(value: Any, source: str) -> None:
    """Refuse ``value`` if it holds more than MAX_RECIPE_VALUES values with its aliases expanded, or
    contains itself; counted with each shared node's size memoised, so the check itself stays fast."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def expanded(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise RecipeError(
                f"{source} contains itself through a YAML alias (*name inside &name); write the values out"
            )
        open_nodes.add(id(node))
        size = 1
        for child in node.values() if isinstance(node, dict) else node:
            size += expanded(child)
            if size > MAX_RECIPE_VALUES:
                raise RecipeError(
                    f"{source} expands to more than {MAX_RECIPE_VALUES} values through its YAML aliases "
                    "(&name/*name); write the settings out instead of nesting aliases"
                )
        open_nodes.discard(id(node))
        sizes[id(node)] = size
        return size

    try:
        expanded(value)
    except RecursionError:
        raise _too_deep(source) from None


def _too_deep(source: str) -> RecipeError:
    return RecipeError(f"{source} is nested too deeply to be a recipe setting; a recipe is a few levels of keys")


def parse_value(text: str, source: str) -> Any:
    """A value typed on the command line (``--set``, ``--sweep``), read as YAML; the text itself where it is not
    YAML. ``source`` names the flag in the refusal of a value too deep or too large to be a setting."""
    try:
        value = _parse_yaml(text)
    except yaml.YAMLError:
        value = text
    except RecursionError:
        raise _too_deep(source) from None
    check_expanded_size(value, source)
    return value


def apply_overrides(data: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` assignments (value parsed as YAML) to a copy of ``data``."""
    data = _deep_copy(data)
    if any(a.startswith("drafts.") for a in assignments) and "draft" in data and "drafts" not in data:
        data["drafts"] = [] if data["draft"] is None else [data.pop("draft")]  # 'draft:' is drafts.0
    for assignment in assignments:
        path, sep, raw_value = assignment.partition("=")
        if not sep or not path.strip():
            raise RecipeError(f"--set expects key.path=value, got '{assignment}' (e.g. --set generation.top_k=50)")
        value = parse_value(raw_value, f"--set {path.strip()}") if raw_value.strip() else None
        set_path(data, path.strip(), value)
    return data


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``data[a][b]... = value`` for ``path = "a.b..."``; list items by index (``drafts.0.temperature``)."""
    keys = path.split(".")
    node: Any = data
    for depth, key in enumerate(keys[:-1]):
        node = _child(node, key, ".".join(keys[: depth + 1]), create=True)
    last = keys[-1]
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and not _holds_mapping(keys[:-1]):
        node[_list_index(node, last, path)] = value
    else:
        raise _not_a_mapping(keys[:-1], node, path)


def _child(node: Any, key: str, path: str, create: bool) -> Any:
    keys = path.split(".")
    if isinstance(node, list) and not _holds_mapping(keys[:-1]):
        return node[_list_index(node, key, path)]
    if not isinstance(node, dict):
        raise _not_a_mapping(keys[:-1], node, path)
    if key not in node or node[key] is None:
        node[key] = {}
    return node[key]


def _not_a_mapping(keys: list[str], node: Any, path: str) -> RecipeError:
    """Setting ``path`` met ``node`` at ``keys``: a recipe section that is not the mapping it must be, or a path
    that goes past a setting."""
    parent = ".".join(keys)
    if _holds_mapping(keys):
        return RecipeError(
            f"{parent}: must be a mapping of keys (such as {path.split('.')[len(keys)]}: …), not "
            f"{_describe(node)}; fix '{parent}:' in the recipe"
        )
    return RecipeError(f"cannot set '{path}': '{parent}' is a {type(node).__name__}, not a mapping; set '{parent}=…'")


def _holds_mapping(keys: list[str]) -> bool:
    """Whether the recipe's value at ``keys`` must be a mapping: a section (a dataclass) or parameters (a dict)."""
    hint: Any = Recipe
    for key in keys:
        if key == "draft" and hint is Recipe:
            hint = DraftConfig
        elif typing.get_origin(hint) is tuple and key.isdigit():
            hint = typing.get_args(hint)[0]
        elif dataclasses.is_dataclass(hint) and key in field_names(hint):
            hint = _without_none(typing.get_type_hints(hint)[key])
        else:
            return False
    return dataclasses.is_dataclass(hint) or typing.get_origin(hint) is dict


def _without_none(hint: Any) -> Any:
    """``X`` of ``X | None``; any other hint as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _list_index(node: list, key: str, path: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise RecipeError(f"'{path}': use an index from 0 to {len(node) - 1} for this list")
    return int(key)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# --------------------------------------------------------------------------- building


def build_recipe(data: dict[str, Any]) -> Recipe:
    """Check a raw recipe mapping and turn it into a :class:`Recipe`."""
    data = _expand_shorthands(dict(data))
    if "draft" in data:
        if "drafts" in data:
            raise RecipeError("a recipe has either 'draft:' (one draft) or 'drafts:' (a list), not both")
        draft = data.pop("draft")
        data["drafts"] = [] if draft is None else [draft]
    if "target" not in data or data["target"] is None:
        raise RecipeError("the recipe has no 'target:' section; add e.g. target: {model: path/or/hub-id}")
    recipe = _build(Recipe, data, "")
    validate(recipe)
    return recipe


def load_recipe(recipe: str | Path | None = None, overrides: list[str] = ()) -> Recipe:
    """Read, override and validate a recipe: the library's one entry point for recipes."""
    return build_recipe(apply_overrides(read_recipe_file(recipe), list(overrides)))


def _build(cls: type, data: Any, path: str) -> Any:
    where = path or "recipe"
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping of keys, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    aliases = {"draft"} if cls is Recipe else set()
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields) + list(aliases), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise RecipeError(f"unknown key '{_join(path, key)}'{hint}")
    values = {name: _convert(hints[name], data[name], _join(path, name)) for name in fields if name in data}
    return cls(**values)


# Scalar field types: what the error calls them, and which YAML values they take (bool is
# an int in Python, so it is excluded from the numbers explicitly).
_SCALARS: dict[type, tuple[str, Any]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path)
    if dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list, got {_describe(value)}")
        return tuple(_convert(args[0], item, f"{path}.{i}") for i, item in enumerate(value))
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a mapping, got {_describe(value)}")
        return dict(value)
    if hint in _SCALARS:
        expected, accepts = _SCALARS[hint]
        if not accepts(value):
            raise RecipeError(f"{path}: expected {expected}, got {_describe(value)}")
        return hint(value)
    return value


def validate(recipe: Recipe) -> None:
    """Value checks of a built recipe (also for recipes a grid derives from one): a RecipeError if any fails."""
    problems = recipe.decoding_config().problems()
    for i, draft in enumerate(recipe.drafts):
        problems += sampling_problems(f"drafts.{i}", draft.temperature, draft.top_k, draft.top_p)
    models = [("target", recipe.target)] + [(f"drafts.{i}", d) for i, d in enumerate(recipe.drafts)]
    for owner, spec in models:
        problems += spec.problems(owner)
    checks: list[tuple[bool, str, str]] = []
    checks.append(
        (recipe.target.model is not None, "target.model", "is required (hub id, local directory or .gguf file)")
    )
    for i, draft in enumerate(recipe.drafts):
        if draft.early_exit is not None:
            checks.append((draft.early_exit >= 1, f"drafts.{i}.early_exit", "must be >= 1 (number of target layers)"))
            checks.append((draft.model is None, f"drafts.{i}", "give either 'model' or 'early_exit', not both"))
        # What else an entry needs depends on its drafter: DrafterRegistry.entry_problem, before any model loads.
    problems += [(path, message) for ok, path, message in checks if not ok]
    for path, message in problems:
        raise RecipeError(f"{path}: {message}")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return f"{type(value).__name__} {value!r}"
