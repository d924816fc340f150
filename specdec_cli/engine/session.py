"""One model's view of a batch of sequences being decoded: one KV cache for all of them, each row at its own length.

The engine keeps one :class:`ModelSession` per model for every batch size (a single sample is a batch of one).
Its rows are the batch's sequences (each fanned out to K rows while a block is scored), and each row keeps its own
number of cached ids, since rows accept different numbers of draft tokens. The cache is *right-aligned*: row r's
ids fill the last ``lengths[r]`` columns and the columns before them are padding that the attention mask hides,
so every row's next tokens go into the same new columns. Positions are given per row, from the row's own length;
a decoder without absolute positions (T5's relative attention) sees the same distances as unpadded. When rows
keep different lengths after a block, the next forward moves each row's columns so that all end at the last
column again (one gather per cache tensor): padding stays on the left, never between a row's ids. When every row
keeps its start, the cache is cropped instead, as a single sequence's always is.

A model whose rows cannot keep their own positions (:func:`batch_problem`: BART numbers its decoder's positions
from the cache; sliding-window caches) takes no mask and no positions: it decodes one sequence at a time, whose
rows never need padding. Without a KV cache (``use_cache=False``) the session holds the ids instead and every
forward recomputes them: the reference the cache is tested against, and position scoring
(:func:`next_token_logits`).

With a ``headroom`` (``speculation.static_cache``), a decoder-only model's session holds the static cache of
:mod:`.slots` instead: rows left-aligned at their own slots, each forward writing every row where its ids end, a
rejected suffix hidden by the mask until the next block overwrites it, so nothing is cropped or realigned and the
buffers keep their shape (they widen only for a sequence that joins longer than them).

Sequences join (:meth:`ModelSession.add`, each prompt read on its own, once for all its samples) and leave
(:meth:`ModelSession.select`) between blocks, so a long answer does not hold the others.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import nullcontext
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from ..base.timing import RegionTimer
from ..models.loading import LoadedModel
from .slots import SlotCache
from .steps import CAPACITY_BUCKET, StepCompiler, step_compiler

__all__ = ["ModelSession", "batch_problem", "next_token_logits", "pad_to", "static_problem"]


def static_problem(loaded: LoadedModel, use_cache: bool = True) -> str | None:
    """Why ``loaded`` keeps the dynamic cache where the static one (:mod:`.slots`) was asked for, or None: the static
    cache writes each row at its own positions, which needs a decoder-only model that takes them."""
    if not use_cache:
        return "kv_cache: false holds no cache, static or dynamic"
    if loaded.is_encoder_decoder:
        why = "an encoder-decoder"
    elif batch_problem(loaded) is not None:
        why = "its rows cannot keep their own positions (a sliding window, or no position_ids)"
    else:
        return None
    return f"model '{loaded.name}' keeps the dynamic cache: {why}"


def batch_problem(loaded: LoadedModel) -> str | None:
    """Why ``loaded`` cannot decode rows of different lengths in one cache (so not more than one sequence at a
    time), or None.

    A decoder-only model takes each row's positions (``position_ids``). An encoder-decoder's decoder takes none:
    it must have no absolute positions (T5's relative attention sees only distances, which right alignment keeps);
    one that numbers positions from the cache's width (BART) would number a padded row's tokens wrongly.
    """
    parameters = inspect.signature(loaded.model.forward).parameters
    config = loaded.model.config
    if getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return (
            f"model '{loaded.name}' attends through a sliding window, whose cache the batch's alignment does not "
            "handle; use --batch-size 1"
        )
    if loaded.is_encoder_decoder:
        if getattr(config, "max_position_embeddings", None) is not None:
            return (
                f"model '{loaded.name}' numbers its decoder's positions from the cache, so rows of different "
                "lengths cannot share one; use --batch-size 1"
            )
        return None
    if "position_ids" not in parameters:
        return (
            f"model '{loaded.name}' takes no position_ids, so rows cannot keep their own positions; use --batch-size 1"
        )
    return None


def cache_argument(model: torch.nn.Module) -> str:
    """What the model's forward (and its output) calls the KV cache: ``cache`` from transformers 5.24, which warns
    on ``past_key_values`` and drops it in 5.40; ``past_key_values`` in the releases before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ModelSession:
    """A model's KV cache (or, without one, its ids) for a batch's rows, each at its own length: right-aligned, or at
    its own slots of a static cache."""

    def __init__(
        self,
        loaded: LoadedModel,
        vocab_size: int,
        use_cache: bool = True,
        headroom: int | None = None,
        compiled: bool = False,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.vocab_size = vocab_size
        self.use_cache = use_cache
        self.device = loaded.device
        self.padded = batch_problem(loaded) is None
        """Rows may be padded (masks and positions given per row); False: one sequence at a time, no padding."""
        self.headroom = headroom if headroom is not None and static_problem(loaded, use_cache) is None else None
        """With a static cache (:mod:`.slots`): the slots a joining sequence gets past its context; None: dynamic."""
        self.steps: StepCompiler | None = step_compiler(self.model) if compiled and self.headroom is not None else None
        """The compiled forward of the steps that extend the static cache (:mod:`.steps`); None: every forward eager."""
        self.cache: Any = None
        self.ids: torch.Tensor | None = None  # [rows, columns]: without a KV cache, the ids it holds instead
        self.columns = 0  # the cache's (or the ids') columns: every row's ids end at the last one
        self.lengths: list[int] = []  # [rows]: ids of each row the session holds for it
        self.starts: list[int] = []  # [rows]: each row's first column (the columns before it are padding)
        self.encoder_hidden: torch.Tensor | None = None  # [rows, source, d] for an encoder-decoder
        self.encoder_mask: torch.Tensor | None = None  # [rows, source] 1 on each row's prompt
        self.keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.cache_argument = cache_argument(self.model)
        self._last_read: tuple[tuple, ModelSession] | None = None  # ((prompt, context), the one-row session it read)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    # ----------------------------------------------------------------------- rows joining and leaving

    def add(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None = None) -> None:
        """Sequences join at the end of the batch: an encoder-decoder encodes each of ``prompts``; the decoder reads
        each of ``contexts`` (the committed ids) and holds all of it but its last id, which the next block feeds.

        Each sequence is read on its own: reading prompts of different lengths together would compute their
        padding too, which on a compute-bound device costs more than it saves; the next sample of a prompt (they join
        one after another) takes a copy of what the last read computed. One sequence joining an empty session (a
        single sample) is read with its first block instead: one forward less, and nothing to align."""
        deferred = not self.lengths and len(contexts) == 1
        for prompt, context in zip(prompts, contexts):
            key = (tuple(prompt), tuple(context))
            if deferred or self._last_read is None or self._last_read[0] != key:
                joining = self._read(prompt, context, deferred, timer)
                self._last_read = None if deferred else (key, joining._copy())
            else:
                joining = self._last_read[1]._copy()
            self._merge(joining)

    @torch.no_grad()  # what a read computes is copied (_copy), which a tensor with a grad_fn refuses
    def _read(self, prompt: list[int], context: list[int], deferred: bool, timer: RegionTimer | None) -> ModelSession:
        """A session of one row that has read ``prompt`` (an encoder-decoder's) and ``context`` (but for its last id),
        or, ``deferred``, that will read them with its first block."""
        joining = ModelSession(self.loaded, self.vocab_size, self.use_cache, self.headroom, self.steps is not None)
        if self.headroom is not None:
            layers = self.model.config.get_text_config().num_hidden_layers
            joining.cache = SlotCache(layers, self._capacity(len(context) + self.headroom + 1))
        if self.loaded.is_encoder_decoder:
            joining.encoder_hidden, joining.encoder_mask = self._encode(prompt)
        joining.starts, joining.lengths = [0], [0]
        if not deferred:
            ids = torch.tensor([context], dtype=torch.long, device=self.device)  # [1, context]
            if self.use_cache:
                joining._run(ids, 1, timer)
            else:  # nothing to compute: the next forward reads every id again
                joining.ids, joining.columns = ids, ids.shape[1]
            joining.lengths = [len(context) - 1]
        return joining

    def _copy(self) -> ModelSession:
        """This session with its own cache, which forwards write in place (ids and encoder outputs are replaced)."""
        twin = copy.copy(self)
        twin.cache = copy.deepcopy(self.cache)
        twin.lengths, twin.starts = list(self.lengths), list(self.starts)
        return twin

    def _encode(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's output for ``prompt`` → (hidden ``[1, source, d]``, mask ``[1, source]``, all ones)."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, source]
        hidden = self.model.get_encoder()(input_ids=ids).last_hidden_state  # [1, source, d]
        return hidden, torch.ones_like(ids)

    def _merge(self, other: ModelSession) -> None:
        """``other``'s rows after this session's: caches left-padded to one width (cross-attention caches and
        encoder outputs right-padded to one source length) and concatenated."""
        if not self.lengths:
            self.cache, self.ids, self.columns = other.cache, other.ids, other.columns
            self.lengths, self.starts = other.lengths, other.starts
            self.encoder_hidden, self.encoder_mask = other.encoder_hidden, other.encoder_mask
            return
        if self.headroom is not None:  # rows at their own slots: nothing to align, the buffers to join
            self.cache.join(other.cache, self.rows, other.rows)
            self.lengths, self.starts = self.lengths + other.lengths, self.starts + other.starts
            return
        width = max(self.columns, other.columns)
        self.starts = [start + width - self.columns for start in self.starts] + [
            start + width - other.columns for start in other.starts
        ]
        self.lengths = self.lengths + other.lengths
        self.columns = width
        if self.use_cache:
            _join_layers(_self_layers(self.cache), _self_layers(other.cache), width, left=True)
        else:
            self.ids = _joined(self.ids, other.ids, width, left=True, dim=1)
        if self.encoder_hidden is not None:
            source = max(self.encoder_hidden.shape[1], other.encoder_hidden.shape[1])
            if self.use_cache:
                _join_layers(_cross_layers(self.cache), _cross_layers(other.cache), source, left=False)
            self.encoder_hidden = _joined(self.encoder_hidden, other.encoder_hidden, source, left=False, dim=1)
            self.encoder_mask = _joined(self.encoder_mask, other.encoder_mask, source, left=False, dim=1)

    def select(self, rows: list[int]) -> None:
        """Keep ``rows`` only, in that order (a row may repeat: fanning out is a selection)."""
        if rows == list(range(self.rows)):
            return
        self.lengths = [self.lengths[row] for row in rows]
        self.starts = [self.starts[row] for row in rows]
        if not rows:
            self.cache = self.ids = self.encoder_hidden = self.encoder_mask = None
            self.columns = 0
            return
        index = torch.tensor(rows, device=self.device)  # [rows']: the kept rows
        if self.cache is not None:
            self.cache.batch_select_indices(index)
        if self.ids is not None:
            self.ids = self.ids.index_select(0, index)  # [rows', columns]
        if self.encoder_hidden is not None:
            self.encoder_hidden = self.encoder_hidden.index_select(0, index)  # [rows', source, d]
            self.encoder_mask = self.encoder_mask.index_select(0, index)  # [rows', source]

    def fan_out(self, rows: int) -> None:
        """Repeat every row ``rows`` times in place (sequence b's K rows are ``b K .. b K + K - 1``)."""
        self.select([row for row in range(self.rows) for _ in range(rows)])

    def keep(self, rows: list[int], lengths: list[int]) -> None:
        """Keep ``rows`` (one per sequence), each cropped to at most its first ``lengths`` ids (done lazily, with the
        next forward's alignment)."""
        self.select(rows)
        self.lengths = [min(own, length) for own, length in zip(self.lengths, lengths)]

    # ----------------------------------------------------------------------- forwards

    def forward(
        self, contexts: list[list[int]] | None, tokens: torch.Tensor | None, keep: int, timer: RegionTimer | None = None
    ) -> torch.Tensor:
        """Logits ``[rows, keep, vocab]`` of the last ``keep`` inputs: each row's committed ids the session does not
        hold (of its ``contexts`` entry), then its ``tokens`` ``[rows, n]`` (or none). ``contexts`` None: ``tokens``
        follow what the rows hold (a draft's next token).

        Rows are first cropped so that each has the same number of pending ids (the most any has): their
        inputs then fill the same columns, and recomputing an id or two costs less than padding between them.
        """
        if contexts is None:
            return self._run(tokens.to(self.device), keep, timer)
        pending = max(len(context) - length for context, length in zip(contexts, self.lengths))
        held = [max(len(context) - pending, 0) for context in contexts]
        # A row with fewer ids than that (an encoder-decoder's start, a one-id prompt) holds none: its inputs are
        # left-padded. The dynamic cache masks the padding as columns before the row; the static one writes it to
        # the scratch slot.
        padding = [max(pending - len(context), 0) for context in contexts]
        if self.headroom is None:
            self._align(held)
            self.starts = [start + pad for start, pad in zip(self.starts, padding)]
        else:
            self.lengths = held
        padded = [[0] * pad + context[length:] for pad, length, context in zip(padding, held, contexts)]
        inputs = torch.tensor(padded, dtype=torch.long, device=self.device).view(self.rows, pending)  # [rows, pending]
        if tokens is not None:
            inputs = torch.cat([inputs, tokens.to(self.device)], dim=1)  # [rows, pending + n]
        return self._run(inputs, keep, timer, padding)

    def _run(
        self, inputs: torch.Tensor, keep: int, timer: RegionTimer | None, padding: list[int] | None = None
    ) -> torch.Tensor:
        """The forward of ``inputs`` ``[rows, m]`` after each row's held ids → logits ``[rows, keep, vocab]``.
        ``padding`` [rows]: how many of each row's inputs are left padding (the static cache's; the dynamic one has
        made it columns before the row)."""
        padding = padding or [0] * self.rows
        if not self.use_cache:  # recompute every held id: the whole sequence is this forward's input
            inputs = inputs if self.ids is None else torch.cat([self.ids, inputs], dim=1)  # [rows, columns + m]
            self.ids, self.columns = inputs, 0
        # A step that extends a static cache has the fixed shapes a compiled graph needs; the first forward (prefill,
        # the prompt's length) writes an empty one and runs eager.
        extends = self.steps is not None and self.cache.layers[0].is_initialized
        forward = self.steps if extends else self.model
        # A compiled step computes the logits of all its inputs (0: keep all): a step's few positions cost little
        # beside its weights, and a number of logits kept per call would be one more value its graphs specialise on.
        arguments = self._forward_arguments(inputs, 0 if extends else keep, padding)
        with self.steps.compiling((*inputs.shape, self.cache.capacity)) if extends else nullcontext():
            with timer.region("forward") if timer is not None else nullcontext():
                output = forward(**arguments)
        self.cache = getattr(output, self.cache_argument) if self.use_cache else None
        if self.headroom is None:
            self.columns += inputs.shape[1]
            self.lengths = [self.columns - start for start in self.starts]
        else:
            self.lengths = [length + inputs.shape[1] - pad for length, pad in zip(self.lengths, padding)]
        return output.logits[:, -keep:, : self.vocab_size]  # [rows, keep, vocab]

    def _forward_arguments(self, inputs: torch.Tensor, keep: int, padding: list[int]) -> dict[str, Any]:
        """The model's keyword arguments for ``inputs`` ``[rows, m]`` after the held columns: where rows may be
        padded, the mask of every row's columns and, for a decoder-only model, each row's positions."""
        kwargs: dict[str, Any] = {"use_cache": self.use_cache, self.cache_argument: self.cache}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = keep
        if self.loaded.is_encoder_decoder and self.use_cache and self.cache is None:
            self.cache = kwargs[self.cache_argument] = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if self.headroom is not None:
            return kwargs | self._slot_arguments(inputs, padding)
        if not self.padded:
            encoder = {"encoder_outputs": (self.encoder_hidden,), "decoder_input_ids": inputs}
            return kwargs | (encoder if self.loaded.is_encoder_decoder else {"input_ids": inputs})
        mask = self._attention_mask(inputs.shape[1])  # [rows, 1, m, columns + m]
        if self.loaded.is_encoder_decoder:
            source_mask = _additive(self.encoder_mask.view(self.rows, 1, 1, -1) == 0, self.model.dtype)
            return kwargs | {
                "decoder_input_ids": inputs,
                "decoder_attention_mask": mask,
                "attention_mask": source_mask,
                "encoder_outputs": (self.encoder_hidden,),
            }
        # Row r's id in column c is at position c - start[r] (padding columns get position 0; they are masked).
        columns = torch.arange(self.columns, self.columns + inputs.shape[1], device=self.device)  # [m]
        positions = (columns - torch.tensor(self.starts, device=self.device).view(-1, 1)).clamp(min=0)  # [rows, m]
        return kwargs | {"input_ids": inputs, "attention_mask": mask, "position_ids": positions}

    def _slot_arguments(self, inputs: torch.Tensor, padding: list[int]) -> dict[str, Any]:
        """With the static cache: where each row's ``inputs`` ``[rows, m]`` go (after its held ids; its ``padding``
        to the scratch slot), their positions, and the mask over every slot: a real input sees its row's slots up to
        its own, padding only the scratch slot."""
        new = inputs.shape[1]
        self.cache.settle()
        needed = max(length + new - pad for length, pad in zip(self.lengths, padding)) + 1  # and the scratch
        if needed > self.cache.capacity:
            self.cache.widen(self._capacity(needed + self.headroom))
        offsets = torch.arange(new, device=self.device)  # [m]
        pads = torch.tensor(padding, device=self.device).view(-1, 1)  # [rows, 1]
        real = offsets >= pads  # [rows, m]
        slots = torch.tensor(self.lengths, device=self.device).view(-1, 1) + offsets - pads  # [rows, m]
        scratch = self.cache.capacity - 1
        self.cache.write_slots = torch.where(real, slots, scratch)  # [rows, m]
        every = torch.arange(self.cache.capacity, device=self.device)  # [S]
        seen = (every <= slots.unsqueeze(-1)) & real.unsqueeze(-1)  # [rows, m, S]
        seen |= ~real.unsqueeze(-1) & (every == scratch)
        mask = _additive(~seen, self.model.dtype).unsqueeze(1)  # [rows, 1, m, S]
        # A compiled step's inputs copied to standard strides: its graph is specialised to them, and a draft token
        # sliced from a block's tokens keeps the block's (contiguous() keeps a one-row slice's, which counts as one).
        ids = inputs if self.steps is None else inputs.clone(memory_format=torch.contiguous_format)  # [rows, m]
        return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.where(real, slots, 0)}

    def _capacity(self, slots: int) -> int:
        """Slots per row for a static cache that needs ``slots``: rounded up to a bucket when steps are compiled, so
        that prompts of different lengths share their graphs."""
        return slots if self.steps is None else -(-slots // CAPACITY_BUCKET) * CAPACITY_BUCKET

    def _attention_mask(self, new: int) -> torch.Tensor:
        """The additive mask ``[rows, 1, new, columns + new]`` of ``new`` queries after the held columns: each sees
        its row's columns up to its own. Whole and additive: transformers would read a 2D mask on the host to see
        whether it can skip it."""
        columns = torch.arange(self.columns + new, device=self.device)  # [W + m]
        starts = torch.tensor(self.starts, device=self.device).view(-1, 1, 1)  # [rows, 1, 1]
        own = self.columns + columns[:new].view(new, 1)  # [m, 1]: query i is column W + i
        # A padding query sees its own column too: a row that sees nothing would be NaN in float16, and NaN spreads.
        seen = ((columns >= starts) & (columns <= own)) | (columns == own)  # [rows, m, W + m]
        return _additive(~seen, self.model.dtype).unsqueeze(1)

    def _align(self, lengths: list[int]) -> None:
        """Crop row r to its first ``lengths[r]`` ids and move every row's columns to end at the last column, the
        padding before them as narrow as the longest row allows."""
        lengths = [min(own, length) for own, length in zip(self.lengths, lengths)]
        width = max(lengths, default=0)
        starts = [width - length for length in lengths]
        if starts == self.starts:  # every row keeps its first column: cut the columns past the longest
            if width < self.columns:
                self._crop(width)
        elif self.columns:
            shift = torch.tensor([old - new for old, new in zip(self.starts, starts)], device=self.device)  # [rows]
            source = (torch.arange(width, device=self.device) + shift.view(-1, 1)).clamp(
                0, self.columns - 1
            )  # [rows, W']
            self._gather(source)
        self.lengths, self.starts, self.columns = lengths, starts, width

    def _crop(self, width: int) -> None:
        """Keep the first ``width`` columns of every row."""
        if self.cache is not None:
            self.cache.crop(width - self.columns)  # negative: the columns to remove
        if self.ids is not None:
            self.ids = self.ids[:, :width]  # [rows, W']

    def _gather(self, source: torch.Tensor) -> None:
        """Column j of row r becomes column ``source[r, j]`` ``[rows, W']`` of the cache (or of the ids)."""
        if self.ids is not None:
            self.ids = self.ids.gather(1, source)  # [rows, W']
        if self.cache is None:
            return
        rows, width = source.shape
        for layer in _self_layers(self.cache):
            index = source.view(rows, 1, width, 1).expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)  # [rows, heads, W', d]
            layer.values = layer.values.gather(2, index)


@torch.inference_mode()
def next_token_logits(
    loaded: LoadedModel, prompt_ids: list[int], continuations: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Logits after every prefix of each continuation, in one forward with no cache → ``[rows, n+1, vocab]``.

    continuations ``[rows, n]``: generated ids after ``prompt_ids`` (after the decoder's start ids
    for an encoder-decoder model, whose encoder reads the prompt). Entry ``[r, i]`` is the
    model's logits for the token after ``continuations[r, :i]``.
    """
    session = ModelSession(loaded, vocab_size, use_cache=False)
    context = loaded.decoder_start_ids if loaded.is_encoder_decoder else list(prompt_ids)
    session.add([prompt_ids], [context])
    rows = continuations.shape[0]
    session.fan_out(rows)
    return session.forward([context] * rows, continuations.to(session.device), keep=continuations.shape[1] + 1)


def _additive(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive attention mask: 0 where a query sees a column, the dtype's lowest value where ``hidden`` (not -inf,
    so that a padding query that sees nothing gets finite junk, not NaN)."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, torch.finfo(dtype).min)


def _self_layers(cache: Any) -> list[Any]:
    """The layers (``.keys``/``.values`` ``[rows, heads, columns, d]``) of a cache's self-attention."""
    return (cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache).layers


def _cross_layers(cache: Any) -> list[Any]:
    """An encoder-decoder cache's cross-attention layers (over the encoder's source positions)."""
    return cache.cross_attention_cache.layers


def _join_layers(own: list[Any], joining: list[Any], size: int, left: bool) -> None:
    """Each of ``own`` layers' keys and values followed by ``joining``'s rows, padded to ``size`` columns."""
    for own_layer, joining_layer in zip(own, joining):
        own_layer.keys = _joined(own_layer.keys, joining_layer.keys, size, left)
        own_layer.values = _joined(own_layer.values, joining_layer.values, size, left)


def _joined(own: torch.Tensor, new: torch.Tensor, size: int, left: bool, dim: int = 2) -> torch.Tensor:
    """``own`` then ``new`` along dim 0, each padded with zeros to ``size`` along ``dim`` (on the left or right)."""
    return torch.cat([pad_to(own, size, dim, left), pad_to(new, size, dim, left)])


def pad_to(tensor: torch.Tensor, size: int, dim: int, left: bool = False) -> torch.Tensor:
    """``tensor`` padded with zeros to ``size`` along ``dim``, on the right (or the left)."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    zeros = tensor.new_zeros(shape)
    return torch.cat([zeros, tensor] if left else [tensor, zeros], dim=dim)
