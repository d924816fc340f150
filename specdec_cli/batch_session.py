"""One model's view of a batch of sequences: one KV cache for all of them, each row at its own length.

The batched engine keeps one :class:`BatchSession` per model. Its rows are the batch's sequences
(each fanned out to K rows while a block is scored), and each row keeps its own number of cached
ids, since rows accept different numbers of draft tokens. The cache is *right-aligned*: row r's
ids fill the last ``lengths[r]`` columns and the columns before them are padding that the
attention mask hides, so every row's next tokens go into the same new columns. Positions are
given per row, from the row's own length; a decoder without absolute positions (T5's relative
attention) sees the same distances as unpadded. When rows keep different lengths after a block,
the next forward moves each row's columns so that all end at the last column again (one gather
per cache tensor): padding stays on the left, never between a row's ids.

Sequences join (:meth:`BatchSession.add`, which reads their prompts in one forward) and leave
(:meth:`BatchSession.select`) between blocks, so a long answer does not hold the others.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from .errors import UsageError
from .models import LoadedModel
from .timing import RegionTimer

__all__ = ["BatchSession", "batch_problem"]


def batch_problem(loaded: LoadedModel) -> str | None:
    """Why ``loaded`` cannot decode rows of different lengths in one cache, or None.

    A decoder-only model takes each row's positions (``position_ids``). An encoder-decoder's decoder
    takes none: it must have no absolute positions (T5's relative attention sees only distances,
    which right alignment keeps); one that numbers positions from the cache's width (BART) would
    number a padded row's tokens wrongly.
    """
    parameters = inspect.signature(loaded.model.forward).parameters
    config = loaded.model.config
    if getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return (f"model '{loaded.name}' attends through a sliding window, whose cache the batch's alignment does not "
                "handle; use --batch-size 1")  # fmt: skip
    if loaded.is_encoder_decoder:
        if getattr(config, "max_position_embeddings", None) is not None:
            return (f"model '{loaded.name}' numbers its decoder's positions from the cache, so rows of different "
                    "lengths cannot share one; use --batch-size 1")  # fmt: skip
        return None
    if "position_ids" not in parameters:
        return (f"model '{loaded.name}' takes no position_ids, so rows cannot keep their own positions; "
                "use --batch-size 1")
    return None


class BatchSession:
    """A model's KV cache for a batch's rows, right-aligned, with each row's cached length."""

    def __init__(self, loaded: LoadedModel, vocab_size: int):
        problem = batch_problem(loaded)
        if problem is not None:
            raise UsageError(problem)
        self.loaded = loaded
        self.model = loaded.model
        self.vocab_size = vocab_size
        self.device = loaded.device
        self.cache: Any = None
        self.lengths: list[int] = []  # [rows]: ids of each row the cache holds for it
        self.starts: list[int] = []  # [rows]: each row's first column (the columns before it are padding)
        self.encoder_hidden: torch.Tensor | None = None  # [rows, source, d] for an encoder-decoder
        self.encoder_mask: torch.Tensor | None = None  # [rows, source] 1 on each row's prompt
        self.keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Columns of the cache: every row's ids end at the last one."""
        return _self_layers(self.cache)[0].keys.shape[2] if self.cache is not None and self.lengths else 0

    # ----------------------------------------------------------------------- rows joining and leaving

    def add(self, prompts: list[list[int]], contexts: list[list[int]], timer: RegionTimer | None = None) -> None:
        """Sequences join at the end of the batch: an encoder-decoder encodes each of ``prompts``; the decoder reads
        each of ``contexts`` (the committed ids) and caches all of it but its last id, which the next block feeds.

        Each sequence is read on its own, as at batch 1: reading prompts of different lengths together would
        compute their padding too, and on a compute-bound device that costs more than it saves."""
        for prompt, context in zip(prompts, contexts):
            joining = BatchSession(self.loaded, self.vocab_size)
            if self.loaded.is_encoder_decoder:
                joining.encoder_hidden, joining.encoder_mask = self._encode(prompt)
            joining.starts, joining.lengths = [0], [0]
            joining._run(torch.tensor([context], dtype=torch.long, device=self.device), 1, timer)  # [1, context]
            joining.lengths = [len(context) - 1]
            self._merge(joining)

    def _encode(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's output for ``prompt`` → (hidden ``[1, source, d]``, mask ``[1, source]``, all ones)."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, source]
        hidden = self.model.get_encoder()(input_ids=ids).last_hidden_state  # [1, source, d]
        return hidden, torch.ones_like(ids)

    def _merge(self, other: "BatchSession") -> None:
        """``other``'s rows after this session's: caches left-padded to one width (cross-attention caches and
        encoder outputs right-padded to one source length) and concatenated."""
        if not self.lengths:
            self.cache, self.lengths, self.starts = other.cache, other.lengths, other.starts
            self.encoder_hidden, self.encoder_mask = other.encoder_hidden, other.encoder_mask
            return
        width = max(self.width, other.width)
        self.starts = [start + width - self.width for start in self.starts] + [
            start + width - other.width for start in other.starts]  # fmt: skip
        self.lengths = self.lengths + other.lengths
        _join_layers(_self_layers(self.cache), _self_layers(other.cache), width, left=True)
        if self.encoder_hidden is not None:
            source = max(self.encoder_hidden.shape[1], other.encoder_hidden.shape[1])
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
            self.cache = self.encoder_hidden = self.encoder_mask = None
            return
        index = torch.tensor(rows, device=self.device)  # [rows']: the kept rows
        self.cache.batch_select_indices(index)
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
        """Logits ``[rows, keep, vocab]`` of the last ``keep`` inputs: each row's committed ids the cache does not hold
        (of its ``contexts`` entry), then its ``tokens`` ``[rows, n]`` (or none). ``contexts`` None: ``tokens`` follow
        what the rows hold (a draft's next token).

        Rows are first cropped so that each has the same number of pending ids (the most any has): their
        inputs then fill the same columns, and recomputing an id or two costs less than padding between them.
        """
        if contexts is None:
            return self._run(tokens.to(self.device), keep, timer)
        pending = max(len(context) - length for context, length in zip(contexts, self.lengths))
        self._align([max(len(context) - pending, 0) for context in contexts])
        # A row with fewer ids than that (an encoder-decoder's start) caches none: its inputs are left-padded,
        # the padding masked as the columns before it.
        self.starts = [start + max(pending - len(context), 0) for start, context in zip(self.starts, contexts)]
        padded = [[0] * (pending - len(context)) + context[max(len(context) - pending, 0) :] for context in contexts]
        inputs = torch.tensor(padded, dtype=torch.long, device=self.device).view(self.rows, pending)  # [rows, pending]
        if tokens is not None:
            inputs = torch.cat([inputs, tokens.to(self.device)], dim=1)  # [rows, pending + n]
        return self._run(inputs, keep, timer)

    def _run(self, inputs: torch.Tensor, keep: int, timer: RegionTimer | None) -> torch.Tensor:
        """The forward of ``inputs`` ``[rows, m]`` after each row's cached ids → logits ``[rows, keep, vocab]``."""
        with timer.region("forward") if timer is not None else nullcontext():
            output = self.model(**self._forward_arguments(inputs, keep))
        self.cache = output.past_key_values
        self.lengths = [self.width - start for start in self.starts]
        return output.logits[:, -keep:, : self.vocab_size]  # [rows, keep, vocab]

    def _forward_arguments(self, inputs: torch.Tensor, keep: int) -> dict[str, Any]:
        """The model's keyword arguments for ``inputs`` ``[rows, m]`` after the cache: the mask of every row's
        columns and, for a decoder-only model, each row's positions."""
        rows, new = inputs.shape
        width = self.width
        columns = torch.arange(width + new, device=self.device)  # [width + m]
        starts = torch.tensor(self.starts, device=self.device).view(rows, 1)  # [rows, 1]
        # The whole mask, additive: transformers would read a 2D one on the host to see whether it can skip it.
        own = width + columns[:new].view(new, 1)  # [m, 1]: query i is column W + i
        # A padding query sees its own column too: a row that sees nothing would be NaN in float16, and NaN spreads.
        seen = ((columns >= starts.view(rows, 1, 1)) & (columns <= own)) | (columns == own)  # [rows, m, W + m]
        mask = _additive(~seen, self.model.dtype).unsqueeze(1)  # [rows, 1, m, width + m]
        kwargs: dict[str, Any] = {"use_cache": True, "past_key_values": self.cache}
        if self.keeps_logits:
            kwargs["logits_to_keep"] = keep
        if self.loaded.is_encoder_decoder:
            if self.cache is None:
                self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
                kwargs["past_key_values"] = self.cache
            padding = self.encoder_mask.view(rows, 1, 1, -1) == 0  # [rows, 1, 1, source]
            source_mask = _additive(padding, self.model.dtype)
            kwargs.update(decoder_input_ids=inputs, decoder_attention_mask=mask, attention_mask=source_mask,
                          encoder_outputs=(self.encoder_hidden,))  # fmt: skip
        else:
            # Row r's id in column c is at position c - start[r] (padding columns get position 0; they are masked).
            positions = (columns[-new:] - starts).clamp(min=0)  # [rows, m]
            kwargs.update(input_ids=inputs, attention_mask=mask, position_ids=positions)
        return kwargs

    def _align(self, lengths: list[int]) -> None:
        """Crop row r to its first ``lengths[r]`` ids and move every row's columns to end at the last column, the
        padding before them as narrow as the longest row allows."""
        lengths = [min(own, length) for own, length in zip(self.lengths, lengths)]
        old_width = self.width
        width = max(lengths, default=0)
        starts = [width - length for length in lengths]
        if starts == self.starts and width == old_width:
            return
        if self.cache is not None and old_width:
            shift = torch.tensor([old - new for old, new in zip(self.starts, starts)], device=self.device)  # [rows]
            source = (torch.arange(width, device=self.device) + shift.view(-1, 1)).clamp(0, old_width - 1)  # [rows, W']
            for layer in _self_layers(self.cache):
                index = source.view(len(lengths), 1, width, 1).expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys = layer.keys.gather(2, index)  # [rows, heads, W', d]
                layer.values = layer.values.gather(2, index)
        self.lengths, self.starts = lengths, starts


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
