"""Which draft rows propose at each position of a continuation, and what: a loaded drafter section
(:class:`_LoadedSection`), a drafter without a model asked as the engine asks it (:func:`_proposed_laws`), and a
prompt's positions grouped by the rows that proposed there (:class:`_ProposingRows`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from ..base.randomness import Draws
from ..engine.decoder import SpeculativeDecoder
from ..engine.decoding import Draft
from ..plugins.draft_rows import DraftRows, round_robin
from ..plugins.verifiers import JudgedLaws

PositionValues = Callable[[torch.Tensor, torch.Tensor, list[int], JudgedLaws], tuple[torch.Tensor | None, str]]
"""(target ``[T', V]``, drafts ``[T', K', V]`` of the rows that proposed, those rows' places among the K, and the
laws a verifier judges drafts by there, or None) → (a value at each of the T' positions ``[T']``, or None and why
there is none)."""


@dataclass
class _LoadedSection:
    """A drafter section with its entries loaded."""

    drafter: str | None
    drafts: list[Draft]
    laws: list[Hashable]
    """Each entry's law key (as the engine keys its rows: equal keys, equal laws)."""
    proposers: dict[int, SpeculativeDecoder]
    """Entry index → a decoder whose one drafter is that entry's, set up by the engine (entries without a model)."""

    def choice(self, num_drafts: int) -> list[int]:
        """The entry of each of K = ``num_drafts`` rows, taken in turn."""
        return [k % len(self.drafts) for k in range(num_drafts)]

    def rows(self, num_drafts: int) -> DraftRows:
        return round_robin(self.laws, num_drafts)


@dataclass(frozen=True)
class _ProposingRows:
    """A prompt's positions grouped by which of the K rows proposed there: few patterns, since a row with a model
    always proposes and a row without one either does or not."""

    positions: int
    groups: list[tuple[torch.Tensor, torch.Tensor]]
    """(positions ``[T']``, rows ``[K']``) of each pattern in which at least one row proposed."""

    @classmethod
    def of(cls, proposed: torch.Tensor) -> _ProposingRows:
        """From where each row proposed ``[T, K]``."""
        patterns, inverse = torch.unique(proposed, dim=0, return_inverse=True)  # [P, K], [T]
        groups = [
            ((inverse == number).nonzero().squeeze(-1), pattern.nonzero().squeeze(-1))
            for number, pattern in enumerate(patterns)
            if bool(pattern.any())
        ]
        return cls(proposed.shape[0], groups)

    def values(
        self, value: PositionValues, target: torch.Tensor, drafts: torch.Tensor, judged: JudgedLaws = None
    ) -> tuple[list[float] | None, str]:
        """``value`` over the rows that proposed at each position, for target ``[T, V]``, drafts ``[T, K, V]`` and the
        laws a verifier judges drafts by (shaped as those two, or None); 0 where no row proposed (the block is the
        target's own token: nothing is accepted). None and why where ``value`` gives none for some group."""
        result = torch.zeros(self.positions, dtype=torch.float64, device=target.device)  # [T]
        for positions, rows in self.groups:
            laws = _taken(judged, positions, rows)
            values, reason = value(target[positions], drafts[positions][:, rows], rows.tolist(), laws)  # [T']
            if values is None:
                return None, reason
            result[positions] = values.to(result)
        return result.tolist(), ""

    def laws(
        self,
        law: Callable[[torch.Tensor, torch.Tensor, JudgedLaws], torch.Tensor | None],
        target: torch.Tensor,
        drafts: torch.Tensor,
        judged: JudgedLaws = None,
    ) -> torch.Tensor | None:
        """The output law ``law`` gives over the rows that proposed at each position ``[T, V]``, for target ``[T, V]``,
        drafts ``[T, K, V]`` and the laws a verifier judges drafts by (or None): q where no row proposed (the
        target's own token); None where ``law`` gives none."""
        result = target.clone()  # [T, V]
        for positions, rows in self.groups:
            values = law(target[positions], drafts[positions][:, rows], _taken(judged, positions, rows))  # [T', V]
            if values is None:
                return None
            result[positions] = values.to(result)
        return result

    @property
    def proposed(self) -> torch.Tensor:
        """The positions where some row proposed ``[P]`` (int64)."""
        found = [positions for positions, _ in self.groups]
        return torch.cat(found) if found else torch.zeros(0, dtype=torch.long)


def _proposed_laws(
    decoder: SpeculativeDecoder, prompt_ids: list[int], tokens: list[int], key: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``decoder``'s one drafter (no model) proposes after each prefix of the target's continuation ``tokens``,
    asked through the engine's draft step (:class:`~specdec_cli.engine.block_steps.DraftStep`), as a run asks it:
    started on the prompt, then at each position a block of one token with the sample's keyed uniforms, of whose row
    nothing is committed. → the law of its first token ``[T, V]`` (zeros where it proposed nothing) and where it
    proposed ``[T]``."""
    step, device = decoder.steps.draft, decoder.device
    context = decoder.target.decoder_start_ids if decoder.target.is_encoder_decoder else list(prompt_ids)
    step.reset()
    step.start([prompt_ids], [context], None)
    draws = Draws.batch([key], device)
    laws = torch.zeros(len(tokens), decoder.vocab_size, dtype=torch.float64, device=device)  # [T, V]
    proposed = torch.zeros(len(tokens), dtype=torch.bool, device=device)  # [T]
    for position, token in enumerate(tokens):
        draws.block_start.fill_(position)
        drafted, _ = step.propose([context], [1], draws, decoder.steps.sampling_law, None)
        decoder.guards.check_block_flags(step.drafters, True, drafted.finite.tolist(), drafted.in_vocab.tolist())
        if drafted.lengths[0]:
            laws[position], proposed[position] = drafted.laws[0, 0, 0], True
        step.keep([[0]], [[len(context)]])
        context.append(token)  # committed in place, as the engine commits a block
    return laws, proposed


def _taken(judged: JudgedLaws, positions: torch.Tensor, rows: torch.Tensor) -> JudgedLaws:
    """Judged laws (target ``[T, V]``, drafts ``[T, K, V]``) at ``positions`` ``[T']`` for the draft ``rows``
    ``[K']``, as the sampling laws are taken; None stays None."""
    return None if judged is None else (judged[0][positions], judged[1][positions][:, rows])
