"""The block-level verifier contract: :class:`BlockVerifier`, whose one call :meth:`BlockVerifier.verify` decides a
batch of blocks ``[B, K, L+1, V]`` (B = 1 for one sequence, K = 1 for one draft row: ordinary sizes, not branches).

A rule is written either for the batch (overriding ``verify``) or for one block (``verify_block``, as every plugin
written before ``verify`` existed): the base class's ``verify`` is then the one adapter that maps the block rule over
the batch (:func:`decide_blocks`).
"""

from __future__ import annotations

from abc import ABCMeta
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from ..base.randomness import Draws, Randomness, block_generator
from .decisions import BlockDecision, Decision, DecisionError, decision_problem
from .divergences import kl_divergence
from .parameters import check_parameters

__all__ = [
    "JUDGED_VIEWS",
    "BlockVerifier",
    "JudgedLaws",
    "decide_blocks",
    "device_path",
    "judged_argument",
    "reads_are_free",
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


def _mapped_decisions(
    verifier: "BlockVerifier",
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draws: Draws,
    judged: JudgedLaws = None,
) -> Decision:
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
    return Decision(*fields).as_long()


def decide_blocks(
    verifier: "BlockVerifier",
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: "Draws | list[torch.Generator] | None",
    judged: JudgedLaws = None,
) -> Decision:
    """The one adapter from a rule written for one block (``verify_block``) to :meth:`BlockVerifier.verify`.

    It maps the block rule over a batch of several with ``torch.func.vmap`` when ``batches_by_vmap`` is set (one
    call's launches for B blocks; on the CPU a rule with a reading CPU path is looped instead, where reads are free
    and that path is cheaper), and otherwise calls it once per sequence: correct for every plugin, B times the
    launches. A rule without ``keyed_randomness`` is handed a ``torch.Generator`` per sequence, seeded from its key
    and block start (two host reads, for rules that are never captured). Inputs: :meth:`BlockVerifier.verify`'s.
    """
    keyed, batch = isinstance(randomness, Draws), draft_tokens.shape[0]
    # A batch of one maps to the same decision looped (the kit checks that mapped equals looped), and vmap's own
    # dispatch would cost it more than it saves (0.96 against 0.33 ms for speculative at V = 49152 on a CPU).
    reading = verifier.reading_cpu_path and reads_are_free(target_probs)
    if verifier.batches_by_vmap and keyed and batch > 1 and not reading:
        return _mapped_decisions(verifier, target_probs, draft_probs, draft_tokens, randomness, judged)
    blocks = _block_randomness(verifier, randomness, batch, draft_tokens.device)
    decisions = [
        verifier.verify_block(target_probs[b], draft_probs[b], draft_tokens[b], block, **judged_argument(judged, b))
        for b, block in enumerate(blocks)
    ]
    for decision in decisions:
        problem = decision_problem(decision, draft_tokens.shape[2] + 1, draft_tokens.device)
        if problem is not None:
            raise DecisionError(problem)
    return Decision.stack(decisions)


def _block_randomness(
    verifier: "BlockVerifier", randomness: "Draws | list[torch.Generator] | None", batch: int, device: torch.device
) -> list[Randomness]:
    """Each sequence's randomness for a rule written for one block: its row of keyed draws, a generator seeded from
    its key and block start for a rule that draws from one, or None (a test's fresh draws)."""
    if randomness is None:
        return [None] * batch
    if not isinstance(randomness, Draws):
        return list(randomness)
    if verifier.keyed_randomness:
        return [randomness.row(b) for b in range(batch)]
    keys, starts = randomness.key.tolist(), randomness.block_start.tolist()  # [B] each
    return [block_generator(key, start, device) for key, start in zip(keys, starts)]


def _batch_of_one(randomness: Randomness) -> "Draws | list[torch.Generator]":
    """One block's randomness as a batch of one's."""
    if isinstance(randomness, Draws):
        return Draws(randomness.key.view(1), randomness.block_start.view(1), randomness.offset)
    return [randomness]


def judged_argument(judged: JudgedLaws, index: int | slice | None = None) -> dict[str, Any]:
    """The keyword arguments that hand ``judged`` (rows ``index`` of its leading dimension, or all) to a verifier's
    method: none where there are none, so a rule that judges by the sampling laws is never given the argument."""
    if judged is None:
        return {}
    return {"judged": tuple(laws if index is None else laws[index] for laws in judged)}


def _set_below_contract(cls: type, flag: str) -> bool:
    """Whether ``cls`` or one of its bases outside the contract's modules (a plugin's own classes) sets ``flag``."""
    return any(flag in vars(klass) for klass in cls.__mro__ if not klass.__module__.startswith(_CONTRACT_PACKAGE))


_CONTRACT_PACKAGE = __name__.rpartition(".")[0] + "."


_CALLS = ("verify", "verify_block", "verify_batch")


class _ContractMeta(ABCMeta):
    """ABC's metaclass, under which a verifier class is abstract until it (or a base outside this module) writes one
    of the contract's calls: :meth:`BlockVerifier.verify` for the batch or ``verify_block`` for one block. Either
    completes it; the other then comes from the base class. The one left abstract is named ``verify_block``, the call
    every plugin written before ``verify`` implements."""

    def __new__(mcls, *args: Any, **kwargs: Any) -> type:
        cls = super().__new__(mcls, *args, **kwargs)
        written = any(call in vars(klass) for klass in cls.__mro__ if klass.__module__ != __name__ for call in _CALLS)
        if not written:
            cls.__abstractmethods__ = frozenset(cls.__abstractmethods__ | {"verify_block"})
        return cls


class BlockVerifier(metaclass=_ContractMeta):
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
    dependent_drafts: ClassVar[bool] = False
    """True for rules that stay exact on draft rows that are not independent, each row's law reported given the rows
    before it (a model drafter's ``branch_after``: rows that copy a token report the one-hot law at it). False: the
    rule needs independent rows, and the registry refuses the others (:attr:`DraftRows.dependent`)."""
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

    def verify(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: Draws | None = None,
        judged: JudgedLaws = None,
    ) -> Decision:
        """The verifier's one call: decide B blocks, one per sequence, on the tensors' device, without reading values
        back to the host.

        target_probs ``[B, K, L+1, V]``: q after each prefix of each draft row of each sequence (position L is the
        bonus position); draft_probs ``[B, K, L, V]``: the laws the draft tokens were drawn from; draft_tokens
        ``[B, K, L]``. A sequence's rows share its committed prefix, so ``target_probs[b, k, 0]`` is the same for
        every k. L ≥ 1; B = 1 and K = 1 are ordinary sizes. ``randomness``: keyed
        :class:`~specdec_cli.randomness.Draws` with a key and a block start per sequence (``[B]`` each), or None (a
        test's fresh draws). Sequence b's decision must not depend on the others in its batch: it is the one made
        with :meth:`Draws.row(b) <specdec_cli.randomness.Draws.row>` alone. ``judged``: the laws the rule judges
        drafts by (:attr:`judged_laws`) with the same leading B, passed only to a rule that asks for them.

        A rule written for the batch overrides this. The default is the adapter for a rule written for one block
        (:meth:`verify_block`): :func:`decide_blocks`.
        """
        if type(self).verify_batch is not BlockVerifier.verify_batch:  # batched natively under the old name
            return self.verify_batch(target_probs, draft_probs, draft_tokens, randomness, **judged_argument(judged))
        return decide_blocks(self, target_probs, draft_probs, draft_tokens, randomness, judged)

    def verify_block(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: Randomness = None,
    ) -> BlockDecision:
        """A rule written for one block: :meth:`verify`'s inputs for one sequence, without the leading B.

        target_probs ``[K, L+1, V]``, draft_probs ``[K, L, V]``, draft_tokens ``[K, L]``. ``randomness``: the
        block's keyed :class:`~specdec_cli.randomness.Draws` when ``keyed_randomness`` is set, else a
        ``torch.Generator`` seeded from the sample and the block (plugins written against a stateful generator).
        The base class's :meth:`verify` maps it over the batch; a rule that overrides :meth:`verify` need not
        write it (it then decides one block as a batch of one).
        """
        decision = self.verify(
            target_probs.unsqueeze(0),
            draft_probs.unsqueeze(0),
            draft_tokens.unsqueeze(0),
            None if randomness is None else _batch_of_one(randomness),
        )
        return BlockDecision(decision.tokens[0], decision.num_accepted[0], decision.row[0])

    def verify_batch(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: "Draws | list[torch.Generator] | None" = None,
        judged: JudgedLaws = None,
    ) -> Decision:
        """:meth:`verify`'s name before it was the one call (kept for callers and plugins written against it)."""
        if type(self).verify is not BlockVerifier.verify:  # a rule written for the batch
            return self.verify(target_probs, draft_probs, draft_tokens, randomness, **judged_argument(judged))
        return decide_blocks(self, target_probs, draft_probs, draft_tokens, randomness, judged)

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
