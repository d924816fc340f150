"""The benchmark grid: cells, the shared baseline, generation, and the per-cell results."""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..engine import SpeculativeDecoder, check_drafts, load_drafts, sample_seed
from ..errors import SpecdecError, UsageError
from ..models import load_model
from ..recipe import DraftConfig, Recipe, validate
from ..verifiers import VerifierRegistry, parameter_defaults
from .metrics import corpus_quality, expected_speedup, mean_and_std, speed_summary
from .store import ResultsStore
from .tasks import Example, Task

BASELINE = "none"


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid; verifier 'none' is the target-only baseline."""

    verifier: str
    kl: float | None
    num_drafts: int
    draft_length: int
    temperature: float
    draft_temperatures: tuple[float, ...] | None

    @property
    def key(self) -> str:
        if self.verifier == BASELINE:
            return f"baseline T={self.temperature:g}"
        name = self.verifier if self.kl is None else f"{self.verifier} D={self.kl:g}"
        drafts = "" if self.draft_temperatures is None else " dT=" + ",".join(f"{t:g}" for t in self.draft_temperatures)
        return f"{name} K={self.num_drafts} L={self.draft_length} T={self.temperature:g}{drafts}"

    @property
    def baseline_key(self) -> str:
        return Cell(BASELINE, None, 0, 0, self.temperature, None).key

    def recipe(self, base: Recipe, registry: VerifierRegistry) -> Recipe:
        """The base recipe with this cell's settings; the verifier gets the base's parameters it takes."""
        if self.verifier == BASELINE:
            return dataclasses.replace(base, generation=dataclasses.replace(base.generation, temperature=self.temperature))
        drafts = base.drafts
        if self.draft_temperatures is not None:
            drafts = tuple(dataclasses.replace(base.drafts[0], temperature=t) for t in self.draft_temperatures)
        params = registry.params_for(self.verifier, base.verifier.params)
        if self.kl is not None:
            params["kl"] = self.kl
        return dataclasses.replace(
            base,
            drafts=drafts,
            verifier=dataclasses.replace(base.verifier, name=self.verifier, params=params),
            speculation=dataclasses.replace(base.speculation, num_drafts=self.num_drafts, draft_length=self.draft_length),
            generation=dataclasses.replace(base.generation, temperature=self.temperature),
        )


@dataclass(frozen=True)
class Grid:
    verifiers: tuple[str, ...]
    kl: tuple[float, ...]
    num_drafts: tuple[int, ...]
    draft_lengths: tuple[int, ...]
    temperatures: tuple[float, ...]
    draft_temperatures: tuple[tuple[float, ...] | None, ...] = (None,)

    def cells(self, registry: VerifierRegistry) -> tuple[list[Cell], list[str]]:
        """Baselines first, then every valid combination; and why some combinations were left out."""
        cells = [Cell(BASELINE, None, 0, 0, t, None) for t in self.temperatures]
        skipped = []
        for name in self.verifiers:
            verifier_class = registry.load_class(registry.canonical(name))
            kls: tuple[float | None, ...] = self.kl if "kl" in parameter_defaults(verifier_class) and self.kl else (None,)
            for kl, k, length, temperature, draft_temps in itertools.product(
                kls, self.num_drafts, self.draft_lengths, self.temperatures, self.draft_temperatures
            ):
                drafts = k * (len(draft_temps) if draft_temps else 1)
                if verifier_class.max_drafts is not None and drafts > verifier_class.max_drafts:
                    skipped.append(f"{name} with {drafts} drafts (takes at most {verifier_class.max_drafts})")
                    continue
                if verifier_class.identical_drafts and draft_temps and len(set(draft_temps)) > 1:
                    skipped.append(f"{name} with drafts of different temperatures")
                    continue
                cells.append(Cell(registry.canonical(name), kl, k, length, temperature, draft_temps))
        return cells, sorted(set(skipped))


@dataclass
class Progress:
    done: int
    total: int
    cell: str


class BenchRunner:
    """Runs every (cell, seed, example) not yet in the store; models are loaded once for all cells."""

    def __init__(
        self,
        recipe: Recipe,
        task: Task,
        examples: list[Example],
        cells: list[Cell],
        seeds: list[int],
        store: ResultsStore,
        rank: int = 0,
        world_size: int = 1,
        registry: VerifierRegistry | None = None,
        template: str | None = None,
        lang_pair: tuple[str, str] = ("en", "fr"),
    ):
        self.recipe = recipe
        self.task = task
        self.examples = examples
        self.cells = cells
        self.seeds = seeds
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.registry = registry or VerifierRegistry()
        self.target = load_model(recipe.target, "target")
        self.template = template or task.template(self.target.is_encoder_decoder, lang_pair)
        self._models: dict[DraftConfig, Any] = {}

    def _load_draft(self, spec, role="draft"):
        key = dataclasses.replace(spec, temperature=None, top_k=None, top_p=None)
        if key not in self._models:
            self._models[key] = load_model(spec, role)
        return self._models[key]

    def decoder(self, cell: Cell) -> SpeculativeDecoder:
        recipe = cell.recipe(self.recipe, self.registry)
        if cell.verifier == BASELINE:
            return SpeculativeDecoder(self.target, [], None, recipe)
        verifier = self.registry.create(cell.verifier, recipe.verifier.params)
        drafts = load_drafts(recipe, self.target, loader=self._load_draft)
        return SpeculativeDecoder(self.target, drafts, verifier, recipe)

    def prompt(self, example: Example) -> str:
        return self.template.replace("{source}", example.source)

    def my_examples(self) -> list[tuple[int, Example]]:
        """(global index, example) for this process: examples are sharded by rank."""
        return [(i, e) for i, e in enumerate(self.examples) if i % self.world_size == self.rank]

    def pending(self) -> int:
        mine = self.my_examples()
        return sum(
            not self.store.done((cell.key, seed, example.id))
            for cell in self.cells for seed in self.seeds for _, example in mine
        )  # fmt: skip

    def run(self, on_sample: Callable[[Progress], None] | None = None) -> None:
        mine = self.my_examples()
        total, done = self.pending(), 0
        for cell in self.cells:
            todo = [(seed, index, example) for seed in self.seeds for index, example in mine
                    if not self.store.done((cell.key, seed, example.id))]  # fmt: skip
            if not todo:
                continue
            decoder = self.decoder(cell)
            prompt_ids = {example.id: decoder.encode_prompt(self.prompt(example)) for _, _, example in todo}
            decoder.generate_ids(prompt_ids[todo[0][2].id], seed=-1)  # warm-up, not recorded
            for seed, index, example in todo:
                tokens, mask, stats = decoder.generate_ids(prompt_ids[example.id], sample_seed(seed, index, 0))
                self.store.append({
                    "cell": cell.key, "seed": seed, "example_id": example.id, "index": index,
                    "category": example.category, "prompt": self.prompt(example),
                    "text": decoder.target.tokenizer.decode(tokens, skip_special_tokens=True),
                    "reference": example.reference, "token_ids": tokens, "new_tokens": len(tokens),
                    "accepted_mask": mask, "stats": stats.to_dict(), "wall_time_s": stats.wall_time_s,
                })  # fmt: skip
                done += 1
                if on_sample is not None:
                    on_sample(Progress(done, total, cell.key))


def summarize(config: dict, records: list[dict]) -> dict:
    """Per-cell metrics from the samples: speed pooled per seed, quality per seed, mean ± std over seeds."""
    by_cell: dict[str, dict[int, list[dict]]] = {}
    for record in records:
        by_cell.setdefault(record["cell"], {}).setdefault(record["seed"], []).append(record)
    metrics_wanted = config["task"]["metrics"]
    cells = []
    for spec in config["cells"]:
        cell = Cell(**{**spec, "draft_temperatures": tuple(spec["draft_temperatures"]) if spec["draft_temperatures"] else None})
        per_token = cell.verifier == BASELINE or token_level(cell.verifier)
        per_seed = {}
        for seed, samples in sorted(by_cell.get(cell.key, {}).items()):
            samples = sorted(samples, key=lambda r: r["index"])
            metrics = speed_summary([r["stats"] for r in samples])
            metrics.update(corpus_quality(metrics_wanted, [r["text"] for r in samples], [r["reference"] for r in samples]))
            baseline = [r for r in by_cell.get(cell.baseline_key, {}).get(seed, [])]
            if cell.verifier != BASELINE and baseline:
                _add_speedup(metrics, cell, samples, baseline, per_token)
            if not per_token:
                del metrics["token_acceptance"]  # a block-level decision has no per-token acceptance
            if config["task"]["per_category"]:
                metrics["tokens_per_second_by_category"] = _by_category(samples)
            per_seed[str(seed)] = metrics
        summary = {}
        for name in ("block_efficiency", "acceptance_rate", "token_acceptance", "tokens_per_second", "speedup",
                     "expected_speedup", "efficiency_vs_expected", "engine_overhead", "bleu", "chrf",
                     "rougeL"):  # fmt: skip
            if cell.verifier == BASELINE and name in ("acceptance_rate", "token_acceptance"):
                continue  # nothing is drafted
            values = [m[name] for m in per_seed.values() if name in m]
            if values:
                summary[name] = mean_and_std(values)
        cells.append({**spec, "key": cell.key, "per_seed": per_seed, "summary": summary})
    return {"cells": cells}


def token_level(verifier: str) -> bool:
    """Whether a verifier decides position by position (else per-token acceptance is not defined for it)."""
    registry = VerifierRegistry()
    try:
        return bool(registry.load_class(registry.canonical(verifier)).token_level)
    except SpecdecError:  # a results folder read after its plugin was uninstalled
        return True


def _add_speedup(metrics: dict, cell: Cell, samples: list[dict], baseline: list[dict], per_token: bool) -> None:
    """Speedup on the examples both runs finished; Leviathan's expected speedup from α and c.

    The expected speedup assumes each draft token is accepted independently with probability α,
    so it is left out for verifiers that decide a block jointly (``per_token`` False).
    """
    shared = {r["example_id"] for r in samples} & {r["example_id"] for r in baseline}
    mine = [r["stats"] for r in samples if r["example_id"] in shared]
    theirs = [r["stats"] for r in baseline if r["example_id"] in shared]
    rate, base = speed_summary(mine), speed_summary(theirs)
    if not base["tokens_per_second"]:
        return
    metrics["speedup"] = rate["tokens_per_second"] / base["tokens_per_second"]
    cost_ratio = rate["draft_s_per_forward"] / base["target_s_per_forward"] if base["target_s_per_forward"] else 0.0
    metrics["cost_ratio"] = cost_ratio
    if not per_token:
        return
    metrics["expected_speedup"] = expected_speedup(rate["token_acceptance"], cell.draft_length, cost_ratio)
    metrics["efficiency_vs_expected"] = metrics["speedup"] / metrics["expected_speedup"]


def _by_category(samples: list[dict]) -> dict[str, float]:
    categories: dict[str, list[dict]] = {}
    for record in samples:
        categories.setdefault(record.get("category") or "all", []).append(record["stats"])
    return {name: speed_summary(stats)["tokens_per_second"] for name, stats in sorted(categories.items())}


def environment() -> dict:
    """Versions, device, git hash and date for results.json."""
    import transformers

    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        git = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "specdec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "device": device, "git": git, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }  # fmt: skip


def check_cells(cells: list[Cell], skipped: list[str], base: Recipe, registry: VerifierRegistry) -> list[str]:
    """Every cell's recipe, verifier parameters and drafts, before the first model loads: a bad grid
    value fails here with the cell it belongs to, not after earlier cells ran. Returns notes on the
    base's verifier parameters that no verifier of the grid takes (they are ignored)."""
    if len(cells) == sum(c.verifier == BASELINE for c in cells):
        why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
        raise UsageError(f"the grid has no speculative configuration to compare with the baseline{why}")
    for cell in cells:
        try:
            recipe = cell.recipe(base, registry)
            validate(recipe)
            if cell.verifier != BASELINE:
                check_drafts(registry.create(cell.verifier, recipe.verifier.params), recipe)
        except UsageError as error:
            raise type(error)(f"grid cell '{cell.key}': {error}") from None
    taken = {key for c in cells if c.verifier != BASELINE for key in registry.params_for(c.verifier, base.verifier.params)}
    return [f"verifier.params.{key} is taken by no verifier of the grid; ignored"
            for key in sorted(set(base.verifier.params) - taken)]
