"""The speculative decoding engine: draft → score → verify → commit, block after block, for every batch size.

A run advances B sequences (prompts × samples) together, each at its own pace; a single sample is a batch of one.
One step is one block for every sequence of the batch, with K draft rows (every draft config's ``num_drafts``
samples) and up to L draft tokens:

1. every drafter proposes for every sequence (:meth:`~specdec_cli.drafting.Drafter.propose`: the model drafter runs
   one forward per position for all rows); each sequence's block length is its own (its drafters' proposals, its
   remaining tokens), and the model drafters are asked last, for what the others leave to verify;
2. the target scores all B × K rows in one forward (:class:`~specdec_cli.engine.session.ModelSession`);
3. the verifier decides every sequence's block on the device, one call per distinct block shape and rule: a block
   alone through :meth:`~specdec_cli.verifiers.BlockVerifier.verify_block` (compiled, or replayed from a CUDA graph,
   under ``--compile``), several through :meth:`~specdec_cli.verifiers.BlockVerifier.verify_batch`;
4. EOS, finiteness and every model's longest-agreeing row are folded in on the device, and the step reads the
   device once for the whole batch; each sequence then commits its own tokens and keeps its own cache rows.

No other value crosses from the device to the host inside a step. The target alone is the same loop with no
drafts (L = 0: each block is one target forward and the token drawn from it), so baseline and speculative runs
share sampler and stopping. Sequences that finish leave the batch after the step and waiting ones join it, so a
long answer does not hold the others. A sequence's draws are keyed by its own (seed, prompt, sample) and its own
block starts, so its tokens do not depend on what else is in its batch, up to the float rounding of batched
forwards. docs/block-loop.md walks through it.

Exact first (``speculation.exact_first`` N > 0 with a lossy verifier): a block that starts after g < N generated
tokens is decided by a lossless rule (``speculation.exact_verifier``) and drafts at most N − g tokens, so that no
block straddles N. Its draft tokens lie at positions g .. N − 1 and its correction before N (a bonus token, at N at
the latest, is drawn from q anyway); a lossless block commits tokens distributed as the target's own continuation,
and the rule and cap of each block depend on the tokens before it only, so the first N tokens follow the target's
law exactly. One rule decides a whole block, so without the cap a block from before N would either let the exact
rule decide tokens past N or let the lossy one decide tokens before it. Blocks that start at g >= N are the run's
verifier's. One step may hold sequences of both phases: each is a group of its own, decided on the device before
the step's one read.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.errors import NonFiniteLogitsError, SpecdecError, UsageError, is_allocation_error, requested_memory
from ..base.inputs import require_text
from ..base.randomness import Draws, Stream, block_generator, sample_key
from ..base.recipe import AUTOREGRESSIVE, DecodingConfig, Recipe
from ..base.sampling import judged_params, non_finite_message, sample_with, sampling_law
from ..base.timing import RegionTimer
from ..base.waits import waiting
from ..models.loading import LoadedModel, shared_vocab_size
from ..models.pool import ModelPool
from ..plugins.draft_rows import DraftRows, rows_per_config
from ..plugins.drafter_registry import DrafterRegistry, recipe_draft_rows
from ..plugins.drafting import (
    Drafter,
    DraftRequest,
    DraftSetup,
    Proposal,
    ProposalError,
    block_length,
    empty_proposal,
    proposal_problem,
)
from ..plugins.registry import VerifierRegistry, error_line
from ..plugins.verifiers import (
    BatchDecision,
    BlockVerifier,
    JudgedLaws,
    batch_decision_problem,
    batch_departs_from_drafts,
    decision_problem,
    decision_value_problem,
    judged_argument,
)
from ..results.stats import GenerationResult, SampleStats
from .decoding import Draft, create_exact_verifier, create_verifier, exact_first_note, load_drafts, target_sampling
from .draft_schedule import next_draft_length
from .drafted import Drafted, count_to_eos, longest_matches
from .graphs import CapturedVerifyStep
from .session import ModelSession, batch_problem, static_problem
from .stopping import cut_at_stop, tokens_through_stop

BlockCallback = Callable[[int, int, list[int], list[bool]], None]
"""on_block(prompt_index, sample_index, new_token_ids, accepted_mask) after each committed block."""


@dataclass(frozen=True)
class TargetLaws:
    """The target's laws of a step ``[B, K, n+1, V]``: the sampling laws, and the ones the verifier judges drafts by
    where it asks for others (its ``judged_laws``; None otherwise)."""

    probs: torch.Tensor
    judged: torch.Tensor | None = None


class PromptTypeError(UsageError, TypeError):
    """Prompts that are not text (a TypeError too, as Python callers expect)."""


class SpeculativeDecoder:
    """Generates with a target, zero or more drafts and a verifier; returns results with stats.

    It holds loaded models and a :class:`~specdec_cli.recipe.DecodingConfig`; :meth:`with_config`
    (or keyword arguments to :meth:`generate`) changes the verifier, draft length, number of drafts
    and sampling settings without loading anything again. Build one from a recipe with
    :meth:`from_recipe`. With verifier 'none' it decodes autoregressively with the target alone.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafts: Sequence[Draft],
        config: DecodingConfig,
        registry: VerifierRegistry | None = None,
        drafter_registry: DrafterRegistry | None = None,
    ):
        problems = config.problems()
        if problems:
            raise UsageError("{}: {}".format(*problems[0]))
        self.target = target
        self.drafts = list(drafts)
        self.config = config
        self.registry = registry or VerifierRegistry()
        self.drafter_registry = drafter_registry or DrafterRegistry()
        self.vocab_size = shared_vocab_size(target, self._models_in_target_ids())
        self.target_params = target_sampling(config)
        self.drafters, row_laws = self._drafters() if config.speculative else ([], [])
        rows = dataclasses.replace(DraftRows.of(row_laws), unjudged=self._unjudged_drafters())
        self.verifier = create_verifier(config, rows, self.registry)
        self.exact_verifier = create_exact_verifier(config, rows, self.registry, self.verifier)
        """The lossless rule of the blocks that start before :attr:`exact_first`; None where no block needs one."""
        self.exact_first = config.speculation.exact_first if self.exact_verifier is not None else 0
        """Tokens of every sample the exact rule decides (0: the run's verifier decides every block)."""
        self._sampling_law = torch.compile(sampling_law) if config.speculation.compile else sampling_law
        self._verify_block = self._verify_step(self.verifier)
        self._verify_exact_block = self._verify_step(self.exact_verifier)
        self.draft_length = config.speculation.draft_length if self.drafters else 0
        self.running = threading.RLock()
        """Held by the generation under way (:meth:`DecodingRun.run`): calls from other threads wait their turn."""
        self.eos_ids = target.eos_ids
        self.eos_tensor = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=target.device)  # [eos ids]
        self.device = target.device

    def _models_in_target_ids(self) -> list[LoadedModel]:
        """The draft models whose logits are laws over the target's ids: not a drafter's model with a vocabulary of
        its own (it proposes in the target's ids through text), which therefore does not narrow the shared V."""
        return [
            draft.model
            for draft in self.drafts
            if draft.model is not None and not self.drafter_registry.plugin_class(draft.drafter).own_vocabulary
        ]

    def _unjudged_drafters(self) -> tuple[str, ...]:
        """The drafters of this decoder's entries that sample without reporting judged laws (:attr:`DraftRows.unjudged`,
        as the recipe's rows give it before the models load)."""
        classes = [(draft.drafter, self.drafter_registry.plugin_class(draft.drafter)) for draft in self.drafts]
        return tuple(name for name, cls in classes if not (cls.deterministic or cls.reports_judged_laws))

    def _verify_step(self, verifier: BlockVerifier | None) -> Callable | None:
        """``verifier``'s step for a block alone (None for no verifier): its ``verify_block``, or under ``--compile``
        through ``torch.compile``, which traces it into one graph (keyed randomness, no reads:
        :func:`~specdec_cli.engine.decoding.create_verifier` refused a verifier without keyed randomness). On a GPU
        it is captured in CUDA graphs instead (:mod:`specdec_cli.engine.graphs`), compiled only where a block reads
        the host; on the CPU a verifier with a reading CPU path stays eager. The run's verifier and its exact rule
        each get their own step."""
        if verifier is None or not self.config.speculation.compile:
            return getattr(verifier, "verify_block", None)
        compiled_verify = torch.compile(verifier.verify_block)
        if self.target.device.type == "cuda":
            return CapturedVerifyStep(verifier, fallback=compiled_verify)
        if verifier.reading_cpu_path:  # compiled, it would leave its CPU path for a costlier one
            return verifier.verify_block
        return compiled_verify

    @property
    def judged_view(self) -> str | None:
        """The laws the run's verifier judges drafts by besides the sampling laws (its ``judged_laws``), which the
        steps compute from the same logits; None where it judges by the sampling laws (or there is none)."""
        return None if self.verifier is None else self.verifier.judged_laws

    def rule(self, exact: bool) -> tuple[BlockVerifier, Callable]:
        """The verifier that decides a block and its step for a block alone: the exact rule for a block that starts
        before :attr:`exact_first` (``exact``), the run's verifier for any other."""
        if exact:
            return self.exact_verifier, self._verify_exact_block
        return self.verifier, self._verify_block

    @property
    def exact_first_note(self) -> str | None:
        """One line where ``speculation.exact_first`` is set and changes nothing (the verifier is lossless)."""
        return exact_first_note(self.config, self.verifier)

    def _drafters(self) -> tuple[list[Drafter], list[Hashable]]:
        """Each draft entry's drafter, set up, and the law key of every row they fill. Entries whose drafters can
        share work are joined (drafts of one model share its session and one batched forward per position);
        each joined drafter keeps its first entry's place, so rows and their keyed lanes stay in recipe order."""
        by_class: dict[type, list[Drafter]] = {}
        order: dict[int, int] = {}  # id of a drafter → its entry's place in the recipe
        row_laws: list[Hashable] = []
        for index, draft in enumerate(self.drafts):
            drafter = self.drafter_registry.create(draft.drafter, draft.params)
            order[id(drafter)] = index
            rows = rows_per_config(type(drafter).deterministic, self.config.speculation.num_drafts)
            row_laws += [draft.law(self.config)] * rows
            self._call_drafter(
                drafter,
                "setup",
                drafter.setup,
                DraftSetup(
                    draft.model,
                    self.target,
                    draft.sampling(self.config),
                    rows,
                    self.vocab_size,
                    self.target.device,
                    self.config.speculation.kv_cache,
                    self.cache_headroom,
                    self.config.speculation.compile,
                ),
            )
            by_class.setdefault(type(drafter), []).append(drafter)
        joined = [
            kept
            for cls, drafters in by_class.items()
            for kept in self._call_drafter(drafters[0], "joined", cls.joined, drafters)
        ]
        return sorted(joined, key=lambda drafter: order[id(drafter)]), row_laws

    def with_config(self, **changes: Any) -> "SpeculativeDecoder":
        """The same models under a changed config: ``with_config(verifier="block", draft_length=8)``."""
        return SpeculativeDecoder(
            self.target, self.drafts, self.config.replace(**changes), self.registry, self.drafter_registry
        )

    @property
    def cache_headroom(self) -> int | None:
        """With ``speculation.static_cache`` (or ``compile``, whose steps need it): the slots each sequence's cache
        holds past its prompt (its output, a block's drafts and the bonus token); None: dynamic caches."""
        if not (self.config.speculation.static_cache or self.config.speculation.compile):
            return None
        return self.config.generation.max_new_tokens + self.config.speculation.draft_length + 1

    @property
    def cache_notes(self) -> list[str]:
        """One line for each model that keeps the dynamic cache where ``speculation.static_cache`` asks for the static
        one, and why (an encoder-decoder, a sliding window, ``kv_cache: false``)."""
        if self.cache_headroom is None:
            return []
        models = {id(model.model): model for model in [self.target, *(d.model for d in self.drafts if d.model)]}
        problems = (static_problem(model, self.config.speculation.kv_cache) for model in models.values())
        eager = " (so its steps run eager under --compile)" if self.config.speculation.compile else ""
        return [f"static cache: {problem}{eager}" for problem in dict.fromkeys(problems) if problem]

    @property
    def num_draft_rows(self) -> int:
        """Drafts per position in a block at most: every drafter's rows (0 for the target alone)."""
        return sum(drafter.rows for drafter in self.drafters)

    # ----------------------------------------------------------------------- building

    @classmethod
    def from_recipe(
        cls,
        recipe: Recipe,
        *,
        autoregressive: bool = False,
        pool: ModelPool | None = None,
        registry: VerifierRegistry | None = None,
        drafters: DrafterRegistry | None = None,
    ) -> "SpeculativeDecoder":
        """The one way a recipe becomes a decoder: check its settings, drafters and verifier, then take its
        models from ``pool`` (each loaded once per pool). Drafts are not loaded to decode autoregressively."""
        registry, drafters = registry or VerifierRegistry(), drafters or DrafterRegistry()
        config = cls.check_recipe(recipe, registry, autoregressive, drafters)  # before the slow loads
        pool = pool if pool is not None else ModelPool()
        target = pool.target(recipe.target)
        loaded = load_drafts(pool, recipe.drafts if config.speculative else (), target, drafters)
        return cls(target, loaded, config, registry, drafters)

    @staticmethod
    def check_recipe(
        recipe: Recipe,
        registry: VerifierRegistry,
        autoregressive: bool = False,
        drafters: DrafterRegistry | None = None,
    ) -> DecodingConfig:
        """The recipe's decoding config, once every draft entry suits its drafter and the verifier (and the exact
        rule of ``speculation.exact_first``) has taken the rows they fill (no model loads)."""
        config = recipe.decoding_config()
        if autoregressive:
            config = config.replace(verifier=AUTOREGRESSIVE)
        drafters = drafters or DrafterRegistry()
        if config.speculative:
            drafters.check_entries(recipe.drafts)
        rows = recipe_draft_rows(recipe, drafters)
        create_exact_verifier(config, rows, registry, create_verifier(config, rows, registry))
        return config

    # ----------------------------------------------------------------------- generation

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a prompt (through the chat template when the config asks for it)."""
        require_text(prompt)
        tokenizer = self.target.tokenizer
        if self.config.generation.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise UsageError("--chat was given but the target's tokenizer has no chat template")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = tokenizer(prompt).input_ids
        if not ids:
            raise UsageError("the prompt encodes to no tokens; give some text to continue")
        context = self.target.context_length
        if context is not None:
            _check_context(
                len(ids),
                self.config.generation.max_new_tokens,
                self.draft_length,
                context,
                self.target.is_encoder_decoder,
            )
        return ids

    def generate(
        self,
        prompts: str | Sequence[str],
        num_samples: int = 1,
        on_block: BlockCallback | None = None,
        batch_size: int = 1,
        **changes: Any,
    ) -> list[GenerationResult]:
        """``num_samples`` independent samples for each prompt (one string is one prompt), in order (prompt-major).

        ``batch_size`` B > 1 decodes B samples at a time in one batch (:class:`DecodingRun`); a sample's
        tokens do not depend on B, up to float rounding. Keyword ``changes`` to the decoding config apply to this
        call only (``verifier="block"``, ``draft_length=8``, ``temperature=0.3``, ...); the models stay loaded.
        """
        if changes:
            return self.with_config(**changes).generate(prompts, num_samples, on_block, batch_size)
        results = list(self.samples(prompts, num_samples, on_block, batch_size))
        return sorted(results, key=lambda result: (result.prompt_index, result.sample_index))

    def samples(
        self,
        prompts: str | Sequence[str],
        num_samples: int = 1,
        on_block: BlockCallback | None = None,
        batch_size: int = 1,
    ) -> Iterator[GenerationResult]:
        """What :meth:`generate` returns, yielded as each sample finishes (a caller that is stopped keeps
        the samples it was given): in order at batch size 1, in the order they finish in a batch. Every prompt
        is checked before any model runs. Every batch size runs the same loop (:class:`DecodingRun`)."""
        prompts = _prompt_list(prompts)
        for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a whole number >= 1, got {value!r}")
        if batch_size > 1:
            self.check_batching()
        encoded = [self.encode_prompt(p) for p in prompts]
        jobs = [
            SequenceJob(prompts[p], p, s, encoded[p], None if on_block is None else functools.partial(on_block, p, s))
            for p, s in itertools.product(range(len(prompts)), range(num_samples))
        ]
        yield from DecodingRun(self, batch_size).run(jobs)

    def check_batching(self) -> None:
        """Refuse, in one line, a model whose rows cannot keep their own positions, so cannot decode in batches
        (:func:`~specdec_cli.engine.session.batch_problem`): the one place that asks whether this decoder batches."""
        for model in [self.target, *(draft.model for draft in self.drafts if draft.model is not None)]:
            problem = batch_problem(model)
            if problem is not None:
                raise UsageError(problem)

    def sample(
        self,
        prompt: str,
        prompt_index: int,
        sample_index: int,
        prompt_ids: list[int],
        on_block: Callable[[list[int], list[bool]], None] | None = None,
    ) -> GenerationResult:
        """One sample of one prompt, with the key of (run seed, prompt index, sample index): its draws do not
        depend on which samples ran before it or beside it."""
        job = SequenceJob(prompt, prompt_index, sample_index, prompt_ids, on_block)
        (result,) = DecodingRun(self, 1).run([job])
        return result

    def warm_up(self, prompt_ids: list[int], max_new_tokens: int = 8) -> None:
        """One short untimed generation, so the first timed sample does not pay one-time costs
        (lazy initialisation, the allocator's first blocks, kernel selection)."""
        budget = self.config.generation.max_new_tokens
        if 0 < self.exact_first < budget:  # past exact_first, so that both rules' steps are warmed
            max_new_tokens = min(max_new_tokens + self.exact_first, budget)
        warm = self.with_config(max_new_tokens=max_new_tokens)
        # This decoder's own compiled steps, so that their compilation and CUDA graphs are paid here, untimed.
        warm._verify_block, warm._sampling_law = self._verify_block, self._sampling_law
        warm._verify_exact_block = self._verify_exact_block
        # Those steps are this decoder's: a generation in another thread waits, as for its own.
        with self.running, waiting("warming up: one short untimed generation, so no sample pays one-time costs"):
            warm.generate_ids(prompt_ids, key=-1)

    def generate_ids(
        self, prompt_ids: list[int], key: int, on_block: Callable[[list[int], list[bool]], None] | None = None
    ) -> tuple[list[int], list[bool], SampleStats]:
        """Generate after ``prompt_ids`` with the randomness of ``key`` (:func:`~specdec_cli.randomness.sample_key`)
        → (new token ids, accepted mask, stats)."""
        (result,) = DecodingRun(self, 1).run([SequenceJob("", 0, 0, prompt_ids, on_block, key)])
        return result.token_ids, result.accepted_mask, result.stats

    def check_block_flags(self, target_finite: bool, drafts_finite: list[int], drafts_in_vocab: list[int]) -> None:
        """Stop the run, in one line, on a drafter's token ids outside the vocabulary or on non-finite logits
        (the flags of a step's read, one per drafter)."""
        for drafter, in_vocab in zip(self.drafters, drafts_in_vocab):
            if not in_vocab:
                raise self.drafter_registry.fault(
                    drafter.name, f"proposed token ids outside the vocabulary [0, {self.vocab_size})"
                )
        if not target_finite:
            raise NonFiniteLogitsError(non_finite_message("target"))
        for drafter, finite in zip(self.drafters, drafts_finite):
            if not finite:
                raise NonFiniteLogitsError(non_finite_message(f"draft {drafter.label}"))

    def guarded_decision(self, verifier: BlockVerifier, verify: Callable[..., Any], *inputs: Any, **judged: Any) -> Any:
        """``verify(*inputs, **judged)`` (``verifier``'s verify_block or verify_batch, and the laws it judges by where
        it asks for them): a plugin's exception is its fault, named in one line with the original chained for
        ``--debug``; running out of memory is not, and reaches the run's memory guard."""
        try:
            return verify(*inputs, **judged)
        except SpecdecError:
            raise
        except Exception as error:
            if is_allocation_error(error):
                raise
            raise self.registry.fault(verifier.name, f"raised {error_line(error)}") from error

    def checked_proposal(self, drafter: Drafter, request: DraftRequest) -> Proposal:
        """``drafter``'s proposal (one of this decoder's), checked on the host (no device read): a plugin's exception
        or a bad proposal is one line naming it."""
        try:
            proposal = self._call_drafter(drafter, "propose", drafter.propose, request)
        except ProposalError as error:  # a sequence drafter's own proposal, checked by its base class
            raise self.drafter_registry.fault(drafter.name, str(error)) from None
        problem = proposal_problem(
            proposal, len(request.contexts), drafter.rows, request.max_lengths, self.vocab_size, self.device
        )
        if problem is not None:
            raise self.drafter_registry.fault(drafter.name, problem)
        return proposal

    def _call_drafter(self, drafter: Drafter, what: str, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` of ``drafter``: a plugin's exception is its fault, one line (running out of memory is
        not, and reaches the run's memory guard)."""
        return self.drafter_registry.guarded(drafter.name, what, method, *args)

    def memory_advice(self, batch_size: int, stats: SampleStats | None) -> str:
        """What to lower when an allocation failed: in a batch, its size first; alone, the prompt while it was read
        (``stats`` None or before the first block), the output length after."""
        drafts = f"--num-drafts ({self.config.speculation.num_drafts}) or --draft-length ({self.draft_length})"
        if batch_size > 1:
            return (
                f"decoding a batch of {batch_size}; lower --batch-size, --max-new-tokens, --num-drafts or "
                "--draft-length"
            )
        if stats is None or not stats.blocks:  # the prompt's encoding or prefill, or the first block's draft rows
            advice = f"reading the prompt; shorten the prompt ({stats.prompt_tokens if stats else '?'} tokens)"
            return advice + (f", or lower {drafts}" if self.drafters else "")
        advice = f"while generating; lower --max-new-tokens ({self.config.generation.max_new_tokens})"
        return advice + (f", {drafts}" if self.drafters else "")


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

    def __init__(self, decoder: SpeculativeDecoder, batch_size: int) -> None:
        self.decoder = decoder
        self.batch_size = batch_size
        self.device = decoder.device
        speculation = decoder.config.speculation
        self.target = ModelSession(
            decoder.target, decoder.vocab_size, speculation.kv_cache, decoder.cache_headroom, speculation.compile
        )
        self.drafters = decoder.drafters
        rows = [drafter.rows for drafter in self.drafters]  # [drafters]
        self.lanes = list(itertools.accumulate([0, *rows]))  # drafter j's rows are lanes[j] .. lanes[j+1] - 1
        self.sequences: list[_Sequence] = []
        self.draws: Draws | None = None  # the batch's keyed draws, set as sequences join and leave
        self.timer = RegionTimer(self.device)

    def run(self, jobs: list[SequenceJob]) -> Iterator[GenerationResult]:
        """Every job's result, yielded as each finishes (in the jobs' order at batch size 1). A decoder runs one
        generation at a time: its drafters hold their sequences' state, so a run from another thread waits for the
        one under way to end."""
        with self.decoder.running:
            for drafter in self.drafters:  # a drafter may hold the sequences of an interrupted run
                self.decoder._call_drafter(drafter, "remove_sequences", drafter.remove_sequences, [])
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
        for drafter in self.drafters:
            decoder._call_drafter(drafter, "start", drafter.add_sequences, prompts, contexts, self.timer)
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
        """Every drafter's proposals, the model drafters asked last for what the others leave to verify, so that no
        draft forward is paid for a position that is not verified (:func:`~specdec_cli.drafting.block_length`)."""
        batch, width = len(contexts), max(limits)
        # Row k's token at offset t is (stream DRAFT, t, lane k), whichever drafter fills it: one table per step.
        uniforms = self.draws.batch_uniforms(Stream.DRAFT, max(width, 1), self.lanes[-1] or 1)  # [B, L, K]
        proposals: list[Proposal | None] = [None] * len(self.drafters)
        lengths = list(limits)
        asked: list[list[int]] = [[]] * len(self.drafters)  # [drafters][B]: what each drafter was asked for
        for runs_model in (False, True):
            for index, drafter in enumerate(self.drafters):
                if drafter.uses_model != runs_model:
                    continue
                asked[index] = lengths
                if max(lengths) == 0:
                    proposals[index] = empty_proposal(batch, drafter.rows, self.decoder.vocab_size, self.device)
                    continue
                lanes = uniforms[:, : max(lengths), self.lanes[index] : self.lanes[index + 1]]  # [B, n, K_j]
                request = DraftRequest(
                    contexts, lengths, lanes, self.decoder._sampling_law, self.timer, self.decoder.judged_view
                )
                proposals[index] = self.decoder.checked_proposal(drafter, request)
            if not runs_model:
                lengths = [
                    block_length([p.lengths[b] for p in proposals if p is not None], limit)
                    for b, limit in enumerate(limits)
                ]
        for b, sequence in enumerate(self.sequences):  # a model drafter ran as many forwards as it drafted for b
            sequence.stats.draft_forwards += sum(min(p.forwards, asked[j][b]) for j, p in enumerate(proposals))
        return Drafted.of(proposals, batch, self.decoder.vocab_size, self.device, self.decoder.judged_view is not None)

    def _score(self, contexts: list[list[int]], drafted: Drafted) -> tuple[TargetLaws, torch.Tensor]:
        """The target's laws after every prefix of every row of every sequence ``[B, K, n+1, V]`` (and the laws the
        verifier judges drafts by, where it asks for others), and whether all are finite ``[]``."""
        batch, rows, width = drafted.tokens.shape
        self.target.fan_out(rows)
        repeated = [context for context in contexts for _ in range(rows)]
        tokens = drafted.tokens.reshape(batch * rows, width)  # [B K, n]
        logits = self.target.forward(repeated, tokens, width + 1, self.timer)  # [B K, n+1, V]
        params, view = self.decoder.target_params, self.decoder.judged_view
        probs, finite = self.decoder._sampling_law(logits, params)  # [B K, n+1, V], [B K, n+1]
        judged = None if view is None else self.decoder._sampling_law(logits, judged_params(params, view))[0]
        for sequence in self.sequences:
            sequence.stats.target_forwards += 1
        shape = (batch, rows, width + 1, -1)
        return TargetLaws(probs.view(shape), None if judged is None else judged.view(shape)), finite.all()

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
        """The decision of the sequences ``members`` by the exact rule (``exact``) or the verifier: one block through
        that rule's verify step (compiled or captured under ``--compile``), several through ``verify_batch``; its
        exceptions and its decision's form checked on the host (no device read). ``judged``: the laws the verifier
        judges drafts by, where it asks for others than the sampling laws (``[G, ...]`` as the sampling laws)."""
        decoder = self.decoder
        verifier, verify_block = decoder.rule(exact)
        keyed = verifier.keyed_randomness
        randomness = (
            self._draws_of(members)
            if keyed
            else [block_generator(self.sequences[b].key, self.sequences[b].generated, self.device) for b in members]
        )
        if len(members) == 1:
            alone = randomness.row(0) if keyed else randomness[0]
            inputs = (target_probs[0], draft_probs[0], draft_tokens[0], alone)
            decision = decoder.guarded_decision(verifier, verify_block, *inputs, **judged_argument(judged, 0))
            problem = decision_problem(decision, draft_tokens.shape[2] + 1, self.device)
            decision = BatchDecision.of_block(decision) if problem is None else decision
        else:
            inputs = (target_probs, draft_probs, draft_tokens, randomness)
            decision = decoder.guarded_decision(verifier, verifier.verify_batch, *inputs, **judged_argument(judged))
            problem = batch_decision_problem(decision, len(members), draft_tokens.shape[2] + 1, self.device)
        if problem is not None:
            raise decoder.registry.fault(verifier.name, problem)
        return decision.as_long()

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
        decoder.check_block_flags(bool(target_finite), drafts_finite, in_vocab)
        for b in range(batch):
            if drafted.lengths[b]:  # a verifier decided (a block without draft tokens is the engine's own draw)
                problem = decision_value_problem(
                    tokens[b][: drafted.lengths[b] + 1],
                    num_accepted[b],
                    local[b],
                    bool(departs[b]),
                    len(drafted.present[b]),
                    decoder.vocab_size,
                )
                if problem is not None:
                    verifier, _ = decoder.rule(self._exact_phase(sequences[b]))
                    raise decoder.registry.fault(verifier.name, problem)
        # Rows cache the committed prefix then their own drafts; the last committed token stays uncached.
        before = [len(sequence.committed) for sequence in sequences]
        self.target.keep(
            [b * drafted.tokens.shape[1] + rows[b] for b in range(batch)],
            [before[b] + min(num_accepted[b], count[b] - 1) for b in range(batch)],
        )
        for drafter, (match_rows, agreeing) in zip(self.drafters, matches):
            lengths = [before[b] + min(agreeing[b], count[b] - 1) for b in range(batch)]
            decoder._call_drafter(drafter, "keep", drafter.keep, match_rows, lengths)
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
        for drafter in self.drafters:
            self.decoder._call_drafter(drafter, "remove_sequences", drafter.remove_sequences, kept)
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


def _prompt_list(prompts: object) -> list[str]:
    """``prompts`` as a list of strings: one string is one prompt (iterating it would give its characters)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise PromptTypeError(f"prompts must be a string or a list of strings, not {type(prompts).__name__}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise PromptTypeError(
                f"prompt {index} is {type(prompt).__name__}, not text; pass strings (decode bytes first)"
            )
    return list(prompts)


# --------------------------------------------------------------------------- helpers


def _check_context(prompt: int, max_new_tokens: int, draft_length: int, context: int, encoder_decoder: bool) -> None:
    """The prompt and every position generation can reach fit the model's ``context`` positions.

    A decoder-only model holds prompt + output + one block of draft tokens; an encoder-decoder's
    encoder holds the prompt and its decoder the start token, the output and one block.
    """
    if draft_length >= context:
        raise UsageError(
            f"draft_length {draft_length} does not fit the target's context of {context} tokens; lower --draft-length"
        )
    output = max_new_tokens + draft_length + (1 if encoder_decoder else prompt)
    if encoder_decoder and prompt > context:
        raise UsageError(f"the prompt has {prompt} tokens but the encoder takes at most {context}; shorten the prompt")
    if output > context:
        what = "the decoder's" if encoder_decoder else f"the prompt has {prompt} tokens; the model's"
        raise UsageError(
            f"{what} context of {context} positions cannot hold max_new_tokens {max_new_tokens} "
            f"(and {draft_length} draft tokens); lower --max-new-tokens or --draft-length"
            + ("" if encoder_decoder else ", or shorten the prompt")
        )
