"""`specdec bench`: speed and quality over a grid of configurations, resumable, data-parallel."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from ..base.errors import SpecdecError, UsageError
from ..base.inputs import check_plot_path, write_atomically
from ..base.recipe import Recipe
from ..bench import report
from ..bench.grid import Grid
from ..bench.results import BenchResults, summarize
from ..bench.tasks import DataSource, Task, fingerprint, get_task, load_examples, parse_lang_pair, turns_note
from ..plugins.registry import VerifierRegistry
from ..results.store import ResultsStore, load_saved
from . import common

if TYPE_CHECKING:
    from ..bench.runner import BenchRunner

_ReportOption = Annotated[
    Optional[Path],
    typer.Option(
        "--report", metavar="FOLDER", help=("Show the results of a results folder again, without running models.")
    ),
]
_PlotOption = Annotated[
    Optional[Path], typer.Option(metavar="FILE.png", help=("Draw speedup (or token rate) against quality to this PNG."))
]
_AllowMixedOption = Annotated[
    bool,
    typer.Option(
        "--allow-mixed-conditions",
        metavar="",
        help=(
            "Resume an --output folder whose samples ran with other threads, device or versions "
            "(the results flag the mix)."
        ),
    ),
]


def bench(
    task: Annotated[str, typer.Option(metavar="TASK", help="wmt, xsum, dolly or spec-bench.")] = "wmt",
    lang_pair: Annotated[str, typer.Option(metavar="SRC-TGT", help="WMT language pair.")] = "en-fr",
    source: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Plain-text inputs, one per line.")] = None,
    reference: Annotated[
        Optional[Path], typer.Option(metavar="FILE", help="Plain-text references aligned with --source.")
    ] = None,
    dataset: Annotated[
        Optional[Path], typer.Option(metavar="FILE", help="A .jsonl file of examples (Spec-Bench's format too).")
    ] = None,
    source_field: Annotated[
        Optional[str], typer.Option(metavar="NAME", help="Input field of --dataset records.")
    ] = None,
    reference_field: Annotated[
        Optional[str], typer.Option(metavar="NAME", help="Reference field of --dataset records.")
    ] = None,
    template: Annotated[
        Optional[str],
        typer.Option(
            metavar="TEXT",
            help=("Prompt template with {source}. [dim]\\[default: the task's, for the target's kind][/dim]"),
        ),
    ] = None,
    limit: Annotated[
        Optional[int], typer.Option(metavar="N", help="Use only the first N examples (after --shuffle).")
    ] = None,
    shuffle: Annotated[
        bool, typer.Option("--shuffle", metavar="", help="Shuffle the examples (--shuffle-seed) before --limit.")
    ] = False,
    shuffle_seed: Annotated[
        int, typer.Option(metavar="N", help="Seed of --shuffle (the data order, not sampling).")
    ] = 0,
    seed: common.SeedOption = None,
    seeds: Annotated[
        Optional[str],
        typer.Option(
            metavar="N[,N…]",
            help=(
                "Comma list of sampling seeds: every cell runs with each (mean ± std over seeds). "
                "[dim]\\[default: --seed][/dim]"
            ),
        ),
    ] = None,
    recipe: common.RecipeOption = None,
    verifiers: Annotated[
        Optional[str],
        typer.Option(
            "--verifier",
            metavar="NAME[,NAME…]",
            help=(f"Comma list of verifiers (grid). {common.from_recipe(common.DEFAULT_RECIPE.verifier.name)}"),
        ),
    ] = None,
    drafters: Annotated[
        Optional[str],
        typer.Option(
            "--drafter",
            metavar="NAME[,NAME…]",
            help=(
                "Comma list of drafters (grid; see `specdec drafters`): each cell drafts with the recipe's entries "
                "of it, or "
                "one with its defaults. [dim]\\[default: the recipe's drafts][/dim]"
            ),
        ),
    ] = None,
    kl: Annotated[
        Optional[str],
        typer.Option(
            "--kl", metavar="NATS[,NATS…]", help=("Comma list of KL bounds D in nats, for verifiers with one (grid).")
        ),
    ] = None,
    num_drafts: Annotated[
        Optional[str],
        typer.Option(
            "--num-drafts",
            metavar="K[,K…]",
            help=(
                f"Comma list of draft counts (grid). {common.from_recipe(common.DEFAULT_RECIPE.speculation.num_drafts)}"
            ),
        ),
    ] = None,
    draft_length: Annotated[
        Optional[str],
        typer.Option(
            "--draft-length",
            metavar="L[,L…]",
            help=(
                "Comma list of draft lengths in tokens (grid). "
                f"{common.from_recipe(common.DEFAULT_RECIPE.speculation.draft_length)}"
            ),
        ),
    ] = None,
    temperature: Annotated[
        Optional[str],
        typer.Option(
            "--temperature",
            metavar="T[,T…]",
            help=(
                f"Comma list of temperatures (grid). {common.from_recipe(common.DEFAULT_RECIPE.generation.temperature)}"
            ),
        ),
    ] = None,
    draft_temperatures: Annotated[
        Optional[str],
        typer.Option(
            metavar="T,T[;T,T]",
            help=("Draft temperature sets: '1.0,1.2' is one set of two drafts; ';' separates sets (grid)."),
        ),
    ] = None,
    batch_sizes: Annotated[
        Optional[str],
        typer.Option(
            "--batch-size",
            metavar="B[,B…]",
            help=(
                "Comma list of batch sizes (grid): each cell decodes B samples at a time, and its speedup is over "
                "the target "
                "alone at the same B (batch 1: latency; larger: throughput). [dim]\\[default: 1][/dim]"
            ),
        ),
    ] = None,
    max_new_tokens: common.MaxNewTokensOption = None,
    top_k: common.TopKOption = None,
    top_p: common.TopPOption = None,
    device: common.DeviceOption = None,
    dtype: common.DtypeOption = None,
    sets: common.SetOption = None,
    compile_steps: common.CompileOption = False,
    chat: common.ChatOption = None,
    output: common.OutputOption = None,
    report_dir: _ReportOption = None,
    plot: _PlotOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", metavar="", help="Print results.json instead of the table.")
    ] = False,
    threads: common.ThreadsOption = None,
    allow_mixed_conditions: _AllowMixedOption = False,
) -> None:
    """Benchmark speed and quality of speculative configurations against the target alone."""
    check_plot_path(plot)
    common.check_at_least_one(limit, "--limit")
    common.apply_threads(threads)
    if report_dir is not None:
        return _report(report_dir, as_json, plot)
    base = common.RecipeOptions(
        recipe=recipe,
        sets=common.with_compile(sets, compile_steps),
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        device=device,
        dtype=dtype,
        chat=chat,
    ).resolve()
    examples = load_examples(
        DataSource(
            task=task,
            lang_pair=lang_pair,
            source_file=source,
            reference_file=reference,
            dataset=dataset,
            source_field=source_field,
            reference_field=reference_field,
            limit=limit,
            shuffle=shuffle,
            seed=shuffle_seed,
        )
    )
    grid = _grid(base, verifiers, kl, num_drafts, draft_length, temperature, draft_temperatures, drafters)
    grid = dataclasses.replace(grid, batch_sizes=_batch_sizes(batch_sizes, base))
    hint = "name the reference field with --reference-field NAME" if dataset else "give --reference FILE"
    plan = _Plan(
        base=base,
        task=get_task(task),
        lang_pair=lang_pair,
        template=template,
        examples=examples,
        grid=grid,
        seeds=common.grid_values(seeds, int, "--seeds") or [base.seed],
        reference_hint=hint,
    )
    _run(plan, _Output(output, as_json, plot, allow_mixed_conditions))


def _report(folder: Path, as_json: bool, plot: Path | None) -> None:
    """Show a results folder again, without running models."""
    config, records = load_saved(folder)
    if not records:
        raise UsageError(
            f"'{folder}' holds no samples yet (its run stopped before the first); run bench with "
            f"--output {folder} to fill it"
        )
    results, output = summarize(config, records), _Output(folder, as_json, plot, False)
    _show(results, output, "")
    _plot(results, output)


def _grid(base: Recipe, verifiers, kl, num_drafts, draft_length, temperature, draft_temperatures, drafters) -> Grid:
    """The grid from the comma-list flags (``str | None`` each); an absent flag takes the recipe's value."""
    return Grid(
        verifiers=tuple(common.grid_values(verifiers, str, "--verifier") or [base.verifier.name]),
        kl=tuple(common.grid_values(kl, float, "--kl")),
        num_drafts=tuple(common.grid_values(num_drafts, int, "--num-drafts") or [base.speculation.num_drafts]),
        draft_lengths=tuple(common.grid_values(draft_length, int, "--draft-length") or [base.speculation.draft_length]),
        temperatures=tuple(common.grid_values(temperature, float, "--temperature") or [base.generation.temperature]),
        draft_temperatures=_draft_temperature_sets(draft_temperatures),
        drafters=tuple(common.grid_values(drafters, str, "--drafter")) or (None,),
    )


def _batch_sizes(values: str | None, base: Recipe) -> tuple[int, ...]:
    """``--batch-size``'s values, each at least 1; more than 1 needs the KV cache."""
    sizes = tuple(common.grid_values(values, int, "--batch-size")) or (1,)
    common.check_batch_sizes(list(sizes))
    return sizes


@dataclasses.dataclass(kw_only=True)
class _Plan:
    """A validated run: recipe, task, examples, the grid's cells and the seeds."""

    base: Recipe
    task: Task
    lang_pair: str
    template: str | None
    examples: list
    grid: Grid
    seeds: list[int]
    reference_hint: str
    """How to give references for the data's kind (a note says so when the examples have none)."""
    registry: VerifierRegistry = dataclasses.field(default_factory=VerifierRegistry)

    def __post_init__(self) -> None:
        self.languages = parse_lang_pair(self.lang_pair)
        self.cells, self.skipped = self.grid.cells(self.registry, self.base)
        from ..bench.runner import check_cells  # torch: imported only on the paths that run models

        self.notes = check_cells(self.cells, self.skipped, self.base, self.registry)
        references = report.reference_note(self.task.metrics, [e.reference for e in self.examples], self.reference_hint)
        self.notes += [note for note in (turns_note(self.examples), references) if note is not None]

    def config(self) -> dict:
        """What defines the run's results (a results folder refuses another)."""
        return {
            "recipe": self.base.to_dict(),
            "task": {
                "name": self.task.name,
                "lang_pair": self.lang_pair,
                "metrics": list(self.task.metrics),
                "per_category": self.task.per_category,
                "template": self.template,
            },
            "data": {"examples": len(self.examples), "fingerprint": fingerprint(self.examples)},
            "cells": [dataclasses.asdict(c) for c in self.cells],
            "seeds": self.seeds,
        }


@dataclass(frozen=True)
class _Output:
    """Where the results go: the results folder (None: nowhere), stdout as JSON or a table, a plot."""

    folder: Path | None
    as_json: bool
    plot: Path | None
    allow_mixed_conditions: bool


def _run(plan: _Plan, output: _Output) -> None:
    """Run what the folder does not hold yet, then write and show the results (also when stopped)."""
    rank, world_size = _init_distributed()
    config = plan.config()
    store = ResultsStore(output.folder, config, rank, world_size)
    err = Console(stderr=True)
    if store.dropped_cut_line:
        err.print(
            "note: the last sample line was cut short (a killed run or a full disk); it was dropped and runs again"
        )
    for line in [f"skipped: {reason}" for reason in plan.skipped] + [f"note: {note}" for note in plan.notes]:
        err.print(line, highlight=False, soft_wrap=True)
    from ..bench.runner import BenchRunner, check_conditions, pending_samples, shard  # torch: only a run imports it
    from ..models.loading import resolve_device
    from ..models.pool import ModelPool
    from ..results.provenance import provenance, run_conditions

    conditions = run_conditions(resolve_device(plan.base.target.device))
    if not output.allow_mixed_conditions and pending_samples(
        store, plan.cells, plan.seeds, shard(plan.examples, rank, world_size)
    ):
        check_conditions(list(store.records.values()), conditions, output.folder)
    pool = ModelPool()
    with err.status("Loading models…"):
        runner = BenchRunner(
            recipe=plan.base,
            task=plan.task,
            examples=plan.examples,
            cells=plan.cells,
            seeds=plan.seeds,
            store=store,
            rank=rank,
            world_size=world_size,
            registry=plan.registry,
            template=plan.template,
            lang_pair=plan.languages,
            pool=pool,
            conditions=conditions,
        )
    interrupted = _generate(runner, plan.base.generation.max_new_tokens, rank == 0, err)
    store.close()
    failures = {key: failure.summary() for key, failure in runner.failures.items()}
    if world_size > 1:
        failures = _gather(store, rank, failures)
        if rank != 0:
            return
    environment = provenance(pool.target(plan.base.target).device)
    results = summarize(
        config,
        list(store.records.values()),
        failures,
        environment=environment,
        interrupted=interrupted,
        notes=[*plan.skipped, *plan.notes],
    )
    _finish(results, output, len(store.records))


def _generate(runner: "BenchRunner", budget: int, enabled: bool, err: Console) -> bool:
    """Every pending sample under a progress bar, a failing cell's line printed as it fails; True if stopped."""
    with common.token_progress(runner.pending() * budget, enabled=enabled, label="samples") as progress:

        def on_tokens(cell: str, tokens: int) -> None:
            progress.describe(cell)
            progress.advance(tokens)

        try:
            runner.run(
                on_tokens,
                on_failure=lambda failure: err.print(f"error: {failure.line()}", highlight=False, soft_wrap=True),
            )
        except KeyboardInterrupt:
            return True
    return False


def _finish(results: BenchResults, output: _Output, kept: int) -> None:
    """Show the results and write them to the folder; stopped: exit 130, a failed cell: exit 1."""
    if results.interrupted:
        where = (
            f"kept in '{output.folder}'; run the same command to resume"
            if output.folder is not None
            else "done, but nothing was saved (no --output): pass --output FOLDER to be able to resume"
        )
        note = f"interrupted: {kept} samples {where}"
    else:
        note = ""
    _show(results, output, note)
    if output.folder is not None:
        _write_summaries(output.folder, results)
    _plot(results, output)  # last: a failing plot never costs the table or the summaries
    if results.interrupted:
        raise typer.Exit(130)
    if any(cell.failure for cell in results.cells):
        raise typer.Exit(1)  # each failed cell's line came as it failed; a run with one is not a success


def _write_summaries(folder: Path, results: BenchResults) -> None:
    """results.json and the tables, after the table is shown: a full disk costs them, never the table."""
    summaries = {
        "results.json": json.dumps(results.to_dict(), indent=2) + "\n",
        "table.md": report.markdown(results),
        "table.csv": report.csv_text(results),
    }
    for name, text in summaries.items():
        try:
            write_atomically(folder / name, text)  # a failed write leaves the previous summary whole
        except OSError as error:
            raise SpecdecError(
                f"could not write '{folder / name}' ({error.strerror}); the samples are kept: free "
                f"some space and run `specdec bench --report {folder}` to see them again"
            ) from None


def _show(results: BenchResults, output: _Output, note: str) -> None:
    if output.as_json:
        sys.stdout.write(json.dumps(results.to_dict(), indent=2) + "\n")
    else:
        config = results.config
        title = f"specdec bench: {config['task']['name']}, {config['data']['examples']} examples"
        console = Console(width=None if sys.stdout.isatty() else 200)
        console.print(report.rich_table(results, title))
        if (categories := report.category_table(results)) is not None:
            console.print(categories)
    if note:
        Console(stderr=True).print(note, highlight=False, soft_wrap=True)


def _plot(results: BenchResults, output: _Output) -> None:
    """The plot, if asked for; a stopped run's plot that fails is a note, so the stop keeps its exit code 130."""
    if output.plot is None:
        return
    try:
        common.write_plot(lambda: report.plot(results, output.plot), output.plot)
    except SpecdecError as error:
        if not results.interrupted:
            raise
        Console(stderr=True).print(f"note: {error}", highlight=False, soft_wrap=True)


def _draft_temperature_sets(text: str | None) -> tuple:
    """'1.0,1.2;1.0' → ((1.0, 1.2), (1.0,)); absent: (None,), the recipe's drafts. A temperature may repeat
    within a set (two drafts alike), a set may not repeat."""
    if text is None:
        return (None,)
    sets = [tuple(common.parse_list(part, float, "--draft-temperatures")) for part in text.split(";") if part.strip()]
    if not sets or not all(sets):
        raise UsageError(f"--draft-temperatures expects sets such as '1.0,1.2;0.7,0.7' (a set per ';'), got '{text}'")
    common.refuse_repeats(sets, "--draft-temperatures")
    return tuple(sets)


def _init_distributed() -> tuple[int, int]:
    """Rank and world size under torchrun / accelerate launch (gloo on CPU, nccl on GPUs)."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(f"WORLD_SIZE must be a number, got '{os.environ['WORLD_SIZE']}'") from None
    if world_size == 1:
        return 0, 1
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UsageError(
            f"WORLD_SIZE={world_size} is set without {', '.join(missing)}; launch a data-parallel "
            "run with torchrun (it sets them), or unset WORLD_SIZE"
        )
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world_size


def _gather(store: ResultsStore, rank: int, failures: dict[str, str]) -> dict[str, str]:
    """Every process's samples to rank 0, which writes the one samples.jsonl of a single-process run;
    every process's failed cells (cell key → why) to all."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (list(store.records.values()), failures))
    if rank == 0:
        store.merge([record for records, _ in gathered for record in records])
    dist.barrier()
    dist.destroy_process_group()
    return {key: why for _, theirs in gathered for key, why in theirs.items()}
