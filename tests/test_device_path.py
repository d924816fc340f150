"""Every built-in verifier's device path (issue #20 §2), counted with specdec_cli.device_path.

For each (verifier, K, L) over random blocks of several kinds at two vocabulary sizes:
(a) one ``verify_block`` dispatches the same number of operations whatever the data;
(b) at most 200 with one draft, 400 with two to four;
(c) no host read (importance sampling: exactly one, its host LP);
(d) dynamo traces it with keyed ``Draws`` and no graph break (importance sampling: none but its
LP call).
Negative controls show that each check fails on what it must catch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from specdec_cli import BlockDecision, BlockVerifier
from specdec_cli.engine.device_path import BlockCount, OperationCount, count_block, is_host_copy
from specdec_cli.plugins.verifiers import device_path
from tests.conftest import CASES, Case, random_blocks

VOCABULARIES = (64, 4096)
LENGTHS = (4, 8)
GRAPH_VOCABULARY = 32  # dynamo traces the same code at any V; a small one keeps its checks fast


GRAPH_CASES = [case for case in CASES if case.num_drafts in (1, 4)]
"""Dynamo's trace takes seconds: each verifier's code is traced once with one draft and once with four
(K = 2, 3 run the same code as four; one draft takes the single-draft path)."""

pytestmark = pytest.mark.usefixtures("one_thread")


def _params(cases=CASES, lengths=LENGTHS) -> list:
    # a list, not a generator: pytest 9.1 deprecates iterators as parametrize's values
    return [pytest.param(case, length, id=f"{case.id}-L{length}") for case in cases for length in lengths]


@functools.cache
def block_counts(case: Case, draft_length: int) -> tuple[tuple[str, BlockCount], ...]:
    """("V=…, kind", count) for every random block of the case at both vocabulary sizes."""
    verifier = case.verifier()
    return tuple(
        (f"V={vocab} {kind}", count_block(verifier, *block, draws))
        for vocab in VOCABULARIES
        for kind, block, draws in random_blocks(case, draft_length, vocab)
    )


# ------------------------------------------------------------------ what each check finds wrong (or None)


def varying_count(counts) -> str | None:
    different = {count.ops for _, count in counts}
    return None if len(different) == 1 else f"op counts vary: {[(label, count.ops) for label, count in counts]}"


def over_budget(counts, num_drafts: int) -> str | None:
    budget = 200 if num_drafts == 1 else 400
    most = max(count.ops for _, count in counts)
    return None if most <= budget else f"{most} ops per block, over the budget of {budget}"


def unexpected_reads(counts, expected: int) -> str | None:
    wrong = [(label, count.read_names) for label, count in counts if count.reads != expected]
    return None if not wrong else f"expected {expected} read(s) per block, got {wrong}"


def graph_breaks(verifier: BlockVerifier, block, randomness) -> list[str]:
    """The distinct reasons dynamo breaks the graph of one ``verify_block`` call (eager backend).

    Read from dynamo's counters: ``torch._dynamo.explain`` misses a break met before a graph's first
    operation (a generator draw at the top of a function) and counts a break inside a nested call
    once for every frame on the way; here such a break is one reason, its first two lines.
    """
    torch._dynamo.reset()
    counters.clear()
    with device_path():
        torch.compile(verifier.verify_block, backend="eager")(*block, randomness)
    return [" ".join(reason.splitlines()[:2]) for reason in counters["graph_break"]]


# ------------------------------------------------------------------ the built-ins


@pytest.mark.parametrize(("case", "draft_length"), _params())
def test_operation_count_does_not_depend_on_the_data(case, draft_length):
    assert varying_count(block_counts(case, draft_length)) is None


@pytest.mark.parametrize(("case", "draft_length"), _params())
def test_operation_count_is_within_the_budget(case, draft_length):
    assert over_budget(block_counts(case, draft_length), case.num_drafts) is None


@pytest.mark.parametrize(("case", "draft_length"), _params())
def test_no_host_read_except_the_lp(case, draft_length):
    assert unexpected_reads(block_counts(case, draft_length), 1 if case.host_lp else 0) is None


@pytest.mark.parametrize(("case", "draft_length"), _params(GRAPH_CASES, lengths=(4,)))
def test_verify_block_traces_into_one_graph(case, draft_length):
    _, block, draws = next(random_blocks(case, draft_length, GRAPH_VOCABULARY))
    assert len(graph_breaks(case.verifier(), block, draws)) <= (1 if case.host_lp else 0)


# ------------------------------------------------------------------ negative controls


class _DataDependentLoop(BlockVerifier):
    """Halves a mass until it is below the first draft token's probability: the trip count is read."""

    name, lossless, max_drafts = "data-dependent-loop", False, 1

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        mass = target_probs[0, 0].sum()  # []
        floor = draft_probs[0, 0].gather(0, draft_tokens[0, :1]).squeeze(0)  # []
        while bool(mass > floor):
            mass = mass / 2
        zero = torch.zeros((), dtype=torch.long)
        return BlockDecision(draft_tokens.new_zeros(draft_tokens.shape[1] + 1), zero, zero)


class _GeneratorDraw(BlockVerifier):
    """Draws its acceptance uniforms from the torch.Generator it is handed (what a keyed path must not)."""

    name, lossless, max_drafts = "generator-draw", False, 1

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        accepted = torch.rand(draft_tokens.shape[1], generator=randomness) < 0.5  # [L]
        num_accepted = accepted.long().cumprod(0).sum()  # []
        return BlockDecision(torch.cat([draft_tokens[0], draft_tokens[0, :1]]), num_accepted, num_accepted * 0)


_VALUES = torch.tensor([0.25, 0.5, 0.25])
READS = {
    "item": lambda: _VALUES[0].item(),
    "bool": lambda: bool(_VALUES.sum() > 0),
    "tolist": lambda: _VALUES.tolist(),
    "numpy": lambda: _VALUES.numpy(force=True),
    "mask indexing": lambda: _VALUES[_VALUES > 0.3],
    "nonzero": lambda: torch.where(_VALUES > 0.3),
    "0-dim tensor index": lambda: _VALUES[torch.tensor(1)],
    "unique": lambda: _VALUES.unique(),
    "argwhere": lambda: torch.argwhere(_VALUES),
}


@pytest.mark.parametrize("read", READS)
def test_the_counter_sees_each_kind_of_read(read):
    with torch.inference_mode(), OperationCount() as count:
        READS[read]()
    assert count.reads == 1, count.read_names


def test_a_copy_from_a_device_to_the_host_is_a_read():
    """Judged on the arguments alone (a meta tensor stands for a GPU one: this machine may have none)."""
    on_device, on_host, aten = torch.empty(3, device="meta"), torch.empty(3), torch.ops.aten
    assert is_host_copy(aten._to_copy.default, (on_device,), {"device": torch.device("cpu")})
    assert is_host_copy(aten.to.device, (on_device, torch.device("cpu"), torch.float32), {})
    assert is_host_copy(aten.copy_.default, (on_host, on_device), {})
    assert not is_host_copy(aten.copy_.default, (on_device, on_host), {})
    assert not is_host_copy(aten._to_copy.default, (on_host,), {"device": torch.device("cpu")})


def test_the_counter_sees_no_read_in_pure_tensor_code():
    with torch.inference_mode(), OperationCount() as count:
        _VALUES.index_select(0, _VALUES.argmax().view(1)).cumsum(0)
    assert (count.ops, count.reads) == (4, 0), count.by_operation


def test_the_checks_see_a_data_dependent_loop():
    verifier = _DataDependentLoop()
    counts = [
        (kind, count_block(verifier, *block, draws))
        for kind, block, draws in random_blocks(Case("speculative", 1), 4, 4096)
    ]
    assert varying_count(counts) is not None
    assert unexpected_reads(counts, 0) is not None
    assert over_budget([("one", BlockCount(201, 0, ()))], 1) is not None


def test_the_graph_check_sees_a_generator_draw():
    _, block, _ = next(random_blocks(Case("speculative", 1), 4, GRAPH_VOCABULARY))
    assert graph_breaks(_GeneratorDraw(), block, torch.Generator().manual_seed(0))
