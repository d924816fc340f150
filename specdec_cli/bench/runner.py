"""The runner that generates every (grid cell, seed, example), and the checks that run before any model loads."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from ..base.errors import SpecdecError, UsageError
from ..base.randomness import sample_key
from ..base.recipe import Recipe, validate
from ..engine.decoder import DecodingRun, SequenceJob, SpeculativeDecoder
from ..models.pool import ModelPool
from ..plugins.registry import VerifierRegistry
from ..results.store import ResultsStore
from .grid import BASELINE, GridCell
from .tasks import Example, Task


@dataclass(kw_only=True)
class BenchSample:
    """One line of samples.jsonl: a (cell, seed, example) generation and its statistics."""

    cell: str
    seed: int
    example_id: str
    index: int
    category: str | None
    prompt: str
    text: str
    reference: str | None
    token_ids: list[int]
    accepted_mask: list[bool]
    stats: dict
    conditions: dict
    """:func:`~specdec_cli.results.provenance.run_conditions` of the run that made it."""

    def to_record(self) -> dict:
        return {**dataclasses.asdict(self), "new_tokens": len(self.token_ids), "wall_time_s": self.stats["wall_time_s"]}


class BenchRunner:
    """Runs every (cell, seed, example) not yet in the store; each model is loaded once for all cells."""

    def __init__(
        self,
        *,
        recipe: Recipe,
        task: Task,
        examples: list[Example],
        cells: list[GridCell],
        seeds: list[int],
        store: ResultsStore,
        conditions: dict,
        rank: int = 0,
        world_size: int = 1,
        registry: VerifierRegistry | None = None,
        template: str | None = None,
        lang_pair: tuple[str, str] = ("en", "fr"),
        pool: ModelPool | None = None,
    ):
        self.recipe = recipe
        self.examples = examples
        self.cells = cells
        self.seeds = seeds
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.registry = registry or VerifierRegistry()
        self.pool = pool if pool is not None else ModelPool()
        target = self.pool.target(recipe.target)
        self.template = template or task.template(target.is_encoder_decoder, lang_pair)
        self.conditions = conditions
        """:func:`~specdec_cli.results.provenance.run_conditions`, kept on every sample (a resume compares them)."""
        self.failures: dict[str, CellFailure] = {}
        """cell key → why that cell stopped in this run (its remaining samples are skipped)."""
        self._on_failure: Callable[[CellFailure], None] | None = None
        self.notes: list[str] = []
        """What the run said before decoding (the samples a resumed folder reuses; a model keeping the dynamic
        cache), each once."""
        self._on_note: Callable[[str], None] | None = None

    def decoder(self, cell: GridCell) -> SpeculativeDecoder:
        return SpeculativeDecoder.from_recipe(
            cell.recipe(self.recipe, self.registry), pool=self.pool, registry=self.registry
        )

    def prompt(self, example: Example) -> str:
        return self.template.replace("{source}", example.source)

    def my_examples(self) -> list[tuple[int, Example]]:
        return shard(self.examples, self.rank, self.world_size)

    def pending(self) -> int:
        return pending_samples(self.store, self.cells, self.seeds, self.my_examples())

    def run(
        self,
        on_tokens: Callable[[str, int], None] | None = None,
        on_failure: Callable[[CellFailure], None] | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        """Every pending (seed, example), each run by every cell in turn: the baseline and the cells
        see the same state of the machine, so slow drift (thermal, other load) cancels in speedups.
        ``on_tokens(cell key, count)`` follows generation, block by block. A cell whose generation
        fails (a plugin's error, NaN logits) is reported to ``on_failure`` and skipped from then on;
        the others go on. ``on_note`` hears each of :attr:`notes` as it is first said, a resumed folder's
        count of reused samples first."""
        mine = self.my_examples()
        self._on_failure, self._on_note = on_failure, on_note
        total = len(self.cells) * len(self.seeds) * len(mine)
        resumed = self.store.resume_note(total - self.pending(), total)
        self._note([resumed] if resumed else [])
        prepared = self._prepare(mine)
        for seed in self.seeds:
            for index, example in mine:
                for cell, run in prepared.items():
                    if cell.batch_size <= 1:
                        self._decode(cell, run, seed, [(index, example)], on_tokens)
            for cell, run in prepared.items():  # a batch holds several examples: each batched cell runs them together
                if cell.batch_size > 1:
                    self._decode(cell, run, seed, mine, on_tokens)

    def _prepare(self, mine: list[tuple[int, Example]]) -> dict[GridCell, _CellRun]:
        """A decoder for every cell with pending samples, each pending prompt encoded once (and so checked
        against the model's context) and one warm-up run on the first, before any sample is timed."""
        prepared = {}
        for cell in self.cells:
            pending = {
                example.id: example
                for seed in self.seeds
                for _, example in mine
                if not self.store.done((cell.key, seed, example.id))
            }
            if pending:
                decoder = self.decoder(cell)
                self._note([*decoder.cache_notes, *filter(None, [decoder.exact_first_note])])
                prompt_ids = {key: decoder.encode_prompt(self.prompt(example)) for key, example in pending.items()}
                try:
                    if cell.batch_size > 1:
                        decoder.check_batching()
                    decoder.warm_up(next(iter(prompt_ids.values())))
                except SpecdecError as error:
                    self._fail(CellFailure(cell=cell.key, example_id=None, seed=None, reason=str(error)))
                    continue
                prepared[cell] = _CellRun(decoder, prompt_ids)
        return prepared

    def _decode(
        self,
        cell: GridCell,
        run: _CellRun,
        seed: int,
        examples: list[tuple[int, Example]],
        on_tokens: Callable[[str, int], None] | None,
    ) -> None:
        """The (index, example) pairs of ``examples`` that the store lacks for ``seed``, decoded ``cell.batch_size``
        at a time; each sample is kept as it finishes, with the key it has alone (a resumed run's batches differ,
        its samples do not). A cell that failed skips them, reporting their share of the progress."""
        pending = [(index, example) for index, example in examples if not self.store.done((cell.key, seed, example.id))]
        if not pending:
            return
        if cell.key in self.failures:
            if on_tokens is not None:
                on_tokens(cell.key, len(pending) * self.recipe.generation.max_new_tokens)
            return
        by_index = dict(pending)
        decoder = run.decoder
        progress = None if on_tokens is None else (lambda _p, _s, new, _mask: on_tokens(cell.key, len(new)))
        jobs = [
            SequenceJob(
                self.prompt(example),
                index,
                0,
                run.prompt_ids[example.id],
                None if progress is None else functools.partial(progress, index, 0),
                sample_key(seed, index, 0),
            )
            for index, example in pending
        ]
        results = DecodingRun(decoder, cell.batch_size).run(jobs)
        while True:
            try:  # only the generation: a failing write (a full disk) in _keep stops the run
                result = next(results, None)
            except SpecdecError as error:
                failed = pending[0][1].id if len(pending) == 1 else None  # decoded alone: the failure is its example's
                self._fail(CellFailure(cell=cell.key, example_id=failed, seed=seed, reason=str(error)))
                return
            if result is None:
                return
            self._keep(
                cell,
                decoder,
                seed,
                result.prompt_index,
                by_index[result.prompt_index],
                result.token_ids,
                result.accepted_mask,
                result.stats.to_dict(),
                on_tokens,
            )

    def _keep(
        self,
        cell: GridCell,
        decoder: SpeculativeDecoder,
        seed: int,
        index: int,
        example: Example,
        tokens: list[int],
        mask: list[bool],
        stats: dict,
        on_tokens: Callable[[str, int], None] | None,
    ) -> None:
        """Append one sample to the store (it is on disk before the next one starts)."""
        if on_tokens is not None:
            on_tokens(cell.key, decoder.config.generation.max_new_tokens - len(tokens))  # an early EOS's unused budget
        self.store.append(
            BenchSample(
                cell=cell.key,
                seed=seed,
                example_id=example.id,
                index=index,
                category=example.category,
                prompt=self.prompt(example),
                text=decoder.target.tokenizer.decode(tokens, skip_special_tokens=True),
                reference=example.reference,
                token_ids=tokens,
                accepted_mask=mask,
                stats=stats,
                conditions=self.conditions,
            ).to_record()
        )

    def _note(self, notes: list[str]) -> None:
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
                if self._on_note is not None:
                    self._on_note(note)

    def _fail(self, failure: CellFailure) -> None:
        self.failures[failure.cell] = failure
        if self._on_failure is not None:
            self._on_failure(failure)


@dataclass(frozen=True)
class CellFailure:
    """A cell that stopped: where, and the error's one line."""

    cell: str
    example_id: str | None
    """None: it failed on its warm-up, before its first sample (``seed`` None too), or in a batch."""
    seed: int | None
    reason: str

    def summary(self) -> str:
        """'on example 3 (seed 0): <the error>', as results.json keeps it."""
        if self.example_id is None:  # a batch's failure names its seed, not one example
            where = "its warm-up" if self.seed is None else f"a batch (seed {self.seed})"
        else:
            where = f"example {self.example_id} (seed {self.seed})"
        return f"on {where}: {self.reason}"

    def line(self) -> str:
        return f"cell '{self.cell}' failed {self.summary()}; its other samples and every other cell are kept"


def shard(examples: list[Example], rank: int, world_size: int) -> list[tuple[int, Example]]:
    """(global index, example) for process ``rank``: examples are sharded by rank."""
    return [(i, e) for i, e in enumerate(examples) if i % world_size == rank]


def pending_samples(
    store: ResultsStore, cells: list[GridCell], seeds: list[int], mine: list[tuple[int, Example]]
) -> int:
    """How many (cell, seed, example) of this process the store does not hold yet."""
    return sum(not store.done((cell.key, seed, example.id)) for cell in cells for seed in seeds for _, example in mine)


@dataclass
class _CellRun:
    """A cell's decoder and its pending prompts, encoded once."""

    decoder: SpeculativeDecoder
    prompt_ids: dict[str, list[int]]
    """example id → token ids of its prompt."""


def check_cells(cells: list[GridCell], skipped: list[str], base: Recipe, registry: VerifierRegistry) -> list[str]:
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
            SpeculativeDecoder.check_recipe(recipe, registry)
        except UsageError as error:
            raise type(error)(f"grid cell '{cell.key}': {error}") from None
    taken = {
        key for c in cells if c.verifier != BASELINE for key in registry.params_for(c.verifier, base.verifier.params)
    }
    return [
        f"verifier.params.{key} is taken by no verifier of the grid; ignored"
        for key in sorted(set(base.verifier.params) - taken)
    ]


def check_conditions(records: list[dict], current: dict, folder: object) -> None:
    """Refuse to add samples measured under ``current`` conditions to a folder whose samples ran under
    others (threads, device, versions): their speeds would be pooled as if they compared."""
    for record in records:
        stored = record.get("conditions") or current  # samples written before conditions were kept
        changed = next((name for name in current if stored.get(name) != current[name]), None)
        if changed is not None:
            hint = f" (--threads {stored[changed]})" if changed == "threads" else ""
            raise UsageError(
                f"'{folder}' holds samples run with {changed} {stored.get(changed)} but this run has "
                f"{current[changed]}; speeds under other conditions do not compare: run under the same ones{hint}, "
                "pass "
                "--allow-mixed-conditions to mix them (the results flag it), or give a new --output folder"
            )
