"""Exact enumeration of draft rows that share a prefix: the model drafter's ``branch_after: d``, where the first row
draws a block's first d tokens, every row carries them, and then each row draws its own continuation.

The rows' joint law is then not a product of per-row laws, so the kit's enumeration over independent rows
(:func:`~specdec_cli.kit.testing.enumerate_block_law`) does not reach them. Here the delayed process itself is
enumerated on a 3-token vocabulary with L = 3, each row reporting its law given the rows before it (a copy's
one-hot law at the tokens it copied, as the model drafter reports them), and :func:`largest_gap` measures how far
the law of what one block commits, followed by the target alone, is from the target's own law.
:func:`~specdec_cli.kit.conformance.check_verifier` holds every verifier that declares ``dependent_drafts`` to a gap
of zero; tests/test_branch_after.py runs the same enumeration with its negative controls (copies reported under the
draft's law; a rule for independent rows).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from ..plugins.drafting import one_hot_laws
from .testing import SequenceLaw, _complete, decision_outcomes, random_sequence_laws, target_sequence_law

__all__ = ["LENGTH", "VOCAB", "committed_law", "delayed_blocks", "largest_gap", "reported_laws"]

VOCAB, LENGTH = 3, 3  # K = 3 rows branching after 1 token: 3^7 draft blocks


def delayed_blocks(
    draft_law: SequenceLaw, num_rows: int, branch_after: int
) -> Iterator[tuple[list[tuple[int, ...]], float]]:
    """Every draft block (``num_rows`` rows of L tokens) of the delayed-branch process with its probability: row 1
    draws the first ``branch_after`` tokens, every row carries them, then each row draws its own continuation."""
    tail = LENGTH - branch_after
    for shared in itertools.product(range(VOCAB), repeat=branch_after):
        for continuations in itertools.product(range(VOCAB), repeat=num_rows * tail):
            rows = [shared + continuations[k * tail : (k + 1) * tail] for k in range(num_rows)]
            draws = [(rows[0], t) for t in range(branch_after)]
            draws += [(row, t) for row in rows for t in range(branch_after, LENGTH)]
            weight = math.prod(float(draft_law(row[:t])[row[t]]) for row, t in draws)
            if weight > 0:
                yield rows, weight


def reported_laws(
    draft_law: SequenceLaw, rows: list[tuple[int, ...]], branch_after: int, copies_as_drawn: bool = False
) -> torch.Tensor:
    """The laws ``[K, L, V]`` the drafter reports: a copy's one-hot law at its copied tokens (its law given the rows
    before it), or, with ``copies_as_drawn`` (a negative control), the draft law the copied token came from."""
    laws = torch.stack([torch.stack([draft_law(row[:t]) for t in range(LENGTH)]) for row in rows])  # [K, L, V]
    if not copies_as_drawn:
        copied = torch.tensor([row[:branch_after] for row in rows[1:]]).view(len(rows) - 1, branch_after)  # [K-1, d]
        laws[1:, :branch_after] = one_hot_laws(copied, VOCAB).to(laws.dtype)
    return laws


def committed_law(
    verifier: Any,
    target_law: SequenceLaw,
    draft_law: SequenceLaw,
    num_rows: int,
    branch_after: int,
    copies_as_drawn: bool = False,
) -> dict[tuple[int, ...], float]:
    """The exact law of the tokens one block commits (its ``block_law``), summed over every delayed-branch block."""
    outcomes: dict[tuple[int, ...], float] = {}
    for rows, weight in delayed_blocks(draft_law, num_rows, branch_after):
        target_probs = torch.stack([torch.stack([target_law(row[:t]) for t in range(LENGTH + 1)]) for row in rows])
        draft_probs = reported_laws(draft_law, rows, branch_after, copies_as_drawn)  # [K, L, V]
        block = verifier.block_law(target_probs, draft_probs, torch.tensor(rows))  # [K, L+1, V]
        for sequence, mass in decision_outcomes(block, torch.tensor(rows)).items():
            outcomes[sequence] = outcomes.get(sequence, 0.0) + weight * mass
    return outcomes


def largest_gap(verifier: Any, num_rows: int, branch_after: int, copies_as_drawn: bool = False) -> float:
    """The largest gap, over sequences of L + 1 tokens, between the law of one block's committed tokens followed by
    the target's own and the target's law, on seeded random laws (0 up to rounding for an exact rule)."""
    generator = torch.Generator().manual_seed(1)
    target_law, draft_law = (random_sequence_laws(generator, VOCAB, LENGTH + 1).__getitem__ for _ in range(2))
    committed = committed_law(verifier, target_law, draft_law, num_rows, branch_after, copies_as_drawn)
    through_block = _complete(committed, target_law, VOCAB, LENGTH + 1)  # committed prefixes, then the target's own
    exact = target_sequence_law(target_law, VOCAB, LENGTH + 1)
    return max(
        abs(through_block.get(sequence, 0.0) - exact.get(sequence, 0.0))
        for sequence in itertools.product(range(VOCAB), repeat=LENGTH + 1)
    )
