"""Building a :class:`SpeculativeDecoder`: from a recipe (checked before any model loads) or from loaded models, its
drafters set up and its step functions made (:class:`~specdec_cli.engine.block_steps.Steps`); its prompts encoded and
checked against the target's context; and what to lower when memory runs out. Its generations are runs of
:class:`~specdec_cli.engine.run.DecodingRun`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from ..base.errors import UsageError
from ..base.inputs import require_text
from ..base.recipe import AUTOREGRESSIVE, DecodingConfig, Recipe
from ..base.sampling import sampling_law
from ..base.waits import waiting
from ..models.loading import LoadedModel, shared_vocab_size
from ..models.pool import ModelPool
from ..plugins.draft_rows import DraftRows, rows_per_config
from ..plugins.drafter_registry import DrafterRegistry, recipe_draft_rows
from ..plugins.drafting import Drafter, DraftSetup
from ..plugins.registry import VerifierRegistry
from ..plugins.verifiers import BlockVerifier
from ..results.stats import GenerationResult, SampleStats
from .block_steps import DraftStep, Steps, VerifyStep, score_target, verify_step
from .decoding import Draft, create_exact_verifier, create_verifier, exact_first_note, load_drafts, target_sampling
from .guards import PluginGuards
from .run import BlockCallback, DecodingRun, SequenceJob
from .session import batch_problem, static_problem


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
        self.device = target.device
        self.guards = PluginGuards(self.registry, self.drafter_registry, self.vocab_size, self.device)
        """The guards around this decoder's plugins (:mod:`specdec_cli.engine.guards`)."""
        self.drafters, row_laws = self._drafters() if config.speculative else ([], [])
        rows = dataclasses.replace(
            DraftRows.of(row_laws), unjudged=self._unjudged_drafters(), dependent=self._dependent_drafters()
        )
        self.verifier = create_verifier(config, rows, self.registry)
        self.exact_verifier = create_exact_verifier(config, rows, self.registry, self.verifier)
        """The lossless rule of the blocks that start before :attr:`exact_first`; None where no block needs one."""
        self.exact_first = config.speculation.exact_first if self.exact_verifier is not None else 0
        """Tokens of every sample the exact rule decides (0: the run's verifier decides every block)."""
        under_compile = config.speculation.compile
        self.steps = Steps(
            draft=DraftStep(self.drafters, self.guards, self.judged_view),
            score=score_target,
            sampling_law=torch.compile(sampling_law) if under_compile else sampling_law,
            verify=verify_step(self.verifier, under_compile, self.device),
            verify_exact=verify_step(self.exact_verifier, under_compile, self.device),
        )
        """The step functions every run of this decoder is handed (:class:`~specdec_cli.engine.block_steps.Steps`)."""
        self.draft_length = config.speculation.draft_length if self.drafters else 0
        self.running = threading.RLock()
        """Held by the generation under way (:meth:`DecodingRun.run`): calls from other threads wait their turn."""
        self.eos_ids = target.eos_ids
        self.eos_tensor = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=target.device)  # [eos ids]

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

    def _dependent_drafters(self) -> tuple[str, ...]:
        """The drafters of this decoder's entries whose rows are not independent samples (:attr:`DraftRows.dependent`,
        as the recipe's rows give it before the models load)."""
        entries = [(draft.drafter, draft.params) for draft in self.drafts]
        dependent = self.drafter_registry.dependent_entries(entries, self.config.speculation.num_drafts)
        return tuple(name for _, name in dependent)

    @property
    def judged_view(self) -> str | None:
        """The laws the run's verifier judges drafts by besides the sampling laws (its ``judged_laws``), which the
        steps compute from the same logits; None where it judges by the sampling laws (or there is none)."""
        return None if self.verifier is None else self.verifier.judged_laws

    def rule(self, exact: bool) -> tuple[BlockVerifier, VerifyStep]:
        """The verifier that decides a block and its verify step: the exact rule for a block that starts before
        :attr:`exact_first` (``exact``), the run's verifier for any other."""
        if exact:
            return self.exact_verifier, self.steps.verify_exact
        return self.verifier, self.steps.verify

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
            self.guards.call_drafter(
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
            for kept in self.guards.call_drafter(drafters[0], "joined", cls.joined, drafters)
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
        warm.steps = dataclasses.replace(
            warm.steps,
            sampling_law=self.steps.sampling_law,
            verify=self.steps.verify,
            verify_exact=self.steps.verify_exact,
        )
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
