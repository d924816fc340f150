"""The speculative decoding engine: draft → score → verify → commit, block after block.

One block, with K draft rows (every draft config's ``num_drafts`` samples) and L draft tokens:

1. each draft model extends its K_j rows by L tokens, one batched forward per position,
   sampling from the shared :func:`~specdec_cli.sampling.sampling_law` law it records;
2. the target scores all K × (L+1) positions in one forward;
3. the verifier decides the block on the device (:meth:`~specdec_cli.verifiers.BlockVerifier.verify_block`):
   an accepted draft prefix of one row and the token after it;
4. EOS and non-finite logits are folded into the decision on the device, and the engine reads
   it back once: the committed tokens, how many there are, and for every model the cache row
   that agrees longest with them; every cache is then cropped from those numbers.

No other value crosses from the device to the host inside a block. An autoregressive run is the
same loop with no drafts (L = 0: each block is one target forward and the token drawn from it),
so baseline and speculative runs share sampler and stopping. docs/block-loop.md walks through it.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .batch_engine import BatchDecoding, SequenceJob, count_to_eos, longest_matches
from .batch_session import batch_problem
from .decoding import Draft, create_verifier, target_sampling
from .draft_rows import DraftRows, recipe_draft_rows, rows_per_config
from .drafter_registry import DrafterRegistry
from .drafting import DraftRequest, Drafter, DraftSetup, Proposal, block_length, empty_proposal, proposal_problem
from .errors import NonFiniteLogitsError, SpecdecError, UsageError, is_allocation_error, requested_memory
from .graphs import CapturedVerifyStep
from .inputs import require_text
from .model_pool import ModelPool
from .model_session import ModelSession
from .models import LoadedModel, shared_vocab_size
from .recipe import AUTOREGRESSIVE, DecodingConfig, Recipe
from .randomness import Draws, Randomness, Stream, block_generator, sample_key
from .sampling import non_finite_message, sample, sampling_law
from .stats import GenerationResult, SampleStats
from .timing import RegionTimer
from .registry import error_line
from .verifiers import (
    BatchDecision, BlockDecision, VerifierRegistry, decision_problem, decision_value_problem, departs_from_drafts,
)  # fmt: skip

BlockCallback = Callable[[int, int, list[int], list[bool]], None]
"""on_block(prompt_index, sample_index, new_token_ids, accepted_mask) after each committed block."""


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
        self, target: LoadedModel, drafts: Sequence[Draft], config: DecodingConfig,
        registry: VerifierRegistry | None = None, drafter_registry: DrafterRegistry | None = None,
    ):  # fmt: skip
        problems = config.problems()
        if problems:
            raise UsageError("{}: {}".format(*problems[0]))
        self.target = target
        self.drafts = list(drafts)
        self.config = config
        self.registry = registry or VerifierRegistry()
        self.drafter_registry = drafter_registry or DrafterRegistry()
        self.vocab_size = shared_vocab_size(target, [d.model for d in self.drafts if d.model is not None])
        self.target_params = target_sampling(config)
        self.target_session = ModelSession(target, self.vocab_size, config.speculation.kv_cache)
        self.drafters, row_laws = self._drafters() if config.speculative else ([], [])
        rows = DraftRows.of(row_laws)
        self.verifier = create_verifier(config, rows, self.registry)
        self._verify_block, self._sampling_law = self._compiled() if config.speculation.compile else (
            getattr(self.verifier, "verify_block", None), sampling_law)  # fmt: skip
        self.draft_length = config.speculation.draft_length if self.drafters else 0
        self.eos_ids = target.eos_ids
        self.eos_tensor = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=target.device)  # [eos ids]
        self.device = target.device

    def _compiled(self) -> tuple[Callable, Callable]:
        """The verify step and the sampling law through ``torch.compile``: each traces into one graph (keyed
        randomness, no reads: :func:`~specdec_cli.decoding.create_verifier` refused a verifier without keyed
        randomness). On a GPU the verify step is captured in CUDA graphs instead (:mod:`specdec_cli.graphs`),
        compiled only where a block reads the host; on the CPU a verifier with a reading CPU path stays eager."""
        compiled_law = torch.compile(sampling_law)
        if self.verifier is None:
            return None, compiled_law
        compiled_verify = torch.compile(self.verifier.verify_block)
        if self.target.device.type == "cuda":
            return CapturedVerifyStep(self.verifier, fallback=compiled_verify), compiled_law
        if self.verifier.reading_cpu_path:  # compiled, it would leave its CPU path for a costlier one
            return self.verifier.verify_block, compiled_law
        return compiled_verify, compiled_law

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
            self._call_drafter(drafter, "setup", drafter.setup, DraftSetup(
                draft.model, self.target, draft.sampling(self.config), rows, self.vocab_size, self.target.device,
                self.config.speculation.kv_cache))  # fmt: skip
            by_class.setdefault(type(drafter), []).append(drafter)
        joined = [kept for cls, drafters in by_class.items()
                  for kept in self._call_drafter(drafters[0], "joined", cls.joined, drafters)]  # fmt: skip
        return sorted(joined, key=lambda drafter: order[id(drafter)]), row_laws

    def with_config(self, **changes: Any) -> "SpeculativeDecoder":
        """The same models under a changed config: ``with_config(verifier="block", draft_length=8)``."""
        return SpeculativeDecoder(self.target, self.drafts, self.config.replace(**changes), self.registry,
                                  self.drafter_registry)  # fmt: skip

    @property
    def num_draft_rows(self) -> int:
        """Drafts per position in a block at most: every drafter's rows (0 for the target alone)."""
        return sum(drafter.rows for drafter in self.drafters)

    # ----------------------------------------------------------------------- building

    @classmethod
    def from_recipe(
        cls, recipe: Recipe, *, autoregressive: bool = False, pool: ModelPool | None = None,
        registry: VerifierRegistry | None = None, drafters: DrafterRegistry | None = None,
    ) -> "SpeculativeDecoder":  # fmt: skip
        """The one way a recipe becomes a decoder: check its settings, drafters and verifier, then take its
        models from ``pool`` (each loaded once per pool). Drafts are not loaded to decode autoregressively."""
        registry, drafters = registry or VerifierRegistry(), drafters or DrafterRegistry()
        config = cls.check_recipe(recipe, registry, autoregressive, drafters)  # before the slow loads
        pool = pool if pool is not None else ModelPool()
        target = pool.target(recipe.target)
        loaded = pool.drafts(recipe.drafts if config.speculative else (), target, drafters)
        return cls(target, loaded, config, registry, drafters)

    @staticmethod
    def check_recipe(
        recipe: Recipe, registry: VerifierRegistry, autoregressive: bool = False, drafters: DrafterRegistry | None = None
    ) -> DecodingConfig:
        """The recipe's decoding config, once every draft entry suits its drafter and the verifier has taken
        the rows they fill (no model loads)."""
        config = recipe.decoding_config()
        if autoregressive:
            config = config.replace(verifier=AUTOREGRESSIVE)
        drafters = drafters or DrafterRegistry()
        if config.speculative:
            drafters.check_entries(recipe.drafts)
        create_verifier(config, recipe_draft_rows(recipe, drafters), registry)
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
            _check_context(len(ids), self.config.generation.max_new_tokens, self.draft_length, context,
                           self.target.is_encoder_decoder)  # fmt: skip
        return ids

    def generate(
        self, prompts: str | Sequence[str], num_samples: int = 1, on_block: BlockCallback | None = None,
        batch_size: int = 1, **changes: Any,
    ) -> list[GenerationResult]:  # fmt: skip
        """``num_samples`` independent samples for each prompt (one string is one prompt), in order (prompt-major).

        ``batch_size`` B > 1 decodes B samples at a time in one batch (:mod:`specdec_cli.batch_engine`); a sample's
        tokens do not depend on B, up to float rounding. Keyword ``changes`` to the decoding config apply to this
        call only (``verifier="block"``, ``draft_length=8``, ``temperature=0.3``, ...); the models stay loaded.
        """
        if changes:
            return self.with_config(**changes).generate(prompts, num_samples, on_block, batch_size)
        results = list(self.samples(prompts, num_samples, on_block, batch_size))
        return sorted(results, key=lambda result: (result.prompt_index, result.sample_index))

    def samples(
        self, prompts: str | Sequence[str], num_samples: int = 1, on_block: BlockCallback | None = None,
        batch_size: int = 1,
    ) -> Iterator[GenerationResult]:  # fmt: skip
        """What :meth:`generate` returns, yielded as each sample finishes (a caller that is stopped keeps
        the samples it was given): in order at batch size 1, in the order they finish in a batch. Every prompt
        is checked before any model runs."""
        prompts = _prompt_list(prompts)
        for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a whole number >= 1, got {value!r}")
        if batch_size > 1:
            self.check_batching()
        encoded = [self.encode_prompt(p) for p in prompts]
        jobs = [SequenceJob(prompts[p], p, s, encoded[p],
                            None if on_block is None else functools.partial(on_block, p, s))
                for p, s in itertools.product(range(len(prompts)), range(num_samples))]  # fmt: skip
        if batch_size > 1:
            yield from BatchDecoding(self, batch_size).run(jobs)
            return
        for job in jobs:
            yield self.sample(job.prompt, job.prompt_index, job.sample_index, job.prompt_ids, job.on_block)

    def check_batching(self) -> None:
        """Refuse, in one line, what cannot decode in batches: no KV cache, or a model whose rows cannot keep
        their own positions (:func:`~specdec_cli.batch_session.batch_problem`)."""
        if not self.config.speculation.kv_cache:
            raise UsageError("batched decoding needs the KV cache; drop kv_cache: false or use --batch-size 1")
        for model in [self.target, *(draft.model for draft in self.drafts if draft.model is not None)]:
            problem = batch_problem(model)
            if problem is not None:
                raise UsageError(problem)

    def sample(
        self, prompt: str, prompt_index: int, sample_index: int, prompt_ids: list[int],
        on_block: Callable[[list[int], list[bool]], None] | None = None,
    ) -> GenerationResult:  # fmt: skip
        """One sample of one prompt, with the key of (run seed, prompt index, sample index): its draws do not
        depend on which samples ran before it or beside it."""
        key = sample_key(self.config.seed, prompt_index, sample_index)
        tokens, mask, stats = self.generate_ids(prompt_ids, key, on_block)
        text = self.target.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationResult(prompt, prompt_index, sample_index, tokens, text, stats, mask)

    def warm_up(self, prompt_ids: list[int], max_new_tokens: int = 8) -> None:
        """One short untimed generation, so the first timed sample does not pay one-time costs
        (lazy initialisation, the allocator's first blocks, kernel selection)."""
        warm = self.with_config(max_new_tokens=max_new_tokens)
        # This decoder's own compiled steps, so that their compilation and CUDA graphs are paid here, untimed.
        warm._verify_block, warm._sampling_law = self._verify_block, self._sampling_law
        warm.generate_ids(prompt_ids, key=-1)

    @torch.inference_mode()
    def generate_ids(
        self, prompt_ids: list[int], key: int, on_block: Callable[[list[int], list[bool]], None] | None = None
    ) -> tuple[list[int], list[bool], SampleStats]:
        """Generate after ``prompt_ids`` with the randomness of ``key`` (:func:`~specdec_cli.randomness.sample_key`)
        → (new token ids, accepted mask, stats)."""
        stats = SampleStats(prompt_tokens=len(prompt_ids))
        with self._memory_guard(stats):
            return self._generate_ids(prompt_ids, key, on_block, stats)

    def _generate_ids(
        self, prompt_ids: list[int], key: int, on_block: Callable[[list[int], list[bool]], None] | None,
        stats: SampleStats,
    ) -> tuple[list[int], list[bool], SampleStats]:  # fmt: skip
        draws = Draws.create(key, 0, self.device)  # its block start is moved on the device, block by block
        self.target_session.start(prompt_ids)
        for drafter in self.drafters:
            self._call_drafter(drafter, "start", drafter.start, prompt_ids)
        committed = self.target.decoder_start_ids if self.target.is_encoder_decoder else list(prompt_ids)
        start = len(committed)
        timer = RegionTimer(self.device)
        mask: list[bool] = []
        max_new = self.config.generation.max_new_tokens
        wall_start = time.perf_counter()
        while True:
            remaining = max_new - (len(committed) - start)
            # Never overshoot: a block commits at most L + 1 tokens.
            draft_length = min(self.draft_length, remaining - 1)
            block_start = len(committed) - start
            draws.block_start.fill_(block_start)
            block = self._block(committed, draft_length, (draws, self._verifier_randomness(draws, key, block_start)),
                                stats, timer)  # fmt: skip
            new_tokens = block.tokens
            accepted = [i < block.num_accepted for i in range(len(new_tokens))]
            # The verifier decided every committed position but a bonus token (which follows all L accepted).
            stats.record_block(block.draft_length, min(len(new_tokens), block.draft_length), sum(accepted))
            committed += new_tokens
            mask += accepted
            if on_block is not None:
                on_block(new_tokens, accepted)
            if block.eos or len(committed) - start >= max_new:
                stats.stop_reason = "eos" if block.eos else "max_new_tokens"
                break
        _synchronize(self.device)
        stats.wall_time_s = stats.share_time_s = time.perf_counter() - wall_start
        for name in ("draft", "target", "verify", "forward"):
            setattr(stats, f"{name}_time_s", timer.seconds(name))
        stats.new_tokens = len(committed) - start
        return committed[start:], mask, stats

    @contextmanager
    def _memory_guard(self, stats: SampleStats) -> Iterator[None]:
        """An allocation this machine cannot make (a long prompt to an encoder without a position limit,
        many long draft rows) becomes one line naming what to lower, instead of the allocator's traceback."""
        try:
            yield
        except (RuntimeError, MemoryError) as error:
            if not is_allocation_error(error):
                raise
            drafts = f"--num-drafts ({self.config.speculation.num_drafts}) or --draft-length ({self.draft_length})"
            if not stats.blocks:  # the prompt's encoding or prefill, with the first block's draft rows
                advice = f"reading the prompt; shorten the prompt ({stats.prompt_tokens} tokens)"
                advice += f", or lower {drafts}" if self.drafters else ""
            else:
                advice = f"while generating; lower --max-new-tokens ({self.config.generation.max_new_tokens})"
                advice += f", {drafts}" if self.drafters else ""
            raise SpecdecError(f"out of memory{requested_memory(error)} {advice}") from error

    def _verifier_randomness(self, draws: Draws, key: int, block_start: int) -> Randomness:
        """The block's keyed draws, or for a plugin that draws from a stateful generator one seeded from the
        sample's key and the block's start, both known on the host."""
        keyed = self.verifier is None or self.verifier.keyed_randomness  # None: the target alone, the engine's own draws
        return draws if keyed else block_generator(key, block_start, self.device)

    def _block(
        self, committed: list[int], draft_length: int, randomness: tuple[Draws, Randomness], stats: SampleStats,
        timer: RegionTimer,
    ) -> "_Committed":  # fmt: skip
        """One draft → score → verify round, and the block's one read of device values.

        ``randomness``: the block's keyed draws (for the engine's own) and what the verifier draws from.
        """
        draws, verifier_randomness = randomness
        with timer.region("draft"):
            drafted = self._draft(committed, draft_length, draws, stats, timer)
        with timer.region("target"):
            target_probs, target_finite = self._score(committed, drafted.tokens, timer)  # [K, n+1, vocab], []
            stats.target_forwards += 1
        with timer.region("verify"):
            if drafted.length:
                decision = self._decide(target_probs, drafted.laws, drafted.tokens, verifier_randomness)
                departs = departs_from_drafts(decision, drafted.tokens)  # []
            else:
                decision = _target_token(target_probs, draws)
                departs = torch.zeros_like(target_finite)  # []: the engine drew the token itself
            count = count_to_eos(BatchDecision.of_block(decision), self.eos_tensor)[0]  # []
            block_tokens = decision.tokens.unsqueeze(0)  # [1, L+1]: the block as a batch of one
            matches = [longest_matches(rows.unsqueeze(0), block_tokens, count.view(1)) for rows in drafted.by_drafter()]
            flags = [decision.num_accepted, decision.row, count, target_finite.long(), departs.long()]
            packed = torch.cat([
                decision.tokens, torch.stack(flags), drafted.finite.long(), drafted.in_vocab.long(),
                *(torch.cat(match) for match in matches),
            ])  # fmt: skip
            values = packed.tolist()  # the one device read of the block
            block = self._commit(values, drafted, committed)
        return block

    def _commit(self, values: list[int], drafted: "_Drafted", committed: list[int]) -> "_Committed":
        """Unpack the block's read, stop on non-finite logits or a decision no verifier may make, and crop
        every cache to what was committed."""
        block_size = drafted.length + 1
        tokens = values[:block_size]
        num_accepted, row, count, target_finite, departs = values[block_size : block_size + 5]
        drafters = len(self.drafters)
        drafts_finite = values[block_size + 5 : block_size + 5 + drafters]
        drafts_in_vocab = values[block_size + 5 + drafters : block_size + 5 + 2 * drafters]
        matches = iter(values[block_size + 5 + 2 * drafters :])
        self.check_block_flags(bool(target_finite), drafts_finite, drafts_in_vocab)
        if drafted.length:  # a verifier decided (a block without draft tokens is the engine's own draw)
            problem = decision_value_problem(tokens, num_accepted, row, bool(departs), drafted.tokens.shape[0],
                                             self.vocab_size)  # fmt: skip
            if problem is not None:
                raise self.registry.fault(self.verifier.name, problem)
        # Rows cache the committed prefix then their own drafts; the last committed token stays uncached.
        reusable = len(committed) + min(num_accepted, count - 1)
        self.target_session.keep(row, min(self.target_session.cached_length, reusable))
        for drafter, rows in zip(self.drafters, drafted.sizes):
            drafter_row, agreeing = (next(matches), next(matches)) if rows else (0, 0)
            self._call_drafter(drafter, "keep", drafter.keep, drafter_row, len(committed) + min(agreeing, count - 1))
        new_tokens = tokens[:count]
        eos = any(t in self.eos_ids for t in new_tokens)
        return _Committed(new_tokens, min(num_accepted, count), eos, drafted.length)

    def check_block_flags(self, target_finite: bool, drafts_finite: list[int], drafts_in_vocab: list[int]) -> None:
        """Stop the run, in one line, on a drafter's token ids outside the vocabulary or on non-finite logits
        (the flags of a block's read, one per drafter)."""
        for drafter, in_vocab in zip(self.drafters, drafts_in_vocab):
            if not in_vocab:
                raise self.drafter_registry.fault(drafter.name, f"proposed token ids outside the vocabulary "
                                                                f"[0, {self.vocab_size})")  # fmt: skip
        if not target_finite:
            raise NonFiniteLogitsError(non_finite_message("target"))
        for drafter, finite in zip(self.drafters, drafts_finite):
            if not finite:
                raise NonFiniteLogitsError(non_finite_message(f"draft {drafter.label}"))

    def guarded_decision(self, verify: Callable[..., Any], *inputs: Any) -> Any:
        """``verify(*inputs)`` (the verifier's verify_block or verify_batch): a plugin's exception is its fault, named
        in one line with the original chained for ``--debug``; running out of memory is not, and reaches
        :meth:`_memory_guard`."""
        try:
            return verify(*inputs)
        except SpecdecError:
            raise
        except Exception as error:
            if is_allocation_error(error):
                raise
            raise self.registry.fault(self.verifier.name, f"raised {error_line(error)}") from error

    def _decide(
        self, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
        randomness: Randomness,
    ) -> BlockDecision:  # fmt: skip
        """The verifier's decision, its types, shapes and devices checked on the host (no device read)."""
        decision = self.guarded_decision(self._verify_block, target_probs, draft_probs, draft_tokens, randomness)
        problem = decision_problem(decision, draft_tokens.shape[1] + 1, target_probs.device)
        if problem is not None:
            raise self.registry.fault(self.verifier.name, problem)
        return decision.as_long()

    def _score(
        self, committed: list[int], draft_tokens: torch.Tensor, timer: RegionTimer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's laws after every prefix of every row ``[K, L+1, vocab]``, and whether all are finite ``[]``."""
        rows, draft_length = draft_tokens.shape
        session = self.target_session
        session.fan_out(rows)
        pending = session.pending(committed)  # [K, pending]
        logits = session.forward(torch.cat([pending, draft_tokens], dim=1), draft_length + 1, timer)
        probs, finite = self._sampling_law(logits, self.target_params)  # [K, L+1, vocab], [K, L+1]
        return probs, finite.all()

    def _draft(
        self, committed: list[int], draft_length: int, draws: Draws, stats: SampleStats, timer: RegionTimer
    ) -> "_Drafted":
        """Every drafter's proposal as the block's rows. Drafters that run no model are asked first: their
        shortest non-empty proposal is the block's length (:func:`~specdec_cli.drafting.block_length`), which
        the model drafters then draft, so no draft forward is paid for a position that is not verified."""
        if not draft_length:
            empty = [empty_proposal(drafter.rows, self.vocab_size, self.device) for drafter in self.drafters]
            return _Drafted.of(empty, self.vocab_size, self.device)
        # Row k's token at offset t is (stream DRAFT, t, lane k), whichever drafter fills it: one table per block.
        uniforms = draws.uniforms(Stream.DRAFT, draft_length, self.num_draft_rows)  # [L, K]
        lanes = _lanes([drafter.rows for drafter in self.drafters])
        proposals: list[Proposal] = [None] * len(self.drafters)  # type: ignore[list-item]
        length = draft_length
        for runs_model in (False, True):
            for index, drafter in enumerate(self.drafters):
                if drafter.uses_model == runs_model:
                    own_uniforms = uniforms[:length, lanes[index]]  # [n, K_j]: this drafter's rows' lanes
                    request = DraftRequest(committed, length, own_uniforms, self._sampling_law, timer)
                    proposals[index] = self.checked_proposal(drafter, request)
            if not runs_model:
                length = block_length([p.length for p in proposals if p is not None], draft_length)
        stats.draft_forwards += sum(proposal.forwards for proposal in proposals)
        return _Drafted.of(proposals, self.vocab_size, self.device)

    def checked_proposal(self, drafter: Drafter, request: DraftRequest) -> Proposal:
        """``drafter``'s proposal (one of this decoder's), its shapes, types and devices checked on the host (no device
        read): a plugin's exception or a bad proposal is one line naming it."""
        proposal = self._call_drafter(drafter, "propose", drafter.propose, request)
        problem = proposal_problem(proposal, drafter.rows, request.max_length, self.vocab_size, self.device)
        if problem is not None:
            raise self.drafter_registry.fault(drafter.name, problem)
        return proposal

    def _call_drafter(self, drafter: Drafter, what: str, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` of ``drafter``: a plugin's exception is its fault, one line (running out of memory is
        not, and reaches :meth:`_memory_guard`)."""
        return self.drafter_registry.guarded(drafter.name, what, method, *args)


@dataclass
class _Drafted:
    """A block's draft rows: those of the drafters that proposed, cut to the block's length."""

    tokens: torch.Tensor  # [K', n]: K' rows of the drafters that proposed (one empty row [1, 0] when none did)
    laws: torch.Tensor  # [K', n, vocab]
    finite: torch.Tensor  # [drafters] bool: each drafter's laws came from finite logits
    in_vocab: torch.Tensor  # [drafters] bool: each drafter's tokens are ids of the vocabulary
    sizes: list[int]  # rows each drafter has in the block (0: it proposed nothing)

    @classmethod
    def of(cls, proposals: list[Proposal], vocab_size: int, device: torch.device) -> "_Drafted":
        """The rows of the non-empty ``proposals``, each cut to the shortest of them. Token ids outside the
        vocabulary are told by ``in_vocab`` in the block's one read and clamped until then: on a GPU such an id
        in the target's embedding is a device-side assert, which no message could follow."""
        flags = [torch.stack([p.finite, ((p.tokens >= 0) & (p.tokens < vocab_size)).all()]) for p in proposals]
        finite, in_vocab = torch.stack(flags, 1) if flags else torch.ones(2, 0, dtype=torch.bool, device=device)
        present = [proposal for proposal in proposals if proposal.length]
        sizes = [proposal.tokens.shape[0] if proposal.length else 0 for proposal in proposals]
        if not present:
            empty = empty_proposal(1, vocab_size, device)
            return cls(empty.tokens, empty.laws, finite, in_vocab, sizes)
        length = min(proposal.length for proposal in present)
        tokens = torch.cat([proposal.tokens[:, :length] for proposal in present]).clamp(0, vocab_size - 1)  # [K', n]
        laws = torch.cat([proposal.laws[:, :length] for proposal in present])  # [K', n, vocab]
        return cls(tokens, laws, finite, in_vocab, sizes)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def by_drafter(self) -> list[torch.Tensor]:
        """The rows ``[K_j, n]`` of each drafter in the block (none when nothing was drafted)."""
        if not self.length:
            return []
        return list(self.tokens.split([size for size in self.sizes if size]))


def _lanes(rows: list[int]) -> list[slice]:
    """The uniforms' lanes of each drafter: its rows' places among all drafters' rows."""
    ends = list(itertools.accumulate(rows))
    return [slice(end - count, end) for end, count in zip(ends, rows)]


@dataclass
class _Committed:
    """A block's outcome on the host: tokens to commit, how many are accepted drafts, and whether it hit EOS."""

    tokens: list[int]
    num_accepted: int
    eos: bool
    draft_length: int
    """Tokens each row proposed in the block (what the verifier decided on)."""


def _target_token(target_probs: torch.Tensor, draws: Draws) -> BlockDecision:
    """No draft tokens: the block is one token drawn from q (target_probs ``[1, 1, V]``), stream TARGET."""
    token = sample(target_probs[0, 0], draws, Stream.TARGET).view(1)  # [1]
    zero = torch.zeros((), dtype=torch.long, device=token.device)
    return BlockDecision(token, zero, zero)


def _prompt_list(prompts: object) -> list[str]:
    """``prompts`` as a list of strings: one string is one prompt (iterating it would give its characters)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise PromptTypeError(f"prompts must be a string or a list of strings, not {type(prompts).__name__}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise PromptTypeError(f"prompt {index} is {type(prompt).__name__}, not text; pass strings (decode bytes first)")
    return list(prompts)


# --------------------------------------------------------------------------- helpers


def _check_context(prompt: int, max_new_tokens: int, draft_length: int, context: int, encoder_decoder: bool) -> None:
    """The prompt and every position generation can reach fit the model's ``context`` positions.

    A decoder-only model holds prompt + output + one block of draft tokens; an encoder-decoder's
    encoder holds the prompt and its decoder the start token, the output and one block.
    """
    if draft_length >= context:
        raise UsageError(f"draft_length {draft_length} does not fit the target's context of {context} tokens; "
                         "lower --draft-length")
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
