"""One model's view of a sequence being decoded: its KV cache, the ids the cache holds, and rollback.

The engine keeps one :class:`ModelSession` per model. A block fans the single committed row out
to the block's K draft rows, appends tokens with :meth:`ModelSession.forward`, and after the
verifier's decision keeps one row, cropped to the ids that were committed
(:meth:`ModelSession.keep`). :func:`next_token_logits` scores every position of given
continuations in one forward without a cache: the acceptance analysis and the test helpers
score positions with it.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any

import torch

from .models import LoadedModel
from .timing import RegionTimer


class ModelSession:
    """A model's KV cache and the ids it holds, one row per draft row of the current block.

    Between blocks there is a single row. With ``use_cache=False`` every forward recomputes the
    whole sequence (the reference that tests cache rollback against, and position scoring).
    """

    def __init__(self, loaded: LoadedModel, vocab_size: int, use_cache: bool = True):
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
        """Forget the previous sequence; an encoder-decoder model encodes ``prompt_ids`` here."""
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

    def pending(self, committed: list[int]) -> torch.Tensor:
        """Committed ids the cache does not hold yet, for each row → ``[rows, pending]``."""
        ids = torch.tensor(committed[self.cached_length :], dtype=torch.long, device=self.device)  # [pending]
        return ids.expand(self.rows, -1)

    def forward(self, tokens: torch.Tensor, keep: int, timer: RegionTimer | None = None) -> torch.Tensor:
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
        with timer.region("forward") if timer is not None else nullcontext():
            output = self.model(**kwargs)
        if self.use_cache:
            self.cache = output.past_key_values
        self.cached_ids = torch.cat([self.cached_ids, tokens], dim=1)  # [rows, n + m]
        return output.logits[:, -keep:, : self.vocab_size]  # [rows, keep, vocab]


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
    session.start(prompt_ids)
    session.fan_out(continuations.shape[0])
    context = loaded.decoder_start_ids if loaded.is_encoder_decoder else list(prompt_ids)
    tokens = torch.cat([session.pending(context), continuations.to(session.device)], dim=1)  # [rows, context + n]
    return session.forward(tokens, keep=continuations.shape[1] + 1)
