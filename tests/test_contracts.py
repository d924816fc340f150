"""The contract every registered verifier and drafter keeps, as one table (issue #42 item 7).

Rows: the installed built-ins, found through the registries, plus the example plugins under examples/ (the kit
authors copy); each verifier at the parameter settings its rule-specific tests use, with one draft and, where it
takes several, with several. Columns, each one test over the rows:

- the author's kit passes (``check_verifier`` / ``check_drafter``), with the parameters each must refuse;
- the capability flags are consistent (the built-ins' as each spelt them, and the implications any plugin's keep);
- a batch decides each sequence as it is decided alone with that sequence's own draws, on either path (and a
  token-level rule's laws batch over leading dimensions);
- the device path's operation count does not depend on the data (nor, mapped, on the batch size), within the
  budget, with no host read (importance sampling: one, its host LP);
- dynamo traces a block into one graph (importance sampling: broken only at its host LP);
- a bad parameter is one line: through `specdec generate` for the built-ins (the exact text), through the
  registry for every row.

The rule-specific tests stay in each rule's own file; the checks' negative controls stay beside the checks
(tests/test_device_path.py, tests/test_verify_batch.py, tests/test_conformance.py).
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import pytest
import torch
from specdec_bigram import ContextBigram
from specdec_lenient import LenientSpeculative
from torch._dynamo.utils import counters

from specdec_cli.device_path import BlockCount, OperationCount, count_block
from specdec_cli.plugins.drafter_registry import DrafterRegistry
from specdec_cli.plugins.parameters import PluginParameterError
from specdec_cli.randomness import Draws
from specdec_cli.testing import check_drafter, check_verifier, random_distributions
from specdec_cli.verifiers import BatchDecision, BlockDecision, BlockVerifier, Verifier, VerifierRegistry, device_path
from tests.conftest import (
    BLOCK_KINDS,
    LP_SUPPORT,
    one_error_line,
    random_block,
)

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLE_VERIFIERS = {"lenient": LenientSpeculative}
EXAMPLE_DRAFTERS = {"bigram": ContextBigram}
VERIFIERS = VerifierRegistry(extra=EXAMPLE_VERIFIERS)
DRAFTERS = DrafterRegistry(extra=EXAMPLE_DRAFTERS)


def decide_batch(verifier: BlockVerifier, target, draft, tokens, draws: Draws, judged=None) -> BatchDecision:
    """The verifier's one call: target ``[B, K, L+1, V]``, draft ``[B, K, L, V]``, tokens ``[B, K, L]``."""
    return verifier.verify(target, draft, tokens, draws, judged)


# ------------------------------------------------------------------ the rows


SETTINGS: dict[str, list[dict]] = {
    "mentored": [
        {"kl": 0.0},
        {"kl": 0.1},
        {"kl": 0.3},
        {"kl": 0.1, "divergence": "tv"},
        {"kl": 0.3, "divergence": "tv"},
    ],
    "threshold": [{"single": 0.5, "acc": 0.5}, {"single": 0.2, "acc": 0.7}],
    "typical": [
        {"threshold": 0.3, "alpha": 0.5},
        {"threshold": 1.0, "alpha": 2.0},
        {"threshold": 0.05, "alpha": 5.0},
    ],
    "fuzzy": [
        {"threshold": 0.05},
        {"threshold": 0.1, "divergence": "kl"},
        {"threshold": 0.1, "divergence": "kl_reversed", "laws": "sampling"},
        {"threshold": 0.2, "divergence": "tv", "fallback": "speculative"},
        {"threshold": 0.05, "laws": "sampling", "fallback": "speculative"},
    ],
    "fly": [
        {"window_size": 1, "entropy_threshold": 0.0},
        {"window_size": 1, "entropy_threshold": 0.5, "entropy_top_k": 2},
        {"window_size": 2, "entropy_threshold": 0.0},
        {"window_size": 2, "entropy_threshold": 0.1},
    ],
    "cactus": [{"delta": 0.0}, {"delta": 0.1}, {"delta": 1.0}],
    "ensemble": [{"weight": 0.3}],
    "is-truncated": [{"s": 2, "alphabet": 3}],
    "lenient": [{"leniency": 2.0}],
}
"""Parameter settings beyond the defaults at which each rule keeps the contract: those its own tests decide with.
Every rule is checked at its defaults too."""

REFUSED: dict[str, list[dict]] = {
    "mentored": [{"kl": -1.0}, {"kl": math.inf}, {"divergence": "js"}],
    "ensemble": [{"weight": 1.5}, {"weight": -0.1}],
    "typical": [{"threshold": 0.0}, {"threshold": 1.5}, {"alpha": 0.0}, {"alpha": math.inf}, {"alpha": math.nan}],
    "threshold": [{"single": math.nan}, {"acc": math.nan}],
    "fly": [{"window_size": 0}, {"entropy_top_k": 0}, {"entropy_threshold": -0.1}, {"entropy_threshold": math.inf}],
    "fuzzy": [
        *({"threshold": value} for value in (-0.1, math.inf, math.nan)),
        {"divergence": "hellinger"},
        {"divergence": "js_div"},
        {"laws": "raw"},
        {"fallback": "draft"},
    ],
    "cactus": [{"delta": -0.1}, {"delta": math.nan}, {"delta": math.inf}],
    "is-lp": [{"max_support": 0}],
    "is-truncated": [{"s": 0}, {"alphabet": 0}, {"alphabet_mass": 1.5}],
    "lenient": [{"leniency": 0.5}, {"leniency": math.nan}],
    "early-exit": [{"layers": 0}],
    "prompt-lookup": [{"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}],
    "bigram": [{"smoothing": 0.0}, {"smoothing": math.nan}],
}
"""Parameters each plugin must refuse in one line naming them (the kit adds an unknown one and ill-typed ones)."""

KIT_SAMPLES = {"match": 2000}
"""The kit's chi-square samples where a rule's own tests need more than the default 1000."""

DRAFTER_PARAMS = {"early-exit": {"layers": 1}, "prompt-lookup": {"max_ngram": 2}, "bigram": {"smoothing": 0.5}}

HOST_LP = {"is-lp", "is-truncated"}
"""Importance sampling solves its free LPs on the host: with two or more drafts, one read per block (and batch)."""


@dataclass(frozen=True)
class Row:
    """One verifier at one parameter setting, with ``num_drafts`` drafts."""

    name: str
    params: dict = field(default_factory=dict)
    num_drafts: int = 1

    @property
    def id(self) -> str:
        settings = ",".join(f"{key}={value}" for key, value in self.params.items())
        return f"{self.name}-K{self.num_drafts}" + (f"-{settings}" if settings else "")

    @property
    def cls(self) -> type[BlockVerifier]:
        return VERIFIERS.load_class(self.name)

    def verifier(self) -> BlockVerifier:
        return VERIFIERS.create(self.name, self.params)

    @property
    def host_reads(self) -> int:
        return 1 if self.name in HOST_LP and self.num_drafts > 1 else 0


def _drafts(cls: type[BlockVerifier]) -> tuple[int, ...]:
    """One draft, and for a multi-draft rule two and four (K = 3 runs the same code as four)."""
    return (1,) if cls.max_drafts == 1 else (1, 2, 4)


ROWS = [
    Row(name, params, num_drafts)
    for name in VERIFIERS.names()
    for params in [{}, *SETTINGS.get(name, [])]
    for num_drafts in _drafts(VERIFIERS.load_class(name))
]
KIT_ROWS = [row for row in ROWS if row.num_drafts == 1]  # the kit checks one and two drafts itself
GRAPH_ROWS = [row for row in ROWS if row.num_drafts in (1, 4)]  # a trace takes seconds; K = 2 runs K = 4's code


KNOWN_GAPS = {
    ("is-truncated", "alphabet"): "found by this table: is-truncated with a fixed alphabet writes with scatter_, "
    "which vmap loops (its 'performance drop' warning): the device-path batch loops, and its count grows with B",
}
"""Rows a column is known to fail, by (rule, a parameter given), and why: strict expected failures, so the fix shows."""


def _rows(rows: list[Row], batched_on_the_device: bool = False) -> list:
    """The rows as pytest parameters; in a column that maps batches on the device path, a row of several drafts with
    a known gap marked as its strict expected failure."""
    params = []
    for row in rows:
        gaps = [why for (name, param), why in KNOWN_GAPS.items() if name == row.name and param in row.params]
        known = gaps and batched_on_the_device and row.num_drafts > 1
        params.append(
            pytest.param(row, id=row.id, marks=[pytest.mark.xfail(strict=True, reason=gaps[0])] if known else [])
        )
    return params


def test_every_registered_plugin_has_rows():
    """A plugin installed later joins every column: the rows come from the registries, not a hand list."""
    assert {row.name for row in ROWS} == set(VERIFIERS.names()) >= {"speculative", "lenient"}
    assert set(DRAFTERS.names()) >= {"model", "bigram"}
    assert set(SETTINGS) <= set(VERIFIERS.names()) and set(REFUSED) <= {*VERIFIERS.names(), *DRAFTERS.names()}


# ------------------------------------------------------------------ the author's kit


@pytest.mark.parametrize("row", _rows(KIT_ROWS))
def test_the_verifier_passes_the_authors_kit(row):
    samples = KIT_SAMPLES.get(row.name, 1000)
    check_verifier(row.cls, row.params, samples=samples, bad_params=REFUSED.get(row.name, ()))


@pytest.mark.parametrize("name", DRAFTERS.names())
def test_the_drafter_passes_the_authors_kit(name):
    """Through speculative sampling, end to end: the kit's chi-square of the first tokens and greedy equality."""
    check_drafter(DRAFTERS.load_class(name), DRAFTER_PARAMS.get(name), bad_params=REFUSED.get(name, ()))


# ------------------------------------------------------------------ capability flags

FAST = {"keyed_randomness", "capturable", "batches_by_vmap"}
BUILT_IN_FLAGS = {  # name: (the flags that are True, max_drafts, kl_bound_parameter), as each built-in once spelt them
    "speculative": ({"lossless", "token_level", *FAST}, 1, None),
    "mentored": ({"token_level", "reading_cpu_path", *FAST}, 1, "kl"),
    "ensemble": ({"token_level", *FAST}, 1, None),
    "typical": ({"token_level", *FAST}, 1, None),
    "threshold": ({"token_level", *FAST}, 1, None),
    "fuzzy": ({"token_level", *FAST}, 1, None),
    "fly": (FAST, 1, None),
    "cactus": ({"token_level", *FAST}, 1, None),
    "match": ({"lossless", "token_level", *FAST}, None, None),
    "specinfer": ({"lossless", "token_level", "reading_cpu_path", *FAST}, None, None),
    "spectr": ({"lossless", "identical_drafts", "token_level", "reading_cpu_path", *FAST}, None, None),
    "block": ({"lossless", *FAST}, 1, None),
    "is-lp": ({"lossless", "token_level", "keyed_randomness", "capturable", "reading_cpu_path"}, None, None),
    "is-truncated": ({"lossless", "token_level", "keyed_randomness", "capturable", "reading_cpu_path"}, None, None),
    "traversal": ({"lossless", "keyed_randomness"}, None, None),
    "lenient": ({"token_level", "keyed_randomness"}, 1, None),
}
FLAGS = ("lossless", "identical_drafts", "token_level", "keyed_randomness", "capturable", "reading_cpu_path")
FLAGS += ("batches_by_vmap",)


@pytest.mark.parametrize("name", VERIFIERS.names())
def test_the_capability_flags_are_consistent(name):
    """Each plugin's flags as spelt, and what any plugin's must keep: a lossless rule has no bound to set, a
    token-level rule has the token-level methods, a mapped batch is capturable, a capturable block keyed."""
    cls = VERIFIERS.load_class(name)
    flags = {flag for flag in FLAGS if getattr(cls, flag)}
    assert (flags, cls.max_drafts, cls.kl_bound_parameter) == BUILT_IN_FLAGS[name]
    assert not (cls.lossless and cls.kl_bound_parameter)
    assert cls.token_level == issubclass(cls, Verifier)
    assert not cls.batches_by_vmap or cls.capturable
    assert not cls.capturable or cls.keyed_randomness
    assert cls.max_drafts is None or cls.max_drafts >= 1
    if cls.max_drafts == 1:
        assert cls.reason_to_refuse(2, True) == f"verifier '{name}' takes at most 1 draft(s) per position"


# ------------------------------------------------------------------ batches


def random_batch(row: Row, batch: int, draft_length: int = 4, vocab: int = 16):
    """B blocks of every kind stacked: ``[B, K, L+1, V]``, ``[B, K, L, V]``, ``[B, K, L]``, each sequence's draws,
    and the judged laws (other laws than the sampling ones) where the row's rule judges by them."""
    identical = row.cls.identical_drafts
    kinds = [kind for kind in BLOCK_KINDS if kind != "one_token_equal"]
    blocks = [
        random_block(kinds[b % len(kinds)], row.num_drafts, draft_length, vocab, b, identical, support=8)
        for b in range(batch)
    ]
    target, draft, tokens = (torch.stack(parts) for parts in zip(*blocks))  # [B, K, L+1, V], [B, K, L, V], [B, K, L]
    draws = Draws.batch([100 + b for b in range(batch)])
    draws.block_start.copy_(torch.arange(batch) * 3)  # every sequence at its own output position
    judged = (target.flip(-1), draft.flip(-1)) if row.verifier().judged_laws else None
    return target, draft, tokens, draws, judged


def decided_alone(verifier: BlockVerifier, target, draft, tokens, draws: Draws, judged) -> BatchDecision:
    return BatchDecision.stack(
        [
            verifier.verify_block(
                target[b],
                draft[b],
                tokens[b],
                draws.row(b),
                **({} if judged is None else {"judged": judged_row(judged, b)}),
            )
            for b in range(tokens.shape[0])
        ]
    )


def judged_row(judged, b: int):
    return tuple(laws[b] for laws in judged)


@pytest.mark.parametrize(
    ("row", "forced_device_path"),
    [
        pytest.param(*param.values, True, id=f"{param.id}-device-path", marks=param.marks)
        for param in _rows(ROWS, batched_on_the_device=True)
    ]
    + [pytest.param(row, False, id=f"{row.id}-cpu-path") for row in ROWS],
)
def test_a_batch_decides_each_sequence_as_it_is_decided_alone(row, forced_device_path):
    verifier = row.verifier()
    target, draft, tokens, draws, judged = random_batch(row, 7)
    with torch.inference_mode(), warnings.catch_warnings(), device_path() if forced_device_path else nullcontext():
        # vmap's "performance drop" warning: an operation it has no batching rule for, and so loops.
        warnings.filterwarnings("error", message="There is a performance drop")
        batch = decide_batch(verifier, target, draft, tokens, draws, judged)
        alone = decided_alone(verifier, target, draft, tokens, draws, judged)
    assert batch.tokens.shape == (7, 5) and batch.num_accepted.shape == batch.row.shape == (7,)
    for name in ("tokens", "num_accepted", "row"):
        assert torch.equal(getattr(batch, name), getattr(alone, name)), name
    if judged is None:  # blocks that keep tokens and blocks that stop: the comparison sees both
        assert 0 < int(batch.num_accepted.max()) and int(batch.num_accepted.min()) < tokens.shape[-1]


@pytest.mark.parametrize("row", _rows([row for row in ROWS if row.cls.token_level and row.num_drafts < 4]))
def test_the_token_level_laws_batch_over_leading_dimensions(row):
    """``conditional`` and ``acceptance_probability`` of a [batch, positions] stack equal each position's own."""
    verifier, num_drafts, vocab = row.verifier(), row.num_drafts, 5
    generator = torch.Generator().manual_seed(8)
    target = random_distributions(generator, (3, 2, vocab))  # [batch, positions, V]
    draft = random_distributions(generator, (3, 2, 1, vocab)).expand(-1, -1, num_drafts, -1)  # [batch, pos, K, V]
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=generator).reshape(3, 2, num_drafts)
    batched = verifier.conditional(target, draft, tokens)  # [3, 2, V]
    acceptance = verifier.acceptance_probability(target, draft)  # [3, 2]
    for b in range(3):
        for t in range(2):
            torch.testing.assert_close(batched[b, t], verifier.conditional(target[b, t], draft[b, t], tokens[b, t]))
            torch.testing.assert_close(acceptance[b, t], verifier.acceptance_probability(target[b, t], draft[b, t]))


# ------------------------------------------------------------------ operation counts and reads


@pytest.mark.parametrize(
    "row", _rows([row for row in ROWS if row.cls.batches_by_vmap or row.host_reads], batched_on_the_device=True)
)
def test_a_batch_dispatches_the_same_operations_at_any_size(row):
    """Mapped (or, importance sampling, packed), 8 blocks take as many operations as 2, and reads as many: none, or
    the host LP's one."""
    verifier = row.verifier()

    def count(batch: int) -> OperationCount:
        *inputs, draws, judged = random_batch(row, batch)
        with torch.inference_mode(), device_path(), OperationCount() as counted:
            decide_batch(verifier, *inputs, draws, judged)
        return counted

    two, eight = count(2), count(8)
    assert two.ops == eight.ops
    assert two.reads == eight.reads == row.host_reads, eight.read_names


OPERATION_LENGTHS = {"fly": (1, 2, 4, 8)}
"""Draft lengths a block's count is taken at where (4, 8) do not reach every shape: fly's window test takes one where
the window covers the block (W ≥ L) and one where it does not."""


def block_counts(row: Row, draft_length: int, path=device_path) -> list[tuple[str, BlockCount]]:
    """("V=…, kind", count) of one block of every kind at two vocabularies, decided on ``path``."""
    verifier, support = row.verifier(), LP_SUPPORT if row.name == "is-lp" else None
    counts = []
    for vocab in (64, 4096):
        for seed, kind in enumerate(BLOCK_KINDS):
            block = random_block(kind, row.num_drafts, draft_length, vocab, seed, row.cls.identical_drafts, support)
            with path():
                count = count_block(verifier, *block, Draws.create(key=1000 + seed, block_start=17 * seed))
            counts.append((f"V={vocab} {kind}", count))
    return counts


def varying_count(counts) -> str | None:
    different = {count.ops for _, count in counts}
    return None if len(different) == 1 else f"op counts vary: {[(label, count.ops) for label, count in counts]}"


def over_budget(counts, num_drafts: int) -> str | None:
    budget = 200 if num_drafts == 1 else 400
    most = max(count.ops for _, count in counts)
    return None if most <= budget else f"{most} ops per block, over the budget of {budget}"


def unexpected_reads(counts, expected: int) -> str | None:
    """Reads other than ``expected`` per block, or a read that is not the host LP's copy of its few numbers."""
    names = ("Tensor.numpy",) * expected
    wrong = [(label, count.read_names) for label, count in counts if count.read_names != names]
    return None if not wrong else f"expected {expected} read(s) per block, got {wrong}"


@pytest.mark.parametrize(
    ("row", "draft_length"),
    [
        pytest.param(row, length, id=f"{row.id}-L{length}")
        for row in ROWS
        if row.cls.capturable
        for length in OPERATION_LENGTHS.get(row.name, (4, 8))
    ],
)
def test_a_blocks_operations_do_not_depend_on_the_data(row, draft_length):
    """On every kind of block at two vocabularies, on the device path: the same operation count, within the budget
    (200 a block with one draft, 400 with more), and no host read but the LP's; a rule without a reading CPU path
    counts the same off the device path too."""
    counts = block_counts(row, draft_length)
    if not row.cls.reading_cpu_path:
        counts += block_counts(row, draft_length, nullcontext)
    problems = [varying_count(counts), over_budget(counts, row.num_drafts), unexpected_reads(counts, row.host_reads)]
    assert problems == [None] * 3, problems


class _DataDependentLoop(BlockVerifier):
    """Negative control: halves a mass until it is below the first draft token's probability (a trip count read)."""

    name, lossless, max_drafts = "data-dependent-loop", False, 1

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        mass = target_probs[0, 0].sum()  # []
        floor = draft_probs[0, 0].gather(0, draft_tokens[0, :1]).squeeze(0)  # []
        while bool(mass > floor):
            mass = mass / 2
        zero = torch.zeros((), dtype=torch.long)
        return BlockDecision(draft_tokens.new_zeros(draft_tokens.shape[1] + 1), zero, zero)


def test_the_count_checks_see_a_data_dependent_loop_a_read_and_an_overrun(monkeypatch):
    monkeypatch.setattr(Row, "verifier", lambda row: _DataDependentLoop())
    counts = block_counts(Row("speculative"), 4)
    assert varying_count(counts) is not None
    assert unexpected_reads(counts, 0) is not None
    assert over_budget([("one", BlockCount(201, 0, ()))], 1) is not None
    assert unexpected_reads([("lp", BlockCount(9, 1, ("Tensor.item",)))], 1) is not None  # a read, not the LP's


# ------------------------------------------------------------------ one graph


def graph_breaks(verifier: BlockVerifier, block, draws: Draws, judged=None) -> list[str]:
    """The distinct reasons dynamo breaks the graph of a ``verify_block`` call (eager backend), each its first two
    lines; from dynamo's counters, which also see a break before a graph's first operation."""
    torch._dynamo.reset()
    counters.clear()
    with device_path():
        verify = torch.compile(verifier.verify_block, backend="eager")
        verify(*block, draws)
        if judged is not None:
            verify(*block, draws, judged=judged)
    return [" ".join(reason.splitlines()[:2]) for reason in counters["graph_break"]]


class _GeneratorDraw(BlockVerifier):
    """Negative control: draws its acceptance uniforms from the torch.Generator it is handed (what a keyed path must
    not)."""

    name, lossless, max_drafts = "generator-draw", False, 1

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        accepted = torch.rand(draft_tokens.shape[1], generator=randomness) < 0.5  # [L]
        num_accepted = accepted.long().cumprod(0).sum()  # []
        return BlockDecision(torch.cat([draft_tokens[0], draft_tokens[0, :1]]), num_accepted, num_accepted * 0)


def test_the_graph_check_sees_a_generator_draw():
    block = random_block("peaked", 1, 4, 32, 0, True)
    assert graph_breaks(_GeneratorDraw(), block, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("row", _rows([row for row in GRAPH_ROWS if row.cls.capturable]))
def test_a_block_traces_into_one_graph(row):
    """What --compile and a CUDA graph need: no graph break with keyed draws (and with judged laws, where the rule
    takes them); importance sampling breaks only at its host LP. The traced block decides as the eager one."""
    verifier = row.verifier()
    block = random_block("peaked", row.num_drafts, 4, 32, 0, row.cls.identical_drafts)
    judged = (block[0].flip(-1), block[1].flip(-1)) if verifier.judged_laws else None
    reasons = graph_breaks(verifier, block, Draws.create(key=1), judged)
    assert len(reasons) == row.host_reads, reasons
    assert all("disable" in reason for reason in reasons), reasons  # the LP's solver, kept out of the graph
    with device_path():
        traced = torch.compile(verifier.verify_block, backend="eager")(*block, Draws.create(key=1))
        eager = verifier.verify_block(*block, Draws.create(key=1))
    assert torch.equal(traced.tokens, eager.tokens) and torch.equal(traced.num_accepted, eager.num_accepted)


# ------------------------------------------------------------------ a bad parameter is one line


@pytest.mark.parametrize(
    ("name", "params"),
    [pytest.param(name, bad, id=f"{name}-{bad}") for name, refused in REFUSED.items() for bad in refused],
)
def test_a_refused_parameter_is_one_line_naming_it(name, params):
    registry = VERIFIERS if name in VERIFIERS.names() else DRAFTERS
    with pytest.raises(PluginParameterError) as refusal:
        registry.create(name, params)
    assert "\n" not in str(refusal.value) and any(key in str(refusal.value) for key in params)


CLI_REFUSALS = {
    "threshold": [
        ("single=.nan", "single must be a number, got nan"),
        ("acc=.nan", "acc must be a number, got nan"),
    ],
    "typical": [
        *(
            (f"threshold={v}", f"threshold must be a number in (0, 1], got {s}")
            for v, s in (("0", "0"), ("1.5", "1.5"))
        ),
        ("threshold=.nan", "threshold must be a number in (0, 1], got nan"),
        *((f"alpha={v}", f"alpha must be a finite number > 0, got {s}") for v, s in (("0", "0"), ("-0.3", "-0.3"))),
        ("alpha=.inf", "alpha must be a finite number > 0, got inf"),
        ("alpha=.nan", "alpha must be a finite number > 0, got nan"),
    ],
    "fuzzy": [
        *((f"threshold={v}", f"threshold must be a finite number >= 0, got {s}") for v, s in (("-1", "-1"),)),
        ("threshold=.inf", "threshold must be a finite number >= 0, got inf"),
        ("threshold=.nan", "threshold must be a finite number >= 0, got nan"),
        ("divergence=hellinger", "divergence must be 'js' or 'kl' or 'kl_reversed' or 'tv', got 'hellinger'"),
        ("fallback=draft", "fallback must be 'target' or 'speculative', got 'draft'"),
    ],
    "fly": [
        ("window_size=0", "window_size must be a whole number >= 1, got 0"),
        ("entropy_top_k=-2", "entropy_top_k must be a whole number >= 1, got -2"),
        ("entropy_threshold=-0.5", "entropy_threshold must be a finite number >= 0, got -0.5"),
        ("entropy_threshold=.inf", "entropy_threshold must be a finite number >= 0, got inf"),
        ("entropy_threshold=.nan", "entropy_threshold must be a finite number >= 0, got nan"),
    ],
    "cactus": [(f"delta={value}", "delta must be a finite number ≥ 0, got") for value in ("-0.1", ".nan", ".inf")],
    "ensemble": [
        (f"weight={value}", "weight must be a number in [0, 1] or null (lossless), got")
        for value in ("1.5", "-0.1", ".nan")
    ],
    "mentored": [("divergence=js", "divergence")],
}
"""`--set verifier.params.SETTING` each built-in refuses at the command line, and what its one line says."""


@pytest.mark.parametrize(
    ("name", "setting", "message"),
    [pytest.param(n, s, m, id=f"{n}-{s}") for n, refusals in CLI_REFUSALS.items() for s, m in refusals],
)
def test_a_bad_parameter_at_the_command_line_is_one_line(run, recipe_path, name, setting, message):
    code, _, err = run(["generate", "-r", recipe_path, "--verifier", name, "--set", f"verifier.params.{setting}", "a"])
    assert code == 2
    one_error_line(err, f"verifier '{name}': {message}")
