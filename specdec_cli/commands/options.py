"""The command line's options, each declared once, and the groups of them a command takes as one object.

A command names a group (``model: ModelOptions``) as one parameter; :func:`takes_option_groups` spreads the
group's fields into the options typer parses and gathers them back into the group for the command, so each
command's function says what it does rather than listing the thirty options it shares with the others."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Optional

import typer

from ..base.errors import UsageError
from ..base.recipe import build_recipe, read_recipe_file

DEFAULT_RECIPE = build_recipe(read_recipe_file(None))
"""The shipped default recipe: where an option left out takes its value from (unless --recipe names another)."""
_generation, _speculation = DEFAULT_RECIPE.generation, DEFAULT_RECIPE.speculation
MODEL_PANEL = "Recipe, sampling and devices"


def default_note(text: str) -> str:
    """The dimmed ``[default: text]`` that ends an option's help where typer cannot show the default itself."""
    return f"[dim]\\[default: {text}][/dim]"


def from_recipe(value: object) -> str:
    """Help text for an option whose default is the recipe's: the default recipe's value."""
    return default_note(f"the recipe's; {value} in the default recipe")


RecipeOption = Annotated[
    Optional[str],
    typer.Option(
        "--recipe",
        "-r",
        metavar="FILE|NAME",
        help=f"Recipe YAML file, or the name of a shipped recipe. {default_note('default')}",
    ),
]
SetOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Override any recipe key, e.g. --set generation.top_k=50 (value read as YAML). Repeatable.",
    ),
]
SweepOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--sweep",
        metavar="VERIFIER.PARAM=V[,V…]",
        help="Sweep a verifier parameter: one row (or cell) per value, e.g. --sweep ensemble.weight=0.2,0.5,0.8 "
        "(values read as YAML). Repeatable; sweeps of one verifier combine.",
    ),
]
MaxNewTokensOption = Annotated[
    Optional[int],
    typer.Option(
        metavar="TOKENS", help=f"Most tokens to generate per sample. {from_recipe(_generation.max_new_tokens)}"
    ),
]
TemperatureOption = Annotated[
    Optional[float],
    typer.Option(metavar="T", help=f"Sampling temperature (0 = greedy). {from_recipe(_generation.temperature)}"),
]
TopKOption = Annotated[
    Optional[int],
    typer.Option(
        metavar="TOKENS", help=f"Sample among the k most likely tokens (0 = all). {from_recipe(_generation.top_k)}"
    ),
]
TopPOption = Annotated[
    Optional[float],
    typer.Option(
        metavar="MASS",
        help="Sample among the most likely tokens holding this probability mass, in (0, 1] (1 = all). "
        + from_recipe(_generation.top_p),
    ),
]
SeedOption = Annotated[
    Optional[int],
    typer.Option(
        metavar="N",
        help="Sampling seed: the same seed on the same device gives the same output. "
        + from_recipe(DEFAULT_RECIPE.seed),
    ),
]
DeviceOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="DEVICE",
        help="auto, cpu, cuda or cuda:N, for every model. " + default_note("the recipe's; auto: CUDA when present"),
    ),
]
DtypeOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="DTYPE", help="auto, float32, bfloat16 or float16, for every model. " + default_note("the recipe's")
    ),
]
ChatOption = Annotated[
    Optional[bool],
    typer.Option(
        "--chat/--no-chat",
        metavar="",
        help=f"Apply the target's chat template to each prompt. {from_recipe(_generation.chat)}",
    ),
]
ThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        metavar="N",
        help="CPU threads for torch (recorded with the results). On a busy or shared CPU one thread is often faster "
        "and steadier than all of them. " + default_note("torch's, usually one per core"),
    ),
]
CompileOption = Annotated[
    bool,
    typer.Option(
        "--compile",
        metavar="",
        rich_help_panel=MODEL_PANEL,
        help="Run the verify step and the sampling laws through torch.compile (CUDA graphs on a GPU); the same as "
        "--set speculation.compile=true. The first blocks pay the compilation.",
    ),
]
PromptFileOption = Annotated[
    Optional[Path],
    typer.Option(
        metavar="FILE", help="One prompt per non-empty line, or .jsonl (Spec-Bench's format too); '-' reads stdin."
    ),
]
FieldOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="NAME",
        help="Prompt field of a .jsonl prompt file. "
        + default_note("the first of prompt, text, instruction, question, turns"),
    ),
]
LimitOption = Annotated[Optional[int], typer.Option(metavar="N", help="Use only the first N inputs (after --shuffle).")]
ShuffleOption = Annotated[
    bool, typer.Option("--shuffle", metavar="", help="Shuffle the inputs (--shuffle-seed) before --limit.")
]
ShuffleSeedOption = Annotated[int, typer.Option(metavar="N", help="Seed of --shuffle (the data order, not sampling).")]
StopOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--stop",
        metavar="TEXT",
        rich_help_panel=MODEL_PANEL,
        help="End a sample at the first occurrence of TEXT in its text (the text before it is kept); added to the "
        "recipe's generation.stop. Repeatable.",
    ),
]
DraftLengthScheduleOption = Annotated[
    Optional[str],
    typer.Option(
        "--draft-length-schedule",
        metavar="NAME",
        help="How the draft length moves between blocks: constant, or heuristic (+2 after a wholly accepted draft, "
        f"-1 otherwise, starting at --draft-length). {from_recipe(_speculation.draft_length_schedule)}",
    ),
]
ExactFirstOption = Annotated[
    Optional[int],
    typer.Option(
        "--exact-first",
        metavar="N",
        help="Verify the first N generated tokens of every sample with a lossless rule (speculation.exact_verifier) "
        f"and the rest with the verifier (0 = off). {from_recipe(_speculation.exact_first)}",
    ),
]
OutputOption = Annotated[
    Optional[Path],
    typer.Option(
        "--output", metavar="FOLDER", help="Results folder: written as it goes; run the same command again to resume."
    ),
]


@dataclass(kw_only=True)
class ModelOptions:
    """What every command that runs models takes: the recipe, the flags that override its generation settings
    and devices, and torch's CPU threads."""

    help_panel: ClassVar[str] = MODEL_PANEL
    recipe: RecipeOption = None
    sets: SetOption = None
    max_new_tokens: MaxNewTokensOption = None
    top_k: TopKOption = None
    top_p: TopPOption = None
    seed: SeedOption = None
    device: DeviceOption = None
    dtype: DtypeOption = None
    chat: ChatOption = None
    threads: ThreadsOption = None


def one_value(option: object, flag: str, sweeps: str) -> object:
    """``option`` (an ``Annotated`` typer option) where the command takes one value: a comma list is refused in one
    line that says which commands (``sweeps``) take it as a sweep, not parsed as a malformed number."""
    kind, declaration = typing.get_args(option)
    convert = next(arg for arg in typing.get_args(kind) if arg is not type(None))

    def parse(text: str) -> object:
        if "," in text:
            raise UsageError(f"{flag} takes one value on generate; to sweep {text} use {sweeps}")
        return convert(text)

    taking_one = copy.copy(declaration)
    taking_one.parser = parse
    return Annotated[kind, taking_one]


def takes_option_groups(command: Callable) -> Callable:
    """Let ``command`` take option groups: each parameter annotated with a dataclass stands in the signature typer
    reads as that dataclass's fields (typer options, shown under the group's ``help_panel``), and reaches the
    command as one instance of it."""
    hints = typing.get_type_hints(command, include_extras=True)
    groups = {name: hint for name, hint in hints.items() if dataclasses.is_dataclass(hint)}
    spread: list[inspect.Parameter] = []
    for parameter in inspect.signature(command).parameters.values():
        group = groups.get(parameter.name)
        if group is None:
            spread.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[parameter.name]))
        else:
            spread += _group_parameters(group)

    @functools.wraps(command)
    def run(**values: object) -> object:
        for name, group in groups.items():
            values[name] = group(**{field.name: values.pop(field.name) for field in dataclasses.fields(group)})
        return command(**values)

    run.__signature__ = inspect.Signature(spread)  # type: ignore[attr-defined]
    run.__annotations__ = {parameter.name: parameter.annotation for parameter in spread}
    return run


def _group_parameters(group: type) -> list[inspect.Parameter]:
    """A group's fields as typer parameters, each option placed under the group's help panel."""
    hints = typing.get_type_hints(group, include_extras=True)
    parameters = []
    for field in dataclasses.fields(group):
        kind, *declarations = typing.get_args(hints[field.name])
        placed = [_in_panel(declaration, group.help_panel) for declaration in declarations]
        annotation = Annotated[(kind, *placed)]
        parameters.append(
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=annotation)
        )
    return parameters


def _in_panel(declaration: object, panel: str) -> object:
    """A copy of a typer option declaration, shown under ``panel`` in the help (a declaration may be shared)."""
    placed = copy.copy(declaration)
    placed.rich_help_panel = panel
    return placed
