"""The step functions a :class:`~specdec_cli.engine.run.DecodingRun` is handed (:class:`Steps`): the draft step that
asks every drafter for its proposals, the target's scoring, the sampling law, and each rule's verify step, which is
the verifier's one call (:meth:`~specdec_cli.verifiers.BlockVerifier.verify`) for every group of sequences, compiled
or replayed from a CUDA graph under ``--compile``.

The draft step is also how ``acceptance`` asks a drafter for its laws (:mod:`specdec_cli.acceptance.proposing`): one
code path asks drafters for proposals, whoever asks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..base.randomness import Draws, Stream
from ..base.sampling import SamplingParams, judged_params
from ..base.timing import RegionTimer
from ..plugins.drafting import Drafter, DraftRequest, Proposal, block_length, empty_proposal
from ..plugins.verifiers import BlockVerifier
from .drafted import Drafted
from .graphs import CapturedVerifyStep
from .guards import PluginGuards
from .session import ModelSession

VerifyStep = Callable[..., object]
"""A rule's verify step: ``verify(target_probs [B, K, L+1, V], draft_probs [B, K, L, V], draft_tokens [B, K, L],
randomness, judged=...) -> Decision``, the verifier's one call or its compiled or captured form."""


@dataclass(frozen=True)
class TargetLaws:
    """The target's laws of a step ``[B, K, n+1, V]``: the sampling laws, and the ones the verifier judges drafts by
    where it asks for others (its ``judged_laws``; None otherwise)."""

    probs: torch.Tensor
    judged: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftStep:
    """Every drafter's part in a block: starting and ending sequences, proposals, and the rows each keeps.

    ``drafters`` in recipe order; drafter j's rows are lanes ``lanes[j] .. lanes[j+1] - 1`` of the block's K."""

    drafters: list[Drafter]
    guards: PluginGuards
    judged_view: str | None = None
    """The laws the run's verifier judges drafts by besides the sampling ones (``judged_laws``), or None."""

    @property
    def lanes(self) -> list[int]:
        return list(itertools.accumulate([0, *(drafter.rows for drafter in self.drafters)]))

    def reset(self) -> None:
        """Drop every sequence a drafter may hold (of an interrupted run)."""
        self.remove([])

    def start(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        """New sequences join: each drafter reads their ``prompts`` (``contexts``: what decoding continues)."""
        for drafter in self.drafters:
            self.guards.call_drafter(drafter, "start", drafter.add_sequences, prompts, contexts, timer)

    def keep(self, rows: list[list[int]], lengths: list[list[int]]) -> None:
        """Each drafter j keeps, for every sequence, its row ``rows[j][b]`` cached through ``lengths[j][b]``."""
        for drafter, kept_rows, kept_lengths in zip(self.drafters, rows, lengths):
            self.guards.call_drafter(drafter, "keep", drafter.keep, kept_rows, kept_lengths)

    def remove(self, kept: list[int]) -> None:
        """Every sequence but ``kept`` (indices into the batch, in order) leaves every drafter."""
        for drafter in self.drafters:
            self.guards.call_drafter(drafter, "remove_sequences", drafter.remove_sequences, kept)

    def propose(
        self,
        contexts: list[list[int]],
        limits: list[int],
        draws: Draws,
        sampling_law: Callable,
        timer: RegionTimer | None,
    ) -> tuple[Drafted, list[int]]:
        """Every drafter's proposals for the sequences of ``contexts``, at most ``limits`` ``[B]`` tokens each, drawn
        with ``draws`` (stream DRAFT) → the step's rows and the draft forwards each sequence cost. The model drafters
        are asked last, for what the others leave to verify, so that no draft forward is paid for a position that is
        not verified (:func:`~specdec_cli.drafting.block_length`)."""
        batch, width, lanes, guards = len(contexts), max(limits), self.lanes, self.guards
        # Row k's token at offset t is (stream DRAFT, t, lane k), whichever drafter fills it: one table per step.
        uniforms = draws.batch_uniforms(Stream.DRAFT, max(width, 1), lanes[-1] or 1)  # [B, L, K]
        proposals: list[Proposal | None] = [None] * len(self.drafters)
        lengths = list(limits)
        asked: list[list[int]] = [[]] * len(self.drafters)  # [drafters][B]: what each drafter was asked for
        for runs_model in (False, True):
            for index, drafter in enumerate(self.drafters):
                if drafter.uses_model != runs_model:
                    continue
                asked[index] = lengths
                if max(lengths) == 0:
                    proposals[index] = empty_proposal(batch, drafter.rows, guards.vocab_size, guards.device)
                    continue
                own = uniforms[:, : max(lengths), lanes[index] : lanes[index + 1]]  # [B, n, K_j]
                request = DraftRequest(contexts, lengths, own, sampling_law, timer, self.judged_view)
                proposals[index] = guards.checked_proposal(drafter, request)
            if not runs_model:
                lengths = [
                    block_length([p.lengths[b] for p in proposals if p is not None], limit)
                    for b, limit in enumerate(limits)
                ]
        # A model drafter ran as many forwards as it drafted for sequence b.
        forwards = [sum(min(p.forwards, asked[j][b]) for j, p in enumerate(proposals)) for b in range(batch)]
        judged = self.judged_view is not None
        return Drafted.of(proposals, batch, guards.vocab_size, guards.device, judged), forwards


def score_target(
    session: ModelSession,
    contexts: list[list[int]],
    drafted: Drafted,
    sampling_law: Callable,
    params: SamplingParams,
    judged_view: str | None,
    timer: RegionTimer | None,
) -> tuple[TargetLaws, torch.Tensor]:
    """The target's laws after every prefix of every row of every sequence ``[B, K, n+1, V]`` (and the laws the
    verifier judges drafts by, where it asks for others: ``judged_view``), in one forward of ``session``, and whether
    all are finite ``[]``."""
    batch, rows, width = drafted.tokens.shape
    session.fan_out(rows)
    repeated = [context for context in contexts for _ in range(rows)]
    tokens = drafted.tokens.reshape(batch * rows, width)  # [B K, n]
    logits = session.forward(repeated, tokens, width + 1, timer)  # [B K, n+1, V]
    probs, finite = sampling_law(logits, params)  # [B K, n+1, V], [B K, n+1]
    judged = None if judged_view is None else sampling_law(logits, judged_params(params, judged_view))[0]
    shape = (batch, rows, width + 1, -1)
    return TargetLaws(probs.view(shape), None if judged is None else judged.view(shape)), finite.all()


def verify_step(verifier: BlockVerifier | None, under_compile: bool, device: torch.device) -> VerifyStep | None:
    """``verifier``'s verify step (None for no verifier): its one call, :meth:`~specdec_cli.verifiers.BlockVerifier
    .verify`, for a group of any size, or under ``--compile`` through ``torch.compile``, which traces it into one
    graph (keyed randomness, no reads: :func:`~specdec_cli.engine.decoding.create_verifier` refused a verifier
    without keyed randomness). On a GPU a group of one is captured in CUDA graphs instead
    (:mod:`specdec_cli.engine.graphs`), compiled only where a block reads the host; on the CPU a verifier with a
    reading CPU path stays eager. The run's verifier and its exact rule each get their own step."""
    if verifier is None or not under_compile:
        return None if verifier is None else verifier.verify
    compiled_verify = torch.compile(verifier.verify)
    if device.type == "cuda":
        return CapturedVerifyStep(verifier, fallback=compiled_verify)
    if verifier.reading_cpu_path:  # compiled, it would leave its CPU path for a costlier one
        return verifier.verify
    return compiled_verify


@dataclass(frozen=True)
class Steps:
    """The step functions of a run, as its decoder built them (compiled under ``--compile``)."""

    draft: DraftStep
    score: Callable[..., tuple[TargetLaws, torch.Tensor]]
    """:func:`score_target`'s signature."""
    sampling_law: Callable
    """:func:`~specdec_cli.sampling.sampling_law`, or its compiled form."""
    verify: VerifyStep | None
    """The run's verifier's verify step (None for the target alone)."""
    verify_exact: VerifyStep | None = None
    """The exact rule's (``speculation.exact_first``), None where no block needs one."""
