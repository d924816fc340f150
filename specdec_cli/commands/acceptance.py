"""`specdec acceptance`: token-level acceptance of every verifier next to the theoretical optimum."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import transformers
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .. import __version__
from ..acceptance import (
    MENTORED,
    OPTIMUM,
    PROMPT_RECORDS,
    AcceptanceAnalysis,
    AcceptanceReport,
    AcceptanceRequest,
    PromptAcceptance,
)
from ..bench.store import ResultsStore
from ..inputs import check_plot_path
from ..recipe import Recipe
from ..verifiers import VerifierRegistry
from . import common


def acceptance(
    prompts: Annotated[Optional[list[str]], typer.Option("--prompt", help="A prompt; repeatable.")] = None,
    prompt_file: Annotated[
        Optional[Path], typer.Option(help="Text file (one prompt per line) or .jsonl (Spec-Bench's format too).")
    ] = None,
    field: common.FieldOption = None,
    recipe: common.RecipeOption = None,
    verifiers: Annotated[
        Optional[str], typer.Option("--verifier", help="Comma list of verifiers; default: all installed.")
    ] = None,
    num_drafts: Annotated[str, typer.Option("--num-drafts", help="Comma list of K values (columns).")] = "1,2,4",
    kl: Annotated[str, typer.Option("--kl", help="Comma list of mentored KL bounds D (one row each).")] = "0.05,0.2,0.5",
    draft_temperatures: Annotated[
        Optional[str], typer.Option(help="Comma list: drafts that differ only in temperature (copies of the first draft).")
    ] = None,
    max_new_tokens: common.MaxNewTokensOption = None,
    temperature: common.TemperatureOption = None,
    top_k: common.TopKOption = None,
    top_p: common.TopPOption = None,
    seed: common.SeedOption = None,
    device: common.DeviceOption = None,
    dtype: common.DtypeOption = None,
    sets: common.SetOption = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--no-chat", help="Apply the chat template.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON instead of a table.")] = False,
    output: Annotated[Optional[Path], typer.Option(help="Write acceptance.json and acceptance.csv to this folder.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Draw acceptance vs K, and mentored's acceptance vs KL, to a PNG.")] = None,
) -> None:
    """Acceptance probability of each verifier per number of drafts, on positions the target generates."""
    temperatures = common.parse_list(draft_temperatures, float, "--draft-temperatures")
    options = common.RecipeOptions(
        recipe, sets or [], None, None, None, None, max_new_tokens, temperature, top_k, top_p, seed, device,
        dtype, chat, temperatures or None,
    )  # fmt: skip
    resolved = options.resolve()
    names = common.parse_list(verifiers, str, "--verifier") or VerifierRegistry().names()
    request = AcceptanceRequest(
        tuple(names), tuple(common.parse_list(num_drafts, int, "--num-drafts")),
        tuple(common.parse_list(kl, float, "--kl")),
    )  # fmt: skip
    texts = _prompts(prompts, prompt_file, field)
    check_plot_path(plot)
    store = _open_store(output, resolved, request, texts)
    err = Console(stderr=True)
    with err.status("Loading models…"):
        analysis = AcceptanceAnalysis(resolved, request)
    report = _evaluate(analysis, texts, store, err)
    if report.interrupted:
        err.print(f"interrupted: results over {len(report.prompts)} of {len(texts)} prompts")
    payload = _payload(resolved, request, report, analysis)
    if output is not None:
        _write(output, payload, report)
    _show(payload, report, as_json, plot)
    if report.interrupted:
        raise typer.Exit(130)


def _show(payload: dict, report: AcceptanceReport, as_json: bool, plot: Path | None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        # Piped output has no terminal width: give the table room rather than cutting its cells.
        Console(width=None if sys.stdout.isatty() else 160).print(render_table(report))
    if plot is not None:  # after the table: a failing plot never hides it
        common.write_plot(lambda: _plot(plot, report), plot)


def _evaluate(analysis: AcceptanceAnalysis, texts: list[str], store: ResultsStore, err: Console) -> AcceptanceReport:
    """Every prompt the store does not hold yet, each written to it as it comes, under a progress bar."""
    done = [PromptAcceptance.from_record(record) for record in store.records.values()]
    if store.dropped_cut_line:
        err.print("note: the last prompt line was cut short (a killed run or a full disk); it was dropped and runs again")
    with Progress(
        TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err, transient=True
    ) as progress:
        task = progress.add_task("prompts", total=len(texts), completed=len(done))

        def written(result: PromptAcceptance) -> None:
            store.append(result.to_record())
            progress.advance(task)

        report = analysis.run(texts, on_prompt=written, done=done)
    store.close()
    return report


def _open_store(output: Path | None, recipe: Recipe, request: AcceptanceRequest, texts: list[str]) -> ResultsStore:
    """The prompts' results, written to ``output`` as they come (resumed from it): checked, locked
    and compared with the folder's configuration before any model loads."""
    config = {"recipe": recipe.to_dict(), "request": dataclasses.asdict(request),
              "prompts": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]}  # fmt: skip
    return ResultsStore(output, config, kind=PROMPT_RECORDS)


def _prompts(prompts: list[str] | None, prompt_file: Path | None, field: str | None) -> list[str]:
    if prompts and prompt_file is not None:
        return list(prompts) + common.read_prompts(None, prompt_file, sys.stdin, field)
    if prompts:
        return list(prompts)
    return common.read_prompts(None, prompt_file, sys.stdin, field)


def render_table(report: AcceptanceReport) -> Table:
    positions = sum(p.positions for p in report.prompts)
    table = Table(
        title="token-level acceptance probability",
        caption=(
            f"mean ± standard error over {positions} positions of {len(report.prompts)} prompts; "
            "optimum: best of any lossless rule (Hu et al. 2025; Khisti et al. Thm 3), exact: full vocabulary "
            "for identical drafts, K=2 different drafts sharing at most 128 tokens"
        ),
    )
    table.add_column("verifier", no_wrap=True)
    for k in report.num_drafts:
        table.add_column(f"K={k}", justify="right", no_wrap=True)
    has_kl = any(row.startswith(MENTORED) for row in report.rows)
    if has_kl:
        table.add_column("KL(q‖out), mean", justify="right", no_wrap=True)
    for row in report.rows:
        cells = [_format(report.cell(row, k)) for k in report.num_drafts]
        if has_kl:
            divergence = report.kl(row)
            cells.append(f"{divergence.mean:.4g}" if divergence else "")
        table.add_row(row, *cells, style="bold" if row == OPTIMUM else None, end_section=row == OPTIMUM)
    reasons = sorted(set(report.unavailable.values()))
    if reasons:
        table.caption += "\n—: " + "; ".join(reasons)
    return table


def _format(cell) -> str:
    if cell is None:
        return "—"
    if math.isnan(cell.stderr):
        return f"{cell.mean:.3f}"
    return f"{cell.mean:.3f} ± {cell.stderr:.3f}"


def _payload(recipe: Recipe, request: AcceptanceRequest, report: AcceptanceReport, analysis) -> dict:
    device = analysis.decoder.device
    return {
        "specdec_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seed": recipe.seed,
        "recipe": recipe.to_dict(),
        "request": {"verifiers": list(request.verifiers), "num_drafts": list(request.num_drafts),
                    "kl": list(request.kl_values)},  # fmt: skip
        **report.to_dict(),
    }


def _write(folder: Path, payload: dict, report: AcceptanceReport) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "acceptance.json").write_text(json.dumps(payload, indent=2) + "\n")
    with open(folder / "acceptance.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["row", "num_drafts", "mean", "stderr", "positions", "kl_mean"])
        for row in report.rows:
            divergence = report.kl(row)
            for k in report.num_drafts:
                cell = report.cell(row, k)
                if cell is not None:
                    writer.writerow([row, k, cell.mean, cell.stderr, cell.count, divergence.mean if divergence else ""])


def _plot(path: Path, report: AcceptanceReport) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mentored = [row for row in report.rows if row.startswith(MENTORED) and report.kl(row)]
    figure, axes = plt.subplots(1, 2 if mentored else 1, figsize=(11 if mentored else 6, 4.5), squeeze=False)
    by_k = axes[0][0]
    for row in report.rows:
        points = [(k, c.mean) for k in report.num_drafts if (c := report.cell(row, k)) is not None]
        if len(points) > 1 or (points and not row.startswith(MENTORED)):
            by_k.plot(*zip(*points), marker="o", label=row, linestyle="--" if row == OPTIMUM else "-")
    by_k.set(xlabel="number of drafts K", ylabel="acceptance probability", title="acceptance vs K",
             xticks=report.num_drafts)  # fmt: skip
    by_k.legend(fontsize=8)
    if mentored:
        pareto = axes[0][1]
        divergences = [report.kl(row).mean for row in mentored]
        accepted = [report.cell(row, 1).mean for row in mentored]
        pareto.plot(divergences, accepted, marker="o", label="mentored")
        for row, x, y in zip(mentored, divergences, accepted):
            pareto.annotate(row.split(" ", 1)[1], (x, y), fontsize=8, textcoords="offset points", xytext=(4, -10))
        if (speculative := report.cell("speculative", 1)) is not None:
            pareto.scatter([0.0], [speculative.mean], color="black", zorder=3, label="speculative (KL 0)")
        pareto.set(xlabel="KL(q ‖ output), nats", ylabel="acceptance probability (K=1)", title="mentored decoding")
        pareto.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
