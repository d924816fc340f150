"""The drafter contract: what proposes a block's draft rows.

A drafter is a plugin of the entry-point group ``specdec.drafters`` (a subclass of :class:`Drafter`;
its constructor's keyword arguments are its parameters, given under ``params:`` of its draft entry).
The engine knows drafters only through this class. Per decoder, :meth:`Drafter.setup` hands a drafter
its :class:`DraftSetup` (its model, if it drafts with one, its sampling settings and how many rows it
fills). Per sample, :meth:`Drafter.start` gives it the prompt. Per block, :meth:`Drafter.propose`
asks it for up to L tokens in each of its rows, with the laws they were drawn from
(:class:`Proposal`), and :meth:`Drafter.keep` tells it how much of each of its rows was committed.

Exactness needs two things of a drafter: the law it reports at each position is the law its token
was drawn from, given the committed context and the row's earlier tokens; and the rows it fills for one
draft entry are independent samples of one law, which only the entry decides (its drafter, parameters,
model and sampling settings: two entries equal in these draw from one law, which SpecTr relies on). A deterministic drafter
(prompt lookup) reports a one-hot law; it then fills one row, since K copies of a function of the
context would be one row K times. A drafter may propose fewer than L tokens, or none; the block
then verifies what was proposed (:func:`block_length`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .registry import check_parameters
from .sampling import SamplingParams
from .timing import RegionTimer

if TYPE_CHECKING:
    from .model_pool import ModelPool
    from .models import LoadedModel
    from .recipe import DraftConfig

__all__ = ["BatchDraftRequest", "BatchProposal", "DraftRequest", "DraftSetup", "Drafter", "Proposal", "block_length", "empty_proposal", "one_hot_laws"]


@dataclass(frozen=True)
class DraftSetup:
    """What a drafter is given once, when a decoder is built."""

    model: LoadedModel | None
    """The draft entry's model (:meth:`Drafter.load_model`), or None for a drafter that takes none."""
    target: LoadedModel
    """The target: its tokenizer and whether it is an encoder-decoder (whose prompt is not in the context)."""
    sampling: SamplingParams
    """The draft entry's sampling settings (the target's where it sets none)."""
    rows: int
    """Rows it fills each block: ``speculation.num_drafts``, or 1 for a deterministic drafter."""
    vocab_size: int
    """V: the laws' last dimension (the vocabulary the target and every draft share)."""
    device: torch.device
    """Where the block's tensors live (the target's device)."""
    kv_cache: bool = True
    """``speculation.kv_cache``: False asks a model drafter to recompute every forward (a test reference)."""


@dataclass
class DraftRequest:
    """One block's request to one drafter."""

    context: list[int]
    """The committed ids: prompt and output so far (for an encoder-decoder target, the decoder's ids)."""
    max_length: int
    """Propose at most this many tokens per row (L, or less near the end of the output)."""
    uniforms: torch.Tensor
    """float64 ``[max_length, rows]``: the keyed uniform of each of this drafter's rows at each offset
    (stream DRAFT; draw with :func:`~specdec_cli.sampling.sample_with`). A deterministic drafter ignores them."""
    sampling_law: Callable[[torch.Tensor, SamplingParams], tuple[torch.Tensor, torch.Tensor]]
    """The engine's :func:`~specdec_cli.sampling.sampling_law` (compiled under ``--compile``)."""
    timer: RegionTimer | None = None
    """Give it to model forwards (``ModelSession.forward``), so that their time counts as forward time."""


@dataclass
class BatchDraftRequest:
    """One block's request to a drafter for every sequence of a batch (:meth:`Drafter.propose_batch`)."""

    contexts: list[list[int]]
    """[B]: each sequence's committed ids (as :attr:`DraftRequest.context`)."""
    max_lengths: list[int]
    """[B]: propose at most this many tokens for sequence b."""
    uniforms: torch.Tensor
    """float64 ``[B, max(max_lengths), rows]``: entry b is sequence b's :attr:`DraftRequest.uniforms`."""
    sampling_law: Callable[[torch.Tensor, SamplingParams], tuple[torch.Tensor, torch.Tensor]]
    timer: RegionTimer | None = None


@dataclass
class BatchProposal:
    """What a drafter proposes for every sequence of a batch: sequence b's rows are ``tokens[b, :, : lengths[b]]``."""

    tokens: torch.Tensor
    """int64 ``[B, rows, n]``; entries past a sequence's length are filler (any id in [0, V))."""
    laws: torch.Tensor
    """float ``[B, rows, n, V]``: the law each token was drawn from."""
    finite: torch.Tensor
    """bool ``[]``: every law came from finite logits."""
    lengths: list[int]
    """[B]: tokens proposed for each sequence, ``0 <= lengths[b] <= min(n, max_lengths[b])``."""
    forwards: int = 0
    """Model forwards it ran (each for every sequence at once)."""


@dataclass
class Proposal:
    """What a drafter proposes for one block: ``n`` tokens in each of its rows, ``0 <= n <= max_length``."""

    tokens: torch.Tensor
    """int64 ``[rows, n]``, on the setup's device: ids in [0, V) (the engine reads that with the block's decision)."""
    laws: torch.Tensor
    """float ``[rows, n, V]``: the law each token was drawn from (one-hot for a deterministic drafter)."""
    finite: torch.Tensor
    """bool ``[]``: every law came from finite logits (the engine stops the run with one line otherwise)."""
    forwards: int = 0
    """Model forwards it ran for this proposal (a sample's ``draft_forwards``)."""

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


class Drafter(ABC):
    """Proposes draft rows for the engine's blocks (see the module docstring)."""

    name: ClassVar[str] = ""
    """Its entry-point name (set from the entry point when they differ)."""
    deterministic: ClassVar[bool] = False
    """Its tokens are a function of the context, its laws one-hot: it fills one row."""
    uses_model: ClassVar[bool] = False
    """It drafts with a model named by its draft entry (``model:``, ``early_exit:``): :meth:`load_model`."""

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

    def load_model(self, pool: ModelPool, entry: DraftConfig, target: LoadedModel) -> LoadedModel | None:
        """The model this drafter drafts with, taken from ``pool`` (each model is loaded once per pool)."""
        return None

    def setup(self, setup: DraftSetup) -> None:
        """Keep what it needs of ``setup``; called once, before the first sample."""
        self.draft_setup = setup

    @property
    def rows(self) -> int:
        """Rows it fills each block."""
        return self.draft_setup.rows

    @property
    def label(self) -> str:
        """How messages name it ("draft NAME produced non-finite logits")."""
        return self.name

    def start(self, prompt_ids: list[int]) -> None:
        """A new sample begins after ``prompt_ids`` (forget the previous one)."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> Proposal:
        """Up to ``request.max_length`` tokens in each of its rows, with their laws (:class:`Proposal`)."""

    def keep(self, row: int, length: int) -> None:
        """After a block: the first ``length`` ids of the new context are the committed context before the block
        followed by the tokens of its ``row`` that were committed; what it holds past them is gone."""

    # ----------------------------------------------------------------------- batches (optional)
    # A drafter that sets ``batched`` drafts for every sequence of a batch at once. The engine runs one instance
    # per sequence of any other (its per-sequence methods above, one call per sequence: correct, and slower).

    batched: ClassVar[bool] = False
    """True when it implements the four methods below (after :meth:`setup`, instead of start/propose/keep)."""

    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None) -> None:
        """Sequences join the batch, after the ones it holds: their prompts and committed ids."""
        raise NotImplementedError(f"drafter '{self.name}' does not draft batches")

    def remove_sequences(self, kept: list[int]) -> None:
        """Only the sequences ``kept`` (indices into the batch, in order) stay; the others have finished. A batch run
        begins with ``remove_sequences([])``, so that an interrupted run's sequences are forgotten."""
        raise NotImplementedError(f"drafter '{self.name}' does not draft batches")

    def propose_batch(self, request: BatchDraftRequest) -> BatchProposal:
        """Each sequence's proposal, as :meth:`propose` makes it for that sequence alone."""
        raise NotImplementedError(f"drafter '{self.name}' does not draft batches")

    def keep_batch(self, rows: list[int], lengths: list[int]) -> None:
        """:meth:`keep` for each sequence b: its row ``rows[b]``, its first ``lengths[b]`` ids."""
        raise NotImplementedError(f"drafter '{self.name}' does not draft batches")

    @classmethod
    def joined(cls, drafters: Sequence[Drafter]) -> list[Drafter]:
        """``drafters`` of this class (set up, in recipe order) as the engine should run them: a class whose
        instances can share work (one model's forward for several entries' rows) returns fewer."""
        return list(drafters)


def one_hot_laws(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The laws of deterministic tokens ``[rows, n]`` → float32 ``[rows, n, V]``, one-hot."""
    laws = torch.zeros(*tokens.shape, vocab_size, device=tokens.device)  # [rows, n, V]
    return laws.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def block_length(lengths: Sequence[int], draft_length: int) -> int:
    """How many positions a block verifies, from the proposals of the drafters that run no model
    (``lengths``, asked first): the shortest non-empty one, or ``draft_length`` when all are empty.
    Rows that proposed nothing leave the block; the model drafters then draft exactly this many tokens,
    never more than a row that stays can be verified against."""
    proposed = [length for length in lengths if length > 0]
    return min(proposed, default=draft_length)


def empty_proposal(rows: int, vocab_size: int, device: torch.device) -> Proposal:
    """No tokens in any of ``rows`` rows (a drafter asked for none)."""
    tokens = torch.empty(rows, 0, dtype=torch.long, device=device)  # [rows, 0]
    laws = torch.empty(rows, 0, vocab_size, device=device)  # [rows, 0, V]
    return Proposal(tokens, laws, torch.ones((), dtype=torch.bool, device=device))


def batch_proposal_problem(
    proposal: object, batch: int, rows: int, max_lengths: list[int], vocab_size: int, device: torch.device
) -> str | None:
    """As :func:`proposal_problem`, for a :class:`BatchProposal` of ``batch`` sequences."""
    if not isinstance(proposal, BatchProposal):
        return f"returned {type(proposal).__name__} from propose_batch instead of a BatchProposal"
    width = max(max_lengths, default=0)
    lengths = proposal.lengths
    if not isinstance(lengths, list) or len(lengths) != batch or not all(isinstance(n, int) for n in lengths):
        return f"returned lengths {lengths!r}; expected a list of {batch} ints"
    if not all(0 <= n <= limit for n, limit in zip(lengths, max_lengths)):
        return f"returned lengths {lengths}, beyond the requested {max_lengths}"
    for field in ("tokens", "laws", "finite"):
        if not isinstance(getattr(proposal, field), torch.Tensor):
            return f"returned BatchProposal.{field} as {type(getattr(proposal, field)).__name__}, not a tensor"
    tokens, laws = proposal.tokens, proposal.laws
    n = tokens.shape[-1] if tokens.dim() == 3 else -1
    if tokens.dtype != torch.long or list(tokens.shape[:2]) != [batch, rows] or not max(lengths, default=0) <= n <= width:
        return f"returned tokens of shape {list(tokens.shape)} ({tokens.dtype}); expected int64 [{batch}, {rows}, n]"
    if not laws.is_floating_point() or tuple(laws.shape) != (batch, rows, n, vocab_size):
        return f"returned laws of shape {list(laws.shape)}; expected float [{batch}, {rows}, {n}, {vocab_size}]"
    if any(tensor.device != device for tensor in (tokens, laws, proposal.finite)):
        return f"returned tensors off the block's device {device}"
    if proposal.finite.dtype != torch.bool or proposal.finite.dim() != 0:
        return "returned finite that is not a 0-dim bool tensor"
    return None


def proposal_problem(proposal: object, rows: int, max_length: int, vocab_size: int, device: torch.device) -> str | None:
    """What is wrong with a drafter's proposal, checked on the host without reading a value from the device
    (types, shapes, dtypes, devices), completing "drafter 'x' ..." in an error; or None."""
    if not isinstance(proposal, Proposal):
        return f"returned {type(proposal).__name__} instead of a Proposal (specdec_cli.drafting)"
    fields = {"tokens": proposal.tokens, "laws": proposal.laws, "finite": proposal.finite}
    for field, value in fields.items():
        if not isinstance(value, torch.Tensor):
            return f"returned Proposal.{field} as {type(value).__name__}, not a tensor"
        if value.device != device:
            return f"returned Proposal.{field} on {value.device}, not on the block's device {device}"
    tokens, laws, finite = fields.values()
    if tokens.dtype != torch.long or tokens.dim() != 2 or tokens.shape[0] != rows or tokens.shape[1] > max_length:
        return (f"returned tokens of shape {list(tokens.shape)} ({tokens.dtype}); expected int64 [{rows}, n] "
                f"with n <= {max_length}")  # fmt: skip
    if not laws.is_floating_point() or tuple(laws.shape) != (rows, tokens.shape[1], vocab_size):
        return f"returned laws of shape {list(laws.shape)} ({laws.dtype}); expected float [{rows}, {tokens.shape[1]}, {vocab_size}]"
    if finite.dtype != torch.bool or finite.dim() != 0:
        return f"returned finite of shape {list(finite.shape)} ({finite.dtype}); expected a 0-dim bool tensor"
    return None
