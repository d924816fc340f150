"""The optimum row of `specdec acceptance`: the dual formulas against brute force and an LP over all couplings."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdec_cli.base.theory import optimal_acceptance, optimal_acceptance_two_drafts
from specdec_cli.kit.testing import random_distributions


def _coupling_optimum(target: torch.Tensor, drafts: torch.Tensor) -> float:
    """max P(Z ∈ {X_1..X_K}) over every joint law of (X_1..X_K, Z) with X_k ~ p_k independent and Z ~ q.

    Variables π(z | x̄) for each draft tuple x̄ ∈ V^K and output z: a direct LP (scipy HiGHS).
    """
    from scipy.optimize import linprog

    q, p = target.numpy(), drafts.numpy()  # [V], [K, V]
    vocab, num_drafts = len(q), len(p)
    tuples = list(itertools.product(range(vocab), repeat=num_drafts))
    weight = np.array([np.prod([p[k, x] for k, x in enumerate(xs)]) for xs in tuples])  # P(x̄)
    size = len(tuples) * vocab  # π(z | x̄) at index t * V + z
    gain = np.zeros(size)
    rows_eq, rhs = [], []
    for t, xs in enumerate(tuples):
        for z in set(xs):
            gain[t * vocab + z] = weight[t]
        row = np.zeros(size)
        row[t * vocab : (t + 1) * vocab] = 1  # a conditional law
        rows_eq.append(row)
        rhs.append(1.0)
    marginal = np.zeros((vocab, size))  # the output follows q: P(Z = z) ≤ q(z) for all z forces equality
    for z in range(vocab):
        marginal[z, np.arange(len(tuples)) * vocab + z] = weight
    result = linprog(
        -gain,
        A_ub=marginal,
        b_ub=q + 1e-12,
        A_eq=np.array(rows_eq),
        b_eq=np.array(rhs),
        bounds=(0, None),
        method="highs",
    )
    assert result.status == 0, result.message
    return -result.fun


@pytest.mark.parametrize("num_drafts, vocab", [(2, 3), (2, 4), (3, 3), (4, 3), (3, 2), (4, 2)])
def test_identical_drafts_optimum_equals_the_coupling_lp(num_drafts, vocab):
    generator = torch.Generator().manual_seed(10 * num_drafts + vocab)
    for _ in range(6):
        target, draft = random_distributions(generator, (2, vocab), sparsity=0.2)
        expected = _coupling_optimum(target, draft.expand(num_drafts, -1))
        assert float(optimal_acceptance(target, draft, num_drafts)) == pytest.approx(expected, abs=1e-8)


@pytest.mark.parametrize("vocab", [2, 3, 4])
def test_two_different_drafts_optimum_equals_the_coupling_lp(vocab):
    generator = torch.Generator().manual_seed(vocab)
    for _ in range(6):
        target, first, second = random_distributions(generator, (3, vocab), sparsity=0.2)
        expected = _coupling_optimum(target, torch.stack([first, second]))
        assert float(optimal_acceptance_two_drafts(target, first, second)) == pytest.approx(expected, abs=1e-8)


@pytest.mark.parametrize("vocab", [5, 7, 9])
def test_two_different_drafts_optimum_equals_subset_enumeration(vocab):
    generator = torch.Generator().manual_seed(100 + vocab)
    masks = torch.tensor(list(itertools.product([0.0, 1.0], repeat=vocab)), dtype=torch.float64)  # [2^V, V]
    for _ in range(20):
        target, first, second = random_distributions(generator, (3, vocab), sparsity=0.2)
        brute = 1 + float((masks @ target - (masks @ first) * (masks @ second)).min())
        assert float(optimal_acceptance_two_drafts(target, first, second)) == pytest.approx(brute, abs=1e-12)


def test_a_wrong_optimum_is_rejected_by_the_lp():
    """Negative control: the identical-drafts formula applied to different drafts misses the LP."""
    target = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    first = torch.tensor([0.8, 0.1, 0.1], dtype=torch.float64)
    second = torch.tensor([0.1, 0.1, 0.8], dtype=torch.float64)
    expected = _coupling_optimum(target, torch.stack([first, second]))
    assert float(optimal_acceptance(target, first, 2)) != pytest.approx(expected, abs=1e-3)
    assert float(optimal_acceptance_two_drafts(target, first, second)) == pytest.approx(expected, abs=1e-8)


def test_two_drafts_refuses_a_large_support():
    law = torch.full((200,), 1 / 200, dtype=torch.float64)
    with pytest.raises(ValueError, match="share 200 tokens"):
        optimal_acceptance_two_drafts(law, law, law)
