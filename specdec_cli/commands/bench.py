"""`specdec bench`: speed and quality over a grid of configurations, resumable, data-parallel."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ..bench import report
from ..bench.results import BenchResults, summarize
from ..bench.grid import Grid
from ..bench.tasks import DataSource, Task, fingerprint, get_task, load_examples, parse_lang_pair, turns_note
from ..errors import UsageError
from ..inputs import check_plot_path
from ..recipe import Recipe
from ..results_store import ResultsStore, load_saved
from ..registry import VerifierRegistry
from . import common


def bench(
    task: Annotated[str, typer.Option(metavar="TASK", help="wmt, xsum, dolly or spec-bench.")] = "wmt",
    lang_pair: Annotated[str, typer.Option(metavar="SRC-TGT", help="WMT language pair.")] = "en-fr",
    source: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Plain-text inputs, one per line.")] = None,
    reference: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Plain-text references aligned with --source.")] = None,
    dataset: Annotated[Optional[Path], typer.Option(metavar="FILE", help="A .jsonl file of examples (Spec-Bench's format too).")] = None,
    source_field: Annotated[Optional[str], typer.Option(metavar="NAME", help="Input field of --dataset records.")] = None,
    reference_field: Annotated[Optional[str], typer.Option(metavar="NAME", help="Reference field of --dataset records.")] = None,
    template: Annotated[Optional[str], typer.Option(metavar="TEXT", help=(
        "Prompt template with {source}. [dim]\\[default: the task's, for the target's kind][/dim]"))] = None,
    limit: Annotated[Optional[int], typer.Option(metavar="N", help="Use only the first N examples (after --shuffle).")] = None,
    shuffle: Annotated[bool, typer.Option("--shuffle", metavar="", help="Shuffle the examples (--shuffle-seed) before --limit.")] = False,
    shuffle_seed: Annotated[int, typer.Option(metavar="N", help="Seed of --shuffle (the data order, not sampling).")] = 0,
    seed: common.SeedOption = None,
    seeds: Annotated[Optional[str], typer.Option(metavar="N[,N…]", help=(
        "Comma list of sampling seeds: every cell runs with each (mean ± std over seeds). [dim]\\[default: --seed][/dim]"))] = None,
    recipe: common.RecipeOption = None,
    verifiers: Annotated[Optional[str], typer.Option("--verifier", metavar="NAME[,NAME…]", help=(
        f"Comma list of verifiers (grid). {common.from_recipe(common.DEFAULT_RECIPE.verifier.name)}"))] = None,
    kl: Annotated[Optional[str], typer.Option("--kl", metavar="NATS[,NATS…]", help=(
        "Comma list of KL bounds D in nats, for verifiers with one (grid)."))] = None,
    num_drafts: Annotated[Optional[str], typer.Option("--num-drafts", metavar="K[,K…]", help=(
        f"Comma list of draft counts (grid). {common.from_recipe(common.DEFAULT_RECIPE.speculation.num_drafts)}"))] = None,
    draft_length: Annotated[Optional[str], typer.Option("--draft-length", metavar="L[,L…]", help=(
        f"Comma list of draft lengths in tokens (grid). {common.from_recipe(common.DEFAULT_RECIPE.speculation.draft_length)}"))] = None,
    temperature: Annotated[Optional[str], typer.Option("--temperature", metavar="T[,T…]", help=(
        f"Comma list of temperatures (grid). {common.from_recipe(common.DEFAULT_RECIPE.generation.temperature)}"))] = None,
    draft_temperatures: Annotated[Optional[str], typer.Option(metavar="T,T[;T,T]", help=(
        "Draft temperature sets: '1.0,1.2' is one set of two drafts; ';' separates sets (grid)."))] = None,
    max_new_tokens: common.MaxNewTokensOption = None,
    top_k: common.TopKOption = None,
    top_p: common.TopPOption = None,
    device: common.DeviceOption = None,
    dtype: common.DtypeOption = None,
    sets: common.SetOption = None,
    chat: common.ChatOption = None,
    output: common.OutputOption = None,
    report_dir: Annotated[Optional[Path], typer.Option("--report", metavar="FOLDER", help=(
        "Show the results of a results folder again, without running models."))] = None,
    plot: Annotated[Optional[Path], typer.Option(metavar="FILE.png", help=(
        "Draw speedup (or token rate) against quality to this PNG."))] = None,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="Print results.json instead of the table.")] = False,
) -> None:
    """Benchmark speed and quality of speculative configurations against the target alone."""
    check_plot_path(plot)
    common.check_at_least_one(limit, "--limit")
    if report_dir is not None:
        config, records = load_saved(report_dir)
        _show(summarize(config, records), as_json, plot, "")
        return
    base = common.RecipeOptions(recipe=recipe, sets=sets or [], max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p,
                                seed=seed, device=device, dtype=dtype, chat=chat).resolve()  # fmt: skip
    examples = load_examples(DataSource(
        task=task, lang_pair=lang_pair, source_file=source, reference_file=reference, dataset=dataset,
        source_field=source_field, reference_field=reference_field, limit=limit, shuffle=shuffle, seed=shuffle_seed,
    ))  # fmt: skip
    grid = _grid(base, verifiers, kl, num_drafts, draft_length, temperature, draft_temperatures)
    plan = _Plan(base=base, task=get_task(task), lang_pair=lang_pair, template=template, examples=examples, grid=grid,
                 seeds=common.parse_list(seeds, int, "--seeds") or [base.seed])  # fmt: skip
    _run(plan, output, as_json, plot)


def _grid(base: Recipe, verifiers, kl, num_drafts, draft_length, temperature, draft_temperatures) -> Grid:
    """The grid from the comma-list flags (``str | None`` each); an absent flag takes the recipe's value."""
    return Grid(
        verifiers=tuple(common.parse_list(verifiers, str, "--verifier") or [base.verifier.name]),
        kl=tuple(common.parse_list(kl, float, "--kl")),
        num_drafts=tuple(common.parse_list(num_drafts, int, "--num-drafts") or [base.speculation.num_drafts]),
        draft_lengths=tuple(common.parse_list(draft_length, int, "--draft-length") or [base.speculation.draft_length]),
        temperatures=tuple(common.parse_list(temperature, float, "--temperature") or [base.generation.temperature]),
        draft_temperatures=_draft_temperature_sets(draft_temperatures),
    )


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
    registry: VerifierRegistry = dataclasses.field(default_factory=VerifierRegistry)

    def __post_init__(self) -> None:
        self.languages = parse_lang_pair(self.lang_pair)
        self.cells, self.skipped = self.grid.cells(self.registry, self.base)
        from ..bench.runner import check_cells  # torch: imported only on the paths that run models

        self.notes = check_cells(self.cells, self.skipped, self.base, self.registry)
        if (note := turns_note(self.examples)) is not None:
            self.notes.append(note)

    def config(self) -> dict:
        """What defines the run's results (a results folder refuses another)."""
        return {
            "recipe": self.base.to_dict(),
            "task": {"name": self.task.name, "lang_pair": self.lang_pair, "metrics": list(self.task.metrics),
                     "per_category": self.task.per_category, "template": self.template},  # fmt: skip
            "data": {"examples": len(self.examples), "fingerprint": fingerprint(self.examples)},
            "cells": [dataclasses.asdict(c) for c in self.cells],
            "seeds": self.seeds,
        }


def _run(plan: _Plan, output: Path | None, as_json: bool, plot: Path | None) -> None:
    """Run what the folder does not hold yet, then write and show the results (also when stopped)."""
    rank, world_size = _init_distributed()
    config = plan.config()
    store = ResultsStore(output, config, rank, world_size)
    err = Console(stderr=True)
    if store.dropped_cut_line:
        err.print("note: the last sample line was cut short (a killed run or a full disk); it was dropped and runs again")
    for line in [f"skipped: {reason}" for reason in plan.skipped] + [f"note: {note}" for note in plan.notes]:
        err.print(line, highlight=False)
    from ..bench.runner import BenchRunner  # torch and transformers: only a run that loads models imports them
    from ..model_pool import ModelPool
    from ..provenance import provenance

    pool = ModelPool()
    with err.status("Loading models…"):
        runner = BenchRunner(recipe=plan.base, task=plan.task, examples=plan.examples, cells=plan.cells,
                             seeds=plan.seeds, store=store, rank=rank, world_size=world_size, registry=plan.registry,
                             template=plan.template, lang_pair=plan.languages, pool=pool)  # fmt: skip
    interrupted = False
    budget = plan.base.generation.max_new_tokens
    with common.token_progress(runner.pending() * budget, enabled=rank == 0, label="samples") as progress:
        def on_tokens(cell: str, tokens: int) -> None:
            progress.describe(cell)
            progress.advance(tokens)

        try:
            runner.run(on_tokens)
        except KeyboardInterrupt:
            interrupted = True
    store.close()
    if world_size > 1:
        _gather(store, rank)
        if rank != 0:
            return
    device = pool.target(plan.base.target).device
    results = summarize(config, list(store.records.values()), environment=provenance(device), interrupted=interrupted)
    if output is not None:
        (output / "results.json").write_text(json.dumps(results.to_dict(), indent=2) + "\n")
        (output / "table.md").write_text(report.markdown(results))
        (output / "table.csv").write_text(report.csv_text(results))
    note = f"interrupted: {len(store.records)} samples kept; run the same command to resume" if interrupted else ""
    _show(results, as_json, plot, note)
    if interrupted:
        raise typer.Exit(130)


def _show(results: BenchResults, as_json: bool, plot: Path | None, note: str) -> None:
    if as_json:
        sys.stdout.write(json.dumps(results.to_dict(), indent=2) + "\n")
    else:
        config = results.config
        title = f"specdec bench: {config['task']['name']}, {config['data']['examples']} examples"
        console = Console(width=None if sys.stdout.isatty() else 200)
        console.print(report.rich_table(results, title))
        if (categories := report.category_table(results)) is not None:
            console.print(categories)
    if note:
        Console(stderr=True).print(note)
    if plot is not None:  # after the table: a failing plot never hides it
        common.write_plot(lambda: report.plot(results, plot), plot)


def _draft_temperature_sets(text: str | None) -> tuple:
    if not text:
        return (None,)
    return tuple(tuple(common.parse_list(part, float, "--draft-temperatures")) for part in text.split(";") if part.strip())


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
        raise UsageError(f"WORLD_SIZE={world_size} is set without {', '.join(missing)}; launch a data-parallel "
                         "run with torchrun (it sets them), or unset WORLD_SIZE")
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world_size


def _gather(store: ResultsStore, rank: int) -> None:
    """Every process's samples to rank 0, which writes the one samples.jsonl of a single-process run."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(store.records.values()))
    if rank == 0:
        store.merge([record for records in gathered for record in records])
    dist.barrier()
    dist.destroy_process_group()
