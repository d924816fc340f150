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
so baseline and speculative runs share sampler and stopping.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import NonFiniteLogitsError, UsageError
from .models import LoadedModel, check_same_tokenizer, derive_early_exit_draft, load_model, shared_vocab_size
from .recipe import DraftConfig, Recipe
from .sampling import SamplingParams, non_finite_message, sample, sampling_law
from .stats import GenerationResult, SampleStats
from .timing import RegionTimer
from .verifiers import BlockDecision, BlockVerifier, VerifierRegistry

BlockCallback = Callable[[int, int, list[int], list[bool]], None]
"""on_block(prompt_index, sample_index, new_token_ids, accepted_mask) after each committed block."""

AUTOREGRESSIVE = "none"
"""Verifier name meaning "no speculation": the target decodes alone."""


class _Runner:
    """One model's view of the sequence being decoded: its KV cache and the ids the cache holds.

    Rows are the K draft continuations of one block; between blocks there is a single row.
    With ``use_cache=False`` every forward recomputes the whole sequence (the reference that
    tests cache rollback against).
    """

    def __init__(self, loaded: LoadedModel, vocab_size: int, use_cache: bool):
        self.loaded = loaded
        self.model = loaded.model
        self.vocab_size = vocab_size
        self.use_cache = use_cache
        self.device = loaded.device
        self.cache: Any = None
        self.cached_ids = torch.empty(1, 0, dtype=torch.long, device=self.device)  # [rows, n]
        self.encoder_output: Any = None
        self.keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def start(self, prompt_ids: list[int]) -> None:
        self.cache = None
        self.cached_ids = torch.empty(1, 0, dtype=torch.long, device=self.device)  # [1, 0]
        self.encoder_output = None
        if self.loaded.is_encoder_decoder:
            # The encoder runs once per prompt; every decoder forward reuses its output.
            encoder_input = torch.tensor([prompt_ids], device=self.device)  # [1, prompt]
            self.encoder_output = self.model.get_encoder()(input_ids=encoder_input)

    @property
    def rows(self) -> int:
        return self.cached_ids.shape[0]

    @property
    def cached_length(self) -> int:
        return self.cached_ids.shape[1]

    def fan_out(self, rows: int) -> None:
        """Repeat the single committed row ``rows`` times (the K drafts of a block)."""
        if rows == self.rows:
            return
        self.cached_ids = self.cached_ids.repeat(rows, 1)  # [rows, n]
        if self.cache is not None:
            self.cache.batch_repeat_interleave(rows)
        if self.encoder_output is not None:
            hidden = self.encoder_output.last_hidden_state  # [1, source, d]
            self.encoder_output.last_hidden_state = hidden.repeat(rows, 1, 1)  # [rows, source, d]

    def keep(self, row: int, length: int) -> None:
        """Keep cache row ``row`` only, cropped to its first ``length`` ids."""
        if self.rows > 1:
            self.cached_ids = self.cached_ids[row : row + 1]  # [1, n]
            if self.cache is not None:
                self.cache.batch_select_indices(torch.tensor([row], device=self.device))
            if self.encoder_output is not None:
                hidden = self.encoder_output.last_hidden_state  # [rows, source, d]
                self.encoder_output.last_hidden_state = hidden[row : row + 1]  # [1, source, d]
        if length < self.cached_length:
            if self.cache is not None:
                self.cache.crop(length - self.cached_length)  # negative: tokens to remove
            self.cached_ids = self.cached_ids[:, :length]  # [1, length]

    def forward(self, tokens: torch.Tensor, timer: RegionTimer, keep: int) -> torch.Tensor:
        """Logits ``[rows, keep, vocab]`` of the last ``keep`` of ``tokens`` ``[rows, m]``, appended after the cached ids.

        Models that support it compute only those positions' logits: the output layer over a whole
        prompt (or a block's pending tokens) would otherwise be computed and thrown away.
        """
        if self.use_cache:
            inputs, cache = tokens, self.cache  # [rows, m]
        else:
            inputs, cache = torch.cat([self.cached_ids, tokens], dim=1), None  # [rows, n + m]
        kwargs: dict[str, Any] = {"use_cache": self.use_cache, "past_key_values": cache}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = keep
        if self.loaded.is_encoder_decoder:
            kwargs.update(encoder_outputs=self.encoder_output, decoder_input_ids=inputs)
        else:
            kwargs.update(input_ids=inputs)
        with timer.region("forward"):
            output = self.model(**kwargs)
        if self.use_cache:
            self.cache = output.past_key_values
        self.cached_ids = torch.cat([self.cached_ids, tokens], dim=1)  # [rows, n + m]
        return output.logits[:, -keep:, : self.vocab_size]  # [rows, keep, vocab]


@dataclass
class _DraftGroup:
    """One draft model and the sampling settings of each of its rows (configs × num_drafts)."""

    runner: _Runner
    row_params: list[SamplingParams]
    name: str

    def rows_by_params(self) -> list[tuple[SamplingParams, list[int]]]:
        """Rows that share sampling settings, so each settings' law is computed in one call."""
        grouped: dict[SamplingParams, list[int]] = {}
        for row, params in enumerate(self.row_params):
            grouped.setdefault(params, []).append(row)
        return list(grouped.items())


class SpeculativeDecoder:
    """Generates with a target, zero or more drafts and a verifier; returns results with stats.

    Build one with :meth:`from_recipe`. With no drafts (``verifier.name: none``) it decodes
    autoregressively with the target alone.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafts: Sequence[tuple[LoadedModel, Sequence[SamplingParams]]],
        verifier: BlockVerifier | None,
        recipe: Recipe,
    ):
        self.recipe = recipe
        self.target = target
        self.verifier = verifier
        self.vocab_size = shared_vocab_size(target, [d for d, _ in drafts])
        use_cache = recipe.speculation.kv_cache
        self.target_runner = _Runner(target, self.vocab_size, use_cache)
        self.draft_groups = [_DraftGroup(_Runner(d, self.vocab_size, use_cache), list(p), d.name) for d, p in drafts]
        self.num_drafts = sum(len(g.row_params) for g in self.draft_groups)
        generation = recipe.generation
        self.target_params = SamplingParams(generation.temperature, generation.top_k, generation.top_p)
        self.draft_length = recipe.speculation.draft_length if self.draft_groups else 0
        self.eos_ids = _eos_ids(target)
        self.eos_tensor = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=target.device)  # [eos ids]
        self.decoder_start = _decoder_start(target) if target.is_encoder_decoder else []
        """Decoder-side ids before the first generated token (encoder-decoder models only)."""
        self.device = target.device
        _check_draft_count(verifier, self.num_drafts)
        different_drafts = len(drafts) > 1 or len({p for _, ps in drafts for p in ps}) > 1
        if verifier is not None and verifier.identical_drafts and different_drafts:
            raise UsageError(_IDENTICAL_DRAFTS_MESSAGE.format(name=verifier.name))

    # ----------------------------------------------------------------------- building

    @classmethod
    def from_recipe(
        cls, recipe: Recipe, autoregressive: bool = False, registry: VerifierRegistry | None = None
    ) -> "SpeculativeDecoder":
        """Load the recipe's models and verifier (drafts are skipped when decoding autoregressively)."""
        autoregressive = autoregressive or recipe.verifier.name.strip().lower() == AUTOREGRESSIVE
        verifier = None
        if not autoregressive:
            if not recipe.drafts:
                raise UsageError("the recipe has no draft: add a 'draft:' section, or use --autoregressive")
            verifier = (registry or VerifierRegistry()).create(recipe.verifier.name, recipe.verifier.params)
            check_drafts(verifier, recipe)  # before the slow model loads
        target = load_model(recipe.target, "target")
        drafts = [] if autoregressive else load_drafts(recipe, target)
        return cls(target, drafts, verifier, recipe)

    # ----------------------------------------------------------------------- generation

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a prompt (through the chat template when the recipe asks for it)."""
        require_text(prompt)
        tokenizer = self.target.tokenizer
        if self.recipe.generation.chat:
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
            _check_context(len(ids), self.recipe.generation.max_new_tokens, self.draft_length, context,
                           self.target.is_encoder_decoder)  # fmt: skip
        return ids

    def generate(
        self, prompts: Sequence[str], num_samples: int = 1, on_block: BlockCallback | None = None
    ) -> list[GenerationResult]:
        """``num_samples`` independent samples for each prompt, in order (prompt-major)."""
        encoded = [self.encode_prompt(p) for p in prompts]  # all checked before any model runs
        results = []
        for prompt_index, (prompt, ids) in enumerate(zip(prompts, encoded)):
            for sample_index in range(num_samples):
                seed = sample_seed(self.recipe.seed, prompt_index, sample_index)
                callback = None
                if on_block is not None:
                    callback = lambda new, mask, p=prompt_index, s=sample_index: on_block(p, s, new, mask)  # noqa: E731
                tokens, mask, stats = self.generate_ids(ids, seed, callback)
                text = self.target.tokenizer.decode(tokens, skip_special_tokens=True)
                results.append(GenerationResult(prompt, prompt_index, sample_index, tokens, text, stats, mask))
        return results

    @torch.inference_mode()
    def generate_ids(
        self, prompt_ids: list[int], seed: int, on_block: Callable[[list[int], list[bool]], None] | None = None
    ) -> tuple[list[int], list[bool], SampleStats]:
        """Generate after ``prompt_ids`` → (new token ids, accepted mask, stats)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        decoder_start = self.decoder_start if self.target.is_encoder_decoder else list(prompt_ids)
        for runner in self._runners():
            runner.start(prompt_ids)
        committed = list(decoder_start)
        start = len(committed)
        stats = SampleStats(prompt_tokens=len(prompt_ids))
        timer = RegionTimer(self.device)
        mask: list[bool] = []
        max_new = self.recipe.generation.max_new_tokens
        wall_start = time.perf_counter()
        while True:
            remaining = max_new - (len(committed) - start)
            # Never overshoot: a block commits at most L + 1 tokens.
            draft_length = min(self.draft_length, remaining - 1)
            block = self._block(committed, draft_length, generator, stats, timer)
            new_tokens = block.tokens
            accepted = [i < block.num_accepted for i in range(len(new_tokens))]
            # The verifier decided every committed position but a bonus token (which follows all L accepted).
            stats.record_block(draft_length, min(len(new_tokens), draft_length), sum(accepted))
            committed += new_tokens
            mask += accepted
            if on_block is not None:
                on_block(new_tokens, accepted)
            if block.eos or len(committed) - start >= max_new:
                stats.stop_reason = "eos" if block.eos else "max_new_tokens"
                break
        _synchronize(self.device)
        stats.wall_time_s = time.perf_counter() - wall_start
        for name in ("draft", "target", "verify", "forward"):
            setattr(stats, f"{name}_time_s", timer.seconds(name))
        stats.new_tokens = len(committed) - start
        return committed[start:], mask, stats

    def _runners(self) -> list[_Runner]:
        return [self.target_runner] + [g.runner for g in self.draft_groups]

    def _block(
        self, committed: list[int], draft_length: int, generator: torch.Generator, stats: SampleStats,
        timer: RegionTimer,
    ) -> "_Committed":  # fmt: skip
        """One draft → score → verify round, and the block's one read of device values."""
        with timer.region("draft"):
            draft_tokens, draft_probs, drafts_finite = self._draft(committed, draft_length, generator, stats, timer)
            # draft_tokens [K, L], draft_probs [K, L, vocab], drafts_finite [groups]; K = 1, L = 0 without drafts
        with timer.region("target"):
            target_probs, target_finite = self._score(committed, draft_tokens, timer)  # [K, L+1, vocab], []
            stats.target_forwards += 1
        with timer.region("verify"):
            if draft_length:
                decision = self.verifier.verify_block(target_probs, draft_probs, draft_tokens, generator)
            else:
                decision = _target_token(target_probs, generator)
            count = self._count_to_eos(decision)  # []
            matches = [_longest_match(group_tokens, decision.tokens, count)
                       for group_tokens in self._group_slices(draft_tokens)]  # fmt: skip
            packed = torch.cat([
                decision.tokens, torch.stack([decision.num_accepted, decision.row, count, target_finite.long()]),
                drafts_finite.long(), *(torch.stack(match) for match in matches),
            ])  # fmt: skip
            values = packed.tolist()  # the one device read of the block
            block = self._commit(values, len(decision.tokens), committed)
        return block

    def _commit(self, values: list[int], block_size: int, committed: list[int]) -> "_Committed":
        """Unpack the block's read, stop on non-finite logits, and crop every cache to what was committed."""
        tokens = values[:block_size]
        num_accepted, row, count, target_finite = values[block_size : block_size + 4]
        groups = len(self.draft_groups)
        drafts_finite = values[block_size + 4 : block_size + 4 + groups]
        matches = values[block_size + 4 + groups :]
        if not target_finite:
            raise NonFiniteLogitsError(non_finite_message("target"))
        for group, finite in zip(self.draft_groups, drafts_finite):
            if not finite:
                raise NonFiniteLogitsError(non_finite_message(f"draft {group.name}"))
        # Rows cache the committed prefix then their own drafts; the last committed token stays uncached.
        reusable = len(committed) + min(num_accepted, count - 1)
        self.target_runner.keep(row, min(self.target_runner.cached_length, reusable))
        for index, group in enumerate(self.draft_groups):
            group_row, agreeing = matches[2 * index : 2 * index + 2] if matches else (0, 0)
            group.runner.keep(group_row, min(group.runner.cached_length, len(committed) + min(agreeing, count - 1)))
        new_tokens = tokens[:count]
        return _Committed(new_tokens, min(num_accepted, count), any(t in self.eos_ids for t in new_tokens))

    def _count_to_eos(self, decision: BlockDecision) -> torch.Tensor:
        """How many tokens to commit ``[]``: through the first EOS, if one comes before the block's end."""
        count = decision.num_accepted + 1  # []
        if self.eos_tensor.numel() == 0:
            return count
        positions = torch.arange(decision.tokens.shape[0], device=self.device)  # [L+1]
        is_eos = torch.isin(decision.tokens, self.eos_tensor) & (positions < count)  # [L+1]
        return torch.where(is_eos.any(), is_eos.to(torch.uint8).argmax() + 1, count)

    def _group_slices(self, draft_tokens: torch.Tensor) -> list[torch.Tensor]:
        """Each draft group's rows of ``draft_tokens`` ``[K, L]`` (none when nothing was drafted)."""
        if draft_tokens.shape[1] == 0:
            return []
        sizes = [len(group.row_params) for group in self.draft_groups]
        return list(draft_tokens.split(sizes))

    def _score(
        self, committed: list[int], draft_tokens: torch.Tensor, timer: RegionTimer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's laws after every prefix of every row ``[K, L+1, vocab]``, and whether all are finite ``[]``."""
        rows, draft_length = draft_tokens.shape
        runner = self.target_runner
        runner.fan_out(rows)
        pending = _pending(runner, committed, rows)  # [K, pending]
        logits = runner.forward(torch.cat([pending, draft_tokens], dim=1), timer, keep=draft_length + 1)
        probs, finite = sampling_law(logits, self.target_params)  # [K, L+1, vocab], [K, L+1]
        return probs, finite.all()

    def _draft(
        self, committed: list[int], draft_length: int, generator: torch.Generator, stats: SampleStats,
        timer: RegionTimer,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Draft tokens ``[K, L]``, the laws they were sampled from ``[K, L, vocab]``, finite flags ``[groups]``."""
        if not draft_length:
            empty = torch.empty(1, 0, dtype=torch.long, device=self.device)  # [1, 0]
            flags = torch.ones(len(self.draft_groups), dtype=torch.bool, device=self.device)  # [groups]
            return empty, torch.empty(1, 0, self.vocab_size, device=self.device), flags
        tokens, laws, finite = [], [], []
        for group in self.draft_groups:
            rows = len(group.row_params)
            runner = group.runner
            runner.fan_out(rows)
            group_tokens = torch.empty(rows, draft_length, dtype=torch.long, device=self.device)  # [K_j, L]
            group_laws = torch.empty(rows, draft_length, self.vocab_size, device=self.device)  # [K_j, L, vocab]
            group_finite = torch.ones((), dtype=torch.bool, device=self.device)  # []
            step_input = _pending(runner, committed, rows)  # [K_j, pending]
            rows_by_params = group.rows_by_params()
            for t in range(draft_length):
                logits = runner.forward(step_input, timer, keep=1)[:, -1].to(self.device)  # [K_j, vocab]
                stats.draft_forwards += 1
                for params, same in rows_by_params:
                    law, row_finite = sampling_law(logits[same], params)  # [rows, vocab], [rows]
                    group_laws[same, t] = law
                    group_finite &= row_finite.all()
                group_tokens[:, t] = sample(group_laws[:, t], generator)
                step_input = group_tokens[:, t : t + 1].to(runner.device)  # [K_j, 1]
            tokens.append(group_tokens)
            laws.append(group_laws)
            finite.append(group_finite)
        return torch.cat(tokens), torch.cat(laws), torch.stack(finite)


@dataclass
class _Committed:
    """A block's outcome on the host: tokens to commit, how many are accepted drafts, and whether it hit EOS."""

    tokens: list[int]
    num_accepted: int
    eos: bool


def _target_token(target_probs: torch.Tensor, generator: torch.Generator) -> BlockDecision:
    """No draft tokens: the block is one token drawn from q (target_probs ``[1, 1, V]``)."""
    token = sample(target_probs[0, 0], generator).view(1)  # [1]
    zero = torch.zeros((), dtype=torch.long, device=token.device)
    return BlockDecision(token, zero, zero)


def _longest_match(group_tokens: torch.Tensor, block_tokens: torch.Tensor, count: torch.Tensor):
    """The row of ``group_tokens`` ``[K_j, L]`` that agrees longest with the first ``count`` committed
    ``block_tokens`` ``[L+1]``, and how long → (row ``[]``, length ``[]``).
    """
    draft_length = group_tokens.shape[1]
    positions = torch.arange(draft_length, device=group_tokens.device)  # [L]
    agrees = (group_tokens == block_tokens[:draft_length]) & (positions < count)  # [K_j, L]
    length = agrees.long().cumprod(-1).sum(-1)  # [K_j]
    best = length.argmax()  # []
    return best, length.gather(0, best.view(1)).squeeze(0)


# --------------------------------------------------------------------------- helpers


_IDENTICAL_DRAFTS_MESSAGE = (
    "verifier '{name}' needs identical drafts (one draft config sampled --num-drafts times), but the recipe's "
    "drafts differ; use one draft config, or a verifier for different drafts (specinfer, is-lp, is-truncated)"
)


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


def check_drafts(verifier: BlockVerifier, recipe: Recipe) -> None:
    """The recipe's drafts suit the verifier (count, identical laws): checked before any model loads."""
    _check_draft_count(verifier, len(recipe.drafts) * recipe.speculation.num_drafts)
    if verifier.identical_drafts and len(set(recipe.drafts)) > 1:
        raise UsageError(_IDENTICAL_DRAFTS_MESSAGE.format(name=verifier.name))


def _check_draft_count(verifier: BlockVerifier | None, num_drafts: int) -> None:
    limit = None if verifier is None else verifier.max_drafts
    if limit is not None and num_drafts > limit:
        raise UsageError(
            f"verifier '{verifier.name}' takes at most {limit} draft(s) per position but the recipe gives "
            f"{num_drafts} (num_drafts × draft configs); lower --num-drafts or pick a multi-draft verifier"
        )


def require_text(prompt: str) -> None:
    if not prompt.strip():
        raise UsageError("the prompt is empty; give some text to continue")


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A per-sample seed, so a sample does not depend on which samples ran before it."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def draft_sampling_params(recipe: Recipe, draft: DraftConfig) -> SamplingParams:
    """A draft's sampling law: its own settings where given, the target's otherwise."""
    generation = recipe.generation
    return SamplingParams(
        temperature=generation.temperature if draft.temperature is None else draft.temperature,
        top_k=generation.top_k if draft.top_k is None else draft.top_k,
        top_p=generation.top_p if draft.top_p is None else draft.top_p,
    )


def load_drafts(
    recipe: Recipe, target: LoadedModel, loader: Callable[..., LoadedModel] = load_model
) -> list[tuple[LoadedModel, list[SamplingParams]]]:
    """Each distinct draft model once, with the sampling settings of all its rows.

    Configs that differ only in sampling settings share one model and one batched forward;
    ``loader`` lets a caller that builds many decoders (bench) load each model only once.
    """
    groups: dict[DraftConfig, tuple[LoadedModel, list[SamplingParams]]] = {}
    for draft in recipe.drafts:
        key = dataclasses.replace(draft, temperature=None, top_k=None, top_p=None)
        if key not in groups:
            if draft.early_exit is not None:
                loaded = derive_early_exit_draft(target, draft.early_exit)
            else:
                loaded = loader(draft, "draft")
                check_same_tokenizer(target, loaded)
            groups[key] = (loaded, [])
        groups[key][1].extend([draft_sampling_params(recipe, draft)] * recipe.speculation.num_drafts)
    return list(groups.values())


def _eos_ids(model: LoadedModel) -> set[int]:
    eos = getattr(model.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def _decoder_start(model: LoadedModel) -> list[int]:
    config = model.model.config
    start = getattr(model.model.generation_config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = config.pad_token_id
    return [int(start)]


def _pending(runner: _Runner, committed: list[int], rows: int) -> torch.Tensor:
    """Committed ids the runner has not cached yet, for each of its ``rows`` → ``[rows, pending]``."""
    ids = torch.tensor(committed[runner.cached_length :], device=runner.device)  # [pending]
    return ids.expand(rows, -1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
