"""`specdec generate`: speculative generation, streamed as blocks are committed."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional, TypeVar

import typer
from rich.console import Console

from ..base.errors import UsageError
from ..base.inputs import require_text
from ..base.recipe import AUTOREGRESSIVE, Recipe, target_alone
from ..plugins.registry import VerifierRegistry
from ..results.stats import GenerationResult
from . import common, options
from .generate_output import Stream, comparison_table, json_header, print_notes, print_round, stats_table, write_json
from .progress import token_progress

if TYPE_CHECKING:  # torch and transformers load only when a command runs models
    from ..engine.decoder import SpeculativeDecoder

LOADING = "Loading models (the first run converts the GGUF weights once)…"
INTERRUPTED_EXIT = 130  # as the shell reports a run stopped by Ctrl-C
BROKEN_PIPE_EXIT = 141  # as the shell reports `yes` in `yes | head`: 128 + SIGPIPE
T = TypeVar("T")
_speculation = options.DEFAULT_RECIPE.speculation


_PromptArgument = Annotated[
    Optional[str],
    typer.Argument(
        metavar="PROMPT",
        show_default=False,
        help="Text to continue (piped stdin is then not read). Leave out to read --prompt-file or piped stdin.",
    ),
]
_VerifierOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="NAME[,NAME…]",
        help="Verifier, or a comma list to compare on the same prompts: speculative,block,none (none: the target "
        "alone). " + options.from_recipe(options.DEFAULT_RECIPE.verifier.name),
    ),
]
_DrafterOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="NAME",
        help="Draft with this drafter (see `specdec drafters`): the recipe's entries for it, or one with its defaults "
        "(prompt-lookup needs no model). Default: the recipe's drafts.",
    ),
]
# Where each of these flags takes a comma list (a sweep); generate takes one value of each.
_BENCH_OR_ACCEPTANCE, _BENCH = "specdec bench or specdec acceptance", "specdec bench"
_KlOption = options.one_value(
    Annotated[
        Optional[float],
        typer.Option(
            "--kl", metavar="NATS", help="KL bound D in nats, for a verifier that has one (see `specdec verifiers`)."
        ),
    ],
    "--kl",
    _BENCH_OR_ACCEPTANCE,
)
_NumDraftsOption = options.one_value(
    Annotated[
        Optional[int],
        typer.Option(
            metavar="K",
            help="Draft sequences sampled from each draft per block. " + options.from_recipe(_speculation.num_drafts),
        ),
    ],
    "--num-drafts",
    _BENCH_OR_ACCEPTANCE,
)
_DraftLengthOption = options.one_value(
    Annotated[
        Optional[int],
        typer.Option(
            metavar="L",
            help=f"Tokens each draft proposes per block. {options.from_recipe(_speculation.draft_length)}",
        ),
    ],
    "--draft-length",
    _BENCH,
)
_TemperatureOption = options.one_value(options.TemperatureOption, "--temperature", _BENCH)
_DraftLengthScheduleOption = options.one_value(options.DraftLengthScheduleOption, "--draft-length-schedule", _BENCH)
_ExactFirstOption = options.one_value(options.ExactFirstOption, "--exact-first", _BENCH)
_NumSamplesOption = Annotated[
    int, typer.Option(metavar="N", help="Independent samples per prompt, each with its own seed.")
]
_BatchSizeOption = Annotated[
    int,
    typer.Option(
        metavar="B",
        help="Decode B samples at a time in one batch (each drafts, is verified and commits on its own; finished "
        "samples leave and waiting ones join). A sample's tokens do not depend on B, up to float rounding.",
    ),
]
_AutoregressiveOption = Annotated[
    bool,
    typer.Option(
        "--autoregressive",
        metavar="",
        help="Decode with the target alone (the baseline); the same as --verifier none.",
    ),
]
_RecalibrateOption = Annotated[
    bool,
    typer.Option(
        "--recalibrate",
        metavar="",
        help="Measure the draft's cost on this machine again instead of using the cached figure (say, after it was "
        "measured while the machine was busy).",
    ),
]
_JsonOption = Annotated[
    bool,
    typer.Option(
        "--json",
        metavar="",
        help="Print one JSON object: the resolved recipe, the environment and every sample's text, token ids and "
        'statistics. Stopped by Ctrl-C: the finished samples, with "interrupted": true; after an error: nothing.',
    ),
]


@options.takes_option_groups
def generate(
    model: options.ModelOptions,
    prompt: _PromptArgument = None,
    prompt_file: options.PromptFileOption = None,
    field: options.FieldOption = None,
    verifier: _VerifierOption = None,
    drafter: _DrafterOption = None,
    kl: _KlOption = None,
    num_drafts: _NumDraftsOption = None,
    draft_length: _DraftLengthOption = None,
    draft_length_schedule: _DraftLengthScheduleOption = None,
    exact_first: _ExactFirstOption = None,
    temperature: _TemperatureOption = None,
    stop: options.StopOption = None,
    compile_steps: options.CompileOption = False,
    num_samples: _NumSamplesOption = 1,
    batch_size: _BatchSizeOption = 1,
    autoregressive: _AutoregressiveOption = False,
    recalibrate: _RecalibrateOption = False,
    as_json: _JsonOption = False,
) -> None:
    """Generate text with speculative decoding; accepted draft tokens are shown in green on a terminal.

    A comma list of verifiers (--verifier speculative,block,none) compares them on the same prompts
    and seeds, with the models loaded once, and prints one table (none = the target alone).
    Ctrl-C or SIGTERM prints what finished (exit code 130).
    """
    common.check_at_least_one(num_samples, "--num-samples")
    names = _verifier_names(verifier, autoregressive)
    comparing = len(names) > 1
    if comparing and batch_size > 1:
        raise UsageError(_COMPARED_AT_BATCH_ONE)
    flags = common.RecipeOptions.of(
        model,
        sets=common.with_compile(model.sets, compile_steps),
        verifier=None if comparing else (names or [None])[0],
        drafter=drafter,
        kl=None if comparing else kl,
        num_drafts=num_drafts,
        draft_length=draft_length,
        draft_length_schedule=draft_length_schedule,
        exact_first=exact_first,
        temperature=temperature,
        stop=stop,
    )
    resolved = flags.resolve()
    common.check_batch_sizes([batch_size])
    drafting = {common.flag_name(setting): getattr(flags, setting) for setting in _DRAFTING_SETTINGS}
    _check_drafting_flags(resolved, names if comparing else None, kl, drafting, flags.registry)
    prompts = _prompts(prompt, prompt_file, field)
    common.check_hub_models(resolved)
    common.apply_threads(model.threads, chooses=True)
    choose_threads = model.threads is None  # the calibration then keeps the faster of the default and one thread
    with _quiet_when_the_reader_leaves():
        if comparing:
            _compare(resolved, names, kl, prompts, num_samples, as_json, recalibrate, choose_threads, flags.registry)
        else:
            _generate(resolved, prompts, num_samples, as_json, recalibrate, choose_threads, batch_size, flags.registry)


_DRAFTING_SETTINGS = ("num_drafts", "draft_length", "draft_length_schedule", "exact_first")
"""The settings whose flags shape drafting: refused with the target alone, which would ignore them."""
_COMPARED_AT_BATCH_ONE = (
    "--batch-size decodes one configuration at a time; compare verifiers at --batch-size 1, or run each verifier on "
    "its own with --batch-size"
)


def _prompts(prompt: str | None, prompt_file: Path | None, field: str | None) -> list[str]:
    """The prompts from the argument, the file or stdin, each checked before the models load (which takes a while)."""
    prompts = common.read_prompts(prompt, prompt_file, sys.stdin, field)
    for text in prompts:
        require_text(text)
    return prompts


def _check_drafting_flags(
    recipe: Recipe, compared: list[str] | None, kl: float | None, drafting: dict, registry: VerifierRegistry
) -> None:
    """Flags that shape drafts or the KL bound, refused where nothing takes them: with the target alone, or a
    --kl that none of the ``compared`` verifiers (None: the recipe's one, checked as it was resolved) takes."""
    if compared is None and target_alone(recipe.verifier.name):
        _check_nothing_to_draft(kl, drafting)
    elif compared is not None:
        length = recipe.speculation.draft_length
        common.check_kl_bounds([] if kl is None else [kl], compared, recipe.verifier.params, registry, length)


def _verifier_names(verifier: str | None, autoregressive: bool) -> list[str]:
    """The verifiers --verifier lists; --autoregressive is --verifier none, and agrees with no other verifier."""
    names = common.parse_list(verifier, str, "--verifier")
    if verifier is not None and not names:
        raise UsageError(
            f"--verifier lists no verifier ('{verifier}'); name one, or a comma list to compare: "
            "--verifier speculative,none"
        )
    if autoregressive and not all(map(target_alone, names)):
        raise UsageError(
            f"--autoregressive runs the target alone; it cannot be combined with --verifier {verifier}: drop one"
        )
    return [AUTOREGRESSIVE] if autoregressive else names


def _check_nothing_to_draft(kl: float | None, drafting: dict[str, object]) -> None:
    """The target alone drafts nothing: a drafting flag given with it (``drafting``: flag → value, None where
    absent) would be silently ignored."""
    if kl is not None:
        raise UsageError(
            "--kl sets a KL bound, which the target alone does not have (--verifier none, "
            "--autoregressive); drop --kl, or name a verifier with one (see `specdec verifiers`)"
        )
    for option, value in drafting.items():
        if value is not None:
            raise UsageError(
                f"{option} has no effect on the target alone (--verifier none, --autoregressive); drop "
                "it, or compare the two: --verifier speculative,none"
            )


@contextmanager
def _quiet_when_the_reader_leaves() -> Iterator[None]:
    """`specdec generate … | head`: a reader that closes the pipe ends the run as it ends `yes | head`,
    quietly and with the shell's exit code for it, instead of a traceback."""
    try:
        try:
            yield
        finally:  # a pipe buffers: its last write fails here (on every way out), not at exit where nothing catches it
            sys.stdout.flush()
    except BrokenPipeError:
        common.stdout_to_nowhere()
        raise typer.Exit(BROKEN_PIPE_EXIT) from None


def _generate(
    recipe: Recipe,
    prompts: list[str],
    num_samples: int,
    as_json: bool,
    recalibrate: bool,
    choose_threads: bool,
    batch_size: int,
    registry: VerifierRegistry,
) -> None:
    """One configuration: the text streams as blocks are committed (as samples finish, in a batch), then a table
    of its statistics. ``registry``: the command's, which resolved the verifier as it checked the flags."""
    from ..engine.decoder import SpeculativeDecoder

    err = Console(stderr=True)
    with err.status(LOADING):
        decoder = SpeculativeDecoder.from_recipe(recipe, registry=registry)
    if batch_size > 1:
        decoder.check_batching()
    first = decoder.encode_prompt(prompts[0])
    decoder.warm_up(first)
    _calibrate(err, decoder, first, recalibrate, choose_threads)
    out = Console(highlight=False)
    several = len(prompts) * num_samples > 1
    stream = None if as_json else Stream(decoder.target.tokenizer, out, several, recipe.generation.stop)
    began = time.perf_counter()
    # A terminal that shows the text needs no bar; a pipe or --json would otherwise be silent.
    results, interrupted = _samples(decoder, (prompts, num_samples, batch_size), stream, as_json or not out.is_terminal)
    throughput = _throughput(results, time.perf_counter() - began, batch_size)
    if stream is not None:
        stream.finish()
    if interrupted:
        err.print(
            f"interrupted after {len(results)} of {len(prompts) * num_samples} samples; the statistics cover "
            f"those {len(results)}",
            highlight=False,
        )
    if as_json:
        samples = {"autoregressive": decoder.verifier is None, "throughput": throughput}
        write_json(json_header(recipe, decoder, interrupted) | samples | {"samples": [r.to_dict() for r in results]})
    elif results:
        err.print(stats_table(decoder, results, colour_caption=out.is_terminal))
        err.print(
            f"batch size {batch_size}: {throughput['new_tokens']} tokens in {throughput['wall_time_s']:.2f} s, "
            f"{throughput['tokens_per_s']:.1f} tokens/s over all samples",
            highlight=False,
        )
    if interrupted:
        raise typer.Exit(INTERRUPTED_EXIT)


def _samples(
    decoder: SpeculativeDecoder, work: tuple[list[str], int, int], stream: Stream | None, show_bar: bool
) -> tuple[list[GenerationResult], bool]:
    """Every sample of ``work`` (prompts, samples per prompt, batch size) in prompt order, shown as it comes (a
    sample's blocks as they commit; a batch's samples, which interleave, each whole); True when stopped."""
    prompts, num_samples, batch_size = work
    budget = decoder.config.generation.max_new_tokens
    results: list[GenerationResult] = []
    with token_progress(len(prompts) * num_samples * budget, enabled=show_bar) as progress:

        def on_block(prompt_index: int, sample_index: int, new_tokens: list[int], accepted: list[bool]) -> None:
            progress.advance(len(new_tokens))
            if stream is not None and batch_size == 1:
                stream.on_block(prompt_index, sample_index, new_tokens, accepted)

        def finished(result: GenerationResult) -> None:
            results.append(result)
            progress.advance(budget - len(result.token_ids))  # the budget an early end of text left unused
            if stream is not None and batch_size > 1:
                stream.on_block(result.prompt_index, result.sample_index, result.token_ids, result.accepted_mask)

        interrupted = _until_interrupted(decoder.samples(prompts, num_samples, on_block, batch_size), finished)
    return sorted(results, key=lambda result: (result.prompt_index, result.sample_index)), interrupted


def _throughput(results: list[GenerationResult], wall_time_s: float, batch_size: int) -> dict:
    """The run's tokens per second over all samples (in a batch, what a sample's own rate does not show)."""
    tokens = sum(len(result.token_ids) for result in results)
    return {
        "batch_size": batch_size,
        "new_tokens": tokens,
        "wall_time_s": wall_time_s,
        "tokens_per_s": tokens / wall_time_s if wall_time_s > 0 else 0.0,
    }


def _compare(
    recipe: Recipe,
    names: list[str],
    kl: float | None,
    prompts: list[str],
    num_samples: int,
    as_json: bool,
    recalibrate: bool,
    choose_threads: bool,
    registry: VerifierRegistry,
) -> None:
    """Every verifier of ``names`` on the same prompts and seeds, models loaded once: each round's texts
    as it finishes, then one table over the rounds every verifier finished (``registry``: the command's, which
    resolved each as it checked --kl)."""
    from ..engine.decoder import SpeculativeDecoder
    from ..generation.comparison import Comparison, comparison_recipes

    recipes = comparison_recipes(recipe, names, kl, registry)
    err = Console(stderr=True)
    first = next((r for r in recipes.values() if not target_alone(r.verifier.name)), next(iter(recipes.values())))
    with err.status(LOADING):
        base = SpeculativeDecoder.from_recipe(first, registry=registry)
    comparison = Comparison(
        {
            label: base.with_config(verifier=r.verifier.name, verifier_params=r.verifier.params)
            for label, r in recipes.items()
        }
    )
    _calibrate(err, base, base.encode_prompt(prompts[0]), recalibrate, choose_threads)
    for note in dict.fromkeys(row.decoder.exact_first_note for row in comparison.rows):  # base's is printed
        if note not in (None, base.exact_first_note):
            err.print(f"note: {note}", highlight=False, soft_wrap=True)
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    total = len(recipes) * len(prompts) * num_samples * recipe.generation.max_new_tokens
    with token_progress(total) as progress:
        show = (lambda results: None) if as_json else functools.partial(print_round, out, comparison.rows)
        interrupted = _until_interrupted(comparison.run(prompts, num_samples, on_tokens=progress.advance), show)
    if interrupted:
        err.print(
            f"interrupted after {comparison.rounds} of {len(prompts) * num_samples} samples per configuration; "
            f"the configurations are compared on those {comparison.rounds}",
            highlight=False,
        )
    if as_json:
        write_json(
            json_header(recipe, base, interrupted)
            | {
                "configurations": [
                    row.summary() | {"samples": [r.to_dict() for r in row.results]} for row in comparison.rows
                ]
            }
        )
    elif comparison.rounds:
        out.print(comparison_table(comparison.rows, comparison.rounds))
    if interrupted:
        raise typer.Exit(INTERRUPTED_EXIT)


def _until_interrupted(results: Iterator[T], each: Callable[[T], None]) -> bool:
    """Hand every result to ``each`` as it comes; True when Ctrl-C or SIGTERM stopped the run (the
    results ``each`` was given are kept: they are what the command prints)."""
    try:
        for result in results:
            each(result)
    except KeyboardInterrupt:
        return True
    return False


def _calibrate(
    err: Console, decoder: SpeculativeDecoder, prompt_ids: list[int], recalibrate: bool, choose_threads: bool
) -> None:
    """Before decoding: measure whether the draft pays on this machine, run at the thread count that measurement
    chose when the user gave none, and print the notes."""
    from ..generation.calibration import calibrate

    calibration = calibrate(decoder, prompt_ids, recalibrate, choose_threads)
    if calibration.threads is not None:
        common.apply_threads(calibration.threads)
    print_notes(err, decoder, calibration.note)
