"""The verifier contract (the registry that finds verifiers as entry-point plugins is :mod:`.registry`).

Notation (q = target law, p = draft law): after each block the engine hands a verifier the
target's laws at every position of every draft row, the draft laws the tokens were sampled
from, and the draft tokens; the verifier decides, on the tensors' device, which draft prefix
to commit and which token follows it.

- :class:`BlockVerifier` is the block-level contract: one :meth:`~BlockVerifier.verify_block`
  call per block. Schemes that decide a block jointly (block verification) implement it.
- :class:`Verifier` is the token-level contract (a selection rule at one position, given the
  K candidates there): plugins implement ``conditional`` and ``acceptance_probability``, and
  the base class builds ``verify_block`` from ``select``.

Plugins register a subclass of either under the entry-point group ``specdec.verifiers``; its
constructor's keyword arguments are its parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..base.randomness import BatchRandomness, Draws, Randomness, Stream, at, uniforms_from
from ..base.sampling import sample, sample_with
from .divergences import kl_divergence
from .parameters import check_parameters

__all__ = [
    "JUDGED_VIEWS",
    "JudgedLaws",
    "judged_argument",
    "BatchDecision",
    "BlockDecision",
    "BlockVerifier",
    "batch_decision_problem",
    "batch_departs_from_drafts",
    "Verifier",
    "first_rejection",
    "shared_prefix_length",
    "walk_alive_rows",
    "decision_problem",
    "departs_from_drafts",
    "decision_value_problem",
    "device_path",
    "reads_are_free",
    "prefix_agreement",
    "problem_members",
    "decide_problems",
    "commit_following",
    "commit_with_uniform",
    "walk_reading",
]


JudgedLaws = tuple[torch.Tensor, torch.Tensor] | None
"""The laws a rule with :attr:`BlockVerifier.judged_laws` judges drafts by: (target's, drafts'), shaped as the
sampling laws they stand beside (``verify_block``: ``[K, L+1, V]`` and ``[K, L, V]``; the token-level methods:
``[..., V]`` and ``[..., K, V]``); None where the rule judges by the sampling laws (or is handed no others: a test,
the author's kit, which then stand for both)."""

JUDGED_VIEWS = ("unprocessed", "untruncated")
"""What :attr:`BlockVerifier.judged_laws` may name: each model's law at temperature 1 over the whole vocabulary
(``unprocessed``: FSD's default), or at its run's temperature with no top-k or top-p (``untruncated``: Medusa's
posterior)."""

_forced_device_path = 0


@contextmanager
def device_path() -> Iterator[None]:
    """Within it, every verifier takes the path it takes on a GPU also on the CPU: no host read, a fixed
    number of operations (for tests that count them, benchmarks, and ``torch.compile``)."""
    global _forced_device_path
    _forced_device_path += 1
    try:
        yield
    finally:
        _forced_device_path -= 1


def reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether a verifier may read ``tensor``'s values on the host: on the CPU a read costs nothing and a
    path that reads (to skip work it does not need) can be faster; on a GPU every read stalls the queue.
    Never inside :func:`device_path` or while torch.compile traces."""
    return tensor.device.type == "cpu" and not _forced_device_path and not torch.compiler.is_compiling()


@dataclass(frozen=True)
class BlockDecision:
    """What a verifier decided for one block; every field is a tensor on the block's device.

    The committed tokens are ``tokens[: num_accepted + 1]``: the accepted draft tokens of row
    ``row`` followed by one token from the target's side (a correction after a rejection, or a
    bonus token when all L were accepted). The engine reads these once per block.
    """

    tokens: torch.Tensor
    """[L+1] int64; entries past ``num_accepted`` are filler."""
    num_accepted: torch.Tensor
    """[] int64 in 0..L: accepted draft tokens, which equal ``draft_tokens[row, :num_accepted]``."""
    row: torch.Tensor
    """[] int64: the draft row the committed tokens follow (its KV caches are kept)."""

    def as_long(self) -> "BlockDecision":
        """The same decision in int64 (itself when it is already, as every built-in's is)."""
        if self.tokens.dtype == self.num_accepted.dtype == self.row.dtype == torch.long:
            return self
        return BlockDecision(self.tokens.long(), self.num_accepted.long(), self.row.long())


@dataclass(frozen=True)
class BatchDecision:
    """What a verifier decided for a batch of blocks, one block per sequence (:meth:`BlockVerifier.verify_batch`):
    each field is :class:`BlockDecision`'s with a leading batch dimension, on the blocks' device."""

    tokens: torch.Tensor
    """[B, L+1] int64: sequence b commits ``tokens[b, : num_accepted[b] + 1]``."""
    num_accepted: torch.Tensor
    """[B] int64 in 0..L."""
    row: torch.Tensor
    """[B] int64: the draft row each sequence's committed tokens follow."""

    @classmethod
    def stack(cls, decisions: Sequence[BlockDecision]) -> "BatchDecision":
        """One decision per sequence, in order, as a batch."""
        decisions = [decision.as_long() for decision in decisions]
        fields = ("tokens", "num_accepted", "row")
        return cls(*(torch.stack([getattr(decision, field) for decision in decisions]) for field in fields))

    @classmethod
    def of_block(cls, decision: BlockDecision) -> "BatchDecision":
        """One block's decision as a batch of one (views, no copy)."""
        return cls(decision.tokens.unsqueeze(0), decision.num_accepted.view(1), decision.row.view(1))

    def as_long(self) -> "BatchDecision":
        if self.tokens.dtype == self.num_accepted.dtype == self.row.dtype == torch.long:
            return self
        return BatchDecision(self.tokens.long(), self.num_accepted.long(), self.row.long())


def decision_problem(decision: object, block_size: int, device: torch.device) -> str | None:
    """What makes ``decision`` (a verifier's return value) unusable, judged on the host without reading
    a value from the device: its type, and each field's type, shape, dtype and device; or None.

    ``block_size``: L + 1 tokens; ``device``: the block's. Completes "verifier 'x' ..." in an error.
    """
    if not isinstance(decision, BlockDecision):
        return f"returned {_kind(decision)} instead of a BlockDecision"
    return _fields_problem(decision, {"tokens": [block_size], "num_accepted": [], "row": []}, block_size, device)


def batch_decision_problem(decision: object, batch: int, block_size: int, device: torch.device) -> str | None:
    """As :func:`decision_problem`, for :meth:`BlockVerifier.verify_batch`'s decision of ``batch`` blocks."""
    if not isinstance(decision, BatchDecision):
        return f"returned {_kind(decision)} from verify_batch instead of a BatchDecision"
    shapes = {"tokens": [batch, block_size], "num_accepted": [batch], "row": [batch]}
    return _fields_problem(decision, shapes, block_size, device)


def _fields_problem(decision, shapes: dict[str, list[int]], block_size: int, device: torch.device) -> str | None:
    """The first field of ``decision`` whose type, dtype, shape (``shapes``) or device is wrong, said; or None."""
    for field, shape in shapes.items():
        value = getattr(decision, field)
        if not isinstance(value, torch.Tensor):
            return f"returned {field} as {type(value).__name__}, not as a tensor"
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            return f"returned {field} of dtype {value.dtype}, not of an integer dtype"
        if list(value.shape) != shape:
            return (
                f"returned {field} of shape {list(value.shape)}, not {shape} (for a block of {block_size - 1} "
                "draft tokens)"
            )
        if value.device != device:
            return f"returned {field} on {value.device}, not on the block's device {device}"
    return None


def departs_from_drafts(decision: BlockDecision, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[]`` bool, on the device: the decision's accepted tokens are not its row's draft tokens
    (``tokens[:num_accepted] != draft_tokens[row, :num_accepted]``), which no verifier may commit.

    draft_tokens ``[K, L]``: :func:`batch_departs_from_drafts` for a batch of one block.
    """
    return batch_departs_from_drafts(BatchDecision.of_block(decision), draft_tokens.unsqueeze(0))[0]


def batch_departs_from_drafts(decision: BatchDecision, draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: :func:`departs_from_drafts` for each block of a batch (draft_tokens ``[B, K, L]``).

    The row is clamped so that indexing cannot fail on the device: a row out of range is reported by
    :func:`decision_value_problem` from the values read anyway.
    """
    batch, rows, width = draft_tokens.shape
    index = decision.row.clamp(0, rows - 1).view(batch, 1, 1).expand(-1, 1, width)  # [B, 1, L]
    drafted = draft_tokens.gather(1, index)[:, 0]  # [B, L]: each block's decided row
    positions = torch.arange(width, device=draft_tokens.device)  # [L]
    accepted = positions < decision.num_accepted.view(-1, 1)  # [B, L]
    return ((decision.tokens[:, :width] != drafted) & accepted).any(1)


def decision_value_problem(
    tokens: list[int], num_accepted: int, row: int, departs: bool, num_rows: int, vocab_size: int
) -> str | None:
    """What is wrong with a decision's values, once the block's one read has brought them to the host, or None.

    tokens: all L + 1 of them; departs: :func:`departs_from_drafts`'s flag. Only committed tokens
    (the first num_accepted + 1) must be in the vocabulary: the rest are filler.
    """
    draft_length = len(tokens) - 1
    if not 0 <= num_accepted <= draft_length:
        return f"returned num_accepted {num_accepted} for a block of {draft_length} draft tokens (0 to {draft_length})"
    if not 0 <= row < num_rows:
        return f"returned row {row} for a block of {num_rows} draft row(s) (0 to {num_rows - 1})"
    outside = [token for token in tokens[: num_accepted + 1] if not 0 <= token < vocab_size]
    if outside:
        return f"returned token {outside[0]}, outside the vocabulary of {vocab_size} ids (0 to {vocab_size - 1})"
    if departs:
        return (
            f"returned num_accepted {num_accepted} with tokens {tokens[:num_accepted]}, which are not row "
            f"{row}'s first {num_accepted} draft tokens"
        )
    return None


def _mapped_decisions(
    verifier: "BlockVerifier",
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draws: Draws,
    judged: JudgedLaws = None,
) -> BatchDecision:
    """``verifier.verify_block`` on its device path, mapped over the batch (``[B, ...]`` inputs, draws with
    ``[B]`` keys and block starts, judged laws ``[B, ...]``) by ``torch.func.vmap``: one call's operations, each on
    B blocks."""

    def decide(target, draft, tokens, key, block_start, *laws):  # one sequence's block: [K, L+1, V], [K, L, V], [K, L]
        extra = {"judged": tuple(laws)} if laws else {}
        decision = verifier.verify_block(target, draft, tokens, Draws(key, block_start), **extra)
        return decision.tokens, decision.num_accepted, decision.row

    inputs = (target_probs, draft_probs, draft_tokens, draws.key, draws.block_start, *(judged or ()))
    with device_path():
        fields = torch.func.vmap(decide)(*inputs)  # tokens [B, L+1], num_accepted [B], row [B]
    return BatchDecision(*fields).as_long()


def judged_argument(judged: JudgedLaws, index: int | slice | None = None) -> dict[str, Any]:
    """The keyword arguments that hand ``judged`` (rows ``index`` of its leading dimension, or all) to a verifier's
    method: none where there are none, so a rule that judges by the sampling laws is never given the argument."""
    if judged is None:
        return {}
    return {"judged": tuple(laws if index is None else laws[index] for laws in judged)}


def _kind(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _set_below_contract(cls: type, flag: str) -> bool:
    """Whether ``cls`` or one of its bases outside this module (a plugin's own classes) sets ``flag``."""
    return any(flag in vars(klass) for klass in cls.__mro__ if klass.__module__ != __name__)


class BlockVerifier(ABC):
    """Base class of every verifier: decides a whole block in one call.

    Subclasses set ``name``, ``lossless`` and ``max_drafts`` (``None`` = any number), optionally
    ``identical_drafts``, and take their parameters as keyword-only constructor arguments with
    defaults. ``token_level`` is False for schemes whose decision is not a walk over positions:
    for them a per-token acceptance is not defined.

    Fast paths (docs/verifiers.md, "Capability flags"): ``batches_by_vmap`` implies ``capturable``, which
    implies ``keyed_randomness``, unless the class or a plugin base of it sets them; each default is slow and safe.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    max_drafts: ClassVar[int | None]
    identical_drafts: ClassVar[bool] = False
    """True for schemes defined only for K samples of one draft law (SpecTr)."""
    token_level: ClassVar[bool] = False
    keyed_randomness: ClassVar[bool] = False
    """True when :meth:`verify_block` draws only through the :class:`~specdec_cli.randomness.Draws` it is handed,
    which the engine then passes. False (unless ``capturable``, or a :class:`Verifier` that draws only through the
    base class): it is handed a ``torch.Generator`` seeded from the sample and the block; ``--compile`` refuses it."""
    capturable: ClassVar[bool] = False
    """True when :meth:`verify_block` is a pure function of its tensors (no Python state it updates, no host value it
    reads or uploads): ``--compile`` on a GPU may then replay it from a CUDA graph
    (:mod:`specdec_cli.engine.graphs`), which runs no Python at all. False (unless ``batches_by_vmap``): it is
    compiled, never captured."""
    reading_cpu_path: ClassVar[bool] = False
    """True when :meth:`verify_block` takes a CPU path that reads the device to skip work (see
    :func:`reads_are_free`). torch.compile cannot trace the reads and sends it down the device path, which
    on a CPU costs more: ``--compile`` on the CPU then leaves its verify step eager."""
    batches_by_vmap: ClassVar[bool] = False
    """True when :meth:`verify_block` on the device path is a function ``torch.func.vmap`` can map over a batch:
    :meth:`verify_batch` then decides B blocks in one mapped call, with the launches of one block. False (the
    default): :meth:`verify_batch` calls :meth:`verify_block` once per sequence, B times the launches."""
    kl_bound_parameter: ClassVar[str | None] = None
    """The constructor parameter that bounds KL(q ‖ output law) in nats, for a lossy scheme that has one:
    ``--kl`` sets it, and ``bench`` and ``acceptance`` sweep it (one configuration per bound)."""

    optimal_under: ClassVar[dict[str, dict[str, Any]]] = {}
    """For a lossy scheme that is the optimum under a divergence (a name in
    :data:`~specdec_cli.plugins.divergences.DIVERGENCES`): that name → the parameters, besides its
    ``kl_bound_parameter`` (which takes the bound D), that make it the rule accepting most among all whose output
    law stays within D of q in that divergence at each position. ``acceptance`` reports each lossy rule's
    acceptance beside this rule's at the divergence the rule spends, and the author's kit holds lossy rules to it."""

    judged_laws: str | None = None
    """Set (per instance: a parameter may decide it) where the rule judges drafts by laws other than the sampling laws
    the tokens were drawn from: one of :data:`JUDGED_VIEWS`. The engine then computes them beside the sampling laws,
    from the same logits, and hands them to :meth:`verify_block` and :meth:`verify_batch` as ``judged=``; ``acceptance``
    hands them to the token-level methods (``conditional``, ``acceptance_probability``, ``output_law``) likewise.
    None (the default): the sampling laws, and no ``judged`` argument is ever passed."""

    revisions: ClassVar[tuple[str, ...]] = ()
    """What changed in the rule's decisions since its first release, one line per change, oldest first (its revision
    is one more than their number). A results folder records each verifier's revision, and one written under
    another is refused on resume with that line, instead of mixing samples of two rules under one name."""

    @classmethod
    def revision(cls) -> int:
        """1 for a rule as first released, one more for each of its :attr:`revisions`."""
        return len(cls.revisions) + 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A block vmap can map reads nothing and updates no Python state, as a CUDA graph needs; a block that is
        # a pure function of its tensors draws from keyed Draws, never from a generator (Python state).
        if not _set_below_contract(cls, "capturable"):
            cls.capturable = cls.batches_by_vmap
        if cls.capturable and not _set_below_contract(cls, "keyed_randomness"):
            cls.keyed_randomness = True

    def __new__(cls, *args: Any, **params: Any) -> "BlockVerifier":
        # Checked here, not in __init__, so that every construction path (stevedore's invoke_kwds included) says
        # what is wrong (an unknown parameter, one of the wrong type) instead of Python's bare TypeError.
        check_parameters(cls, "verifier", args, params)
        return super().__new__(cls)

    @classmethod
    def reason_to_refuse(cls, num_drafts: int, identical_laws: bool) -> str | None:
        """Why this scheme cannot take ``num_drafts`` drafts per position, or None if it can.

        ``identical_laws``: every draft is sampled from one law (one draft model with one set of
        sampling settings). Every caller asks here: the engine, bench's grid and acceptance.
        """
        if cls.max_drafts is not None and num_drafts > cls.max_drafts:
            return f"verifier '{cls.name}' takes at most {cls.max_drafts} draft(s) per position"
        if cls.identical_drafts and not identical_laws:
            return (
                f"verifier '{cls.name}' needs identical drafts (one draft config sampled K times), "
                "not drafts of different laws"
            )
        return None

    def set_draft_length(self, draft_length: int) -> None:
        """The run's configured draft length L (``speculation.draft_length``), told once before the first block.

        A rule that an engine fixes from its configured number of speculative tokens (FLy's default window, which
        vLLM derives from ``num_speculative_tokens``) fixes it here, so that a shorter block (near the end of an
        output, under an adaptive schedule) does not change it. A ValueError says, in one line, why the rule cannot
        run with this L. A verifier used without a run (a test, the author's kit) is never told; the default does
        nothing."""
        return None

    @abstractmethod
    def verify_block(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: Randomness = None,
    ) -> BlockDecision:
        """Decide one block on the tensors' device, without reading values back to the host.

        target_probs ``[K, L+1, V]``: q after each prefix of each draft row (position L is the
        bonus position); draft_probs ``[K, L, V]``: the laws the draft tokens were drawn from;
        draft_tokens ``[K, L]``. Rows share the committed prefix, so ``target_probs[k, 0]`` is
        the same for every k. L ≥ 1. ``randomness``: the block's keyed
        :class:`~specdec_cli.randomness.Draws` when ``keyed_randomness`` is set, else a generator.
        """

    def verify_batch(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: BatchRandomness,
        judged: JudgedLaws = None,
    ) -> BatchDecision:
        """Decide B blocks, one per sequence of a batch, on the tensors' device, without reading values back.

        target_probs ``[B, K, L+1, V]``, draft_probs ``[B, K, L, V]``, draft_tokens ``[B, K, L]``: entry b is
        :meth:`verify_block`'s inputs for sequence b. ``randomness``: keyed
        :class:`~specdec_cli.randomness.Draws` with a key and a block start per sequence (``[B]`` each) when
        ``keyed_randomness`` is set, else one generator per sequence. Block b's decision must be the one
        :meth:`verify_block` makes for it with :meth:`Draws.row(b) <specdec_cli.randomness.Draws.row>`, so a
        sequence's tokens do not depend on the others in its batch.

        The default maps :meth:`verify_block` over the batch with ``torch.func.vmap`` when ``batches_by_vmap``
        is set (on the CPU a verifier with a reading CPU path is looped instead, where reads are free and that
        path is cheaper), and otherwise calls it once per sequence: correct for every plugin, and B times the
        launches. A plugin may override it with a natively batched rule. ``judged``: the judged laws
        (:attr:`judged_laws`) with the same leading B, passed only to a rule that asks for them.
        """
        if self.batches_by_vmap and isinstance(randomness, Draws):
            if not (self.reading_cpu_path and reads_are_free(target_probs)):
                return _mapped_decisions(self, target_probs, draft_probs, draft_tokens, randomness, judged)
        rows = range(draft_tokens.shape[0])
        sequences = [randomness.row(b) for b in rows] if isinstance(randomness, Draws) else randomness
        return BatchDecision.stack(
            [
                self.verify_block(
                    target_probs[b], draft_probs[b], draft_tokens[b], sequences[b], **judged_argument(judged, b)
                )
                for b in rows
            ]
        )

    def block_law(
        self, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Optional, for exactness tests: the exact law of :meth:`verify_block`'s decision.

        Same inputs without the generator → ``[K, L+1, V]``: entry ``[k, n, y]`` is the probability
        that the block commits ``draft_tokens[k, :n]`` followed by ``y`` (rows with equal prefixes
        may share the mass in any way). :func:`specdec_cli.testing.enumerate_block_law` sums it
        over every draft block.
        """
        raise NotImplementedError(f"verifier '{self.name}' does not give its block law")

    def output_law(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor | None:
        """The exact law π of the token a position outputs when its K candidates are drawn independently from
        draft_probs ``[..., K, V]``, for target_probs ``[..., V]`` → ``[..., V]``; None where the scheme does not
        give it. A lossless scheme's is q itself (the default); a lossy one overrides it, and ``acceptance``
        reports KL(q ‖ π) and TV(q, π) from it, the divergence the rule spends at each position.
        """
        return target_probs if self.lossless else None

    def output_kl(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor | None:
        """KL(q ‖ output law) in nats at each position → ``[...]`` (target_probs ``[..., V]``, draft_probs
        ``[..., K, V]``), from :meth:`output_law`; None where that is not given."""
        law = self.output_law(target_probs, draft_probs)  # [..., V]
        return None if law is None else kl_divergence(target_probs, law)  # [...]

    def promised_bound(self) -> tuple[str, float] | None:
        """The bound this instance promises on the divergence of each position's output law from q, as (divergence
        name in :data:`~specdec_cli.plugins.divergences.DIVERGENCES`, bound), or None for a rule that promises
        none. The author's kit holds a rule to it. The default: the KL bound its ``kl_bound_parameter`` sets."""
        if self.kl_bound_parameter is None:
            return None
        return "kl", float(getattr(self, self.kl_bound_parameter))


class _DrawsOnlyThroughVerifier:
    """``keyed_randomness`` of a :class:`Verifier` subclass that neither sets it nor is ``capturable``: True when
    it overrides none of the methods that draw, all of which draw keyed (``select`` through
    :func:`~specdec_cli.sampling.sample`, the others through it, :func:`first_rejection`, :func:`walk_alive_rows`)."""

    def __get__(self, instance: object, owner: type) -> bool:
        drawing = ("select", "select_alive", "verify_block", "verify_batch")
        return all(getattr(owner, method) is getattr(Verifier, method) for method in drawing)


class Verifier(BlockVerifier):
    """A token-level verifier. All methods are batched over leading dimensions ``[...]``.

    Plugins implement :meth:`conditional` and :meth:`acceptance_probability`; :meth:`select`
    samples ``conditional`` unless overridden with something cheaper. The block call walks the
    positions with a mask of the rows still alive (their tokens equal every output so far) and
    stops committing at the first position where none survives; a row alive after all L earns a
    bonus token from q. With one draft the positions are independent, so it decides all of them
    in one batched ``select``.
    """

    token_level = True
    keyed_randomness = _DrawsOnlyThroughVerifier()

    @abstractmethod
    def conditional(
        self, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The exact law of the output token given the candidates.

        target_probs ``[..., V]``, draft_probs ``[..., K, V]``, draft_tokens ``[..., K]`` → ``[..., V]``.
        """

    @abstractmethod
    def acceptance_probability(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """P(output ∈ candidates) when ``x_k ~ draft_probs[..., k, :]`` independently → ``[...]``."""

    def select(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: Randomness = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample from :meth:`conditional` → (token ``[...]``, accepted ``[...]``).

        ``accepted`` says whether the token equals one of the candidates. Keyed draws put row i of the
        leading dimensions at offset i (a block's positions).
        """
        token = sample(self.conditional(target_probs, draft_probs, draft_tokens), randomness)  # [...]
        accepted = (draft_tokens == token.unsqueeze(-1)).any(-1)  # [...]
        return token, accepted

    def select_alive(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        alive: torch.Tensor,
        randomness: Randomness = None,
    ) -> torch.Tensor:
        """:meth:`select` among the candidates with ``alive`` set, in their order → token ``[]``.

        target_probs ``[V]``, draft_probs ``[K, V]``, draft_tokens ``[K]``, alive ``[K]`` bool (the
        result is unused when no row is alive). How many rows are alive is not known on the host,
        so this default selects among the first k alive rows for every k = 1..K and keeps the one
        for the true count; verifiers that can mask dead candidates override it.
        """
        num_drafts = draft_tokens.shape[0]
        if num_drafts == 1:
            return self.select(target_probs, draft_probs, draft_tokens, randomness)[0]
        order = torch.argsort((~alive).to(torch.uint8), stable=True)  # [K]: alive rows first, in order
        outputs = [
            self.select(target_probs, draft_probs[order[:k]], draft_tokens[order[:k]], randomness)[0]
            for k in range(1, num_drafts + 1)
        ]
        count = alive.sum().clamp(min=1)  # []
        return torch.stack(outputs).gather(0, (count - 1).view(1)).squeeze(0)

    def prepare(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> None:
        """Optional: called once per block with the positions' laws, before the positions are walked.

        target_probs ``[n, V]``, draft_probs ``[n, K, V]`` as if all drafts were alive (the device walk
        passes all L positions; where the tokens are known on the host, only the first
        :func:`shared_prefix_length` positions, the ones where that can happen). A scheme that solves
        a problem per position can solve them here in one batched call; the default does nothing.
        """

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None) -> BlockDecision:
        if draft_tokens.shape[0] == 1:
            tokens, accepted = self.select(
                target_probs[0, :-1], draft_probs.transpose(0, 1), draft_tokens.transpose(0, 1), randomness
            )  # [L] each; inputs [L, V], [L, 1, V], [L, 1]
            return first_rejection(accepted, tokens, target_probs[0, -1], randomness)
        return self._walk(target_probs, draft_probs, draft_tokens, randomness)

    def _walk(self, target_probs, draft_probs, draft_tokens, randomness) -> BlockDecision:
        """The multi-draft walk over positions with an alive mask, all on the device."""
        draft_length = draft_tokens.shape[1]
        self.prepare(target_probs[0, :draft_length], draft_probs.transpose(0, 1))  # [L, V], [L, K, V]

        def choose(t: int, alive: torch.Tensor, leader: torch.Tensor) -> torch.Tensor:
            target = target_probs[:, t].index_select(0, leader.view(1)).squeeze(0)  # [V]: q of the alive rows
            return self.select_alive(target, draft_probs[:, t], draft_tokens[:, t], alive, at(randomness, t))

        return walk_alive_rows(choose, target_probs, draft_tokens, randomness)

    def block_law(self, target_probs, draft_probs, draft_tokens):
        """The walk's exact law, by recursion over the alive sets (host loops: for tests only)."""
        num_drafts, draft_length = draft_tokens.shape
        law = torch.zeros(target_probs.shape, dtype=target_probs.dtype)  # [K, L+1, V]
        shared = shared_prefix_length(draft_tokens.numpy(force=True))
        self.prepare(target_probs[0, :shared], draft_probs[:, :shared].transpose(0, 1))

        def walk(t: int, alive: list[int], mass: float) -> None:
            if t == draft_length:
                law[alive[0], t] += mass * target_probs[alive[0], t]
                return
            output = self.conditional(target_probs[alive[0], t], draft_probs[alive, t], draft_tokens[alive, t])  # [V]
            for token in torch.nonzero(output).flatten().tolist():
                survivors = [k for k in alive if int(draft_tokens[k, t]) == token]
                if survivors:
                    walk(t + 1, survivors, mass * float(output[token]))
                else:
                    law[alive[0], t, token] += mass * float(output[token])

        walk(0, list(range(num_drafts)), 1.0)
        return law


def walk_alive_rows(
    choose: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockDecision:
    """The multi-draft block decision, on the device: follow the rows that match every output so far.

    ``choose(t, alive, leader)`` gives the output token ``[]`` at position t, where alive ``[K]`` bool
    marks the rows whose tokens equal every output before t and leader ``[]`` is the first of
    them (alive rows share the committed prefix, so their q_t are equal). The block stops committing
    at the first position where no row survives; a row alive after all L earns a bonus token from q.
    target_probs ``[K, L+1, V]``, draft_tokens ``[K, L]``.
    """
    num_drafts, draft_length = draft_tokens.shape
    device = draft_tokens.device
    alive = torch.ones(num_drafts, dtype=torch.bool, device=device)  # [K]: rows matching every output so far
    ended = torch.zeros((), dtype=torch.bool, device=device)  # []: a position had no survivor
    num_accepted = torch.zeros((), dtype=torch.long, device=device)  # []
    outputs = []
    for t in range(draft_length):
        token = choose(t, alive, alive.to(torch.uint8).argmax())
        survivors = alive & (draft_tokens[:, t] == token)  # [K]
        outputs.append(token)
        num_accepted = num_accepted + (~ended & survivors.any()).long()
        ended = ended | ~survivors.any()
        alive = torch.where(ended, alive, survivors)  # the last non-empty set: the rows followed
    row = alive.to(torch.uint8).argmax()  # []
    bonus_law = target_probs[:, draft_length].index_select(0, row.view(1))  # [1, V]
    outputs.append(sample(bonus_law, randomness, Stream.BONUS, draft_length).squeeze(0))  # kept if no position ended
    tokens = torch.stack(outputs)  # [L+1]: position num_accepted holds the correction or the bonus
    return BlockDecision(tokens, num_accepted, row)


def prefix_agreement(draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[K, K, L+1]`` bool: entry (i, j, t) says rows i and j of draft_tokens ``[K, L]`` drew the same tokens
    before position t (so they are alive together at t, or dead together)."""
    same = (draft_tokens[:, None, :] == draft_tokens[None, :, :]).long()  # [K, K, L]
    empty_prefix = torch.ones_like(same[..., :1])  # [K, K, 1]
    return torch.cat([empty_prefix, same.cumprod(-1)], -1).bool()  # [K, K, L+1]


def problem_members(agreement: torch.Tensor) -> torch.Tensor:
    """``[K, L, K]`` bool: the candidates of problem (k, t), the rows j ≥ k that agree with row k before t.

    agreement ``[K, K, L+1]`` (:func:`prefix_agreement`). When k is the first row alive at t, these are
    exactly the walk's alive rows there; the other problems are solved too, and never used.
    """
    num_rows = agreement.shape[0]
    rows = torch.arange(num_rows, device=agreement.device)  # [K]
    later = (rows[None, :] >= rows[:, None]).unsqueeze(-1)  # [K(k), K(j), 1]
    return (agreement[..., :-1] & later).transpose(1, 2)  # [K(k), L, K(j)]


def decide_problems(
    accepts: torch.Tensor,
    residuals: torch.Tensor,
    agreement: torch.Tensor,
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockDecision:
    """The multi-draft walk when every problem (k, t) of :func:`problem_members` is solved at once: a fixed
    number of small operations and no read, for any data.

    accepts ``[K, L, K]``: candidate j's acceptance probability in problem (k, t), given the candidates
    before it were rejected (0 for a non-member); residuals ``[K, L, V]``: what the output is drawn from
    (any non-negative weights) when all are rejected. Candidate j at offset t is tested with the uniform
    (stream ACCEPT, t, lane j); the walk starts at problem (0, 0) and, after accepting candidate j at t,
    goes on with the first row that agrees with j through t. target_probs ``[K, L+1, V]``, draft_tokens ``[K, L]``.
    """
    num_rows, draft_length = draft_tokens.shape
    uniforms = uniforms_from(randomness, Stream.ACCEPT, (draft_length, num_rows), draft_tokens.device, lanes_last=True)
    taken = uniforms < accepts.double()  # [K, L, K]
    accepted = taken.any(-1).flatten()  # [K L]: problem (k, t) at k L + t
    first = taken.to(torch.uint8).argmax(-1)  # [K, L]: the accepted candidate
    output = draft_tokens.gather(0, first).flatten()  # [K L]: its token
    # The first row that agrees with the accepted candidate through t leads the rows alive at t + 1.
    through = agreement[:, :, 1:].transpose(1, 2)  # [K(i), L, K(j)]: rows i, j agree through t
    following = through.gather(0, first.unsqueeze(-1).expand_as(through)).to(torch.uint8).argmax(-1).flatten()  # [K L]
    leader = torch.zeros((), dtype=torch.long, device=draft_tokens.device)  # []
    going = torch.ones((), dtype=torch.bool, device=draft_tokens.device)  # []: every position so far accepted
    num_accepted = torch.zeros_like(leader)  # []
    path = []
    for t in range(draft_length):
        problem = (leader * draft_length + t).view(1)  # [1]
        going = going & accepted.gather(0, problem).squeeze(0)
        num_accepted = num_accepted + going.long()
        leader = torch.where(going, following.gather(0, problem).squeeze(0), leader)
        path.append(problem)
    path = torch.cat(path)  # [L]: the problem solved at each position
    ended_at = path.gather(0, num_accepted.clamp(max=draft_length - 1).view(1))  # [1]
    residual = residuals.flatten(0, 1).index_select(0, ended_at).squeeze(0)  # [V]
    bonus_law = target_probs[:, draft_length].index_select(0, leader.view(1)).squeeze(0)  # [V]
    return commit_following(num_accepted, output.gather(0, path), residual, bonus_law, randomness, leader)


def walk_reading(
    decide: Callable[[int, list[int], list[list[int]], list[list[float]]], tuple[int | None, torch.Tensor | None]],
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockDecision:
    """The multi-draft walk with host reads, for the CPU, where a read is free: position by position, and
    only as far as the block goes.

    ``decide(t, alive, tokens, uniforms)`` gets the alive rows (host ints, first = the leader), every
    row's tokens ``[K][L]`` and the ACCEPT uniforms ``[L][K]`` (candidate j at offset t: ``uniforms[t][j]``,
    as :func:`decide_problems` uses them) and returns (the accepted row, None) or (None, the residual
    ``[V]`` the block ends with). target_probs ``[K, L+1, V]``, draft_tokens ``[K, L]``.
    """
    num_rows, draft_length = draft_tokens.shape
    tokens = draft_tokens.tolist()  # [K][L]
    uniforms = uniforms_from(
        randomness, Stream.ACCEPT, (draft_length, num_rows), draft_tokens.device, lanes_last=True
    ).tolist()
    alive, num_accepted, law = list(range(num_rows)), 0, None
    while law is None and num_accepted < draft_length:
        accepted, law = decide(num_accepted, alive, tokens, uniforms)
        if accepted is not None:
            alive = [i for i in alive if tokens[i][num_accepted] == tokens[accepted][num_accepted]]
            num_accepted += 1
    row = torch.tensor(alive[0], device=draft_tokens.device)  # []
    law = target_probs[alive[0], draft_length] if law is None else law  # [V]: the bonus law when all were accepted
    return commit_following(
        torch.tensor(num_accepted, device=row.device), draft_tokens[alive[0]], law, law, randomness, row
    )


def commit_following(
    num_accepted: torch.Tensor,
    tokens: torch.Tensor,
    residual: torch.Tensor,
    bonus_law: torch.Tensor,
    randomness: Randomness,
    row: torch.Tensor,
) -> BlockDecision:
    """The decision once ``num_accepted`` ``[]`` of the L ``tokens`` ``[L]`` are kept: the next token is drawn
    from ``residual`` ``[V]`` after a rejection (stream RESIDUAL at offset n) or from ``bonus_law`` ``[V]``
    when all L were accepted (stream BONUS at offset L), in one keyed evaluation and one draw."""
    stream = torch.where(num_accepted < tokens.shape[0], int(Stream.RESIDUAL), int(Stream.BONUS))  # []
    uniform = uniforms_from(randomness, stream, (), residual.device, num_accepted)  # []
    return commit_with_uniform(num_accepted, tokens, residual, bonus_law, uniform, row)


def commit_with_uniform(
    num_accepted: torch.Tensor,
    tokens: torch.Tensor,
    residual: torch.Tensor,
    bonus_law: torch.Tensor,
    uniform: torch.Tensor,
    row: torch.Tensor,
) -> BlockDecision:
    """:func:`commit_following` with the draw's ``uniform`` ``[]`` float64 already taken (from the stream
    that :func:`commit_following` names). A caller that already knows which law is drawn from (a host walk)
    passes it as both, and no choice over V is made."""
    law = residual if residual is bonus_law else torch.where(num_accepted < tokens.shape[0], residual, bonus_law)  # [V]
    token = sample_with(law, uniform).view(1)  # [1]
    committed = torch.cat([tokens, token]).scatter(0, num_accepted.view(1), token)  # [L+1]
    return BlockDecision(committed, num_accepted, row)


def shared_prefix_length(draft_tokens: np.ndarray) -> int:
    """Positions at which all rows of ``draft_tokens`` ``[K, L]`` can still be alive together.

    Rows are alive together at position t only if they drew the same tokens before it, so a
    scheme that prepares "all rows alive" problems needs positions 0..n-1 only: n is one past
    the first position where the rows differ, or L.
    """
    differs = (draft_tokens != draft_tokens[:1]).any(0)  # [L]
    return int(np.argmax(differs)) + 1 if differs.any() else draft_tokens.shape[1]


def first_rejection(
    accepted: torch.Tensor, tokens: torch.Tensor, bonus_law: torch.Tensor, randomness: Randomness
) -> BlockDecision:
    """The single-draft block decision from per-position outcomes, on the device.

    accepted ``[L]`` bool and tokens ``[L]`` (the draft token where accepted, else the correction
    drawn there); bonus_law ``[V]``: q after all L draft tokens. The block commits the accepted
    prefix and the token at its first rejection, or a bonus token drawn from ``bonus_law``.
    """
    num_accepted = accepted.long().cumprod(0).sum()  # []
    bonus = sample(bonus_law.unsqueeze(0), randomness, Stream.BONUS, len(tokens))  # [1]; kept when all L were accepted
    committed = torch.cat([tokens, bonus])  # [L+1]
    return BlockDecision(committed, num_accepted, torch.zeros_like(num_accepted))
