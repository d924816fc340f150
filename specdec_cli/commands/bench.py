"""`specdec bench`: speed and quality over a grid of configurations, resumable, data-parallel."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Optional

import typer
from rich.console import Console

from ..base.errors import UsageError
from ..base.inputs import check_plot_path
from ..base.recipe import Recipe
from ..bench import distributed, report
from ..bench.grid import Grid
from ..bench.results import summarize
from ..bench.tasks import (
    DataSource,
    LoadedExamples,
    Task,
    fingerprint,
    get_task,
    load_examples,
    parse_lang_pair,
    turns_note,
)
from ..plugins.registry import VerifierRegistry
from ..results.store import ResultsStore, load_saved
from . import bench_results, common, options
from .progress import token_progress

_recipe = options.DEFAULT_RECIPE

if TYPE_CHECKING:
    from ..bench.runner import BenchRunner


@dataclass(kw_only=True)
class _DataOptions:
    """The examples: a task's own data or the user's files, shuffled and cut."""

    help_panel: ClassVar[str] = "Data"
    task: Annotated[str, typer.Option(metavar="TASK", help="wmt, xsum, dolly or spec-bench.")] = "wmt"
    lang_pair: Annotated[str, typer.Option(metavar="SRC-TGT", help="WMT language pair.")] = "en-fr"
    source: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Plain-text inputs, one per line.")] = None
    reference: Annotated[
        Optional[Path], typer.Option(metavar="FILE", help="Plain-text references aligned with --source.")
    ] = None
    dataset: Annotated[
        Optional[Path], typer.Option(metavar="FILE", help="A .jsonl file of examples (Spec-Bench's format too).")
    ] = None
    source_field: Annotated[Optional[str], typer.Option(metavar="NAME", help="Input field of --dataset records.")] = (
        None
    )
    reference_field: Annotated[
        Optional[str], typer.Option(metavar="NAME", help="Reference field of --dataset records.")
    ] = None
    template: Annotated[
        Optional[str],
        typer.Option(
            metavar="TEXT",
            help="Prompt template with {source}. " + options.default_note("the task's, for the target's kind"),
        ),
    ] = None
    limit: options.LimitOption = None
    shuffle: options.ShuffleOption = False
    shuffle_seed: options.ShuffleSeedOption = 0

    def examples(self) -> LoadedExamples:
        source = DataSource(
            task=self.task,
            lang_pair=self.lang_pair,
            source_file=self.source,
            reference_file=self.reference,
            dataset=self.dataset,
            source_field=self.source_field,
            reference_field=self.reference_field,
            limit=self.limit,
            shuffle=self.shuffle,
            seed=self.shuffle_seed,
        )
        return load_examples(source)

    def reference_hint(self) -> str:
        """How to give references for this kind of data (a note says so when the examples have none)."""
        return "name the reference field with --reference-field NAME" if self.dataset else "give --reference FILE"


@dataclass(kw_only=True)
class _GridOptions:
    """The grid's axes, a comma list each (an absent one takes the recipe's value): a cell per combination."""

    help_panel: ClassVar[str] = "Grid: a cell per combination of these comma lists"
    verifiers: Annotated[
        Optional[str],
        typer.Option(
            "--verifier", metavar="NAME[,NAME…]", help="Verifiers. " + options.from_recipe(_recipe.verifier.name)
        ),
    ] = None
    drafters: Annotated[
        Optional[str],
        typer.Option(
            "--drafter",
            metavar="NAME[,NAME…]",
            help="Drafters (see `specdec drafters`): each cell drafts with the recipe's entries of it, or one with its "
            "defaults. " + options.default_note("the recipe's drafts"),
        ),
    ] = None
    kl: Annotated[
        Optional[str], typer.Option("--kl", metavar="NATS[,NATS…]", help="KL bounds D in nats, for verifiers with one.")
    ] = None
    sweep: options.SweepOption = None
    num_drafts: Annotated[
        Optional[str],
        typer.Option(
            "--num-drafts",
            metavar="K[,K…]",
            help="Draft counts. " + options.from_recipe(_recipe.speculation.num_drafts),
        ),
    ] = None
    draft_length: Annotated[
        Optional[str],
        typer.Option(
            "--draft-length",
            metavar="L[,L…]",
            help="Draft lengths in tokens. " + options.from_recipe(_recipe.speculation.draft_length),
        ),
    ] = None
    draft_length_schedule: Annotated[
        Optional[str],
        typer.Option(
            "--draft-length-schedule",
            metavar="NAME[,NAME…]",
            help="Draft length schedules: constant, heuristic (+2 after a wholly accepted draft, -1 otherwise, from "
            "each cell's draft length). " + options.from_recipe(_recipe.speculation.draft_length_schedule),
        ),
    ] = None
    exact_first: Annotated[
        Optional[str],
        typer.Option(
            "--exact-first",
            metavar="N[,N…]",
            help="Tokens of every sample verified by a lossless rule (speculation.exact_verifier) before the cell's "
            f"verifier takes over (0 = off). {options.from_recipe(_recipe.speculation.exact_first)}",
        ),
    ] = None
    temperature: Annotated[
        Optional[str],
        typer.Option(
            "--temperature",
            metavar="T[,T…]",
            help="Temperatures. " + options.from_recipe(_recipe.generation.temperature),
        ),
    ] = None
    draft_temperatures: Annotated[
        Optional[str],
        typer.Option(
            "--draft-temperatures",
            metavar="T,T[;T,T]",
            help="Draft temperature sets: '1.0,1.2' is one set of two drafts; ';' separates sets.",
        ),
    ] = None
    batch_sizes: Annotated[
        Optional[str],
        typer.Option(
            "--batch-size",
            metavar="B[,B…]",
            help="Batch sizes: each cell decodes B samples at a time, and its speedup is over the target alone at the "
            "same B (batch 1: latency; larger: throughput). " + options.default_note("1"),
        ),
    ] = None
    seeds: Annotated[
        Optional[str],
        typer.Option(
            "--seeds",
            metavar="N[,N…]",
            help="Sampling seeds: every cell runs with each (mean ± std over seeds). " + options.default_note("--seed"),
        ),
    ] = None

    def grid(self, base: Recipe, registry: VerifierRegistry) -> Grid:
        """The grid, each absent axis at the recipe's value; checked before any model loads, each value a flag
        gives in the flag's words."""
        sizes = tuple(common.grid_values(self.batch_sizes, int, "--batch-size")) or (1,)
        common.check_batch_sizes(list(sizes))
        verifiers = tuple(common.grid_values(self.verifiers, str, "--verifier") or [base.verifier.name])
        bounds = common.grid_values(self.kl, float, "--kl")
        common.check_kl_bounds(bounds, list(verifiers), base.verifier.params, registry)
        sweeps = common.run_sweeps(self.sweep or [], list(verifiers), base.verifier.params, registry)
        speculation, generation = base.speculation, base.generation
        return Grid(
            verifiers=verifiers,
            kl=tuple(bounds),
            sweeps=sweeps,
            num_drafts=self._axis("num_drafts", int) or (speculation.num_drafts,),
            draft_lengths=self._axis("draft_length", int) or (speculation.draft_length,),
            draft_length_schedules=self._axis("draft_length_schedule", str) or (speculation.draft_length_schedule,),
            exact_first=self._axis("exact_first", int) or (speculation.exact_first,),
            temperatures=self._axis("temperature", float) or (generation.temperature,),
            draft_temperatures=_draft_temperature_sets(self.draft_temperatures),
            drafters=tuple(common.grid_values(self.drafters, str, "--drafter")) or (None,),
            batch_sizes=sizes,
        )

    def _axis(self, setting: str, kind: type) -> tuple:
        """The values of the comma-list flag of recipe setting ``setting`` (its field here), each checked by the
        recipe's rules; () when the flag is absent."""
        values = common.grid_values(getattr(self, setting), kind, common.flag_name(setting))
        common.check_flag_values(setting, values)
        return tuple(values)

    def seed_values(self, base: Recipe) -> list[int]:
        return common.grid_values(self.seeds, int, "--seeds") or [base.seed]


@options.takes_option_groups
def bench(
    data: _DataOptions,
    grid: _GridOptions,
    model: options.ModelOptions,
    output: bench_results.Output,
    compile_steps: options.CompileOption = False,
    stop: options.StopOption = None,
) -> None:
    """Benchmark speed and quality of speculative configurations against the target alone."""
    check_plot_path(output.plot)
    common.check_at_least_one(data.limit, "--limit")
    common.apply_threads(model.threads)
    if output.report_folder is not None:
        return _report(dataclasses.replace(output, folder=output.report_folder))
    flags = common.RecipeOptions.of(model, sets=common.with_compile(model.sets, compile_steps), stop=stop)
    base, registry = flags.resolve(), flags.registry
    common.check_hub_models(base)
    loaded = data.examples()
    plan = _Plan(
        base=base,
        task=get_task(data.task),
        lang_pair=data.lang_pair,
        template=data.template,
        examples=loaded.examples,
        data_note=loaded.note,
        grid=grid.grid(base, registry),
        seeds=grid.seed_values(base),
        reference_hint=data.reference_hint(),
        registry=registry,
    )
    _run(plan, output)


def _report(output: bench_results.Output) -> None:
    """Show a results folder again, without running models."""
    config, records = load_saved(output.folder)
    if not records:
        raise UsageError(
            f"'{output.folder}' holds no samples yet (its run stopped before the first); run bench with "
            f"--output {output.folder} to fill it"
        )
    results = summarize(config, records)
    bench_results.show(results, output, "")
    bench_results.plot(results, output)


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
    data_note: str | None = None
    """Where the examples came from, when not from where the user asked (the shipped WMT sample)."""
    registry: VerifierRegistry = dataclasses.field(default_factory=VerifierRegistry)
    busy_cpu: str | None = dataclasses.field(default=None, init=False)
    """The note that other jobs kept the CPU busy as the run started (None: a quiet CPU, or not a CPU run): said
    then, kept with the results' notes, and written on the plot."""

    def __post_init__(self) -> None:
        self.languages = parse_lang_pair(self.lang_pair)
        self.cells, self.skipped = self.grid.cells(self.registry, self.base)
        from ..bench.runner import check_cells  # torch: imported only on the paths that run models

        self.notes = check_cells(self.cells, self.skipped, self.base, self.registry)
        references = report.reference_note(self.task.metrics, [e.reference for e in self.examples], self.reference_hint)
        self.notes += [note for note in (self.data_note, turns_note(self.examples), references) if note is not None]

    def verifiers(self) -> list[str]:
        """Every verifier whose decisions the cells' samples hold: each cell's, and the exact rule of a cell with
        ``exact_first``."""
        names = {cell.verifier for cell in self.cells}
        if any(cell.exact_first for cell in self.cells):
            names.add(self.base.speculation.exact_verifier)
        return sorted(names)

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


def _run(plan: _Plan, output: bench_results.Output) -> None:
    """Run what the folder does not hold yet, then write and show the results (also when stopped)."""
    rank, world_size = distributed.init_distributed()
    config = plan.config()
    revisions = plan.registry.revisions(plan.verifiers())
    store = ResultsStore(output.folder, config, rank, world_size, revisions=revisions)
    err = Console(stderr=True)
    if store.dropped_cut_line:
        err.print(
            "note: the last sample line was cut short (a killed run or a full disk); it was dropped and runs again"
        )
    for line in [f"skipped: {reason}" for reason in plan.skipped] + [f"note: {note}" for note in plan.notes]:
        err.print(line, highlight=False, soft_wrap=True)
    from ..bench.runner import BenchRunner  # torch: only a run imports it
    from ..models.pool import ModelPool
    from ..results.provenance import provenance

    conditions = _conditions(plan, output, store, err)
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
    interrupted = _generate(runner, plan.base.generation.max_new_tokens, rank == 0)
    store.close()
    failures = {key: failure.summary() for key, failure in runner.failures.items()}
    if world_size > 1:
        failures = distributed.gather(store, rank, failures)
        if rank != 0:
            return
    environment = provenance(pool.target(plan.base.target).device)
    results = summarize(
        config,
        list(store.records.values()),
        failures,
        environment=environment,
        interrupted=interrupted,
        notes=[*plan.skipped, *plan.notes, *runner.notes],
    )
    bench_results.finish(results, output, len(store.records), plan.busy_cpu)


def _conditions(plan: _Plan, output: bench_results.Output, store: ResultsStore, err: Console) -> dict:
    """This run's conditions (threads, device, versions), checked against the samples it would resume beside; on a
    busy CPU a note says that its speed figures are the moment's (printed before any sample, kept with the
    results)."""
    from ..bench.runner import check_conditions, pending_samples, shard
    from ..generation.calibration import busy_cpu_note
    from ..models.loading import resolve_device
    from ..results.provenance import run_conditions

    rank, world_size = store.rank, store.world_size
    device = resolve_device(plan.base.target.device)
    conditions = run_conditions(device)
    busy = busy_cpu_note(conditions["threads"]) if device.type == "cpu" else None
    if busy is not None:
        err.print(f"note: {busy}", highlight=False, soft_wrap=True)
        plan.notes.append(busy)
        plan.busy_cpu = busy
    if not output.allow_mixed_conditions and pending_samples(
        store, plan.cells, plan.seeds, shard(plan.examples, rank, world_size)
    ):
        check_conditions(list(store.records.values()), conditions, output.folder)
    return conditions


def _generate(runner: "BenchRunner", budget: int, enabled: bool) -> bool:
    """Every pending sample under a progress bar, a failing cell's line and each note printed above it as they come;
    True if stopped."""
    with token_progress(runner.pending() * budget, enabled=enabled, label="samples") as progress:

        def on_tokens(cell: str, tokens: int) -> None:
            progress.describe(cell)
            progress.advance(tokens)

        try:
            runner.run(
                on_tokens,
                on_failure=lambda failure: bench_results.above_the_bar(f"error: {failure.line()}"),
                on_note=lambda note: bench_results.above_the_bar(f"note: {note}"),
            )
        except KeyboardInterrupt:
            return True
    return False


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
