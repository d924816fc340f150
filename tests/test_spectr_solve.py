"""SpecTr's exact solve for ρ and its block decision on the device path (issue #20 §2, docs/verifiers.md §4).

ρ is the smallest root in [1, K'] of g(ρ) = p_acc(ρ) - ρβ(ρ), β(ρ) = Σ min(p, q/ρ), p_acc = 1 - (1 - β)^K'.
References: the root to 40 digits (mpmath bisection on the same float64 laws) and the 60-step float64
bisection that solved it before. Near a double root (q ≈ p, K' > 1) g stays within rounding of 0 over
an interval, so there ρ is held to what float64 can resolve: 4e-16 / |g'(ρ)|.
"""

from __future__ import annotations

import itertools

import mpmath
import pytest
import torch

import specdec_plugins._spectr_solve as spectr
from specdec_cli import load_verifier
from specdec_cli.base.randomness import Draws
from specdec_cli.engine.device_path import OperationCount
from specdec_cli.kit.testing import adversarial_distribution_pairs, random_distributions
from specdec_cli.plugins.laws import TINY
from specdec_cli.plugins.verifiers import Verifier, device_path
from tests.conftest import BLOCK_KINDS, random_block

mpmath.mp.dps = 40


class _Reference:
    """β, g and the smallest root of one problem, computed in mpmath on the float64 laws' exact values."""

    def __init__(self, q: torch.Tensor, p: torch.Tensor, count: int):
        self.q, self.p, self.count = [mpmath.mpf(x) for x in q.tolist()], [mpmath.mpf(x) for x in p.tolist()], count

    def beta(self, rho):
        return sum(min(p, q / rho) for p, q in zip(self.p, self.q))

    def g(self, rho):
        beta = self.beta(rho)
        return 1 - (1 - beta) ** self.count - rho * beta

    def root(self):
        low, high = mpmath.mpf(1), mpmath.mpf(self.count)
        if self.g(low) <= 0:
            return low
        for _ in range(130):
            middle = (low + high) / 2
            low, high = (low, middle) if self.g(middle) <= 0 else (middle, high)
        return high

    def resolution(self, rho) -> float:
        """How far from ρ float64 can place the root: 4e-16 over the slope of g there."""
        step = rho * mpmath.mpf(10) ** -20
        return 4e-16 / max(abs(float((self.g(rho + step) - self.g(rho)) / step)), 1e-300)


def _bisection_rho(q: torch.Tensor, p: torch.Tensor, count: int) -> float:
    """The solver this one replaced: 60 bisection steps in float64, keeping the feasible end."""
    low, high = 1.0, float(count)
    for _ in range(60 if count > 1 else 0):
        middle = (low + high) / 2
        beta = float(torch.minimum(p, q / middle).sum())
        low, high = (low, middle) if 1 - (1 - beta) ** count <= middle * beta else (middle, high)
    return high


def _laws(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(vocab)
    random = [tuple(random_distributions(generator, (2, vocab), sparsity=s)) for s in (0.0, 0.3, 0.6) for _ in range(4)]
    return random + adversarial_distribution_pairs(vocab)


def _solved(q: torch.Tensor, p: torch.Tensor, count: int) -> tuple[float, float, float]:
    return tuple(float(x) for x in spectr.solve_rho(q, p, count))  # ρ, p_acc, β


@pytest.mark.parametrize("vocab", [2, 3, 4, 6])
def test_rho_is_the_smallest_root(vocab):
    """Feasible (g(ρ) ≤ 0, so the residual is a law), optimal (no acceptance given away) and, where the
    root is well conditioned, within 1e-12 of it; K' = 1 included."""
    for (q, p), count in itertools.product(_laws(vocab), range(1, 5)):
        rho, p_acc, _ = _solved(q, p, count)
        reference = _Reference(q, p, count)
        root = reference.root()
        assert reference.g(mpmath.mpf(rho)) <= 1e-15, (q, p, count)
        assert p_acc >= float(1 - (1 - reference.beta(root)) ** count) - 1e-14, (q, p, count)
        assert abs(rho - float(root)) <= 1e-12 * float(root) + reference.resolution(root), (q, p, count, rho)


@pytest.mark.parametrize("vocab", [3, 50, 1000])
def test_rho_matches_the_old_bisection(vocab):
    generator = torch.Generator().manual_seed(7 * vocab)
    logits = torch.randn(12, vocab, generator=generator, dtype=torch.float64) * 3
    targets = logits.softmax(-1)  # [12, V]
    drafts = (logits + torch.randn(12, vocab, generator=generator, dtype=torch.float64)).softmax(-1)  # [12, V]
    for (q, p), count in itertools.product(zip(targets, drafts), range(1, 5)):
        rho, _, _ = _solved(q, p, count)
        old = _bisection_rho(q, p, count)
        assert abs(rho - old) <= 1e-12 * old, (count, rho, old)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_roots_at_one(count):
    """ρ = 1 exactly for K' = 1, q = p (one-token laws included) and disjoint supports (g ≡ 0)."""
    law = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    one_token = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    disjoint = (
        torch.tensor([0.0, 0.0, 0.5, 0.5], dtype=torch.float64),
        torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64),
    )
    for q, p in [(law, law), (one_token, one_token), disjoint, (law, one_token)][: 4 if count == 1 else 3]:
        rho, p_acc, beta = _solved(q, p, count)
        assert rho == 1.0, (q, p)
        assert p_acc == pytest.approx(1 - (1 - float(torch.minimum(p, q).sum())) ** count, abs=1e-15)


def test_the_residual_is_never_negative():
    """p_acc ≤ ρβ as returned, so q - min(p, q/ρ) p_acc/β ≥ 0 up to one rounding: the clamp loses no mass."""
    for vocab in (2, 4, 50):
        for (q, p), count in itertools.product(_laws(vocab), range(1, 5)):
            rho, p_acc, beta = spectr.solve_rho(q, p, count)
            assert float(p_acc) <= float(rho * beta)
            unclamped = q - torch.minimum(p, q / rho) * (p_acc / beta.clamp_min(TINY))  # [V]
            assert bool((unclamped >= -4e-16 * q).all()), (q, p, count)


@pytest.mark.parametrize("kind", ["peaked", "near_one_token", "equal", "flat_draft"])
def test_the_cpu_solve_agrees_with_the_sort(kind):
    """The bucketed CPU solve (float32 laws, as the engine passes them) against the full sort in float64;
    where they differ by more than 1e-12, by no more than float64 resolves the root (|dβ/dρ| ≤ 1)."""
    target, draft, _ = random_block(kind, 1, 4, 4096, seed=3, identical_drafts=True)
    for position, count in itertools.product(range(4), range(1, 5)):
        q, p = target[0, position], draft[0, position]  # [V] float32 each
        rho, p_acc, beta = (float(x) for x in spectr.solve_rho(q, p, count))
        cpu_rho, cpu_p_acc, cpu_beta = (float(x) for x in spectr.solve_by_buckets(q, p, count))
        tolerance = 1e-12 * rho
        if abs(cpu_rho - rho) > tolerance:
            tolerance += _Reference(q.double(), p.double(), count).resolution(mpmath.mpf(rho))
        assert abs(cpu_rho - rho) <= tolerance and abs(cpu_beta - beta) <= tolerance + 1e-14, (kind, position, count)
        assert cpu_p_acc == pytest.approx(p_acc, abs=1e-14)


def _root_between(reference: _Reference, first: float, second: float):
    """The root of ``reference`` near two estimates of it, by mpmath bisection on a bracket around both."""
    low, high = (
        mpmath.mpf(min(first, second)) * (1 - mpmath.mpf(1e-9)),
        mpmath.mpf(max(first, second)) * (1 + mpmath.mpf(1e-9)),
    )
    assert reference.g(low) >= 0 >= reference.g(high)
    for _ in range(70):
        middle = (low + high) / 2
        low, high = (low, middle) if reference.g(middle) <= 0 else (middle, high)
    return high


def _host_problems(vocab: int):
    """(q, p, K') float32 problems for the CPU walk's solve: random laws near each other and not, exact zeros,
    ties (q = p on a share of the tokens, and equal ratios), p = 0 < q, and the adversarial pairs."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator, dtype=torch.float64) * 3  # [6, V]
    near = [
        (row.softmax(-1), (row + torch.randn(vocab, generator=generator, dtype=torch.float64) * s).softmax(-1))
        for row, s in zip(logits, (0.1, 0.5, 1.0, 2.0, 0.0, 1.0))
    ]
    tied = near[3][0].clone()
    tied[: vocab // 3] = near[3][1][: vocab // 3]  # q = p on a third of the tokens
    doubled = near[2][1].clone()
    doubled[::2] *= 2  # ratios equal in pairs
    laws = near + [(tied / tied.sum(), near[3][1]), (doubled / doubled.sum(), near[2][1])]
    laws += [tuple(random_distributions(generator, (2, vocab), sparsity=s)) for s in (0.0, 0.5, 0.9)]
    for q, p in laws + adversarial_distribution_pairs(vocab):
        for count in (2, 3, 4):
            yield q.float(), p.float(), count


@pytest.mark.parametrize("vocab", [5, 300, 4000])
def test_the_set_steps_agree_with_the_sort(vocab, monkeypatch):
    """The CPU walk's solve (set steps from a rejected θ, float32 then float64 sums) against the full sort of
    the device path: ρ within 1e-12, or within what float64 resolves of the root; the bucketed fallback rare."""
    fallbacks, solve = [], spectr.solve_by_buckets
    monkeypatch.setattr(spectr, "solve_by_buckets", lambda *args: fallbacks.append(args[2]) or solve(*args))
    generator, problems = torch.Generator().manual_seed(1), 0
    for q, p, count in _host_problems(vocab):
        rho, p_acc, beta = (float(x) for x in spectr.solve_rho(q, p, count))
        for start in (1.0, 1 + (rho - 1) * float(torch.rand((), generator=generator, dtype=torch.float64))):
            problem = spectr.HostProblem(q, p, count)
            problem.lower = start  # as a test rejected at θ = start leaves it (ρ ≥ start)
            host_rho, host_p_acc, host_beta = (float(x) for x in problem.solve())
            tolerance = 1e-12 * rho
            if abs(host_rho - rho) > tolerance:  # a root float64 resolves badly: the host at least as near it
                reference = _Reference(q.double(), p.double(), count)
                root = _root_between(reference, host_rho, rho)
                tolerance = max(abs(rho - root), tolerance + reference.resolution(root)) + abs(root - rho)
            assert abs(host_rho - rho) <= tolerance, (vocab, count, start, host_rho, rho)
            mass_rounding = vocab * 2.0**-52  # the sort's prefix sums: B = Σ p - (Σ p up to the segment)
            assert abs(host_beta - beta) <= tolerance + mass_rounding
            assert host_p_acc == pytest.approx(p_acc, abs=count * (tolerance + mass_rounding))
            problems += 1
    assert len(fallbacks) <= problems // 10, (len(fallbacks), problems)


def test_the_comparison_with_the_sort_sees_a_coarse_root(monkeypatch):
    """Negative control: a solve that takes the float32 sums for exact ones (ρ off by about 1e-7) is caught."""
    masses = spectr.HostProblem._masses
    monkeypatch.setattr(
        spectr.HostProblem, "_masses", lambda problem, threshold, coarse=False: masses(problem, threshold, True)
    )
    with pytest.raises(AssertionError):
        test_the_set_steps_agree_with_the_sort(4000, monkeypatch)


@pytest.mark.parametrize("count", [2, 4])
def test_the_candidate_test_places_theta_against_the_sorted_root(count):
    """_HostProblem.accepts(x, u) is ρ < θ = q(x)/(u p(x)) for θ on either side of the sorted ρ, close to it too
    (where the float32 sums are too coarse to decide and float64 decides)."""
    for q, p, _ in itertools.islice(_host_problems(4000), 0, 60, 3):
        rho = float(spectr.solve_rho(q, p, count)[0])
        token = int((q * p).argmax())  # a token both laws give mass to (a candidate has p(x) > 0)
        if p[token] == 0:
            continue
        ratio = float(q[token]) / float(p[token])
        for theta in (rho * (1 - 1e-3), rho * (1 - 1e-9), rho * (1 + 1e-9), rho * (1 + 1e-3), 1.5, count - 0.5):
            if abs(theta - rho) > 1e-12 * rho and theta > 0:
                assert spectr.HostProblem(q, p, count).accepts(token, ratio / theta) == (rho < theta), (theta, rho)


# --------------------------------------------------------------------------- the block decision


def _decision(verifier, block, draws, on_device: bool, base_walk: bool = False) -> tuple:
    verify = (lambda *args: Verifier.verify_block(verifier, *args)) if base_walk else verifier.verify_block
    if on_device:
        with device_path():
            decision = verify(*block, draws)
    else:
        decision = verify(*block, draws)
    accepted = int(decision.num_accepted)
    return tuple(decision.tokens[: accepted + 1].tolist()), accepted, int(decision.row)


def _disagreements(verifier, num_drafts: int, compare_with_base: bool) -> int:
    disagreements = 0
    for kind, seed, key in itertools.product(BLOCK_KINDS, range(2), range(3)):
        block = random_block(kind, num_drafts, 4, 64, seed, identical_drafts=True)
        draws = Draws.create(key=key, block_start=5)
        device = _decision(verifier, block, draws, on_device=True)
        other = _decision(verifier, block, draws, on_device=compare_with_base, base_walk=compare_with_base)
        disagreements += device != other
    return disagreements


@pytest.mark.parametrize("num_drafts", [2, 3, 4])
@pytest.mark.parametrize("other", ["host walk", "token-level walk"])
def test_every_path_makes_the_same_decision(num_drafts, other):
    """With the same keyed draws, the device path, the CPU path that reads, and the token-level walk of
    :class:`Verifier` (select_alive at each position) commit the same tokens from the same row."""
    assert _disagreements(load_verifier("spectr"), num_drafts, other == "token-level walk") == 0


@pytest.mark.parametrize("num_drafts", [2, 4])
def test_the_host_walk_agrees_where_every_row_drew_the_same_tokens(num_drafts, monkeypatch):
    """Rows that share every token stay alive together, so the host walk tests candidates and solves ρ with
    K' = K (the set steps, not the K' = 1 shortcut), at a vocabulary with many tokens per bucket."""
    solve, counts_solved = spectr.HostProblem.solve, []

    def spied(problem):
        counts_solved.append(problem.count)
        return solve(problem)

    monkeypatch.setattr(spectr.HostProblem, "solve", spied)
    verifier, disagreements = load_verifier("spectr"), 0
    for kind, seed in itertools.product(("peaked", "near_one_token", "flat_draft"), range(3)):
        target, draft, tokens = random_block(kind, num_drafts, 4, 4096, seed, identical_drafts=True)
        block = target, draft, tokens[:1].expand(num_drafts, -1).contiguous()  # [K, L]: every row row 0's tokens
        draws = Draws.create(key=seed, block_start=5)
        disagreements += _decision(verifier, block, draws, on_device=True) != _decision(verifier, block, draws, False)
    assert disagreements == 0
    assert num_drafts in counts_solved, counts_solved


def test_the_comparison_sees_a_wrong_residual(monkeypatch):
    """Negative control: a CPU path whose residual swaps p_acc and β (a bug this comparison caught)
    disagrees with the device path."""
    solve = spectr.HostProblem.solve

    def swapped(problem):
        rho, p_acc, beta = solve(problem)
        return rho, beta, p_acc

    monkeypatch.setattr(spectr.HostProblem, "solve", swapped)
    assert _disagreements(load_verifier("spectr"), 3, compare_with_base=False) > 0


def _blocks(num_drafts: int, draft_length: int):
    for vocab, (seed, kind) in itertools.product((64, 4096), enumerate(BLOCK_KINDS)):
        yield random_block(kind, num_drafts, draft_length, vocab, seed, identical_drafts=True), Draws.create(seed, 3)


def test_the_count_sees_the_reading_path():
    """Negative control: on the CPU path (reads, work only where the walk goes) the counts vary and reads show."""
    verifier, counts = load_verifier("spectr"), []
    for block, draws in _blocks(4, 8):
        with torch.inference_mode(), OperationCount() as count:
            verifier.verify_block(*block, draws)
        counts.append(count)
    assert len({count.ops for count in counts}) > 1
    assert all(count.reads > 0 for count in counts)


def test_explain_sees_a_read():
    """Negative control: a host read in the middle of the computation is a graph break."""

    def reads(target_probs, draft_probs, draft_tokens, randomness):
        mass = target_probs.sum()
        return target_probs * 2 if bool(mass > 0) else target_probs

    block = random_block("peaked", 4, 4, 32, 0, identical_drafts=True)
    assert torch._dynamo.explain(reads)(*block, Draws.create(key=1)).graph_break_count > 0
