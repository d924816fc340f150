"""Mentored decoding's two exact solvers (issue #20 §2): the device path (one sort, a fixed number of
operations, no host read, one graph) and the CPU path (set steps that read the device), checked
against each other and against a high-precision reference (specdec_plugins/mentored.py)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.engine.device_path import OperationCount
from specdec_cli.kit.testing import random_distributions
from specdec_cli.plugins.registry import load_verifier
from specdec_cli.plugins.verifiers import device_path
from specdec_plugins import _mentored_sets as mentored_sets
from specdec_plugins import _mentored_solve as mentored
from specdec_plugins import _mentored_sorted as mentored_sorted

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ("peaked", "near_one_token", "one_token_equal", "equal", "sparse", "disjoint")


def block(kind: str, draft_length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[L+1, V]``, p ``[L, V]`` and draft tokens ``[L]`` drawn from p, of one kind of law."""
    generator = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(draft_length + 1, vocab, generator=generator) * 3  # [L+1, V]
    noise = torch.randn(draft_length, vocab, generator=generator)  # [L, V]
    draft_logits = {
        "peaked": target_logits[:-1] + noise,
        "near_one_token": (target_logits[:-1] + 0.1 * noise) * 12,  # T = 0.3-like: almost all mass on one token
        "one_token_equal": target_logits[:-1] * 1e4,  # q = p, both one-hot in float32
        "equal": target_logits[:-1],
        "sparse": target_logits[:-1] + noise,
        "disjoint": -3 * target_logits[:-1],
    }[kind]
    target_logits = target_logits * {"near_one_token": 12, "one_token_equal": 1e4}.get(kind, 1)
    if kind == "sparse":  # top-k on both: zero-q draft tokens and p = 0 < q tokens
        target_logits = _top_k(target_logits, vocab // 2)
        draft_logits = _top_k(draft_logits, vocab // 2)
    target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)  # [L+1, V], [L, V]
    if kind in ("equal", "one_token_equal"):
        target = torch.cat([draft, target[-1:]])
    tokens = torch.multinomial(draft, 1, generator=generator).squeeze(-1)  # [L]
    return target, draft, tokens


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.masked_fill(logits < logits.topk(k, -1).values[..., -1:], -math.inf)


def _decisions(bound: float, lazy: bool, vocab: int = 40, draft_length: int = 5) -> list[tuple[int, ...]]:
    """Committed tokens of many blocks (every kind, several keyed draws and one generator each)."""
    decided = []
    for seed, kind in enumerate(KINDS * 2):
        q, p, x = block(kind, draft_length, vocab, seed)
        for randomness in (
            Draws.create(key=seed, block_start=0),
            Draws.create(key=seed, block_start=9),
            torch.Generator().manual_seed(seed),
        ):
            decision = mentored.verify(q, p, x, bound, randomness, lazy=lazy)
            decided.append(tuple(decision.tokens[: int(decision.num_accepted) + 1].tolist()))
    return decided


@pytest.mark.parametrize("bound", [0.0, 0.02, 0.3, 3.0])
def test_the_device_path_and_the_cpu_path_decide_alike(bound):
    assert _decisions(bound, lazy=False) == _decisions(bound, lazy=True)


def test_the_comparison_of_decisions_has_power():
    """Negative control: another bound changes some decisions with the same draws."""
    assert _decisions(0.02, lazy=True) != _decisions(0.3, lazy=True)


def _counts(bound: float, lazy: bool = False) -> set[tuple[int, int]]:
    """(operations, reads) of one verify_block per block: two vocabularies, every kind of law."""
    verifier = load_verifier("mentored", {"kl": bound})
    counts = set()
    for vocab in (64, 3000):
        for seed, kind in enumerate(KINDS):
            q, p, x = block(kind, 8, vocab, seed)
            draws = Draws.create(key=seed, block_start=3)
            with torch.inference_mode(), OperationCount() as count, nullcontext() if lazy else device_path():
                verifier.verify_block(q[None], p[None], x[None], draws)
            counts.add((count.ops, count.reads))
    return counts


@pytest.mark.parametrize("bound", [0.0, 0.3])
def test_the_device_path_dispatches_a_fixed_number_of_operations_and_reads_nothing(bound):
    counts = _counts(bound)
    assert len(counts) == 1, counts
    assert next(iter(counts))[1] == 0


def test_the_operation_counter_sees_the_cpu_paths_data_dependent_work():
    """Negative control: the CPU path solves only the positions it must, so its count varies."""
    assert len(_counts(0.3, lazy=True)) > 1


def test_the_device_path_traces_into_one_graph():
    q, p, x = block("sparse", 4, 32, 0)
    verifier = load_verifier("mentored", {"kl": 0.3})
    explained = torch._dynamo.explain(verifier.verify_block)(q[None], p[None], x[None], Draws.create(key=1))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    # Negative control: the CPU path reads the device, and dynamo breaks the graph there.
    lazily = torch._dynamo.explain(mentored.verify)(q, p, x, 0.3, Draws.create(key=1), lazy=True)
    assert lazily.graph_break_count > 0


# ------------------------------------------------------------------ exactness against a reference


def _reference(q: list[float], p: list[float], bound: float):
    """(ρ, α, β) with KL(q ‖ π) = D to 30 digits, by bisection on ρ; α(ρ) and β(ρ) by trying every
    group of smallest (largest) ratios, KL as Σ q ln clip(q/p, α, β): none of the solvers' algebra."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(30):  # not mp.dps: a global setting would leak into other modules' references
        q = [mpmath.mpf(v) / mpmath.fsum(map(mpmath.mpf, q)) for v in q]
        p = [mpmath.mpf(v) / mpmath.fsum(map(mpmath.mpf, p)) for v in p]
        live = [i for i in range(len(q)) if q[i] > 0 or p[i] > 0]
        ratio = {i: (q[i] / p[i] if p[i] > 0 else mpmath.inf) for i in live}

        def threshold(rho, below: bool):
            """α (below) or β at rejected mass ρ: the group whose closed form lands between its neighbours."""
            order = sorted(live, key=lambda i: ratio[i], reverse=not below)
            for size in range(1, len(order) + 1):
                group, rest = order[:size], order[size:]
                mass_q, mass_p = mpmath.fsum(q[i] for i in group), mpmath.fsum(p[i] for i in group)
                room = mass_p - rho if below else mass_p + rho  # > 0 for the group to hold the rejected mass
                value = mass_q / room if room > 0 else mpmath.inf
                inside = all((ratio[i] <= value) if below else (ratio[i] >= value) for i in group)
                if inside and all((ratio[i] > value) if below else (ratio[i] < value) for i in rest):
                    return value
            return mpmath.mpf(1)

        def kl(rho):
            alpha, beta = threshold(rho, True), threshold(rho, False)
            return mpmath.fsum(q[i] * mpmath.log(min(max(ratio[i], alpha), beta)) for i in live if q[i] > 0)

        low, high = mpmath.mpf(0), mpmath.fsum(max(p[i] - q[i], 0) for i in live)
        for _ in range(120):
            middle = (low + high) / 2
            low, high = (middle, high) if kl(middle) >= bound else (low, middle)
        return float(low), float(threshold(low, True)), float(threshold(low, False))


def _tiny_laws():
    generator = torch.Generator().manual_seed(4)
    for vocab in (2, 3, 5, 6):
        for sparsity in (0.0, 0.3):
            target, draft = random_distributions(generator, (2, 4, vocab), sparsity=sparsity)  # [4, V] each
            yield target, draft


@pytest.mark.parametrize("lazy", [False, True])
def test_alpha_and_beta_match_a_high_precision_reference(lazy):
    checked = 0
    for target, draft in _tiny_laws():
        for bound in (1e-3, 0.05, 0.4):
            solution = mentored.solve(target, draft, bound, lazy=lazy)
            for row in range(target.shape[0]):
                rho = float(solution.rejected_mass[row])
                if rho < 1e-12:  # accepted outright (KL(q ‖ p) ≤ D), or a root below what float64 resolves
                    continue
                expected = _reference(target[row].tolist(), draft[row].tolist(), bound)
                found = (rho, float(solution.alpha[row]), float(solution.beta[row]))
                assert found == pytest.approx(expected, rel=1e-9, abs=1e-14), (target[row], draft[row], bound)
                checked += 1
    assert checked >= 40


def test_the_reference_sees_a_wrong_bound():
    """Negative control: the reference's root moves with D by far more than the tolerance above."""
    target, draft = next(iter(_tiny_laws()))
    solution = mentored.solve(target, draft, 0.05, lazy=True)
    row = int(solution.rejected_mass.squeeze(-1).argmax())
    assert float(solution.rejected_mass[row]) != pytest.approx(
        _reference(target[row].tolist(), draft[row].tolist(), 0.05 * 1.001)[0], rel=1e-9
    )


def _bound_misses(vocabularies=(2, 3, 50, 1000)) -> float:
    """The device path's largest relative miss |KL(q ‖ π) - D| / D, and its rejected mass's against the
    CPU path's, over dense and sparse laws, peaked or flat, and bounds from 1e-6 to 3 nats."""
    generator = torch.Generator().manual_seed(12)
    worst = 0.0
    for vocab in vocabularies:
        for sparsity, sharpness in ((0.0, 1.0), (0.3, 3.0)):
            target = (random_distributions(generator, (6, vocab), sparsity=sparsity).log() * sharpness).softmax(-1)
            draft = random_distributions(generator, (6, vocab), sparsity=sparsity / 3)
            for bound in (1e-6, 1e-3, 0.1, 1.0, 3.0):
                on_device, on_cpu = (mentored.solve(target, draft, bound, lazy=lazy) for lazy in (False, True))
                solved = (on_cpu.rejected_mass > 1e-250).squeeze(-1)  # [6]: within float64's reach
                kl_miss = ((on_device.kl - bound).abs() / bound).squeeze(-1)[solved]
                rho_miss = ((on_device.rejected_mass - on_cpu.rejected_mass).abs() / on_cpu.rejected_mass).squeeze(-1)
                worst = max(
                    [worst, *kl_miss.tolist(), *rho_miss[solved & (on_cpu.rejected_mass > 1e-12).squeeze(-1)].tolist()]
                )
    return worst


def test_the_device_path_meets_the_bound_to_rounding():
    assert _bound_misses() < 1e-9


def test_the_bound_check_sees_a_root_left_unfinished(monkeypatch):
    """Negative control: without the Newton steps the grid alone leaves the root 1e-7 short."""
    monkeypatch.setattr(mentored_sorted, "_NEWTON_STEPS", 0)
    assert _bound_misses(vocabularies=(3, 1000)) > 1e-9


def test_the_device_path_meets_the_bound_where_a_q_mass_below_the_rounding_of_p_meets_the_turn():
    """A token with q ≈ 6e-18 but most of the draft's mass: at the turn (α = 1) P_low - ρ rounds to 0, not to
    Q_low. KL there must read as ~0 (< D), not ∞ (≥ D), or the root is bracketed past the turn; the
    sorted solve before issue #20's budget rewrite returned NaN at D = 1e-6 and missed D by 2 % at 1e-2."""
    tiny = 6e-18
    target = torch.tensor([[1 - 1.3e-3 - tiny, tiny, 1.3e-3], [1 - tiny, tiny, 0.0]], dtype=torch.float64)
    draft = torch.tensor([[0.31, 0.69, 2.6e-4], [0.2, 0.8, 0.0]], dtype=torch.float64)
    for bound in (1e-6, 1e-4, 1e-2):
        on_device, on_cpu = (mentored.solve(target, draft, bound, lazy=lazy) for lazy in (False, True))
        assert ((on_device.kl - bound).abs() / bound < 1e-9).all(), (bound, on_device.kl)
        assert torch.allclose(on_device.rejected_mass, on_cpu.rejected_mass, rtol=1e-12, atol=0)


# ------------------------------------------------------------------ rows that need no solve


@pytest.mark.parametrize("lazy", [False, True])
def test_rows_within_the_bound_q_equal_p_and_one_token_laws_are_accepted_outright(lazy):
    one_hot = torch.zeros(4, 50).index_fill_(-1, torch.tensor([7]), 1.0)  # [4, V]: one-token laws, q = p
    near = torch.full((4, 50), 1e-9).index_fill_(-1, torch.tensor([7]), 1.0)  # KL(q ‖ p) ≈ 5e-8
    close = random_distributions(torch.Generator().manual_seed(1), (4, 50), sparsity=0.0)  # [4, V]
    for target, draft in ((one_hot, one_hot), (one_hot, near), (close, close)):
        solution = mentored.solve(target, draft, 0.01, lazy=lazy)
        fields = (solution.thresholds, solution.rejected_mass, solution.kl, solution.zero_q_acceptance)
        assert not any(field.isnan().any() for field in fields)
        assert (solution.rejected_mass == 0).all()
        assert (solution.acceptance_of(torch.arange(50).expand(4, -1)) == 1).all()
    # Negative control: the same check fails on a row outside the bound.
    far = mentored.solve(one_hot, close, 0.01, lazy=lazy)
    assert (far.acceptance_of(torch.arange(50).expand(4, -1)) < 1).any()


def test_a_draft_tail_below_the_rounding_of_its_sum_does_not_block_outright_acceptance():
    """p = 4e-17 on the target's 3e-3: Σ p over that tail rounds to 0, so the sorted sums see p missing q's
    support (KL = ∞ at ρ = 0), yet KL(q ‖ p) = 0.093 ≤ D: every draft token is accepted on both paths."""
    target = torch.tensor([[0.5, 0.497, 3e-3]], dtype=torch.float64)
    draft = torch.tensor([[0.5, 0.5 - 4e-17, 4e-17]], dtype=torch.float64)
    for lazy in (False, True):
        solution = mentored.solve(target, draft, 0.3, lazy=lazy)
        assert float(solution.rejected_mass) == 0
        assert (solution.acceptance_of(torch.arange(3).view(1, 3)) == 1).all()
    # Negative control: below that KL the same law needs a solve.
    assert float(mentored.solve(target, draft, 0.05, lazy=False).rejected_mass) > 0


def test_the_cpu_path_accepts_outright_where_the_root_is_below_float64s_range(monkeypatch):
    """Target mass 1e-40 where p = 0 (float32 underflow at T = 0.3): KL(q ‖ p) = ∞, but the root ρ ~ e^-1e39
    is 0 in float64, so the CPU path accepts outright, with no set step or sort (at V = 128k they do not
    settle: 80 ms a block), as the device path ends at ρ = 0; with 1e-3 there the root (~1e-116) is solved
    on both paths."""
    generator = torch.Generator().manual_seed(2)
    target = random_distributions(generator, (2, 200), sparsity=0.0)  # [2, V]
    noise = 0.3 * torch.randn(2, 200, generator=generator)  # [2, V]
    draft = (target.log() + noise).softmax(-1)  # KL(q ‖ p) ≈ 0.04 on the rest
    draft[:, :5] = 0.0
    target[:, :5] = torch.tensor([[1e-40], [1e-3]], dtype=target.dtype) / 5
    monkeypatch.setattr(mentored_sets._Groups, "segments", None)  # no set step on the CPU path,
    monkeypatch.setattr(mentored_sets, "_SortedTable", None)  # nor a sort
    on_cpu = mentored.solve(target[:1], draft[:1], 0.3, lazy=True)
    assert float(on_cpu.rejected_mass) == 0 and (on_cpu.acceptance_of(torch.arange(200).view(1, -1)) == 1).all()
    monkeypatch.undo()
    on_device = mentored.solve(target, draft, 0.3, lazy=False)
    assert (on_device.acceptance_of(torch.arange(200).expand(2, -1))[0] == 1).all()
    solved = mentored.solve(target[1:], draft[1:], 0.3, lazy=True)
    assert 0 < float(solved.rejected_mass) == pytest.approx(float(on_device.rejected_mass[1]), rel=1e-9)


def _groups_near(threshold: float, offsets: list[float]) -> tuple[mentored_sets._Groups, float]:
    """One row whose ratios t = q/p sit at ``threshold`` × (1 + offset) for each offset, and at 1/16 and 16,
    and the scale its renormalisation divides them by."""
    ratios = torch.tensor([threshold * (1 + offset) for offset in offsets] + [1 / 16, 16.0], dtype=torch.float64)
    draft = torch.full_like(ratios, 1 / len(ratios))  # [V]
    target = draft * ratios  # [V]: renormalising scales every ratio alike
    groups = mentored_sets._Groups(target.unsqueeze(0), draft.unsqueeze(0))
    scale = float(target.sum())
    return groups, scale


def test_the_float32_check_sees_a_token_between_two_thresholds():
    """A token whose float64 ratio lies between the old and the new α (or β), even within 1e-9 of one, means
    the groups moved; none between (every ratio a 1e-4 away) means they did not."""
    for threshold in (0.4, 2.5):
        groups, scale = _groups_near(threshold, [1e-9])
        at = threshold / scale  # the planted token's ratio after renormalisation
        low, high = at * (1 - 1e-7), at * (1 + 1e-7)
        moved = [[low, 2.0], [high, 2.0]] if threshold < 1 else [[0.5, low], [0.5, high]]
        assert not groups.same_groups(0, *moved)
        far, _ = _groups_near(threshold, [1e-4])
        assert far.same_groups(0, *moved)  # negative control: the same thresholds with no token between them


def test_the_float32_check_answers_no_outside_float32s_range():
    groups, _ = _groups_near(0.4, [0.5])
    assert groups.same_groups(0, [0.3, 2.0], [0.3, 2.0])
    assert not groups.same_groups(0, [1e-300, 2.0], [1e-300, 2.0])
    assert not groups.same_groups(0, [0.3, 1e300], [0.3, 1e300])


def test_the_float32_steps_only_bring_the_sets_near_the_root(monkeypatch):
    """The float64 steps settle the root alone: skipping the float32 steps, or making them stop at once,
    changes no decision of the CPU path."""
    expected = _decisions(0.1, lazy=True)
    monkeypatch.setattr(mentored_sets, "_COARSE_TOLERANCE", 1.0)
    assert _decisions(0.1, lazy=True) == expected


def test_the_float64_steps_settle_when_the_float32_check_cannot_answer(monkeypatch):
    """A token within the check's margin of the root (common at V = 32k) keeps it answering no; the groups'
    sums repeating must still settle the row, without the sorted fallback (20 ms a solve at V = 128k)."""
    expected = _decisions(0.1, lazy=True)
    monkeypatch.setattr(mentored_sets._Groups, "same_groups", lambda *_: False)
    monkeypatch.setattr(mentored_sets, "_SortedTable", None)
    assert _decisions(0.1, lazy=True) == expected
