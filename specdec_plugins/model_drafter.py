"""The model drafter: a second language model samples each row's tokens, one batched forward per position.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023), §2.3: the
draft samples L tokens autoregressively from its own law p, which it reports beside them. Several draft
entries with one model share one drafter (:meth:`ModelDrafter.joined`): their rows go through one
forward per position, each entry's rows sampled under its own settings.

A row that drafts an EOS (one of the target's ids that end a sample) drafts nothing after it, as transformers'
assistant, whose ``generate`` stops at the target's EOS (transformers 5.24.0,
``src/transformers/generation/candidate_generator.py``: ``AssistedCandidateGenerator.__init__`` gives the assistant
the target's ``eos_token_id``, ``_generate_candidates`` calls its ``generate``). Its later positions repeat that EOS
under a one-hot law, which is the row's law once it has ended: a sample ends at its first EOS, so no token after it
on that row is ever committed, and every verifier keeps its guarantee (each holds for any draft law it is told, and
the rows of one entry still share one law). The block keeps its length: a shorter block would need the EOS positions
read on the host before the target's forward. Where reads are free (the CPU, outside
:func:`~specdec_cli.plugins.verifiers.device_path`) the forwards stop once every row has ended; on a GPU they run
on, since stopping would read the device at every position, and their logits go unused.

``branch_after: d`` (0: K independent rows) drafts one path for the first d tokens of a block and K continuations
from it: at t < d an entry's first row draws and its other rows carry that token under a one-hot law, its law given
the rows before it (they copy it), and from t = d on every row draws alone, from the same law given the same prefix.
A verifier exact on rows that are not independent (SpecInfer's chain, traversal's tree, sample matching) stays exact;
one that needs K independent rows of one law (SpecTr, is-lp, is-truncated) is not (docs/drafters.md, "Delayed
branching"). The copies' forwards at t < d still run, in the batch, and go unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import torch

from specdec_cli.base.sampling import SamplingParams, judged_params, sample_with
from specdec_cli.engine.session import ModelSession
from specdec_cli.plugins.drafting import Drafter, DraftRequest, DraftSetup, Proposal, one_hot_laws
from specdec_cli.plugins.verifiers import reads_are_free

BranchAfter = Annotated[
    int,
    "tokens of each block drafted once before the rows branch: the first row draws them, the others copy them "
    "(0: K independent rows; only specinfer, traversal and match take copies)",
]
"""The ``branch_after`` parameter of the drafters that draft with a model (this one and early-exit)."""


class ModelDrafter(Drafter):
    """A draft model (the entry's ``model:``) samples each row's tokens from its own law."""

    name = "model"
    uses_model = True
    reports_judged_laws = True
    branch_after = 0  # a subclass whose constructor does not call this one drafts K independent rows

    def __init__(self, *, branch_after: BranchAfter = 0):
        if branch_after < 0:  # a whole number: the base class checked the type
            raise ValueError(f"{self.name}: branch_after must be a whole number >= 0 (tokens), got {branch_after!r}")
        self.branch_after = branch_after

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
        self.copies = [_Copy(row, 0, self.branch_after) for row in range(1, setup.rows) if self.branch_after]
        eos = sorted(setup.target.eos_ids)
        self.eos_ids = torch.tensor(eos, dtype=torch.long, device=setup.device)  # [eos ids]: the ids that end a row

    @property
    def rows(self) -> int:
        return len(self.row_params)

    @property
    def label(self) -> str:
        return self.draft_setup.model.name

    @property
    def independent_rows(self) -> bool:
        return not self.branch_after

    @classmethod
    def joined(cls, drafters: Sequence[Drafter]) -> list[Drafter]:
        """One drafter per model: entries that share a model share its session and its forwards."""
        by_model: dict[int, ModelDrafter] = {}
        for drafter in drafters:
            first = by_model.setdefault(id(drafter.draft_setup.model.model), drafter)
            if first is not drafter:
                offset = first.rows
                first.copies = first.copies + [copy.shifted(offset) for copy in drafter.copies]
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
        drawn with its own uniforms; a row that has drafted an EOS repeats it (module docstring)."""
        rows, batch, length = self.rows, len(request.contexts), max(request.max_lengths)
        vocab, device, session = self.draft_setup.vocab_size, self.draft_setup.device, self.session
        session.fan_out(rows)
        table = _DraftTable.empty(batch * rows, length, vocab, device, request.judged_view is not None)
        finite = torch.ones((), dtype=torch.bool, device=device)  # []
        contexts = [context for context in request.contexts for _ in range(rows)]
        by_params = [
            (params, [b * rows + row for b in range(batch) for row in same]) for params, same in self._rows_by_params()
        ]
        forwards = 0
        for t in range(length):
            if not (t and reads_are_free(table.ended) and bool(table.ended.all())):  # a row drafts on, or no read
                step = table.tokens[:, t - 1 : t] if t else None  # [B K, 1]: each row's last draft token
                logits = session.forward(contexts if t == 0 else None, step, 1, request.timer)[:, -1]  # [B K, V]
                finite &= table.draw(t, logits.to(device), request, by_params)
                table.copy_rows(t, self._copied_at(t, batch))
                forwards += 1
            table.end_rows(t, self.eos_ids)
        return Proposal(
            table.tokens.view(batch, rows, length),
            table.laws.view(batch, rows, length, vocab),
            finite,
            list(request.max_lengths),
            forwards=forwards,
            judged_laws=None if table.judged is None else table.judged.view(batch, rows, length, vocab),
        )

    def _copied_at(self, t: int, batch: int) -> tuple[list[int], list[int]]:
        """The rows of every sequence (indices into ``[B K]``) that copy a token at ``t``, and the rows they copy."""
        rows, copying = self.rows, [copy for copy in self.copies if t < copy.tokens]
        return (
            [b * rows + copy.row for b in range(batch) for copy in copying],
            [b * rows + copy.source for b in range(batch) for copy in copying],
        )

    def _rows_by_params(self) -> list[tuple[SamplingParams, list[int]]]:
        """Rows that share sampling settings, so each settings' law is computed in one call."""
        grouped: dict[SamplingParams, list[int]] = {}
        for row, params in enumerate(self.row_params):
            grouped.setdefault(params, []).append(row)
        return list(grouped.items())


@dataclass(frozen=True)
class _Copy:
    """A row that carries another row's first tokens (``branch_after``): its entry's first row, ``source``."""

    row: int
    source: int
    tokens: int  # how many of a block's first tokens it copies

    def shifted(self, offset: int) -> _Copy:
        """The same copy once its entry's rows come after ``offset`` rows of other entries (a joined drafter)."""
        return _Copy(self.row + offset, self.source + offset, self.tokens)


@dataclass
class _DraftTable:
    """A block's draft rows as they are drawn, position after position: every sequence's K rows, ``B K`` in all."""

    tokens: torch.Tensor  # [B K, n]
    laws: torch.Tensor  # [B K, n, V]: the law each token was drawn from
    judged: torch.Tensor | None  # [B K, n, V]: the laws a verifier judges drafts by, where the request asks for them
    ended: torch.Tensor  # [B K] bool: the row has drafted an EOS

    @classmethod
    def empty(cls, rows: int, length: int, vocab: int, device: torch.device, judged: bool) -> _DraftTable:
        laws = torch.empty(rows, length, vocab, device=device)  # [B K, n, V]
        return cls(
            torch.empty(rows, length, dtype=torch.long, device=device),  # [B K, n]
            laws,
            torch.empty_like(laws) if judged else None,  # [B K, n, V]
            torch.zeros(rows, dtype=torch.bool, device=device),  # [B K]
        )

    def draw(
        self, t: int, logits: torch.Tensor, request: DraftRequest, by_params: list[tuple[SamplingParams, list[int]]]
    ) -> torch.Tensor:
        """Position ``t`` of every row from its ``logits`` ``[B K, V]``: the law under its entry's settings (rows
        ``by_params``), the judged law where asked, and the token drawn with its uniform → whether the rows that
        have not ended drew from finite logits ``[]`` (an ended row's logits go unused)."""
        finite = torch.ones((), dtype=torch.bool, device=logits.device)  # []
        for params, same in by_params:
            law, row_finite = request.sampling_law(logits[same], params)  # [rows', V], [rows']
            self.laws[same, t] = law
            finite &= (row_finite | self.ended[same]).all()
            if self.judged is not None:
                self.judged[same, t] = request.sampling_law(logits[same], judged_params(params, request.judged_view))[0]
        self.tokens[:, t] = sample_with(self.laws[:, t], request.uniforms[:, t].reshape(-1))
        return finite

    def copy_rows(self, t: int, copied: tuple[list[int], list[int]]) -> None:
        """Rows ``copied[0]`` carry the tokens of rows ``copied[1]`` at ``t`` (indices into ``[B K]``), under the
        one-hot law: a copy's law given the rows before it, whatever its own forward drew."""
        rows, sources = copied
        if not rows:
            return
        self.tokens[rows, t] = self.tokens[sources, t]
        copies = one_hot_laws(self.tokens[rows, t], self.laws.shape[-1]).to(self.laws.dtype)  # [copies, V]
        for laws in self._law_tables():
            laws[rows, t] = copies

    def _law_tables(self) -> tuple[torch.Tensor, ...]:
        """The laws reported beside the tokens: the sampling laws, and the judged ones where asked."""
        return (self.laws,) if self.judged is None else (self.laws, self.judged)

    def end_rows(self, t: int, eos_ids: torch.Tensor) -> None:
        """Rows that ended before ``t`` repeat their EOS there, under a one-hot law (whatever their forward drew, or
        none ran); rows whose token at ``t`` is one of ``eos_ids`` ``[ids]`` end. On the device: no read."""
        if t:
            previous = self.tokens[:, t - 1]  # [B K]
            self.tokens[:, t] = torch.where(self.ended, previous, self.tokens[:, t])
            repeated = one_hot_laws(previous, self.laws.shape[-1]).to(self.laws.dtype)  # [B K, V]
            for laws in self._law_tables():
                laws[:, t] = torch.where(self.ended.view(-1, 1), repeated, laws[:, t])
        self.ended |= torch.isin(self.tokens[:, t], eos_ids)
