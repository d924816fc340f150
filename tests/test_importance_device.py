"""is-lp and is-truncated on the device path (issue #20 §2): one host read per block, a fixed number
of operations, acceptance at least SpecInfer's, and exactness of the keyed sampler and the walk.

Each counting or statistical check has a negative control that shows it can fail.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.engine.device_path import count_block
from specdec_cli.kit.testing import (
    chi_square_p_value,
    committed_block_law,
    decision_outcomes,
    enumerate_output_law,
    expected_committed_tokens,
    random_distributions,
    random_sequence_laws,
)
from specdec_cli.plugins.registry import load_verifier
from specdec_cli.plugins.verifiers import device_path, walk_alive_rows
from specdec_plugins import _pair_selection
from specdec_plugins._importance_parts import BlockUniforms, Problems, commit_runs
from specdec_plugins.is_truncated import ImportanceSamplingTruncated
from tests.conftest import BLOCK_KINDS as DEVICE_BLOCK_KINDS
from tests.conftest import block_inputs, random_block

IMPORTANCE = ("is-lp", "is-truncated")
KINDS = ("peaked", "near_one_token", "disjoint", "flat_draft")


def _blocks(name: str, num_drafts: int, draft_length: int, vocab: int, kinds=KINDS):
    support = 16 if name == "is-lp" else None  # is-lp needs a bounded draft support (as top-k sampling gives)
    for seed, kind in enumerate(kinds):
        block = random_block(kind, num_drafts, draft_length, vocab, seed, False, support)
        yield f"V={vocab} {kind}", block, Draws.create(key=seed, block_start=3 * seed)


class _ReadsEachPosition(ImportanceSamplingTruncated):
    """Negative control: reads the device once per position and loops over what it read."""

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        for t in range(draft_tokens.shape[1]):
            for _ in range(int((target_probs[0, t] > 0.01).sum())):  # a trip count read from the device
                target_probs[0, t].sum()
        return super().verify_block(target_probs, draft_probs, draft_tokens, randomness)


# ------------------------------------------------------------------ reads and operations


def test_the_counts_see_extra_reads_and_a_data_dependent_loop():
    counts = [count_block(_ReadsEachPosition(), *block, draws) for _, block, draws in _blocks("is-truncated", 2, 4, 64)]
    assert min(count.reads for count in counts) > 1
    assert len({count.ops for count in counts}) > 1


# ------------------------------------------------------------------ acceptance against SpecInfer


def _law_family(kind: str, num_drafts: int, seed: int, top_k: int = 0, rows: int = 6, vocab: int = 1024):
    """Target ``[rows, V]`` and draft laws ``[rows, K, V]`` (float64) of one family."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 1, vocab, generator=generator, dtype=torch.float64) * 1.5  # [rows, 1, V]
    boost = torch.rand(rows, 1, 20, generator=generator, dtype=torch.float64) * 12  # [rows, 1, 20]
    logits = logits.scatter_add(-1, torch.randint(0, vocab, (rows, 1, 20), generator=generator), boost)
    noise = torch.randn(rows, num_drafts, vocab, generator=generator, dtype=torch.float64)  # [rows, K, V]
    temperature = torch.ones(num_drafts, 1, dtype=torch.float64)  # [K, 1]
    if kind == "different":  # the multi-draft paper's drafts: one model at several temperatures
        temperature = 0.7 + 0.3 * torch.arange(num_drafts, dtype=torch.float64)[:, None]
    drafts = {
        "peaked": logits + noise[:, :1],
        "close": logits + 0.1 * noise[:, :1],
        "disjoint": -logits,
        "flat_draft": 0.01 * noise[:, :1],
        "different": (logits + noise) / temperature,
    }[kind]
    drafts = drafts.expand(-1, num_drafts, -1)  # [rows, K, V]
    if top_k:
        drafts = drafts.masked_fill(drafts < drafts.topk(top_k, -1).values[..., -1:], -torch.inf)
    return logits.squeeze(1).softmax(-1), drafts.softmax(-1)


FAMILIES = ("peaked", "close", "disjoint", "flat_draft", "different")


@pytest.mark.parametrize("name", IMPORTANCE)
@pytest.mark.parametrize("num_drafts", [2, 3, 4])
def test_acceptance_is_at_least_specinfers(name, num_drafts):
    verifier, specinfer = load_verifier(name), load_verifier("specinfer")
    gains = []
    for seed, kind in enumerate(FAMILIES):
        target, drafts = _law_family(kind, num_drafts, seed, top_k=16 if name == "is-lp" else 0)
        gain = verifier.acceptance_probability(target, drafts) - specinfer.acceptance_probability(target, drafts)
        assert bool((gain >= -1e-9).all()), (kind, gain)
        gains.append(gain)
    assert float(torch.cat(gains).max()) > 0.01  # and often strictly more


def test_the_acceptance_comparison_can_fail():
    """Negative control: importance sampling alone (without the per-problem SpecInfer fallback) accepts
    less than SpecInfer at some positions of four different drafts."""
    target, drafts = _law_family("different", 4, seed=FAMILIES.index("different"))  # as in the K = 4 case above
    tokens = torch.zeros(drafts.shape[:-1], dtype=torch.long)  # [rows, K]: unused by the acceptance
    alone = load_verifier("is-truncated").plan(Problems.independent(target, drafts, tokens)).scheme.acceptance
    assert bool((alone < load_verifier("specinfer").acceptance_probability(target, drafts) - 1e-3).any())


def _scheme_acceptance(target: torch.Tensor, draft: torch.Tensor) -> float:
    """is-truncated's scheme alone (no SpecInfer fallback) on two copies of ``draft`` ``[V]``, target ``[V]``."""
    tokens = torch.zeros(1, 2, dtype=torch.long)  # [1, K]: unused by the acceptance
    plan = load_verifier("is-truncated").plan(Problems.independent(target[None], draft.expand(1, 2, -1), tokens))
    return float(plan.scheme.acceptance)


def test_the_tail_mixture_keeps_two_identical_drafts_at_one_drafts_acceptance(monkeypatch):
    """With λ chosen per problem, the scheme alone accepts at least what one draft does (λ = 0 gives p_I = p),
    also for drafts close to the target; the ranked rule alone (λ = 1, the negative control) falls below."""
    generator = torch.Generator().manual_seed(60)
    laws = []
    for closeness in [0.3] * 8 + [1.0, 3.0]:
        logits = torch.randn(60, generator=generator, dtype=torch.float64) * 2.5  # [V]
        draft = (logits + closeness * torch.randn(60, generator=generator, dtype=torch.float64)).softmax(-1)
        laws.append((logits.softmax(-1), draft, float(torch.minimum(logits.softmax(-1), draft).sum())))
    assert all(_scheme_acceptance(target, draft) >= one - 1e-9 for target, draft, one in laws)
    monkeypatch.setattr(_pair_selection, "best_mixture", lambda step, coin, target: torch.ones_like(step[:, :1]))
    assert sum(_scheme_acceptance(target, draft) < one - 0.01 for target, draft, one in laws) >= 3


def _sequence_laws(seed: int, vocab: int, depth: int):
    generator = torch.Generator().manual_seed(seed)
    target, draft = random_sequence_laws(generator, vocab, depth + 1), random_sequence_laws(generator, vocab, depth)
    return target.__getitem__, draft.__getitem__


@pytest.mark.parametrize(("num_drafts", "draft_length"), [(2, 2), (3, 1)])
def test_a_block_commits_at_least_what_specinfer_commits(num_drafts, draft_length):
    """Exact expected tokens per block (every draft block enumerated, the walk's continuations included)."""
    example = torch.tensor([1 / 3, 0.2, 7 / 15], dtype=torch.float64)  # Khisti et al.'s Example 1: IS accepts all
    cases = [_sequence_laws(seed, 3, draft_length) for seed in range(2 if draft_length == 1 else 1)]
    cases.append((lambda _: example, lambda _: torch.full((3,), 1 / 3, dtype=torch.float64)))
    for target_law, draft_law in cases:
        tokens = {
            name: expected_committed_tokens(
                committed_block_law(load_verifier(name), target_law, [draft_law] * num_drafts, 3, draft_length)
            )
            for name in ("specinfer", *IMPORTANCE)
        }
        assert min(tokens[name] for name in IMPORTANCE) >= tokens["specinfer"] - 1e-12, tokens
    assert min(tokens[name] for name in IMPORTANCE) > tokens["specinfer"] + 0.05  # the example: strictly more


# ------------------------------------------------------------------ exactness


def _sampled_law(plan, tokens: torch.Tensor, row: int, samples: int) -> Counter:
    """Outputs of ``samples`` copies of problem ``row`` of ``plan`` (candidates ``tokens`` ``[P, K]``), each
    with its own uniforms."""
    generator = torch.Generator().manual_seed(row)
    copies = plan.__class__(*(_copies(getattr(plan, field), row, samples) for field in plan.__dataclass_fields__))
    shapes = ((samples,), (samples, tokens.shape[1]), (samples,), (1,), (samples,), (samples,))  # BlockUniforms' fields
    uniforms = BlockUniforms(*(torch.rand(shape, generator=generator, dtype=torch.float64) for shape in shapes))
    return Counter(copies.sample(tokens[row : row + 1].expand(samples, -1), uniforms).tolist())


def _copies(value, row: int, samples: int):
    """Row ``row`` of every tensor in ``value`` (a tensor, None or a dataclass of them), ``samples`` times."""
    if isinstance(value, torch.Tensor):
        return value[row : row + 1].expand(samples, *value.shape[1:])
    if value is None:
        return None
    return value.__class__(*(_copies(getattr(value, field), row, samples) for field in value.__dataclass_fields__))


@pytest.mark.parametrize("params", [{}, {"s": 2, "alphabet": 3}])
def test_the_sampler_draws_the_output_law(params):
    """Every problem's output is drawn from ``output_law``, on problems that run the scheme and problems
    that run SpecInfer (and with alphabet truncation: the draw off the alphabet)."""
    verifier = load_verifier("is-truncated", params)
    target, drafts = _law_family("peaked", 4, seed=0, vocab=16)  # [6, V], [6, K, V]
    tokens = torch.multinomial(drafts.flatten(0, 1), 1, generator=torch.Generator().manual_seed(0)).view(6, 4)
    plan = verifier.plan(Problems.independent(target, drafts, tokens))
    laws = plan.output_law(tokens)  # [6, V]
    against_target = []
    for row in range(len(tokens)):
        counts = _sampled_law(plan, tokens, row, 4000)
        assert chi_square_p_value(counts, dict(enumerate(laws[row].tolist()))) > 1e-4, row
        against_target.append(chi_square_p_value(counts, dict(enumerate(target[row].tolist()))))
    assert set(plan.use_scheme.tolist()) == {True, False}
    assert min(against_target) < 1e-6  # power: given its candidates the output is not q


def test_commit_runs_is_the_walk_over_alive_rows():
    """The vectorised walk commits what the position-by-position walk over alive sets commits."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        draft_tokens = torch.randint(0, 3, (4, 3), generator=generator)  # [K, L]
        outputs = torch.randint(0, 3, (4, 3), generator=generator)  # [K, L]: problem (k, t)'s output
        target_probs = random_distributions(generator, (4, 4, 3))  # [K, L+1, V]
        problems = Problems.block(target_probs, target_probs[:, :3], draft_tokens)
        draws = Draws.create(key=1, block_start=5)
        uniform = BlockUniforms.of(draws, 4, 3, "cpu", alphabet=False).bonus
        ours = commit_runs(outputs, problems.leader, draft_tokens, target_probs, uniform)
        walked = walk_alive_rows(
            lambda t, alive, leader, outputs=outputs: outputs[leader, t], target_probs, draft_tokens, draws
        )
        n = int(walked.num_accepted)
        assert (int(ours.num_accepted), int(ours.row)) == (n, int(walked.row))
        assert ours.tokens[: n + 1].tolist() == walked.tokens[: n + 1].tolist()


def test_keyed_blocks_follow_the_block_law():
    """verify_block with keyed draws (K = 3, its own key per sample) against the exact block law; the
    same samples reject SpecInfer's block law (the check has power). is-lp runs the same code."""
    name = "is-truncated"
    verifier = load_verifier(name)
    inputs = block_inputs(3, identical=False)
    counts: Counter = Counter()
    for key in range(300):
        decision = verifier.verify_block(*inputs, Draws.create(key=key, block_start=2))
        counts[tuple(decision.tokens[: int(decision.num_accepted) + 1].tolist())] += 1
    laws = {
        rule: load_verifier(rule).block_law(inputs[0].double(), inputs[1].double(), inputs[2])
        for rule in (name, "specinfer")
    }
    exact = {rule: decision_outcomes(law, inputs[2]) for rule, law in laws.items()}
    assert chi_square_p_value(counts, exact[name]) > 1e-3
    assert chi_square_p_value(counts, exact["specinfer"]) < 1e-4


@pytest.mark.parametrize("name", IMPORTANCE)
def test_four_drafts_keep_the_target_law(name):
    verifier = load_verifier(name)
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        target, draft, other = random_distributions(generator, (3, 3))
        for drafts in (draft.expand(4, -1), torch.stack([draft, other, draft, other])):
            torch.testing.assert_close(enumerate_output_law(verifier, target, drafts), target, rtol=0, atol=1e-9)


# ------------------------------------------------------------------ the CPU path against the device path


def _decisions_that_differ(verifier, blocks) -> list[str]:
    """Labels of the blocks on which ``verify_block`` on the CPU (the walk that reads) and the device path
    (forced on the same CPU tensors) commit different tokens, rows or lengths from the same keyed draws."""
    differ = []
    for label, block, draws in blocks:
        walked = verifier.verify_block(*block, draws)
        with device_path():
            planned = verifier.verify_block(*block, draws)
        n = int(walked.num_accepted)
        if (n, int(walked.row)) != (int(planned.num_accepted), int(planned.row)) or (
            walked.tokens[: n + 1].tolist() != planned.tokens[: n + 1].tolist()
        ):
            differ.append(label)
    return differ


def _keyed_blocks(name: str, num_drafts: int, draft_length: int, vocab: int, keys: int = 3):
    """A block of every kind of tests/test_device_path.py, each with ``keys`` different keyed draws."""
    support = 16 if name == "is-lp" else None
    for seed, kind in enumerate(DEVICE_BLOCK_KINDS):
        block = random_block(kind, num_drafts, draft_length, vocab, 7 * seed + num_drafts, False, support)
        for key in range(keys):
            yield f"V={vocab} K={num_drafts} {kind} key={key}", block, Draws.create(key=key, block_start=5 * seed + key)


PATH_CASES = [("is-lp", {}), ("is-truncated", {}), ("is-truncated", {"s": 2, "alphabet": 3})]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("name", "params"), PATH_CASES, ids=["is-lp", "is-truncated", "is-truncated-alphabet"])
def test_the_cpu_walk_makes_the_device_paths_decisions(name, params):
    """On the CPU a block solves only the problems its walk reaches, one position at a time; it must commit
    exactly what the device path commits, block by block, with blocks that end at every position (rows that
    share a prefix, one-token laws, corrections, bonus tokens) and at a vocabulary where the free tokens are
    found by blocks (:func:`_pair_selection.top_ids`)."""
    verifier = load_verifier(name, params)
    blocks = [
        block
        for num_drafts in (2, 3, 4)
        for draft_length, vocab in ((3, 64), (2, 1024))
        for block in _keyed_blocks(name, num_drafts, draft_length, vocab)
    ]
    assert _decisions_that_differ(verifier, blocks) == []
    lengths = Counter(int(verifier.verify_block(*block, draws).num_accepted) for _, block, draws in blocks)
    assert set(lengths) == {0, 1, 2, 3}, lengths  # the walk ended at every position of the longer blocks


@pytest.mark.usefixtures("one_thread")
def test_the_path_comparison_sees_a_walk_that_takes_other_draws(monkeypatch):
    """Negative control: a walk that tests position t's candidates with position t+1's uniforms is caught."""
    at = BlockUniforms.at.__func__
    monkeypatch.setattr(BlockUniforms, "at", classmethod(lambda cls, drawn, t, width: at(cls, drawn, t + 1, width)))
    blocks = [block for num_drafts in (2, 4) for block in _keyed_blocks("is-truncated", num_drafts, 3, 64)]
    assert len(_decisions_that_differ(load_verifier("is-truncated"), blocks)) >= 5


@pytest.mark.parametrize("count", [5, 64])
def test_top_ids_on_the_cpu_are_topks(count):
    """The CPU's top-k by blocks gives topk's free tokens in topk's order, with ties (left to topk), -inf entries
    (padding: any of them) and fewer finite entries than ``count``."""
    generator = torch.Generator().manual_seed(count)
    cases = [(20_000, 20_000, False), (20_000, 20_000, True), (20_000, 40, False), (9_000, 3_000, True)]
    for vocab, finite, tie in cases:  # V, entries above -inf, the two largest equal
        score = torch.full((1, vocab), -torch.inf)
        where = torch.randperm(vocab, generator=generator)[:finite]
        score[0, where] = torch.rand(finite, generator=generator)
        if tie:  # the two largest entries equal: only topk itself may order them
            score[0, where[:2]] = 2.0
        ours, theirs = _pair_selection.top_ids(score, count)[0], score.topk(count).indices[0]  # [count] each
        real = score[0, theirs] > -torch.inf  # [count]
        assert ours[real].tolist() == theirs[real].tolist()
        assert bool((score[0, ours[~real]] == -torch.inf).all())
