"""Expected accepted length per block of every verifier, exactly, on tiny random laws (issue #43, items 3 and 4).

For each of ``--law-sets`` random (target, draft) sequence laws over a V-token vocabulary (one draft law for every
row), every draft block of the model drafter's process is enumerated with its probability: K independent rows
(``branch_after`` 0), or one path for the first d tokens that every row carries and K continuations from it
(``branch_after`` d, rows 2..K reporting the one-hot law at their copied tokens, as the drafter does). Each
verifier's ``block_law`` gives the law of what the block commits; the expected number of drafted tokens it keeps
is the figure. Beside it: P(the first drafted position is accepted) and the best any lossless rule can do there,
P*(K') for the K' candidates that position has (K' = K, or 1 under branch_after ≥ 1; Khisti et al., Theorem 3).

The draft blocks number V^(K L) (V^d · V^(K (L − d)) with branch_after d), so K = 4 with independent rows
(4^12 ≈ 16.8 million blocks at V = 4, L = 3) is left out: the table says so.

    PYTHONPATH=. python benchmarks/matched_drafts_exact.py --output benchmarks/results/matched_drafts_cpu --law-sets 6
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec_cli.base.theory import optimal_acceptance
from specdec_cli.kit.testing import SequenceLaw, decision_outcomes, random_sequence_laws
from specdec_cli.plugins.drafting import one_hot_laws
from specdec_cli.plugins.registry import load_verifier

ONE_DRAFT = ("speculative", "block")
INDEPENDENT_ROWS = ("spectr", "is-lp", "is-truncated")
"""Rules that refuse branch_after > 0 (their selection weighs the rows as drawn independently)."""
MANY_DRAFTS = ("specinfer", "spectr", "is-lp", "is-truncated", "traversal")
MAX_BLOCKS = 70_000
"""Draft blocks one (K, branch_after) enumerates at most: more is left out (minutes per verifier and law set)."""


@dataclass(frozen=True)
class Shape:
    vocab: int
    draft_length: int
    num_drafts: int
    branch_after: int

    @property
    def blocks(self) -> int:
        shared = min(self.branch_after, self.draft_length) if self.num_drafts > 1 else 0
        return self.vocab ** (shared + self.num_drafts * (self.draft_length - shared))


@dataclass(frozen=True)
class ExactRow:
    verifier: str
    num_drafts: int
    branch_after: int
    accepted_length: float | None
    """Mean over the law sets of the expected drafted tokens kept per block."""
    accepted_length_min: float | None
    accepted_length_max: float | None
    first_acceptance: float | None
    """Mean over the law sets of P(the first drafted position is accepted)."""
    first_optimum: float | None
    """Mean over the law sets of P*(K') at the first position: no lossless rule accepts it more often."""
    per_law_set: str = ""
    """The expected drafted tokens kept per block on each law set, ';'-separated (to compare rules law set by law
    set)."""
    note: str = ""


def draft_blocks(draft_law: SequenceLaw, shape: Shape) -> Iterator[tuple[list[tuple[int, ...]], float]]:
    """Every draft block (K rows of L tokens) with its probability under the drafter's process."""
    shared_length = min(shape.branch_after, shape.draft_length) if shape.num_drafts > 1 else 0
    tail = shape.draft_length - shared_length
    for shared in itertools.product(range(shape.vocab), repeat=shared_length):
        for continuations in itertools.product(range(shape.vocab), repeat=shape.num_drafts * tail):
            rows = [shared + continuations[k * tail : (k + 1) * tail] for k in range(shape.num_drafts)]
            draws = [(rows[0], t) for t in range(shared_length)]
            draws += [(row, t) for row in rows for t in range(shared_length, shape.draft_length)]
            weight = math.prod(float(draft_law(row[:t])[row[t]]) for row, t in draws)
            if weight > 0:
                yield rows, weight


def reported_laws(draft_law: SequenceLaw, rows: list[tuple[int, ...]], shape: Shape) -> torch.Tensor:
    """The laws ``[K, L, V]`` the drafter reports: a copy's one-hot law at the tokens it carries."""
    laws = torch.stack([torch.stack([draft_law(row[:t]) for t in range(shape.draft_length)]) for row in rows])
    shared_length = min(shape.branch_after, shape.draft_length)
    if shape.num_drafts > 1 and shared_length:
        copied = torch.tensor([row[:shared_length] for row in rows[1:]])  # [K-1, d]
        laws[1:, :shared_length] = one_hot_laws(copied, shape.vocab).to(laws.dtype)  # [K-1, d, V]
    return laws  # [K, L, V]


def kept_tokens(verifier, target_law: SequenceLaw, draft_law: SequenceLaw, shape: Shape) -> tuple[float, float]:
    """(expected drafted tokens kept per block, P(the first drafted position is kept)), summed over every block."""
    expected, first = 0.0, 0.0
    for rows, weight in draft_blocks(draft_law, shape):
        target_probs = torch.stack(
            [torch.stack([target_law(row[:t]) for t in range(shape.draft_length + 1)]) for row in rows]
        )  # [K, L+1, V]
        law = verifier.block_law(target_probs, reported_laws(draft_law, rows, shape), torch.tensor(rows))
        for sequence, mass in decision_outcomes(law, torch.tensor(rows)).items():  # law: [K, L+1, V]
            expected += weight * mass * (len(sequence) - 1)
            first += weight * mass * (len(sequence) > 1)
    return expected, first


def first_optimum(target_law: SequenceLaw, draft_law: SequenceLaw, shape: Shape) -> float:
    """P*(K') at the first position: K' = K candidates, or one when the rows share it (branch_after ≥ 1)."""
    candidates = 1 if shape.branch_after else shape.num_drafts
    return float(optimal_acceptance(target_law(()), draft_law(()), candidates))


def refusal(verifier: str, shape: Shape) -> str:
    """Why the grid has no figure for this cell ("" when it has one)."""
    if verifier in ONE_DRAFT and shape.num_drafts > 1:
        return "takes one draft"
    if verifier in INDEPENDENT_ROWS and shape.branch_after and shape.num_drafts > 1:
        return "refused (needs independent rows)"
    if shape.blocks > MAX_BLOCKS:
        return f"not enumerated ({shape.blocks:,} draft blocks)"
    return ""


def exact_row(verifier: str, shape: Shape, law_sets: list[tuple[SequenceLaw, SequenceLaw]]) -> ExactRow:
    note = refusal(verifier, shape)
    if note:
        return ExactRow(verifier, shape.num_drafts, shape.branch_after, None, None, None, None, None, note=note)
    rule = load_verifier(verifier)
    kept = [kept_tokens(rule, target, draft, shape) for target, draft in law_sets]
    lengths = [length for length, _ in kept]
    optimum = statistics.fmean(first_optimum(target, draft, shape) for target, draft in law_sets)
    first = statistics.fmean(acceptance for _, acceptance in kept)
    return ExactRow(
        verifier,
        shape.num_drafts,
        shape.branch_after,
        statistics.fmean(lengths),
        min(lengths),
        max(lengths),
        first,
        optimum,
        per_law_set=";".join(repr(length) for length in lengths),
    )


def law_sets_of(count: int, vocab: int, draft_length: int, sparsity: float) -> list[tuple[SequenceLaw, SequenceLaw]]:
    """``count`` random (target law, draft law) pairs over every prefix the enumeration visits."""
    pairs = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed)
        target = random_sequence_laws(generator, vocab, draft_length + 1, sparsity)
        draft = random_sequence_laws(generator, vocab, draft_length, sparsity)
        pairs.append((target.__getitem__, draft.__getitem__))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=4)
    parser.add_argument("--draft-length", type=int, default=3)
    parser.add_argument("--law-sets", type=int, default=6)
    parser.add_argument("--sparsity", type=float, default=0.3, help="share of exact zeros in the random laws")
    args = parser.parse_args()
    torch.set_num_threads(1)  # small tensors: one thread, and the shared CPU's other core stays free
    law_sets = law_sets_of(args.law_sets, args.vocab, args.draft_length, args.sparsity)
    rows = [
        exact_row(verifier, Shape(args.vocab, args.draft_length, num_drafts, branch_after), law_sets)
        for branch_after in (0, 2)
        for num_drafts in (1, 2, 4)
        for verifier in (*ONE_DRAFT, *MANY_DRAFTS)
    ]
    args.output.mkdir(parents=True, exist_ok=True)
    with (args.output / "exact_laws.csv").open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


if __name__ == "__main__":
    main()
