"""One run of a decoder over a list of jobs (:class:`DecodingRun`): the block loop, draft → score → verify → commit,
for every batch size. The run is handed its step functions (:class:`~specdec_cli.engine.block_steps.Steps`: the
draft step, the target's scoring, the sampling law, each rule's verify step) and its plugins' guards
(:class:`~specdec_cli.engine.guards.PluginGuards`) as public values of its decoder; :mod:`specdec_cli.engine.decoder`
tells the loop, and docs/block-loop.md walks through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..base.errors import SpecdecError, is_allocation_error, requested_memory
from ..base.randomness import Draws, Stream, block_generator, sample_key
from ..base.recipe import DecodingConfig
from ..base.sampling import SamplingParams, sample_with
from ..base.timing import RegionTimer
from ..models.loading import LoadedModel
from ..plugins.drafting import Drafter
from ..plugins.verifiers import BatchDecision, BlockVerifier, JudgedLaws, batch_departs_from_drafts, judged_argument
from ..results.stats import GenerationResult, SampleStats
from .block_steps import Steps, TargetLaws, VerifyStep
from .draft_schedule import next_draft_length
from .drafted import Drafted, count_to_eos, longest_matches
from .guards import PluginGuards
from .session import ModelSession
from .stopping import cut_at_stop, tokens_through_stop

BlockCallback = Callable[[int, int, list[int], list[bool]], None]
"""on_block(prompt_index, sample_index, new_token_ids, accepted_mask) after each committed block."""


class RunDecoder(Protocol):
    """What a run reads of its decoder (:class:`~specdec_cli.engine.building.SpeculativeDecoder`)."""

    config: DecodingConfig
    target: LoadedModel
    drafters: list[Drafter]
    steps: Steps
    guards: PluginGuards
    vocab_size: int
    device: torch.device
    target_params: SamplingParams
    eos_ids: set[int]
    eos_tensor: torch.Tensor
    exact_first: int
    draft_length: int
    running: AbstractContextManager
    """Held by the generation under way: a run from another thread waits its turn."""

    @property
    def cache_headroom(self) -> int | None: ...

    @property
    def judged_view(self) -> str | None: ...

    def rule(self, exact: bool) -> tuple[BlockVerifier, VerifyStep]: ...

    def memory_advice(self, batch_size: int, stats: SampleStats | None) -> str: ...


@dataclass
class SequenceJob:
    """One sample to generate: its prompt, where it stands in the run, and its prompt's ids."""

    prompt: str
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    on_block: Callable[[list[int], list[bool]], None] | None = None
    key: int | None = None
    """Its randomness (:func:`~specdec_cli.randomness.sample_key`); None: the key of (the decoder's seed, prompt index,
    sample index)."""


@dataclass
class _Sequence:
    """A sequence in the batch: what it has committed and its stats so far."""

    job: SequenceJob
    key: int
    committed: list[int]
    start: int
    stats: SampleStats
    began: float
    regions_at_start: dict[str, float]
    draft_length: int
    """Tokens its next block drafts at most (``speculation.draft_length_schedule``)."""
    mask: list[bool] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.committed) - self.start


_REGIONS = ("draft", "target", "verify", "forward")


class DecodingRun:
    """One run of a decoder over a list of jobs: sequences join up to ``batch_size`` at a time, and leave when done."""

    def __init__(self, decoder: RunDecoder, batch_size: int) -> None:
        self.decoder = decoder
        self.batch_size = batch_size
        self.device = decoder.device
        self.steps = decoder.steps
        speculation = decoder.config.speculation
        self.target = ModelSession(
            decoder.target, decoder.vocab_size, speculation.kv_cache, decoder.cache_headroom, speculation.compile
        )
        self.drafters = decoder.drafters
        self.lanes = self.steps.draft.lanes  # drafter j's rows are lanes[j] .. lanes[j+1] - 1
        self.sequences: list[_Sequence] = []
        self.draws: Draws | None = None  # the batch's keyed draws, set as sequences join and leave
        self.timer = RegionTimer(self.device)

    def run(self, jobs: list[SequenceJob]) -> Iterator[GenerationResult]:
        """Every job's result, yielded as each finishes (in the jobs' order at batch size 1). A decoder runs one
        generation at a time: its drafters hold their sequences' state, so a run from another thread waits for the
        one under way to end."""
        with self.decoder.running:
            self.steps.draft.reset()  # a drafter may hold the sequences of an interrupted run
            yield from self._blocks(jobs)

    def _blocks(self, jobs: list[SequenceJob]) -> Iterator[GenerationResult]:
        """The run's steps, until every job has finished."""
        waiting = list(jobs)
        while waiting or self.sequences:
            began = time.perf_counter()
            with torch.inference_mode(), self._memory_guard():
                free = self.batch_size - len(self.sequences)
                if waiting and free:
                    self._join(waiting[:free], began)
                    waiting = waiting[free:]
                finished = self._step()
                done = self._leave(finished) if finished else []
            share = (time.perf_counter() - began) / (len(self.sequences) + len(done))  # the step ended in a read
            for sequence in self.sequences + done:
                sequence.stats.share_time_s += share
            yield from (self._result(sequence) for sequence in done)

    @contextmanager
    def _memory_guard(self) -> Iterator[None]:
        """An allocation this machine cannot make (a long prompt to an encoder without a position limit, many long
        draft rows, a large batch) becomes one line naming what to lower, instead of the allocator's traceback."""
        try:
            yield
        except (RuntimeError, MemoryError) as error:
            if not is_allocation_error(error):
                raise
            stats = self.sequences[0].stats if self.sequences else None
            advice = self.decoder.memory_advice(self.batch_size, stats)
            raise SpecdecError(f"out of memory{requested_memory(error)} {advice}") from error

    def _join(self, jobs: list[SequenceJob], began: float) -> None:
        """``jobs`` join the batch in the step that ``began`` (its time counts in their wall time and their shares):
        each model reads their prompts, and their draws are keyed."""
        decoder = self.decoder
        contexts = [
            decoder.target.decoder_start_ids if decoder.target.is_encoder_decoder else list(job.prompt_ids)
            for job in jobs
        ]
        regions = {name: self.timer.seconds(name) for name in _REGIONS}
        for job, context in zip(jobs, contexts):
            key = sample_key(decoder.config.seed, job.prompt_index, job.sample_index) if job.key is None else job.key
            # One count per draft position, L of them, as vLLM's SpecDecodingStats.new(num_spec_tokens).
            stats = SampleStats(prompt_tokens=len(job.prompt_ids), accepted_per_position=[0] * decoder.draft_length)
            self.sequences.append(
                _Sequence(job, key, list(context), len(context), stats, began, regions, decoder.draft_length)
            )
        prompts = [job.prompt_ids for job in jobs]
        self.target.add(prompts, contexts, self.timer)
        self.steps.draft.start(prompts, contexts, self.timer)
        self.draws = Draws.batch([sequence.key for sequence in self.sequences], self.device)

    def _step(self) -> list[int]:
        """One block for every sequence → the indices of those that finished."""
        decoder, sequences = self.decoder, self.sequences
        max_new, exact_first = decoder.config.generation.max_new_tokens, decoder.exact_first
        # A block in the exact phase ends at exact_first: no lossy decision reaches a token before it (module doc).
        limits = [  # [B]
            min(
                sequence.draft_length,
                max_new - sequence.generated - 1,
                exact_first - sequence.generated if self._exact_phase(sequence) else max_new,
            )
            for sequence in sequences
        ]
        self.draws.block_start.copy_(torch.tensor([sequence.generated for sequence in sequences]))
        contexts = [sequence.committed for sequence in sequences]
        with self.timer.region("draft"):
            drafted = self._draft(contexts, limits)
        with self.timer.region("target"):
            target, target_finite = self._score(contexts, drafted)  # [B, K, n+1, V] each, []
        with self.timer.region("verify"):
            values = self._decide(target, target_finite, drafted)
            return self._commit(values, drafted)

    # ----------------------------------------------------------------------- the step's stages

    def _draft(self, contexts: list[list[int]], limits: list[int]) -> Drafted:
        """Every drafter's proposals (the draft step, :meth:`~specdec_cli.engine.block_steps.DraftStep.propose`)."""
        drafted, forwards = self.steps.draft.propose(contexts, limits, self.draws, self.steps.sampling_law, self.timer)
        for sequence, spent in zip(self.sequences, forwards):
            sequence.stats.draft_forwards += spent
        return drafted

    def _score(self, contexts: list[list[int]], drafted: Drafted) -> tuple[TargetLaws, torch.Tensor]:
        """The target's laws ``[B, K, n+1, V]`` and whether all are finite ``[]`` (the scoring step,
        :func:`~specdec_cli.engine.block_steps.score_target`)."""
        decoder = self.decoder
        scored = self.steps.score(
            self.target,
            contexts,
            drafted,
            self.steps.sampling_law,
            decoder.target_params,
            decoder.judged_view,
            self.timer,
        )
        for sequence in self.sequences:
            sequence.stats.target_forwards += 1
        return scored

    def _decide(self, target: TargetLaws, target_finite: torch.Tensor, drafted: Drafted) -> list[int]:
        """Every sequence's decision, EOS, flags and longest-agreeing rows, packed and read in the step's one read."""
        decision, local_rows = self._decisions(target, drafted)
        count = count_to_eos(decision, self.decoder.eos_tensor)  # [B]
        departs = batch_departs_from_drafts(decision, drafted.tokens)  # [B]
        positions = torch.arange(drafted.tokens.shape[2], device=self.device)  # [n]
        verified = positions < torch.tensor(drafted.lengths, device=self.device).view(-1, 1)  # [B, n]
        matches = [
            longest_matches(
                drafted.tokens[:, self.lanes[j] : self.lanes[j + 1]],
                decision.tokens,
                count,
                verified & torch.tensor(proposed, device=self.device).view(-1, 1),
            )
            for j, proposed in enumerate(drafted.proposed)
        ]
        packed = torch.cat(
            [
                decision.tokens.flatten(),
                decision.num_accepted,
                decision.row,
                local_rows,
                count,
                departs.long(),
                target_finite.long().view(1),
                drafted.finite.long(),
                drafted.in_vocab.long(),
                *(torch.cat(match) for match in matches),
            ]
        )
        return packed.tolist()  # the step's one device read

    def _exact_phase(self, sequence: _Sequence) -> bool:
        """Whether the sequence's next block is the exact rule's: it starts before ``exact_first``."""
        return sequence.generated < self.decoder.exact_first

    def _decisions(self, target: TargetLaws, drafted: Drafted) -> tuple[BatchDecision, torch.Tensor]:
        """The decision of each group of sequences with one block shape (length, rows that proposed) and one rule
        (the exact rule's phase or the verifier's), as one batch ``[B, L+1]``, and each sequence's row among those
        that proposed ``[B]``."""
        groups = drafted.groups([self._exact_phase(sequence) for sequence in self.sequences])
        if len(groups) == 1:  # every sequence's block has one shape and rule: decide them in place, as one group
            ((shape, members),) = groups.items()
            decision = self._decide_group(target, drafted, shape, members)
            return BatchDecision(
                decision.tokens, decision.num_accepted, self._rows_of(shape[1], decision.row)
            ), decision.row
        batch, _, width = drafted.tokens.shape
        tokens = torch.zeros(batch, width + 1, dtype=torch.long, device=self.device)  # [B, n+1]
        num_accepted = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]
        rows = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]: among all K rows
        local = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]: among the rows that proposed
        for shape, members in groups.items():
            (length, present, _), index = shape, torch.tensor(members, device=self.device)  # [G]
            group = self._decide_group(target, drafted, shape, members)
            tokens[index, : length + 1] = group.tokens
            num_accepted[index], local[index] = group.num_accepted, group.row
            rows[index] = self._rows_of(present, group.row)
        return BatchDecision(tokens, num_accepted, rows), local

    def _rows_of(self, present: tuple[int, ...], local: torch.Tensor) -> torch.Tensor:
        """Rows among all K ``[G]`` of rows ``local`` ``[G]`` among those that proposed (``present``): the same rows
        when every row proposed."""
        if present == tuple(range(self.lanes[-1] or 1)):
            return local
        return torch.tensor(present, device=self.device)[local.clamp(0, len(present) - 1)]

    def _decide_group(
        self, target: TargetLaws, drafted: Drafted, shape: tuple[int, tuple[int, ...], bool], members: list[int]
    ) -> BatchDecision:
        """The decision of the sequences ``members``, whose blocks have one ``shape``: (length in tokens, the rows that
        proposed, whether the exact rule decides them)."""
        length, present, exact = shape
        if length == 0:  # no draft token: the target's own token, stream TARGET
            uniforms = self._draws_of(members).batch_uniforms(Stream.TARGET, 1, 1)[:, 0, 0]  # [G]
            token = sample_with(_group(target.probs, members)[:, 0, 0], uniforms).view(-1, 1)  # [G, 1]
            zeros = torch.zeros(len(members), dtype=torch.long, device=self.device)  # [G]
            return BatchDecision(token, zeros, zeros)
        rows = None if len(present) == drafted.tokens.shape[1] else torch.tensor(present, device=self.device)
        judged = None  # the exact rule is another verifier, which judges by the sampling laws it is handed
        if target.judged is not None and not exact:
            judged = (_group(target.judged, members, rows, length + 1), _group(drafted.judged, members, rows, length))
        inputs = (
            _group(target.probs, members, rows, length + 1),
            _group(drafted.laws, members, rows, length),
            _group(drafted.tokens, members, rows, length),
        )
        return self._verify(*inputs, members, exact, judged)

    def _verify(
        self, target_probs, draft_probs, draft_tokens, members: list[int], exact: bool, judged: JudgedLaws = None
    ) -> BatchDecision:
        """The decision of the sequences ``members`` (``[G, ...]`` inputs) by the exact rule (``exact``) or the
        verifier: one call of that rule's verify step (its ``verify``, compiled or captured under ``--compile``), for
        a group of one as for several; its exceptions and its decision's form checked on the host (no device read).
        ``judged``: the laws the verifier judges drafts by, where it asks for others than the sampling laws."""
        verifier, verify = self.decoder.rule(exact)
        if verifier.keyed_randomness:
            randomness = self._draws_of(members)
        else:  # a generator per sequence, seeded from its key and block start (known on the host: no read)
            sequences = [self.sequences[b] for b in members]
            randomness = [block_generator(sequence.key, sequence.generated, self.device) for sequence in sequences]
        inputs = (target_probs, draft_probs, draft_tokens, randomness)
        return self.decoder.guards.guarded_decision(verifier, verify, *inputs, **judged_argument(judged))

    def _draws_of(self, members: list[int]) -> Draws:
        """The draws of the sequences ``members`` (the batch's own when they are all of it)."""
        if len(members) == len(self.sequences):
            return self.draws
        index = torch.tensor(members, dtype=torch.long, device=self.device)  # [G]
        return Draws(self.draws.key[index], self.draws.block_start[index])

    # ----------------------------------------------------------------------- after the read

    def _commit(self, values: list[int], drafted: Drafted) -> list[int]:
        """Unpack the step's read, stop on a fault, commit each sequence's tokens and crop every cache → the
        sequences that finished."""
        decoder, sequences = self.decoder, self.sequences
        batch, block = len(sequences), drafted.tokens.shape[2] + 1
        fields = iter(values[batch * block :])
        tokens = [values[b * block : (b + 1) * block] for b in range(batch)]
        num_accepted, rows, local, count, departs = ([next(fields) for _ in range(batch)] for _ in range(5))
        target_finite = next(fields)
        drafts_finite, in_vocab = ([next(fields) for _ in self.drafters] for _ in range(2))
        matches = [([next(fields) for _ in range(batch)], [next(fields) for _ in range(batch)]) for _ in self.drafters]
        decoder.guards.check_block_flags(self.drafters, bool(target_finite), drafts_finite, in_vocab)
        for b in range(batch):
            if drafted.lengths[b]:  # a verifier decided (a block without draft tokens is the engine's own draw)
                verifier, _ = decoder.rule(self._exact_phase(sequences[b]))
                decoder.guards.check_decision_values(
                    verifier,
                    tokens[b][: drafted.lengths[b] + 1],
                    num_accepted[b],
                    local[b],
                    bool(departs[b]),
                    len(drafted.present[b]),
                )
        # Rows cache the committed prefix then their own drafts; the last committed token stays uncached.
        before = [len(sequence.committed) for sequence in sequences]
        self.target.keep(
            [b * drafted.tokens.shape[1] + rows[b] for b in range(batch)],
            [before[b] + min(num_accepted[b], count[b] - 1) for b in range(batch)],
        )
        self.steps.draft.keep(
            [match_rows for match_rows, _ in matches],
            [[before[b] + min(agreeing[b], count[b] - 1) for b in range(batch)] for _, agreeing in matches],
        )
        return [
            b
            for b in range(batch)
            if self._commit_sequence(
                sequences[b], tokens[b][: count[b]], min(num_accepted[b], count[b]), drafted.lengths[b]
            )
        ]

    def _commit_sequence(self, sequence: _Sequence, new_tokens: list[int], num_accepted: int, length: int) -> bool:
        """Commit one sequence's tokens (through a stop string's last token) and record its block → whether it is
        done."""
        decoder = self.decoder
        stops = decoder.config.generation.stop
        through = tokens_through_stop(self._decode, sequence.committed[sequence.start :], new_tokens, stops)
        stopped = through is not None
        new_tokens = new_tokens[:through]
        accepted = [i < num_accepted for i in range(len(new_tokens))]
        # The verifier decided every committed position but a bonus token (which follows all L accepted).
        sequence.stats.record_block(length, min(len(new_tokens), length), sum(accepted))
        sequence.draft_length = next_draft_length(
            decoder.config.speculation.draft_length_schedule,
            sequence.draft_length,
            decoder.draft_length,
            length,
            min(num_accepted, length),
        )
        sequence.committed += new_tokens
        sequence.mask += accepted
        if sequence.job.on_block is not None:
            sequence.job.on_block(new_tokens, accepted)
        eos = any(token in decoder.eos_ids for token in new_tokens)
        if eos or stopped or sequence.generated >= decoder.config.generation.max_new_tokens:
            sequence.stats.stop_reason = "eos" if eos else "stop_string" if stopped else "max_new_tokens"
            return True
        return False

    def _leave(self, finished: list[int]) -> list[_Sequence]:
        """The finished sequences leave the batch; the others stay, in order."""
        kept = [b for b in range(len(self.sequences)) if b not in finished]
        done = [self.sequences[b] for b in finished]
        self.target.select(kept)
        self.steps.draft.remove(kept)
        self.draws = self._draws_of(kept)
        self.sequences = [self.sequences[b] for b in kept]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return done

    def _result(self, sequence: _Sequence) -> GenerationResult:
        stats = sequence.stats
        stats.wall_time_s = time.perf_counter() - sequence.began
        for name in _REGIONS:  # the batch's time in each region while this sequence was in it
            setattr(stats, f"{name}_time_s", self.timer.seconds(name) - sequence.regions_at_start[name])
        stats.new_tokens = sequence.generated
        job = sequence.job
        tokens = sequence.committed[sequence.start :]
        text = cut_at_stop(self._decode(tokens), self.decoder.config.generation.stop)
        return GenerationResult(job.prompt, job.prompt_index, job.sample_index, tokens, text, stats, sequence.mask)

    def _decode(self, tokens: list[int]) -> str:
        """The text of generated ``tokens``, as a result shows it (special tokens left out)."""
        return self.decoder.target.tokenizer.decode(tokens, skip_special_tokens=True)


def _group(tensor: torch.Tensor, members: list[int], rows: torch.Tensor | None = None, width: int | None = None):
    """``tensor`` ``[B, K, n, ...]`` narrowed to the sequences ``members``, the rows ``rows`` (None: all) and the first
    ``width`` positions: a view where it is all of them, as a block alone always is."""
    if len(members) < tensor.shape[0]:
        tensor = tensor[torch.tensor(members, device=tensor.device)]
    if rows is not None:
        tensor = tensor[:, rows]
    return tensor if width is None or width == tensor.shape[2] else tensor[:, :, :width]
