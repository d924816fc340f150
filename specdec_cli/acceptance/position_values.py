"""Per-position values of one acceptance row: a verifier's acceptance over the rows that proposed
(:func:`_acceptance`), with the exact rule's at the first ``exact_first`` positions (:func:`_exact_first`), and the
optimum of any lossless rule (:func:`_optimum`)."""

from __future__ import annotations

import torch

from ..base.errors import SpecdecError
from ..base.theory import MAX_TWO_DRAFT_SUPPORT, optimal_acceptance, optimal_acceptance_two_drafts, two_draft_support
from ..plugins.verifiers import BlockVerifier, JudgedLaws, judged_argument
from .proposing import _ProposingRows


def _acceptance(
    verifier: BlockVerifier,
    laws: tuple[torch.Tensor, torch.Tensor, JudgedLaws],
    refusal: str | None,
    groups: _ProposingRows,
) -> tuple[list[float] | None, str]:
    """(acceptance at each position, or None and why) for ``laws``: target ``[T, V]``, drafts ``[T, K, V]`` and the
    two the verifier judges drafts by (or None), over the rows that proposed at each position (``groups``)."""
    target, drafts, judged = laws
    if not verifier.token_level:
        return (
            None,
            f"{verifier.name} decides whole blocks: a per-token acceptance is not defined (compare it with bench)",
        )
    if refusal is not None:
        return None, refusal
    try:
        return groups.values(
            lambda q, p, _kept, laws: (verifier.acceptance_probability(q, p, **judged_argument(laws)), ""),
            target,
            drafts,
            judged,
        )
    except SpecdecError as error:
        return None, str(error)


def _exact_first(
    values: list[float], exact: tuple[list[float] | None, str], first: int
) -> tuple[list[float] | None, str]:
    """A lossy row's ``values`` at each position with the exact rule's (``exact``: its values, or None and why) at
    the first ``first``: what a run with ``speculation.exact_first`` accepts there. None and why where the exact rule
    has no value."""
    exact_values, reason = exact
    if exact_values is None:
        return None, f"exact first {first}: {reason}"
    return exact_values[:first] + values[first:], ""


def _optimum(target: torch.Tensor, drafts: torch.Tensor, identical: bool) -> tuple[torch.Tensor | None, str]:
    """The optimum at each position ``[T]`` for target ``[T, V]`` and drafts ``[T, K, V]``, or why it is not given."""
    num_drafts = drafts.shape[1]
    if identical:
        return optimal_acceptance(target, drafts[:, 0], num_drafts), ""
    if num_drafts > 2:
        return None, "not computed for K > 2 different drafts (exact here for identical drafts and for K = 2)"
    support = int(two_draft_support(drafts[:, 0], drafts[:, 1]).max())
    if support > MAX_TWO_DRAFT_SUPPORT:
        return None, (
            f"not computed: the two different drafts share up to {support} tokens, and the exact optimum "
            f"for different drafts takes at most {MAX_TWO_DRAFT_SUPPORT} (restrict sampling, e.g. --top-k 50)"
        )
    values = [float(optimal_acceptance_two_drafts(q, p[0], p[1])) for q, p in zip(target, drafts)]
    return torch.tensor(values, dtype=torch.float64), ""
