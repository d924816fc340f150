"""The engine's guards around plugin code: a drafter's or verifier's exception, a bad proposal or decision, and the
flags of a step's read become one line naming the plugin (its original chained for ``--debug``), while running out of
memory is left to the run's memory guard. Every check here is made on the host without a device read, except
:meth:`PluginGuards.check_block_flags` and :meth:`PluginGuards.check_decision_values`, which judge values the step's
one read brought back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..base.errors import NonFiniteLogitsError, SpecdecError, is_allocation_error
from ..base.sampling import non_finite_message
from ..plugins.drafter_registry import DrafterRegistry
from ..plugins.drafting import Drafter, DraftRequest, Proposal, ProposalError, proposal_problem
from ..plugins.registry import VerifierRegistry, error_line
from ..plugins.verifiers import (
    BatchDecision,
    BlockVerifier,
    DecisionError,
    batch_decision_problem,
    decision_value_problem,
)


@dataclass(frozen=True)
class PluginGuards:
    """The guards of one decoder's plugins: the registries that name their faults, and the vocabulary and device
    their outputs must fit."""

    verifiers: VerifierRegistry
    drafters: DrafterRegistry
    vocab_size: int
    device: torch.device

    def call_drafter(self, drafter: Drafter, what: str, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)`` of ``drafter``: a plugin's exception is its fault, one line (running out of memory is
        not, and reaches the run's memory guard)."""
        return self.drafters.guarded(drafter.name, what, method, *args)

    def checked_proposal(self, drafter: Drafter, request: DraftRequest) -> Proposal:
        """``drafter``'s proposal, checked on the host (no device read): a plugin's exception or a bad proposal is one
        line naming it."""
        try:
            proposal = self.call_drafter(drafter, "propose", drafter.propose, request)
        except ProposalError as error:  # a sequence drafter's own proposal, checked by its base class
            raise self.drafters.fault(drafter.name, str(error)) from None
        problem = proposal_problem(
            proposal, len(request.contexts), drafter.rows, request.max_lengths, self.vocab_size, self.device
        )
        if problem is not None:
            raise self.drafters.fault(drafter.name, problem)
        return proposal

    def guarded_decision(
        self, verifier: BlockVerifier, verify: Callable[..., Any], *inputs: Any, **judged: Any
    ) -> BatchDecision:
        """``verify(*inputs, **judged)`` (``verifier``'s one call, compiled or captured under ``--compile``, and the
        laws it judges by where it asks for them) for a batch of ``inputs[2].shape[0]`` blocks: a plugin's exception
        is its fault, named in one line with the original chained for ``--debug``; running out of memory is not, and
        reaches the run's memory guard. The decision's form is checked on the host (no device read)."""
        try:
            decision = verify(*inputs, **judged)
        except SpecdecError:
            raise
        except DecisionError as error:  # a block rule's decision of the wrong form, as the adapter found it
            raise self.verifiers.fault(verifier.name, str(error)) from None
        except Exception as error:
            if is_allocation_error(error):
                raise
            raise self.verifiers.fault(verifier.name, f"raised {error_line(error)}") from error
        batch, _, length = inputs[2].shape  # draft_tokens [G, K, L]
        problem = batch_decision_problem(decision, batch, length + 1, self.device)
        if problem is not None:
            raise self.verifiers.fault(verifier.name, problem)
        return decision.as_long()

    def check_decision_values(
        self, verifier: BlockVerifier, tokens: list[int], num_accepted: int, row: int, departs: bool, rows: int
    ) -> None:
        """Stop the run, in one line naming ``verifier``, on a decision whose values (read back in the step's read)
        no verifier may return: see :func:`~specdec_cli.verifiers.decision_value_problem`."""
        problem = decision_value_problem(tokens, num_accepted, row, departs, rows, self.vocab_size)
        if problem is not None:
            raise self.verifiers.fault(verifier.name, problem)

    def check_block_flags(
        self, drafters: list[Drafter], target_finite: bool, drafts_finite: list[int], drafts_in_vocab: list[int]
    ) -> None:
        """Stop the run, in one line, on a drafter's token ids outside the vocabulary or on non-finite logits
        (the flags of a step's read, one per drafter of ``drafters``)."""
        for drafter, in_vocab in zip(drafters, drafts_in_vocab):
            if not in_vocab:
                raise self.drafters.fault(
                    drafter.name, f"proposed token ids outside the vocabulary [0, {self.vocab_size})"
                )
        if not target_finite:
            raise NonFiniteLogitsError(non_finite_message("target"))
        for drafter, finite in zip(drafters, drafts_finite):
            if not finite:
                raise NonFiniteLogitsError(non_finite_message(f"draft {drafter.label}"))
