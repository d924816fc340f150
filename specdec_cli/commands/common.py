"""What the commands share: their options resolved into a recipe, prompts read, comma lists parsed, and plots
drawn (progress and long waits: :mod:`.progress`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from ..base.errors import SpecdecError, UsageError
from ..base.inputs import PromptLines, has_suffix, json_object_lines, read_stdin, read_text, text_value
from ..base.recipe import (
    DecodingConfig,
    ModelConfig,
    Recipe,
    apply_overrides,
    build_recipe,
    read_recipe_file,
    set_path,
    target_alone,
)
from ..plugins.drafter_registry import DrafterRegistry
from ..plugins.registry import VerifierRegistry
from ..plugins.sweeps import ParameterSweep, parse_sweeps
from .options import ModelOptions


@dataclass
class GlobalFlags:
    """The flags given before the command (``specdec --verbose generate …``), as the CLI's callback read them for
    this invocation."""

    verbose: bool = False
    """Let the libraries' own output through, and say more of what specdec did (what the compile cache reused)."""


GLOBAL_FLAGS = GlobalFlags()


def with_compile(sets: list[str] | None, compile_steps: bool) -> list[str]:
    """The --set list, with what --compile means added when it is given."""
    return [*(sets or []), *(["speculation.compile=true"] if compile_steps else [])]


def apply_threads(threads: int | None, chooses: bool = False) -> None:
    """Set torch's CPU thread count before any model loads (checked first: a usage error is one line). With none
    given, a command that ``chooses`` its own count (generate) takes one thread at once on a busy CPU
    (:func:`~specdec_cli.generation.calibration.take_one_thread_when_busy`); the others keep torch's default.

    torch is imported only here and only when a count is given or chosen, so commands that load no model
    still start at once."""
    if threads is None:
        if chooses:
            from ..generation.calibration import take_one_thread_when_busy

            take_one_thread_when_busy()
        return
    check_at_least_one(threads, "--threads")
    import torch

    torch.set_num_threads(threads)


def check_batch_sizes(sizes: list[int]) -> None:
    """``--batch-size`` values, before any model loads: each at least 1."""
    for size in sizes:
        check_at_least_one(size, "--batch-size")


def check_at_least_one(value: int | None, option: str) -> None:
    """Counts the option parser leaves unchecked (its range note would clutter the help)."""
    if value is not None and value < 1:
        raise UsageError(f"{option} must be at least 1, got {value}")


FLAG_PATHS = {
    "num_drafts": "speculation.num_drafts",
    "draft_length": "speculation.draft_length",
    "draft_length_schedule": "speculation.draft_length_schedule",
    "exact_first": "speculation.exact_first",
    "max_new_tokens": "generation.max_new_tokens",
    "temperature": "generation.temperature",
    "top_k": "generation.top_k",
    "top_p": "generation.top_p",
    "chat": "generation.chat",
    "stop": "generation.stop",
    "seed": "seed",
}
"""The recipe setting each named flag sets (the flag is ``--`` and the name with dashes)."""

MODEL_FLAGS = ("device", "dtype")
"""Flags that set a setting of every model of the recipe."""


def flag_name(setting: str) -> str:
    """The flag of a setting's flat name: ``draft_length`` → ``--draft-length``."""
    return "--" + setting.replace("_", "-")


def check_flag_values(setting: str, values: list) -> None:
    """Values a flag gives to the recipe setting ``setting`` (a flat name of FLAG_PATHS or MODEL_FLAGS), checked
    by the recipe's own rules before any recipe is built: a bad one is refused in the flag's words
    (``--draft-length 0: must be >= 1``), since the user typed the flag, not the recipe's path."""
    for value in values:
        if setting in MODEL_FLAGS:
            problems = ModelConfig(**{setting: value}).problems("model")
        else:
            problems = DecodingConfig().replace(**{setting: (value,) if setting == "stop" else value}).problems()
        found = next((problem for path, problem in problems if path.split(".")[1] == setting), None)
        if found is not None:
            shown = f"'{value}'" if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else value
            raise UsageError(f"{flag_name(setting)} {shown}: {found}")


def check_kl_bounds(
    bounds: list[float],
    names: list[str],
    params: dict[str, Any],
    registry: VerifierRegistry,
    draft_length: int | None = None,
) -> None:
    """--kl's values for a run of the verifiers ``names`` (the recipe's verifier.params ``params``, its draft length
    ``draft_length`` where one run decodes with them), before any model loads: refused when no verifier of the run
    has a KL bound (they would be ignored), and each bound resolved on every verifier that has one
    (:meth:`~specdec_cli.plugins.registry.VerifierRegistry.resolve`, which the run's decoders then find built), so a
    bound a verifier refuses is named by the flag."""
    speculative = [registry.canonical(name) for name in names if not target_alone(name)]
    bounded = [name for name in speculative if registry.verifier_class(name).kl_bound_parameter is not None]
    if bounds and speculative and not bounded:
        raise registry.no_kl_bound(speculative)
    for name in bounded:
        for bound in bounds:
            registry.resolve(
                name, params, kl_bound=bound, draft_length=draft_length, taken_only=True, set_by=f"--kl {bound:g}"
            )


def run_sweeps(
    texts: list[str], names: list[str], params: dict[str, Any], registry: VerifierRegistry
) -> tuple[ParameterSweep, ...]:
    """``--sweep`` values for a run of the verifiers ``names`` the user asked for (the recipe's verifier.params
    ``params``), checked before any model loads: each swept verifier must be one of them, and each value one its
    constructor takes."""
    sweeps = parse_sweeps(texts, registry, params)
    running = {registry.canonical(name) for name in names if not target_alone(name)}
    for sweep in sweeps:
        if sweep.verifier not in running:
            raise UsageError(
                f"--sweep {sweep.verifier}.{sweep.parameter}: verifier '{sweep.verifier}' is not one this run has; "
                "add it to --verifier"
            )
    return sweeps


@dataclass(kw_only=True)
class RecipeOptions(ModelOptions):
    """The recipe file plus the command-line flags that override it: the options every command shares, and those
    a command sets from its own."""

    verifier: str | None = None
    drafter: str | None = None
    """Keep only the recipe's draft entries of this drafter (one with its defaults where there is none)."""
    kl: float | None = None
    num_drafts: int | None = None
    draft_length: int | None = None
    draft_length_schedule: str | None = None
    exact_first: int | None = None
    temperature: float | None = None
    stop: list[str] | None = None
    """Stop texts added to the recipe's."""
    draft_temperatures: list[float] | None = None
    """Replace the drafts by copies of the first draft config at these temperatures."""
    registry: VerifierRegistry = dataclasses.field(default_factory=VerifierRegistry)
    """The command's verifiers: each resolved once, for the checks and the decoders alike."""

    @classmethod
    def of(cls, model: ModelOptions, **more: Any) -> RecipeOptions:
        """The shared options of ``model`` with a command's own (``more``, which may set a shared one: ``sets``)."""
        return cls(**{field.name: getattr(model, field.name) for field in dataclasses.fields(model)} | more)

    def resolve(self) -> Recipe:
        """Check the flags, read the recipe, apply the named flags, then ``--set`` (most specific last), validate,
        and check that every model that names a file or folder names one a model loads from."""
        recipe = self._resolved()
        from ..models.loading import check_model_paths  # no torch: a bad path is refused at once

        check_model_paths(recipe)
        return recipe

    def _resolved(self) -> Recipe:
        for setting in [*FLAG_PATHS, *MODEL_FLAGS]:
            value = getattr(self, setting)
            if value is not None:
                check_flag_values(setting, value if setting == "stop" else [value])
        data = self._with_verifier(self._with_draft_temperatures(read_recipe_file(self.recipe)))
        data = apply_overrides(data, [])  # a copy: the flags' values are set as typed, never re-read as text
        for path, value in self._named(data).items():
            set_path(data, path, value)
        recipe = build_recipe(apply_overrides(data, list(self.sets or [])))
        if self.drafter is not None:
            recipe = dataclasses.replace(recipe, drafts=DrafterRegistry().entries_of(recipe.drafts, self.drafter))
        if self.kl is None or target_alone(recipe.verifier.name):
            return recipe
        # --kl sets whichever parameter the verifier declares as its KL bound.
        chosen = self.registry.resolve(
            recipe.verifier.name,
            recipe.verifier.params,
            kl_bound=self.kl,
            draft_length=recipe.speculation.draft_length,
            set_by=f"--kl {self.kl:g}",
        )
        return dataclasses.replace(recipe, verifier=chosen.config)

    def _with_draft_temperatures(self, data: dict[str, Any]) -> dict[str, Any]:
        if not self.draft_temperatures:
            return data
        first = data.pop("draft", None) or (data.get("drafts") or [None])[0]
        if not isinstance(first, dict):
            raise UsageError("--draft-temperatures needs a draft in the recipe to copy")
        return {**data, "drafts": [{**first, "temperature": t} for t in self.draft_temperatures]}

    def _with_verifier(self, data: dict[str, Any]) -> dict[str, Any]:
        current = data.get("verifier")
        name = current.get("name", "") if isinstance(current, dict) else ""
        if self.verifier is None or str(name).lower() == self.verifier.lower():
            return data
        # Parameters written for another verifier would not apply to this one.
        return {**data, "verifier": {"name": self.verifier, "params": {}}}

    def _named(self, data: dict[str, Any]) -> dict[str, Any]:
        """Recipe path → value of every named flag given; --stop adds to the recipe's stop texts."""
        named = {path: getattr(self, setting) for setting, path in FLAG_PATHS.items()}
        if self.stop:
            generation = data.get("generation")
            written = generation.get("stop") if isinstance(generation, dict) else None
            # A stop that is not a list is left for the recipe's check to name.
            named["generation.stop"] = (
                [*(written or []), *self.stop] if isinstance(written, (list, type(None))) else None
            )
        for setting in MODEL_FLAGS:
            value = getattr(self, setting)
            if value is not None:
                named.update({f"{model}.{setting}": value for model in _model_paths(data)})
        return {path: value for path, value in named.items() if value is not None}


def _model_paths(data: dict[str, Any]) -> list[str]:
    paths = ["target"]
    if isinstance(data.get("draft"), dict):
        paths.append("draft")
    if isinstance(data.get("drafts"), list):
        paths += [f"drafts.{i}" for i in range(len(data["drafts"]))]
    return paths


PROMPT_FIELDS = ("prompt", "text", "instruction", "question", "turns")


def read_prompts(prompt: str | None, prompt_file: Path | None, stdin: Any, field: str | None = None) -> list[str]:
    """Prompts from the argument, a file or piped stdin.

    A text file holds one prompt per non-empty line ('-' = stdin); a ``.jsonl`` file (any case) one
    JSON object per line, its prompt in ``field`` or the first of PROMPT_FIELDS it has (a list, as
    Spec-Bench's ``turns``, gives its first item).
    """
    if prompt is not None and prompt_file is not None:
        raise UsageError("give a prompt argument or --prompt-file, not both")
    _check_field_applies(field, prompt_file)
    if prompt is not None:
        return [prompt]
    if prompt_file is not None:
        return _file_prompts(prompt_file, stdin, field)
    if stdin is not None and not stdin.isatty():
        return [read_stdin(stdin)]
    raise UsageError('give a prompt: specdec generate "Your prompt", --prompt-file FILE, or pipe text to stdin')


def _file_prompts(prompt_file: Path, stdin: Any, field: str | None) -> list[str]:
    if has_suffix(prompt_file, ".json"):  # read line by line, a JSON array's lines would become prompts
        raise UsageError(
            f"--prompt-file '{prompt_file}' is a .json file; give JSON lines (.jsonl: one object per "
            "line) or plain text (one prompt per line)"
        )
    text = read_text(prompt_file, "--prompt-file", stdin)
    if has_suffix(prompt_file, ".jsonl"):
        prompts = _jsonl_prompts(text, prompt_file, field)
    else:
        lines = PromptLines.of(text)
        prompts = lines.prompts
        if (note := lines.note(f"--prompt-file '{prompt_file}'")) is not None:
            Console(stderr=True).print(f"note: {note}", highlight=False, soft_wrap=True)
    if not prompts:
        raise UsageError(f"--prompt-file '{prompt_file}' has no prompts (one prompt per non-empty line)")
    return prompts


def _check_field_applies(field: str | None, prompt_file: Path | None) -> None:
    """--field with prompts that are not JSON would be ignored without a word."""
    if field is not None and not (prompt_file is not None and has_suffix(prompt_file, ".jsonl")):
        raise UsageError("--field names the prompt field of a .jsonl --prompt-file; drop it, or give a .jsonl file")


def _jsonl_prompts(text: str, path: Path, field: str | None) -> list[str]:
    prompts = []
    for number, record in json_object_lines(text, path, field or PROMPT_FIELDS[0]):
        names = [field] if field else [name for name in PROMPT_FIELDS if name in record]
        if not names or names[0] not in record:
            wanted = f"'{field}'" if field else "one of " + ", ".join(PROMPT_FIELDS)
            raise UsageError(f"{path} line {number} has no {wanted} field; name the prompt field with --field")
        prompts.append(text_value(record[names[0]], f"{path} line {number}", names[0]))
    return prompts


def parse_list(text: str | None, kind: type, option: str) -> list:
    """'1,2,4' → [1, 2, 4]: a comma list for sweep options."""
    if text is None:
        return []
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{option} expects a comma list of {kind.__name__} values, got '{text}'") from None


def grid_values(text: str | None, kind: type, option: str) -> list:
    """A comma-list flag's values ([] when it is absent). A list with none is refused, and so is a value
    given twice: it would run (and show) the same cell, or the same seed's samples, twice."""
    if text is None:
        return []
    values = parse_list(text, kind, option)
    if not values:
        raise UsageError(f"{option} expects a comma list of {kind.__name__} values, got '{text}'")
    refuse_repeats([str(v).strip().lower() if kind is str else v for v in values], option)
    return values


def refuse_repeats(values: list, option: str) -> None:
    repeated = [value for index, value in enumerate(values) if value in values[:index]]
    if repeated:
        shown = ", ".join(dict.fromkeys(map(str, repeated)))
        raise UsageError(f"{option} lists {shown} more than once; give each value once")


def stdout_to_nowhere() -> None:
    """Point stdout at the null device once its reader has gone: the interpreter flushes stdout once more at exit,
    and that write would fail again where nothing catches it."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def check_hub_models(recipe: Recipe) -> None:
    """The recipe's hub ids can load, for the draft entries whose drafter loads a model: an entry that names a
    model its drafter does not take gets the drafter's own line later, not the Hub's."""
    from ..models.loading import check_hub_models as check  # no torch

    registry = DrafterRegistry()
    drafts = [
        entry
        for entry in recipe.drafts
        if entry.drafter is None
        or entry.drafter not in registry.names()
        or registry.plugin_class(entry.drafter).uses_model
    ]
    check(recipe, drafts)


def write_plot(draw: Callable[[], None], path: Path) -> None:
    """Draw a plot after the results are out; a failure is one line and exit 1, never a lost table."""
    try:
        draw()
    except (OSError, ValueError) as error:
        raise SpecdecError(f"could not write the plot '{path}': {error}; the results above are complete") from None
