"""The drafter contract: what proposes a block's draft rows, for every sequence of a batch.

A drafter is a plugin of the entry-point group ``specdec.drafters`` (a subclass of :class:`Drafter`; its
constructor's keyword arguments are its parameters, given under ``params:`` of its draft entry). The engine knows
drafters only through this class, and always in the shape of a batch: a run of one sample is a batch of one.
Per decoder, :meth:`Drafter.setup` hands a drafter its :class:`DraftSetup` (its model, if it drafts with one,
its sampling settings and how many rows it fills). Sequences join with :meth:`Drafter.add_sequences` and leave
with :meth:`Drafter.remove_sequences`. Per block, :meth:`Drafter.propose` asks for up to L tokens in each of its
rows of every sequence, with the laws they were drawn from (:class:`Proposal`, leading dimension B), and
:meth:`Drafter.keep` tells it how much of which row of each sequence was committed.

A drafter written for one sequence at a time subclasses :class:`SequenceDrafter` instead and writes
``start``, ``propose_sequence`` and ``keep_sequence``; the base class runs one copy of it per sequence.

Exactness needs two things of a drafter: the law it reports at each position is the law its token was drawn
from, given the committed context and the row's earlier tokens; and the rows it fills for one draft entry are
independent samples of one law, which only the entry decides (its drafter, parameters, model and sampling
settings: two entries equal in these draw from one law, which SpecTr relies on). A deterministic drafter
(prompt lookup) reports a one-hot law; it then fills one row, since K copies of a function of the context
would be one row K times. A drafter may propose fewer than L tokens, or none; the block then verifies what
was proposed (:func:`block_length`). A row need not be drafted past an EOS (an id of the target's ``eos_ids``):
a sample ends at its first EOS, so no token after it on that row is committed, and the row may repeat it under
a one-hot law there, its law once it has ended, as the model drafter does instead of running its model on.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..base.errors import SpecdecError
from ..base.sampling import SamplingParams
from ..base.timing import RegionTimer
from .parameters import check_parameters

if TYPE_CHECKING:
    from ..base.recipe import DraftConfig

__all__ = [
    "DraftRequest",
    "DraftSetup",
    "Drafter",
    "Proposal",
    "SequenceDrafter",
    "SequenceProposal",
    "SequenceRequest",
    "block_length",
    "empty_proposal",
    "one_hot_laws",
]

SamplingLaw = Callable[[torch.Tensor, SamplingParams], tuple[torch.Tensor, torch.Tensor]]
"""The engine's :func:`~specdec_cli.sampling.sampling_law` (compiled under ``--compile``)."""


@dataclass(frozen=True)
class DraftSetup:
    """What a drafter is given once, when a decoder is built."""

    model: Any
    """The draft entry's model (a ``LoadedModel``, from :meth:`Drafter.load_model`), or None for a drafter
    that takes none."""
    target: Any
    """The target (a ``LoadedModel``): its tokenizer and whether it is an encoder-decoder (whose prompt is not
    in the context)."""
    sampling: SamplingParams
    """The draft entry's sampling settings (the target's where it sets none)."""
    rows: int
    """Rows it fills each block: ``speculation.num_drafts``, or 1 for a deterministic drafter."""
    vocab_size: int
    """V: the laws' last dimension (the vocabulary the target and every draft share, but a draft with
    ``own_vocabulary``)."""
    device: torch.device
    """Where the block's tensors live (the target's device)."""
    kv_cache: bool = True
    """``speculation.kv_cache``: False asks a model drafter to recompute every forward (a test reference)."""
    cache_headroom: int | None = None
    """With ``speculation.static_cache``: the slots past its context a sequence's static cache is made with
    (``ModelSession``'s ``headroom``); None: a dynamic cache."""
    compile_steps: bool = False
    """``speculation.compile``: a model drafter's steps over its static cache run compiled (``ModelSession``'s
    ``compiled``)."""


@dataclass
class DraftRequest:
    """One block's request to a drafter, for every sequence of the batch."""

    contexts: list[list[int]]
    """[B]: each sequence's committed ids, prompt and output so far (for an encoder-decoder target, the decoder's
    ids)."""
    max_lengths: list[int]
    """[B]: propose at most this many tokens per row for sequence b (L, or less near the end of its output)."""
    uniforms: torch.Tensor
    """float64 ``[B, max(max_lengths), rows]``: the keyed uniform of each of this drafter's rows of each sequence
    at each offset (stream DRAFT; draw with :func:`~specdec_cli.sampling.sample_with`). A deterministic drafter
    ignores them."""
    sampling_law: SamplingLaw
    timer: RegionTimer | None = None
    """Give it to model forwards (``ModelSession.forward``), so that their time counts as forward time."""
    judged_view: str | None = None
    """Where the run's verifier judges drafts by other laws than the ones they are drawn from (its ``judged_laws``,
    one of ``unprocessed`` and ``untruncated``): a drafter that samples (not a deterministic one, whose one-hot laws
    stand for every processing) reports them too, in :attr:`Proposal.judged_laws`, from the same logits under
    :func:`~specdec_cli.sampling.judged_params`."""


@dataclass
class Proposal:
    """What a drafter proposes for every sequence of a batch: sequence b's rows are ``tokens[b, :, : lengths[b]]``."""

    tokens: torch.Tensor
    """int64 ``[B, rows, n]`` on the setup's device; entries past a sequence's length are filler (any id in
    [0, V)); ids in [0, V) (the engine reads that with the block's decision)."""
    laws: torch.Tensor
    """float ``[B, rows, n, V]``: the law each token was drawn from (one-hot for a deterministic drafter)."""
    finite: torch.Tensor
    """bool ``[]``: every law came from finite logits (the engine stops the run with one line otherwise)."""
    lengths: list[int]
    """[B]: tokens proposed for each sequence, ``0 <= lengths[b] <= min(n, max_lengths[b])``."""
    forwards: int = 0
    """Model forwards it ran (each for every sequence at once): a sample's ``draft_forwards``."""
    judged_laws: torch.Tensor | None = None
    """float ``[B, rows, n, V]``: the laws the request's ``judged_view`` asked for, beside ``laws``; None where it
    asked for none (or the drafter is deterministic)."""


class Drafter(ABC):
    """Proposes draft rows for the engine's blocks, for every sequence of a batch (see the module docstring)."""

    name: ClassVar[str] = ""
    """Its entry-point name (set from the entry point when they differ)."""
    deterministic: ClassVar[bool] = False
    """Its tokens are a function of the context, its laws one-hot: it fills one row."""
    uses_model: ClassVar[bool] = False
    """It drafts with a model named by its draft entry (``model:``, ``early_exit:``): :meth:`load_model`."""
    own_vocabulary: ClassVar[bool] = False
    """Its model has a tokenizer of its own, and it proposes in the target's ids (retokenize): the laws' V is
    shared by the target and the other drafts' models, whatever this model's vocabulary."""
    reports_judged_laws: ClassVar[bool] = False
    """A sampling drafter that reports :attr:`Proposal.judged_laws` when asked (:attr:`DraftRequest.judged_view`): a
    verifier that judges drafts by such laws takes its rows (a deterministic drafter needs none)."""

    def __new__(cls, *args: Any, **params: Any) -> "Drafter":
        # As BlockVerifier.__new__: an unknown or ill-typed parameter is one line before the constructor runs.
        check_parameters(cls, "drafter", args, params)
        return super().__new__(cls)

    def entry_problem(self, entry: DraftConfig) -> str | None:
        """What is wrong with its draft entry's model fields, or None (checked before any model loads). By default
        a drafter takes no model."""
        if entry.model is not None or entry.early_exit is not None:
            return f"drafter '{self.name}' takes no model; remove 'model' and 'early_exit' from the entry"
        return None

    def load_model(self, pool: Any, entry: DraftConfig, target: Any) -> Any:
        """The ``LoadedModel`` this drafter drafts with, taken from ``pool`` (a ``ModelPool``: each model is loaded
        once per pool), or None."""
        return None

    def setup(self, setup: DraftSetup) -> None:
        """Keep what it needs of ``setup``; called once, before the first sequence joins."""
        self.draft_setup = setup

    @property
    def rows(self) -> int:
        """Rows it fills each block, for each sequence."""
        return self.draft_setup.rows

    @property
    def label(self) -> str:
        """How messages name it ("draft NAME produced non-finite logits")."""
        return self.name

    @property
    def independent_rows(self) -> bool:
        """Its rows of one entry are independent samples: True unless its parameters make rows share drawn tokens
        (the model drafter's ``branch_after``), which only a verifier with ``dependent_drafts`` verifies exactly.
        Read before any model loads, from an instance that has not been set up."""
        return True

    @abstractmethod
    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        """Sequences join the batch, after the ones it holds: their prompts and committed ids."""

    @abstractmethod
    def remove_sequences(self, kept: list[int]) -> None:
        """Only the sequences ``kept`` (indices into the batch, in order) stay; the others have finished. A run
        begins with ``remove_sequences([])``, so that an interrupted run's sequences are forgotten."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> Proposal:
        """Up to ``request.max_lengths[b]`` tokens in each of its rows of each sequence b, with their laws."""

    @abstractmethod
    def keep(self, rows: list[int], lengths: list[int]) -> None:
        """After a block, for each sequence b: the first ``lengths[b]`` ids of its new context are its committed
        context before the block followed by the tokens of its row ``rows[b]`` that were committed; what it holds
        past them is gone."""

    @classmethod
    def joined(cls, drafters: Sequence[Drafter]) -> list[Drafter]:
        """``drafters`` of this class (set up, in recipe order) as the engine should run them: a class whose
        instances can share work (one model's forward for several entries' rows) returns fewer."""
        return list(drafters)


@dataclass
class SequenceRequest:
    """One block's request to a :class:`SequenceDrafter`, for its one sequence."""

    context: list[int]
    """The committed ids: prompt and output so far (for an encoder-decoder target, the decoder's ids)."""
    max_length: int
    """Propose at most this many tokens per row (L, or less near the end of the output)."""
    uniforms: torch.Tensor
    """float64 ``[max_length, rows]``: the keyed uniform of each of its rows at each offset (stream DRAFT)."""
    sampling_law: SamplingLaw
    timer: RegionTimer | None = None


@dataclass
class SequenceProposal:
    """What a :class:`SequenceDrafter` proposes for its sequence: ``n`` tokens in each row, ``0 <= n <= max_length``."""

    tokens: torch.Tensor
    """int64 ``[rows, n]``, on the setup's device."""
    laws: torch.Tensor
    """float ``[rows, n, V]``: the law each token was drawn from (one-hot for a deterministic drafter)."""
    finite: torch.Tensor
    """bool ``[]``: every law came from finite logits."""
    forwards: int = 0
    """Model forwards it ran for this proposal."""

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


class SequenceDrafter(Drafter):
    """A drafter written for one sequence at a time: it writes :meth:`start`, :meth:`propose_sequence` and
    (if it keeps state across blocks) :meth:`keep_sequence`.

    In a batch, each sequence has its own shallow copy of the set-up drafter, made when the sequence joins and
    started on its prompt; so :meth:`start` must bind the sequence's state anew (``self.seen = {}``), not change
    objects the copies share. One call per sequence: correct at any batch size, and B calls a block."""

    def start(self, prompt_ids: list[int]) -> None:
        """A new sequence begins after ``prompt_ids``."""

    @abstractmethod
    def propose_sequence(self, request: SequenceRequest) -> SequenceProposal:
        """Up to ``request.max_length`` tokens in each of its rows, with their laws."""

    def keep_sequence(self, row: int, length: int) -> None:
        """After a block: the first ``length`` ids of the new context are the committed context before the block
        followed by the tokens of its ``row`` that were committed."""

    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        copies = self.__dict__.setdefault("sequences", [])
        for prompt in prompts:
            sequence = copy.copy(self)
            del sequence.sequences  # a copy holds one sequence: its own state, not the batch's list
            sequence.start(prompt)
            copies.append(sequence)

    def remove_sequences(self, kept: list[int]) -> None:
        self.sequences = [self.sequences[b] for b in kept] if "sequences" in self.__dict__ else []

    def propose(self, request: DraftRequest) -> Proposal:
        """Each sequence's proposal from its own copy, padded to the longest into one :class:`Proposal`."""
        vocab, device = self.draft_setup.vocab_size, self.draft_setup.device
        proposals: list[SequenceProposal | None] = []
        for b, sequence in enumerate(self.sequences):
            length = request.max_lengths[b]
            if not length:  # a sequence with one token left asks no drafter
                proposals.append(None)
                continue
            one = SequenceRequest(
                request.contexts[b], length, request.uniforms[b, :length], request.sampling_law, request.timer
            )
            proposal = sequence.propose_sequence(one)
            problem = sequence_proposal_problem(proposal, self.rows, length, vocab, device)
            if problem is not None:
                raise ProposalError(problem)
            proposals.append(proposal)
        return _stacked(proposals, self.rows, max(request.max_lengths), vocab, device)

    def keep(self, rows: list[int], lengths: list[int]) -> None:
        for sequence, row, length in zip(self.sequences, rows, lengths):
            sequence.keep_sequence(row, length)


class ProposalError(SpecdecError):
    """A :class:`SequenceDrafter`'s proposal of the wrong form (what is wrong completes "drafter 'x' ...")."""


def _stacked(
    proposals: list[SequenceProposal | None], rows: int, width: int, vocab: int, device: torch.device
) -> Proposal:
    """Per-sequence proposals (None: the sequence was asked for nothing) as one batch ``[B, rows, width]``, zero
    filler past each one's length."""
    made = [proposal for proposal in proposals if proposal is not None]
    dtype = made[0].laws.dtype
    tokens = torch.zeros(len(proposals), rows, width, dtype=torch.long, device=device)  # [B, rows, n]
    laws = torch.zeros(len(proposals), rows, width, vocab, dtype=dtype, device=device)  # [B, rows, n, V]
    for b, proposal in enumerate(proposals):
        if proposal is not None:
            tokens[b, :, : proposal.length] = proposal.tokens
            laws[b, :, : proposal.length] = proposal.laws
    finite = torch.stack([proposal.finite for proposal in made]).all()  # [] (a request asks at least one sequence)
    forwards = max(proposal.forwards for proposal in made)  # per sequence, as batched drafters count
    return Proposal(tokens, laws, finite, [proposal.length if proposal else 0 for proposal in proposals], forwards)


def one_hot_laws(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The laws of deterministic tokens ``[..., n]`` → float32 ``[..., n, V]``, one-hot."""
    laws = torch.zeros(*tokens.shape, vocab_size, device=tokens.device)  # [..., n, V]
    return laws.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def block_length(lengths: Sequence[int], draft_length: int) -> int:
    """How many positions a sequence's block verifies, from the proposals of the drafters that run no model
    (``lengths``, asked first): the shortest non-empty one, or ``draft_length`` when all are empty.
    Rows that proposed nothing leave the block; the model drafters then draft exactly this many tokens,
    never more than a row that stays can be verified against."""
    proposed = [length for length in lengths if length > 0]
    return min(proposed, default=draft_length)


def empty_proposal(batch: int, rows: int, vocab_size: int, device: torch.device) -> Proposal:
    """No tokens in any of ``rows`` rows of any of ``batch`` sequences (a drafter asked for none)."""
    tokens = torch.empty(batch, rows, 0, dtype=torch.long, device=device)  # [B, rows, 0]
    laws = torch.empty(batch, rows, 0, vocab_size, device=device)  # [B, rows, 0, V]
    return Proposal(tokens, laws, torch.ones((), dtype=torch.bool, device=device), [0] * batch)


def proposal_problem(
    proposal: object, batch: int, rows: int, max_lengths: list[int], vocab_size: int, device: torch.device
) -> str | None:
    """What is wrong with a drafter's :class:`Proposal` for ``batch`` sequences, checked on the host without
    reading a value from the device (types, shapes, dtypes, devices), completing "drafter 'x' ..."; or None."""
    if not isinstance(proposal, Proposal):
        return f"returned {type(proposal).__name__} instead of a Proposal (specdec_cli.drafting)"
    lengths = proposal.lengths
    if not isinstance(lengths, list) or len(lengths) != batch or not all(isinstance(n, int) for n in lengths):
        return f"returned lengths {lengths!r}; expected a list of {batch} ints"
    if not all(0 <= n <= limit for n, limit in zip(lengths, max_lengths)):
        return f"returned lengths {lengths}, beyond the requested {max_lengths}"
    problem = _tensors_problem(proposal, device)
    if problem is not None:
        return problem
    tokens, laws = proposal.tokens, proposal.laws
    n = tokens.shape[-1] if tokens.dim() == 3 else -1
    if (
        tokens.dtype != torch.long
        or list(tokens.shape[:2]) != [batch, rows]
        or not max(lengths) <= n <= max(max_lengths)
    ):
        return f"returned tokens of shape {list(tokens.shape)} ({tokens.dtype}); expected int64 [{batch}, {rows}, n]"
    if not laws.is_floating_point() or tuple(laws.shape) != (batch, rows, n, vocab_size):
        return f"returned laws of shape {list(laws.shape)}; expected float [{batch}, {rows}, {n}, {vocab_size}]"
    return None


def sequence_proposal_problem(
    proposal: object, rows: int, max_length: int, vocab_size: int, device: torch.device
) -> str | None:
    """As :func:`proposal_problem`, for a :class:`SequenceDrafter`'s :class:`SequenceProposal`."""
    if not isinstance(proposal, SequenceProposal):
        return f"returned {type(proposal).__name__} instead of a SequenceProposal (specdec_cli.drafting)"
    problem = _tensors_problem(proposal, device)
    if problem is not None:
        return problem
    tokens, laws = proposal.tokens, proposal.laws
    if tokens.dtype != torch.long or tokens.dim() != 2 or tokens.shape[0] != rows or tokens.shape[1] > max_length:
        return (
            f"returned tokens of shape {list(tokens.shape)} ({tokens.dtype}); expected int64 [{rows}, n] "
            f"with n <= {max_length}"
        )
    if not laws.is_floating_point() or tuple(laws.shape) != (rows, tokens.shape[1], vocab_size):
        return (
            f"returned laws of shape {list(laws.shape)} ({laws.dtype}); "
            f"expected float [{rows}, {tokens.shape[1]}, {vocab_size}]"
        )
    return None


def _tensors_problem(proposal: Proposal | SequenceProposal, device: torch.device) -> str | None:
    """A proposal's tensors that are not tensors, off the block's device, or a ``finite`` that is no flag."""
    kind = type(proposal).__name__
    for field in ("tokens", "laws", "finite"):
        value = getattr(proposal, field)
        if not isinstance(value, torch.Tensor):
            return f"returned {kind}.{field} as {type(value).__name__}, not a tensor"
        if value.device != device:
            return f"returned {kind}.{field} on {value.device}, not on the block's device {device}"
    if proposal.finite.dtype != torch.bool or proposal.finite.dim() != 0:
        return (
            f"returned finite of shape {list(proposal.finite.shape)} ({proposal.finite.dtype}); "
            "expected a 0-dim bool tensor"
        )
    return None
