"""`specdec acceptance`: token-level acceptance of every verifier next to the theoretical optimum."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..acceptance import AcceptanceAnalysis, AcceptanceReport, AcceptanceRequest, PromptAcceptance, report
from ..acceptance.results import PROMPT_RECORDS
from ..inputs import check_plot_path
from ..recipe import Recipe
from ..results_store import ResultsStore
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
    kl: Annotated[str, typer.Option("--kl", help="Comma list of KL bounds D in nats: a row each for every verifier with a KL bound.")] = "0.05,0.2,0.5",
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
    plot: Annotated[Optional[Path], typer.Option(help="Draw acceptance vs K, and acceptance vs KL for verifiers with a KL bound, to a PNG.")] = None,
) -> None:
    """Acceptance probability of each verifier per number of drafts, on positions the target generates."""
    temperatures = common.parse_list(draft_temperatures, float, "--draft-temperatures")
    options = common.RecipeOptions(
        recipe=recipe, sets=sets or [], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, device=device, dtype=dtype, chat=chat, draft_temperatures=temperatures or None,
    )  # fmt: skip
    resolved = options.resolve()
    names = common.parse_list(verifiers, str, "--verifier") or VerifierRegistry().names()
    request = AcceptanceRequest(
        verifiers=tuple(names), num_drafts=tuple(common.parse_list(num_drafts, int, "--num-drafts")),
        kl_values=tuple(common.parse_list(kl, float, "--kl")),
    )  # fmt: skip
    texts = _prompts(prompts, prompt_file, field)
    check_plot_path(plot)
    store = _open_store(output, resolved, request, texts)
    err = Console(stderr=True)
    with err.status("Loading models…"):
        analysis = AcceptanceAnalysis(resolved, request)
    results = _evaluate(analysis, texts, store, err)
    if results.interrupted:
        err.print(f"interrupted: results over {len(results.prompts)} of {len(texts)} prompts")
    content = report.payload(resolved, request, results, analysis.decoder.device)
    if output is not None:
        report.write(output, content, results)
    _show(content, results, as_json, plot)
    if results.interrupted:
        raise typer.Exit(130)


def _show(content: dict, results: AcceptanceReport, as_json: bool, plot: Path | None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(content, indent=2) + "\n")
    else:
        # Piped output has no terminal width: give the table room rather than cutting its cells.
        Console(width=None if sys.stdout.isatty() else 160).print(report.table(results))
    if plot is not None:  # after the table: a failing plot never hides it
        common.write_plot(lambda: report.plot(plot, results), plot)


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
