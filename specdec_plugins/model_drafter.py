"""The model drafter: a second language model samples each row's tokens, one batched forward per position.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023), §2.3: the
draft samples L tokens autoregressively from its own law p, which it reports beside them. Several draft
entries with one model share one drafter (:meth:`ModelDrafter.joined`): their rows go through one
forward per position, each entry's rows sampled under its own settings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec_cli.base.sampling import SamplingParams, judged_params, sample_with
from specdec_cli.engine.session import ModelSession
from specdec_cli.plugins.drafting import Drafter, DraftRequest, DraftSetup, Proposal


class ModelDrafter(Drafter):
    """A draft model (the entry's ``model:``) samples each row's tokens from its own law."""

    name = "model"
    uses_model = True
    reports_judged_laws = True

    def entry_problem(self, entry):
        if entry.model is None:
            return "the model drafter needs 'model' (hub id, local directory or .gguf file), or 'early_exit: N'"
        return None

    def load_model(self, pool, entry, target):
        return pool.draft(entry, target)

    def setup(self, setup: DraftSetup) -> None:
        super().setup(setup)
        self.session = ModelSession(
            setup.model, setup.vocab_size, setup.kv_cache, setup.cache_headroom, setup.compile_steps
        )
        self.row_params: list[SamplingParams] = [setup.sampling] * setup.rows  # [rows]: each row's settings

    @property
    def rows(self) -> int:
        return len(self.row_params)

    @property
    def label(self) -> str:
        return self.draft_setup.model.name

    @classmethod
    def joined(cls, drafters: Sequence[Drafter]) -> list[Drafter]:
        """One drafter per model: entries that share a model share its session and its forwards."""
        by_model: dict[int, ModelDrafter] = {}
        for drafter in drafters:
            first = by_model.setdefault(id(drafter.draft_setup.model.model), drafter)
            if first is not drafter:
                first.row_params = first.row_params + drafter.row_params
        return list(by_model.values())

    def add_sequences(self, prompts: list[list[int]], contexts: list[list[int]], timer=None) -> None:
        self.session.add(prompts, contexts, timer)

    def remove_sequences(self, kept: list[int]) -> None:
        self.session.select(kept)

    def keep(self, rows: list[int], lengths: list[int]) -> None:
        session, batch = self.session, len(rows)
        fanned = session.rows == batch * self.rows  # a block drafted: sequence b's rows are b K .. b K + K - 1
        session.keep([b * self.rows + row if fanned else b for b, row in enumerate(rows)], lengths)

    def propose(self, request: DraftRequest) -> Proposal:
        """Every sequence's rows in one forward per position (``[B K, 1]`` after the first), each sequence's tokens
        drawn with its own uniforms."""
        rows, batch, length = self.rows, len(request.contexts), max(request.max_lengths)
        vocab, device, session = self.draft_setup.vocab_size, self.draft_setup.device, self.session
        session.fan_out(rows)
        tokens = torch.empty(batch * rows, length, dtype=torch.long, device=device)  # [B K, n]
        laws = torch.empty(batch * rows, length, vocab, device=device)  # [B K, n, V]
        judged = torch.empty_like(laws) if request.judged_view else None  # [B K, n, V]
        finite = torch.ones((), dtype=torch.bool, device=device)  # []
        contexts = [context for context in request.contexts for _ in range(rows)]
        by_params = [
            (params, [b * rows + row for b in range(batch) for row in same]) for params, same in self._rows_by_params()
        ]
        for t in range(length):
            step = tokens[:, t - 1 : t] if t else None  # [B K, 1]: each row's last draft token
            logits = session.forward(contexts if t == 0 else None, step, 1, request.timer)[:, -1].to(device)  # [B K, V]
            for params, same in by_params:
                law, row_finite = request.sampling_law(logits[same], params)  # [rows', V], [rows']
                laws[same, t] = law
                finite &= row_finite.all()
                if judged is not None:
                    judged[same, t] = request.sampling_law(logits[same], judged_params(params, request.judged_view))[0]
            tokens[:, t] = sample_with(laws[:, t], request.uniforms[:, t].reshape(-1))
        return Proposal(
            tokens.view(batch, rows, length),
            laws.view(batch, rows, length, vocab),
            finite,
            list(request.max_lengths),
            forwards=length,
            judged_laws=None if judged is None else judged.view(batch, rows, length, vocab),
        )

    def _rows_by_params(self) -> list[tuple[SamplingParams, list[int]]]:
        """Rows that share sampling settings, so each settings' law is computed in one call."""
        grouped: dict[SamplingParams, list[int]] = {}
        for row, params in enumerate(self.row_params):
            grouped.setdefault(params, []).append(row)
        return list(grouped.items())
