"""`specdec acceptance`: token-level acceptance of every verifier next to the theoretical optimum."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from ..acceptance import report
from ..acceptance.results import PROMPT_RECORDS, AcceptanceReport, AcceptanceRequest, DrafterSection, PromptAcceptance
from ..base.errors import SpecdecError, UsageError
from ..base.inputs import check_plot_path, subset
from ..base.recipe import Recipe
from ..plugins.draft_rows import round_robin
from ..plugins.drafter_registry import draft_law
from ..plugins.registry import VerifierRegistry
from ..results.store import ResultsStore
from . import common, options
from .progress import token_progress

if TYPE_CHECKING:
    from ..acceptance.analysis import AcceptanceAnalysis


_PromptArguments = Annotated[
    Optional[list[str]],
    typer.Argument(
        metavar="PROMPT", show_default=False, help="Prompts to continue (any number); or --prompt-file, or piped stdin."
    ),
]
_DraftersOption = Annotated[
    Optional[str],
    typer.Option(
        "--drafter",
        metavar="NAME[,NAME…]",
        help="Comma list of drafters (see `specdec drafters`), each evaluated on its own: the recipe's entries of it, "
        "or one with its defaults. " + options.default_note("the recipe's drafts, together"),
    ),
]
_VerifiersOption = Annotated[
    Optional[str],
    typer.Option(
        "--verifier",
        metavar="NAME[,NAME…]",
        help="Comma list of verifiers (rows). "
        + options.default_note("every installed verifier that has a per-token acceptance for these drafts"),
    ),
]
_NumDraftsOption = Annotated[
    str, typer.Option("--num-drafts", metavar="K[,K…]", help="Comma list of draft counts (columns).")
]
_KlOption = Annotated[
    Optional[str],
    typer.Option(
        "--kl",
        metavar="NATS[,NATS…]",
        help="Comma list of KL bounds D in nats: a row each for every verifier with a KL bound. "
        + options.default_note("fractions of the pair's measured KL(q‖p) on the first prompt"),
    ),
]
_DraftTemperaturesOption = Annotated[
    Optional[str],
    typer.Option(
        metavar="T[,T…]",
        help="Drafts that differ only in temperature: copies of the recipe's first draft at these temperatures.",
    ),
]
_JsonOption = Annotated[
    bool, typer.Option("--json", metavar="", help="Print the results as one JSON object instead of a table.")
]
_PlotOption = Annotated[
    Optional[Path],
    typer.Option(
        metavar="FILE.png",
        help="Draw acceptance against K, and the lossy rows' acceptance against the KL and TV they spend, to this PNG.",
    ),
]


@options.takes_option_groups
def acceptance(
    model: options.ModelOptions,
    prompt_args: _PromptArguments = None,
    prompts: Annotated[Optional[list[str]], typer.Option("--prompt", hidden=True)] = None,
    prompt_file: options.PromptFileOption = None,
    field: options.FieldOption = None,
    limit: options.LimitOption = None,
    shuffle: options.ShuffleOption = False,
    shuffle_seed: options.ShuffleSeedOption = 0,
    drafters: _DraftersOption = None,
    verifiers: _VerifiersOption = None,
    num_drafts: _NumDraftsOption = "1,2,4",
    kl: _KlOption = None,
    sweep: options.SweepOption = None,
    draft_temperatures: _DraftTemperaturesOption = None,
    exact_first: options.ExactFirstOption = None,
    temperature: options.TemperatureOption = None,
    as_json: _JsonOption = False,
    output: options.OutputOption = None,
    plot: _PlotOption = None,
) -> None:
    """Acceptance probability of each verifier per number of drafts, on positions the target generates."""
    common.apply_threads(model.threads)
    temperatures = common.parse_list(draft_temperatures, float, "--draft-temperatures")
    flags = common.RecipeOptions.of(
        model, temperature=temperature, draft_temperatures=temperatures or None, exact_first=exact_first
    )
    resolved, registry = flags.resolve(), flags.registry
    common.check_hub_models(resolved)
    from ..engine.decoding import exact_verifier_name  # torch, which the verifiers below import anyway

    exact_verifier_name(resolved.speculation.exact_verifier, registry)
    # Each drafter's entries, checked (an unknown drafter, one that needs an entry): one line before models load.
    sections = DrafterSection.of_recipe(resolved, common.grid_values(drafters, str, "--drafter"))
    common.check_at_least_one(limit, "--limit")
    counts = tuple(common.parse_list(num_drafts, int, "--num-drafts"))
    common.check_flag_values("num_drafts", list(counts))
    bounds = common.parse_list(kl, float, "--kl")
    laws = [[draft_law(draft, resolved.generation) for draft in section.drafts] for section in sections]
    requested = common.parse_list(verifiers, str, "--verifier")
    names, left_out = _applicable(requested, counts, laws, registry)
    common.check_kl_bounds(bounds, names, resolved.verifier.params, registry)
    sweeps = common.run_sweeps(sweep or [], requested or names, resolved.verifier.params, registry)
    request = AcceptanceRequest(
        verifiers=tuple(names),
        num_drafts=counts,
        kl_values=tuple(bounds) if bounds else None,
        sweeps=sweeps,
        exact_first=resolved.speculation.exact_first,
    )
    texts = subset(_prompts([*(prompt_args or []), *(prompts or [])], prompt_file, field), limit, shuffle, shuffle_seed)
    check_plot_path(plot)
    _run(resolved, (request, sections), texts, left_out, output, as_json, plot, registry=registry)


def _run(
    recipe: Recipe,
    what: tuple[AcceptanceRequest, list[DrafterSection]],
    texts: list[str],
    left_out: list[str],
    output: Path | None,
    as_json: bool,
    plot: Path | None,
    *,
    registry: VerifierRegistry,
) -> None:
    """Evaluate what the results folder does not hold yet, then write and show the report (also when stopped).
    ``what``: the request and the drafter sections it is evaluated for; ``registry``: the command's, whose
    resolved verifiers its checks built."""
    from ..acceptance.analysis import AcceptanceAnalysis  # torch and transformers: only now

    request, sections = what
    store = _open_store(output, recipe, what, texts)
    err = Console(stderr=True)
    with err.status("Loading models…"):
        analysis = AcceptanceAnalysis(recipe, request, sections=sections, registry=registry)
    results = _evaluate(analysis, texts, store, err)
    first = results[0]
    if left_out:
        err.print("left out: " + "; ".join(left_out), highlight=False, soft_wrap=True)
    if analysis.kl_reference:  # derived from a pair's positive mean KL (otherwise the fixed fallback bounds)
        bounds_text = ", ".join(f"{b:g}" for b in analysis.request.kl_values)
        err.print(
            f"KL bounds {bounds_text}: 0.1, 0.3 and 1 × the pair's mean KL(q‖p) = {analysis.kl_reference:.3g} nats "
            "on the first prompt (--kl sets others)",
            highlight=False,
            soft_wrap=True,
        )
    if first.interrupted:
        err.print(f"interrupted: results over {len(first.prompts)} of {len(texts)} prompts")
    content = report.payload(recipe, analysis.request, results, analysis.decoder.device)
    _show(content, results, as_json)  # first: a full disk or a failing plot never hides the table
    if output is not None:
        _write_summary(output, content, results)
    if plot is not None:
        if len(results) > 1:
            err.print(f"--plot draws the first drafter's section ({first.drafter}); the tables show every section")
        common.write_plot(lambda: report.plot(plot, first, content), plot)
    if first.interrupted:
        raise typer.Exit(130)


def _show(content: dict, results: list[AcceptanceReport], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(content, indent=2) + "\n")
        return
    # Piped output has no terminal width: give the table room rather than cutting its cells.
    console = Console(width=None if sys.stdout.isatty() else 160)
    for section in results:
        console.print(report.table(section))


def _write_summary(output: Path, content: dict, results: list[AcceptanceReport]) -> None:
    try:
        report.write(output, content, results)  # each file replaced whole: a failed write leaves the previous one
    except OSError as error:
        raise SpecdecError(
            f"could not write the summary in '{output}' ({error.strerror}); every prompt's values are "
            "kept in samples.jsonl: free some space and run the same command again"
        ) from None


def _evaluate(
    analysis: "AcceptanceAnalysis", texts: list[str], store: ResultsStore, err: Console
) -> list[AcceptanceReport]:
    """Every (drafter section, prompt) the store does not hold yet, written to it prompt by prompt, under a
    progress bar."""
    done = [PromptAcceptance.from_record(record) for record in store.records.values()]
    if store.dropped_cut_line:
        err.print(
            "note: the last prompt line was cut short (a killed run or a full disk); it was dropped and runs again"
        )
    budget = analysis.recipe.generation.max_new_tokens
    sections_done = Counter(result.prompt_index for result in done)
    finished = sum(count == len(analysis.sections) for count in sections_done.values())  # prompts wholly done
    if (resumed := store.resume_note(finished, len(texts), unit="prompts")) is not None:
        err.print(f"note: {resumed}", highlight=False, soft_wrap=True)
    with token_progress(len(texts) * budget, completed=finished * budget, label="prompts") as progress:

        def written(results: list[PromptAcceptance]) -> None:
            for result in results:
                store.append(result.to_record())
            progress.advance(budget - results[0].positions)  # the budget an early EOS left unused

        reports = analysis.run_sections(texts, on_prompt=written, done=done, on_tokens=progress.advance)
    store.close()
    return reports


def _open_store(
    output: Path | None, recipe: Recipe, what: tuple[AcceptanceRequest, list[DrafterSection]], texts: list[str]
) -> ResultsStore:
    """The prompts' results, written to ``output`` as they come (resumed from it): checked, locked
    and compared with the folder's configuration before any model loads. ``what``: the request and its drafter
    sections; the sections are written only when named (``--drafter``), so older folders resume."""
    request, sections = what
    named = [section.drafter for section in sections if section.drafter is not None]
    config = {
        "recipe": recipe.to_dict(),
        # Sweeps and exact_first only when given, so that folders of before them resume.
        "request": {
            key: value
            for key, value in dataclasses.asdict(request).items()
            if key not in ("sweeps", "exact_first") or value
        },
        "prompts": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16],
        **({"drafters": named} if named else {}),
    }
    exact = [recipe.speculation.exact_verifier] if request.exact_first else []  # its decisions are in the values
    revisions = VerifierRegistry().revisions([*request.verifiers, *exact])
    return ResultsStore(output, config, kind=PROMPT_RECORDS, revisions=revisions)


def _applicable(
    names: list[str], num_drafts: tuple[int, ...], section_laws: list[list[Hashable]], registry: VerifierRegistry
) -> tuple[list[str], list[str]]:
    """The verifiers (default: every installed one) that have a per-token acceptance for some K of
    ``num_drafts`` in some drafter section (K rows taken in turn from its draft configs, whose laws are keyed by
    ``section_laws``), and why each other one is left out. Checked before any model loads."""
    kept, left_out = [], []
    # A recipe without drafts is refused, in its own words, when the analysis is set up.
    rows = [round_robin(laws or [None], k) for laws in section_laws for k in num_drafts]
    for name in [registry.canonical(n) for n in names] or registry.names():
        cls = registry.verifier_class(name)
        reasons = [registry.refusal(name, row) for row in rows]
        if not cls.token_level:
            left_out.append(f"{name} (decides whole blocks, so it has no per-token acceptance; compare it with bench)")
        elif all(reasons):
            left_out.append(f"{name} ({reasons[0]})")
        else:
            kept.append(name)
    if not kept:
        raise UsageError("no verifier has a per-token acceptance for these drafts: " + "; ".join(left_out))
    return kept, left_out


def _prompts(prompts: list[str] | None, prompt_file: Path | None, field: str | None) -> list[str]:
    if prompts and prompt_file is not None:
        return list(prompts) + common.read_prompts(None, prompt_file, sys.stdin, field)
    if prompts:
        return list(prompts)
    return common.read_prompts(None, prompt_file, sys.stdin, field)
