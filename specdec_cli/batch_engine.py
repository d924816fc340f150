"""Batched speculative decoding: B sequences (prompts × samples) advance together, each at its own pace.

A step is the engine's block (:mod:`specdec_cli.engine`) for every sequence of the batch at once:

1. every drafter proposes for every sequence (:meth:`~specdec_cli.drafting.Drafter.propose_batch`: the model
   drafter runs one forward per position for all rows; a drafter without batch methods is run once per
   sequence); each sequence's block length is its own (its drafters' proposals, its remaining tokens);
2. the target scores all B × K rows in one forward (:class:`~specdec_cli.batch_session.BatchSession`);
3. the verifier decides every sequence's block (:meth:`~specdec_cli.verifiers.BlockVerifier.verify_batch`), one
   call per distinct block shape (all of them, but near the end of an output or with prompt lookup);
4. EOS, finiteness and every model's longest-agreeing row are folded in on the device, and the step reads the
   device once for the whole batch; each sequence then commits its own tokens and keeps its own cache rows.

Sequences that finish leave the batch after the step and waiting ones join it, so a long answer does not hold
the others. A sequence's draws are keyed by its own (seed, prompt, sample) and its own block starts, so its
tokens do not depend on what else is in its batch, up to the float rounding of batched forwards.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .batch_session import BatchSession, pad_to
from .drafting import (
    BatchDraftRequest,
    BatchProposal,
    Drafter,
    DraftRequest,
    batch_proposal_problem,
    block_length,
    empty_proposal,
)  # fmt: skip
from .errors import SpecdecError, is_allocation_error, requested_memory
from .randomness import BatchRandomness, Draws, Stream, block_generator, sample_key
from .sampling import sample_with
from .stats import GenerationResult, SampleStats
from .timing import RegionTimer
from .verifiers import BatchDecision, batch_decision_problem, batch_departs_from_drafts, decision_value_problem

if TYPE_CHECKING:
    from .engine import SpeculativeDecoder

_REGIONS = ("draft", "target", "verify", "forward")


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
    mask: list[bool] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.committed) - self.start


class _SequenceDrafters:
    """A drafter without batch methods, run as one instance per sequence of the batch (one call each)."""

    def __init__(self, decoder: "SpeculativeDecoder", index: int) -> None:
        self.decoder, self.index = decoder, index
        self.instances: list[Drafter] = []
        template = decoder.drafters[index]
        self.name, self.rows, self.uses_model = template.name, template.rows, template.uses_model

    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        for prompt in prompts:
            drafter = self.decoder._drafters()[0][self.index]  # a fresh, set-up instance of this entry's drafter
            self.decoder._call_drafter(drafter, "start", drafter.start, prompt)
            self.instances.append(drafter)

    def remove_sequences(self, kept: list[int]) -> None:
        self.instances = [self.instances[b] for b in kept]

    def propose_batch(self, request: BatchDraftRequest) -> BatchProposal:
        vocab, device = self.decoder.vocab_size, self.decoder.device
        proposals = []
        for b, drafter in enumerate(self.instances):
            length = request.max_lengths[b]
            if not length:  # as alone: a sequence with one token left asks no drafter
                proposals.append(empty_proposal(self.rows, vocab, device))
                continue
            one = DraftRequest(request.contexts[b], length, request.uniforms[b, :length], request.sampling_law,
                               request.timer)  # fmt: skip
            proposals.append(self.decoder.checked_proposal(drafter, one))
        width, dtype = max(request.max_lengths), proposals[0].laws.dtype
        tokens = torch.zeros(len(proposals), self.rows, width, dtype=torch.long, device=device)  # [B, rows, n]
        laws = torch.zeros(len(proposals), self.rows, width, vocab, dtype=dtype, device=device)  # [B, rows, n, V]
        for b, proposal in enumerate(proposals):
            tokens[b, :, : proposal.length] = proposal.tokens
            laws[b, :, : proposal.length] = proposal.laws
        finite = torch.stack([proposal.finite for proposal in proposals]).all()  # []
        forwards = max(proposal.forwards for proposal in proposals)  # per sequence, as the batched drafters count
        return BatchProposal(tokens, laws, finite, [proposal.length for proposal in proposals], forwards)

    def keep_batch(self, rows: list[int], lengths: list[int]) -> None:
        for drafter, row, length in zip(self.instances, rows, lengths):
            self.decoder._call_drafter(drafter, "keep", drafter.keep, row, length)


class BatchDecoding:
    """One batched run of a decoder: sequences join up to ``batch_size`` at a time, and leave when done."""

    def __init__(self, decoder: "SpeculativeDecoder", batch_size: int) -> None:
        self.decoder = decoder
        self.batch_size = batch_size
        self.device = decoder.device
        self.target = BatchSession(decoder.target, decoder.vocab_size)
        self.drafters = [drafter if type(drafter).batched else _SequenceDrafters(decoder, index)
                         for index, drafter in enumerate(decoder.drafters)]  # fmt: skip
        for drafter in self.drafters:  # a batched drafter may hold the sequences of an interrupted run
            decoder._call_drafter(drafter, "keep", drafter.remove_sequences, [])
        rows = [drafter.rows for drafter in decoder.drafters]  # [drafters]
        self.lanes = list(itertools.accumulate([0, *rows]))  # drafter j's rows are lanes[j] .. lanes[j+1] - 1
        self.sequences: list[_Sequence] = []
        self.timer = RegionTimer(self.device)

    def run(self, jobs: list[SequenceJob]) -> Iterator[GenerationResult]:
        """Every job's result, yielded as each finishes (not in the jobs' order)."""
        waiting = list(jobs)
        with torch.inference_mode(), self._memory_guard():
            while waiting or self.sequences:
                began = time.perf_counter()
                free = self.batch_size - len(self.sequences)
                if waiting and free:
                    self._join(waiting[:free])
                    waiting = waiting[free:]
                finished = self._step()
                share = (time.perf_counter() - began) / len(self.sequences)  # the step ended in a read: all of it ran
                for sequence in self.sequences:
                    sequence.stats.share_time_s += share
                if finished:
                    yield from self._leave(finished)

    @contextmanager
    def _memory_guard(self) -> Iterator[None]:
        """An allocation this machine cannot make becomes one line naming what to lower."""
        try:
            yield
        except (RuntimeError, MemoryError) as error:
            if not is_allocation_error(error):
                raise
            raise SpecdecError(f"out of memory{requested_memory(error)} decoding a batch of {self.batch_size}; lower "
                               "--batch-size, --max-new-tokens, --num-drafts or --draft-length") from error

    def _join(self, jobs: list[SequenceJob]) -> None:
        decoder = self.decoder
        contexts = [decoder.target.decoder_start_ids if decoder.target.is_encoder_decoder else list(job.prompt_ids)
                    for job in jobs]  # fmt: skip
        prompts = [job.prompt_ids for job in jobs]
        self.target.add(prompts, contexts, self.timer)
        for drafter in self.drafters:
            decoder._call_drafter(drafter, "start", drafter.add_sequences, prompts, contexts, self.timer)
        regions = {name: self.timer.seconds(name) for name in _REGIONS}
        for job, context in zip(jobs, contexts):
            key = job.key
            if key is None:
                key = sample_key(decoder.config.seed, job.prompt_index, job.sample_index)
            stats = SampleStats(prompt_tokens=len(job.prompt_ids))
            self.sequences.append(_Sequence(job, key, list(context), len(context), stats, time.perf_counter(), regions))
        self.draws = Draws.batch([sequence.key for sequence in self.sequences], self.device)

    def _step(self) -> list[int]:
        """One block for every sequence → the indices of those that finished."""
        decoder, sequences = self.decoder, self.sequences
        max_new = decoder.config.generation.max_new_tokens
        limits = [min(decoder.draft_length, max_new - sequence.generated - 1) for sequence in sequences]  # [B]
        self.draws.block_start.copy_(torch.tensor([sequence.generated for sequence in sequences]))
        contexts = [sequence.committed for sequence in sequences]
        with self.timer.region("draft"):
            drafted = self._draft(contexts, limits)
        with self.timer.region("target"):
            target_probs, target_finite = self._score(contexts, drafted)  # [B, K, n+1, V], []
        with self.timer.region("verify"):
            values = self._decide(target_probs, target_finite, drafted)
            return self._commit(values, drafted)

    # ----------------------------------------------------------------------- the step's stages

    def _draft(self, contexts: list[list[int]], limits: list[int]) -> "_BatchDrafted":
        """Every drafter's proposals, the model drafters asked last for what the others leave to verify."""
        batch, width = len(contexts), max(limits)
        uniforms = self.draws.batch_uniforms(Stream.DRAFT, max(width, 1), self.lanes[-1] or 1)  # [B, L, K]
        proposals: list[BatchProposal | None] = [None] * len(self.drafters)
        lengths = list(limits)
        asked: list[list[int]] = [[]] * len(self.drafters)  # [drafters][B]: what each drafter was asked for
        for runs_model in (False, True):
            for index, drafter in enumerate(self.drafters):
                if drafter.uses_model != runs_model:
                    continue
                asked[index] = lengths
                if max(lengths) == 0:
                    proposals[index] = _empty(batch, drafter.rows, self.decoder.vocab_size, self.device)
                    continue
                lanes = uniforms[:, : max(lengths), self.lanes[index] : self.lanes[index + 1]]  # [B, n, K_j]
                request = BatchDraftRequest(contexts, lengths, lanes, self.decoder._sampling_law, self.timer)
                proposals[index] = self._proposal(drafter, request)
            if not runs_model:
                lengths = [block_length([p.lengths[b] for p in proposals if p is not None], limit)
                           for b, limit in enumerate(limits)]  # fmt: skip
        for b, sequence in enumerate(self.sequences):  # a model drafter ran as many forwards as it drafted for b
            sequence.stats.draft_forwards += sum(min(p.forwards, asked[j][b]) for j, p in enumerate(proposals))
        return _BatchDrafted.of(proposals, batch, self.decoder.vocab_size, self.device)

    def _proposal(self, drafter: Any, request: BatchDraftRequest) -> BatchProposal:
        """``drafter``'s batch proposal, checked on the host: a plugin's exception or a bad proposal is one line."""
        decoder = self.decoder
        proposal = decoder._call_drafter(drafter, "propose", drafter.propose_batch, request)
        problem = batch_proposal_problem(proposal, len(request.contexts), drafter.rows, request.max_lengths,
                                         decoder.vocab_size, self.device)  # fmt: skip
        if problem is not None:
            raise decoder.drafter_registry.fault(drafter.name, problem)
        return proposal

    def _score(self, contexts: list[list[int]], drafted: "_BatchDrafted") -> tuple[torch.Tensor, torch.Tensor]:
        """The target's laws after every prefix of every row of every sequence ``[B, K, n+1, V]``, and whether all
        are finite ``[]``."""
        batch, rows, width = drafted.tokens.shape
        self.target.fan_out(rows)
        repeated = [context for context in contexts for _ in range(rows)]
        tokens = drafted.tokens.reshape(batch * rows, width)  # [B K, n]
        logits = self.target.forward(repeated, tokens, width + 1, self.timer)  # [B K, n+1, V]
        probs, finite = self.decoder._sampling_law(logits, self.decoder.target_params)  # [B K, n+1, V], [B K, n+1]
        for sequence in self.sequences:
            sequence.stats.target_forwards += 1
        return probs.view(batch, rows, width + 1, -1), finite.all()

    def _decide(self, target_probs: torch.Tensor, target_finite: torch.Tensor, drafted: "_BatchDrafted") -> list[int]:
        """Every sequence's decision, EOS, flags and longest-agreeing rows, packed and read in the step's one read."""
        decision, local_rows = self._decisions(target_probs, drafted)
        count = count_to_eos(decision, self.decoder.eos_tensor)  # [B]
        departs = batch_departs_from_drafts(decision, drafted.tokens)  # [B]
        positions = torch.arange(drafted.tokens.shape[2], device=self.device)  # [n]
        verified = positions < torch.tensor(drafted.lengths, device=self.device).view(-1, 1)  # [B, n]
        matches = [longest_matches(drafted.tokens[:, self.lanes[j] : self.lanes[j + 1]], decision.tokens, count,
                                    verified & torch.tensor(proposed, device=self.device).view(-1, 1))
                   for j, proposed in enumerate(drafted.proposed)]  # fmt: skip
        packed = torch.cat([
            decision.tokens.flatten(), decision.num_accepted, decision.row, local_rows, count, departs.long(),
            target_finite.long().view(1), drafted.finite.long(), drafted.in_vocab.long(),
            *(torch.cat(match) for match in matches),
        ])  # fmt: skip
        return packed.tolist()  # the step's one device read

    def _decisions(self, target_probs: torch.Tensor, drafted: "_BatchDrafted") -> tuple[BatchDecision, torch.Tensor]:
        """The verifier's decision for each group of sequences with one block shape (length, rows that proposed),
        as one batch ``[B, L+1]``, and each sequence's row among those that proposed ``[B]``."""
        batch, _, width = drafted.tokens.shape
        tokens = torch.zeros(batch, width + 1, dtype=torch.long, device=self.device)  # [B, n+1]
        num_accepted = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]
        rows = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]: among all K rows
        local = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B]: among the rows that proposed
        for (length, present), members in drafted.groups().items():
            index = torch.tensor(members, device=self.device)  # [G]
            present_rows = torch.tensor(present, device=self.device)  # [K']
            if length == 0:  # no draft token: the target's own token, stream TARGET (as the engine draws it)
                uniforms = self._draws_of(members).batch_uniforms(Stream.TARGET, 1, 1)[:, 0, 0]  # [G]
                group = BatchDecision(sample_with(target_probs[index, 0, 0], uniforms).view(-1, 1),
                                      index * 0, index * 0)  # fmt: skip
            else:
                group = self._verify(target_probs[index][:, present_rows, : length + 1],
                                     drafted.laws[index][:, present_rows, :length],
                                     drafted.tokens[index][:, present_rows, :length], members)  # fmt: skip
            tokens[index, : length + 1] = group.tokens
            num_accepted[index], local[index] = group.num_accepted, group.row
            rows[index] = present_rows[group.row.clamp(0, len(present) - 1)]
        return BatchDecision(tokens, num_accepted, rows), local

    def _verify(self, target_probs, draft_probs, draft_tokens, members: list[int]) -> BatchDecision:
        """``verify_batch`` for the sequences ``members``, its exceptions and its decision's form checked as the
        engine checks ``verify_block``'s."""
        decoder = self.decoder
        verifier = decoder.verifier
        sequences = [self.sequences[b] for b in members]
        randomness: BatchRandomness = self._draws_of(members) if verifier.keyed_randomness else [
            block_generator(sequence.key, sequence.generated, self.device) for sequence in sequences]  # fmt: skip
        decision = decoder.guarded_decision(verifier.verify_batch, target_probs, draft_probs, draft_tokens, randomness)
        problem = batch_decision_problem(decision, len(members), draft_tokens.shape[2] + 1, self.device)
        if problem is not None:
            raise decoder.registry.fault(verifier.name, problem)
        return decision.as_long()

    def _draws_of(self, members: list[int]) -> Draws:
        index = torch.tensor(members, device=self.device)
        return Draws(self.draws.key[index], self.draws.block_start[index])

    # ----------------------------------------------------------------------- after the read

    def _commit(self, values: list[int], drafted: "_BatchDrafted") -> list[int]:
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
        decoder.check_block_flags(bool(target_finite), drafts_finite, in_vocab)
        for b, sequence in enumerate(sequences):
            if drafted.lengths[b]:
                present = drafted.present[b]
                problem = decision_value_problem(tokens[b][: drafted.lengths[b] + 1], num_accepted[b], local[b],
                                                 bool(departs[b]), len(present), decoder.vocab_size)  # fmt: skip
                if problem is not None:
                    raise decoder.registry.fault(decoder.verifier.name, problem)
        before = [len(sequence.committed) for sequence in sequences]
        self.target.keep([b * drafted.tokens.shape[1] + rows[b] for b in range(batch)],
                         [before[b] + min(num_accepted[b], count[b] - 1) for b in range(batch)])  # fmt: skip
        for drafter, (match_rows, agreeing) in zip(self.drafters, matches):
            lengths = [before[b] + min(agreeing[b], count[b] - 1) for b in range(batch)]
            decoder._call_drafter(drafter, "keep", drafter.keep_batch, match_rows, lengths)
        return [b for b in range(batch) if self._commit_sequence(sequences[b], tokens[b][: count[b]],
                                                                 min(num_accepted[b], count[b]), drafted.lengths[b])]

    def _commit_sequence(self, sequence: _Sequence, new_tokens: list[int], num_accepted: int, length: int) -> bool:
        """Commit one sequence's tokens and record its block → whether it is done."""
        accepted = [i < num_accepted for i in range(len(new_tokens))]
        sequence.stats.record_block(length, min(len(new_tokens), length), sum(accepted))
        sequence.committed += new_tokens
        sequence.mask += accepted
        if sequence.job.on_block is not None:
            sequence.job.on_block(new_tokens, accepted)
        eos = any(token in self.decoder.eos_ids for token in new_tokens)
        if eos or sequence.generated >= self.decoder.config.generation.max_new_tokens:
            sequence.stats.stop_reason = "eos" if eos else "max_new_tokens"
            return True
        return False

    def _leave(self, finished: list[int]) -> Iterator[GenerationResult]:
        """The finished sequences' results; the others stay, in order."""
        kept = [b for b in range(len(self.sequences)) if b not in finished]
        done = [self.sequences[b] for b in finished]
        self.target.select(kept)
        for drafter in self.drafters:
            self.decoder._call_drafter(drafter, "keep", drafter.remove_sequences, kept)
        self.sequences = [self.sequences[b] for b in kept]
        self.draws = Draws.batch([sequence.key for sequence in self.sequences], self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for sequence in done:
            yield self._result(sequence)

    def _result(self, sequence: _Sequence) -> GenerationResult:
        stats = sequence.stats
        stats.wall_time_s = time.perf_counter() - sequence.began
        for name in _REGIONS:  # the batch's time in each region while this sequence was in it
            setattr(stats, f"{name}_time_s", self.timer.seconds(name) - sequence.regions_at_start[name])
        stats.new_tokens = sequence.generated
        job = sequence.job
        tokens = sequence.committed[sequence.start :]
        text = self.decoder.target.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationResult(job.prompt, job.prompt_index, job.sample_index, tokens, text, stats, sequence.mask)


@dataclass
class _BatchDrafted:
    """A step's draft rows for every sequence: all drafters' rows side by side, cut to each sequence's length."""

    tokens: torch.Tensor  # [B, K, n]: every drafter's rows (filler where a drafter proposed nothing or less)
    laws: torch.Tensor  # [B, K, n, V]
    finite: torch.Tensor  # [drafters] bool
    in_vocab: torch.Tensor  # [drafters] bool
    lengths: list[int]  # [B]: each sequence's block length
    present: list[tuple[int, ...]]  # [B]: the rows (of K) whose drafter proposed for the sequence
    proposed: list[list[bool]]  # [drafters][B]: the drafter proposed something for the sequence

    @classmethod
    def of(cls, proposals: list[BatchProposal], batch: int, vocab_size: int, device: torch.device) -> "_BatchDrafted":
        """The rows of every drafter's proposal. A sequence's block is as long as its shortest non-empty proposal (as
        alone: :class:`~specdec_cli.engine._Drafted`), and the step's tensors as long as its longest block. Token
        ids outside the vocabulary are told by ``in_vocab`` in the step's read and clamped until then."""
        lengths = [min((p.lengths[b] for p in proposals if p.lengths[b]), default=0) for b in range(batch)]  # [B]
        width = max(lengths, default=0)
        blocks = proposals or [_empty(batch, 1, vocab_size, device)]  # the target alone: an empty row
        tokens = torch.cat([pad_to(p.tokens[:, :, :width], width, 2) for p in blocks], 1)  # [B, K, n]
        laws = torch.cat([pad_to(p.laws[:, :, :width], width, 2) for p in blocks], 1)  # [B, K, n, V]
        flags = [torch.stack([p.finite, ((p.tokens >= 0) & (p.tokens < vocab_size)).all()]) for p in proposals]
        finite, in_vocab = torch.stack(flags, 1) if flags else torch.ones(2, 0, dtype=torch.bool, device=device)
        proposed = [[n > 0 for n in p.lengths] for p in proposals]  # [drafters][B]
        ends = list(itertools.accumulate([0] + [p.tokens.shape[1] for p in proposals]))  # drafter j: ends[j]..
        present = [tuple(row for j, of_j in enumerate(proposed) if of_j[b] for row in range(ends[j], ends[j + 1]))
                   or (0,) for b in range(batch)]  # fmt: skip
        return cls(tokens.clamp(0, vocab_size - 1), laws, finite, in_vocab, lengths, present, proposed)

    def groups(self) -> dict[tuple[int, tuple[int, ...]], list[int]]:
        """Sequences by block shape (length, rows that proposed), in order."""
        grouped: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for b, (length, present) in enumerate(zip(self.lengths, self.present)):
            grouped.setdefault((length, present), []).append(b)
        return grouped


def _empty(batch: int, rows: int, vocab_size: int, device: torch.device) -> BatchProposal:
    """No tokens for any sequence (a step whose sequences all have one token left)."""
    tokens = torch.empty(batch, rows, 0, dtype=torch.long, device=device)  # [B, rows, 0]
    laws = torch.empty(batch, rows, 0, vocab_size, device=device)  # [B, rows, 0, V]
    return BatchProposal(tokens, laws, torch.ones((), dtype=torch.bool, device=device), [0] * batch)


def count_to_eos(decision: BatchDecision, eos: torch.Tensor) -> torch.Tensor:
    """How many tokens each block commits ``[B]``: through its first EOS (of ``eos`` ``[ids]``), if one comes before
    its end. The engine's block is a batch of one."""
    count = decision.num_accepted + 1  # [B]
    if eos.numel() == 0:
        return count
    positions = torch.arange(decision.tokens.shape[1], device=eos.device)  # [n+1]
    is_eos = torch.isin(decision.tokens, eos) & (positions < count.view(-1, 1))  # [B, n+1]
    return torch.where(is_eos.any(1), is_eos.to(torch.uint8).argmax(1) + 1, count)


def longest_matches(
    rows: torch.Tensor, block_tokens: torch.Tensor, count: torch.Tensor, verified: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each block, the row of ``rows`` ``[B, K_j, n]`` that agrees longest with its first ``count`` ``[B]``
    committed tokens (``block_tokens`` ``[B, n+1]``), within its ``verified`` positions ``[B, n]`` (None: all)
    → (rows ``[B]``, lengths ``[B]``). The engine's block is a batch of one."""
    width = rows.shape[2]
    if rows.shape[1] == 0 or width == 0:
        zeros = count * 0
        return zeros, zeros
    positions = torch.arange(width, device=rows.device)  # [n]
    committed = positions < count.view(-1, 1, 1)  # [B, 1, n]
    if verified is not None:
        committed = committed & verified[:, None]
    agrees = (rows == block_tokens[:, None, :width]) & committed  # [B, K_j, n]
    length = agrees.long().cumprod(-1).sum(-1)  # [B, K_j]
    best = length.argmax(1)  # [B]
    return best, length.gather(1, best.view(-1, 1)).squeeze(1)
