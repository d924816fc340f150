"""The drafter contract, where plugin authors import it.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.plugins.drafting`
"""

from __future__ import annotations

from .plugins.drafting import (
    Drafter,
    DraftRequest,
    DraftSetup,
    Proposal,
    SequenceDrafter,
    SequenceProposal,
    SequenceRequest,
    block_length,
    empty_proposal,
    one_hot_laws,
)

__all__ = [
    "DraftRequest",
    "DraftSetup",
    "Drafter",
    "Proposal",
    "SequenceDrafter",
    "SequenceProposal",
    "SequenceRequest",
    "block_length",
    "empty_proposal",
    "one_hot_laws",
]
