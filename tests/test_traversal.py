"""Traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398; specdec_plugins/traversal.py): its block law
is the target's by exact enumeration over every draft block (K rows as a tree, identical or different draft laws),
``verify`` samples that law, on one row it decides as block verification does from the same draws, the author's kit
passes it through the registry's seam, and on one chain its expected accepted length is block verification's, never
below speculative sampling's. Each exactness check has a negative control that it must reject."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import specdec_plugins.traversal as traversal
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.plugins.verifiers import Decision
from specdec_cli.randomness import Draws
from specdec_cli.testing import (
    adversarial_distribution_pairs,
    check_verifier,
    chi_square_p_value,
    committed_block_law,
    decision_outcomes,
    enumerate_block_law,
    expected_committed_tokens,
    random_distributions,
    random_sequence_laws,
    target_sequence_law,
)
from specdec_plugins.block import BlockVerification
from specdec_plugins.speculative import SpeculativeSampling
from specdec_plugins.traversal import TraversalVerification

VOCAB = 3


def laws_of(seed: int, num_rows: int, draft_length: int, identical: bool, sparsity: float = 0.0):
    """(target law, K draft laws) over prefixes of a tiny vocabulary, as the kit's enumeration takes them."""
    generator = torch.Generator().manual_seed(seed)
    target = random_sequence_laws(generator, VOCAB, draft_length + 1, sparsity)
    drafts = [random_sequence_laws(generator, VOCAB, draft_length, sparsity) for _ in range(num_rows)]
    drafts = drafts[:1] * num_rows if identical else drafts
    return target.__getitem__, [laws.__getitem__ for laws in drafts]


def largest_gap(verifier, target_law, draft_laws, draft_length: int) -> float:
    """The largest difference between the enumerated law of the first L+1 tokens and the target's own."""
    law = enumerate_block_law(verifier, target_law, draft_laws, VOCAB, draft_length)
    assert abs(sum(law.values()) - 1) < 1e-12
    target = target_sequence_law(target_law, VOCAB, draft_length + 1)
    return max(abs(law.get(sequence, 0.0) - mass) for sequence, mass in target.items())


TREES = [(1, 3, True), (2, 2, True), (2, 2, False), (3, 2, True), (3, 2, False), (2, 3, False)]


@pytest.mark.parametrize("sparsity", [0.0, 0.4])
@pytest.mark.parametrize("num_rows,draft_length,identical", TREES)
def test_the_block_law_is_the_targets_law(num_rows, draft_length, identical, sparsity):
    """Summed over every draft block (3^(K L) of them), the committed tokens then the target's own follow the target:
    lossless (Weng et al., Theorem 1), with rows of one draft law or of different ones."""
    target_law, draft_laws = laws_of(7 * num_rows + draft_length, num_rows, draft_length, identical, sparsity)
    assert largest_gap(TraversalVerification(), target_law, draft_laws, draft_length) < 1e-12


@pytest.mark.parametrize("pair", range(len(adversarial_distribution_pairs(VOCAB))))
@pytest.mark.parametrize("num_rows", [1, 2])
def test_laws_that_break_careless_verifiers_stay_lossless(num_rows, pair):
    """One-hot, disjoint and near-zero laws (the kit's adversarial pairs, the same at every prefix): no NaN, and the
    law is still the target's."""
    target, draft = adversarial_distribution_pairs(VOCAB)[pair]
    gap = largest_gap(TraversalVerification(), lambda prefix: target, [lambda prefix: draft] * num_rows, 2)
    assert gap < 1e-12


def test_negative_control_a_traversal_that_keeps_visited_siblings_in_p_is_lossy(monkeypatch):
    """The enumeration can fail: with the deletion's residual (w Q - P)+ taken against p whole instead of p without the
    children visited before (the deleted node's draw avoided them), the block law departs from the target's where
    rows share a node."""
    target_law, draft_laws = laws_of(3, 2, 2, identical=True)
    monkeypatch.setattr(traversal, "_unvisited", lambda draft, visited: draft)
    assert largest_gap(TraversalVerification(), target_law, draft_laws, 2) > 1e-3


class MisinformedTraversal(TraversalVerification):
    """Traversal told uniform draft laws instead of the ones the tokens were drawn from."""

    def block_law(self, target_probs, draft_probs, draft_tokens):
        return super().block_law(target_probs, torch.full_like(draft_probs, 1 / VOCAB), draft_tokens)


def test_negative_control_misstated_draft_laws_are_caught():
    target_law, draft_laws = laws_of(5, 2, 2, identical=False)
    assert largest_gap(MisinformedTraversal(), target_law, draft_laws, 2) > 1e-3


# ------------------------------------------------------------------ Algorithm 1 transcribed, node by node


def transcribed_law(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, rows: list[tuple[int, ...]], reverse: bool = False
) -> torch.Tensor:
    """Weng et al.'s Algorithm 1 written out on a dict tree, recursively in post-order, as the paper states it (the
    plugin's tensor form shares none of this code): the block law ``[K, L+1, V]`` of target_probs ``[K, L+1, V]``,
    draft_probs ``[K, L, V]`` (float64) and the K rows. A node is a prefix, owned by the first row that has it; a child
    entered gets p_alpha = min(1, p_alpha(parent) M_b(x) / M_s(x)); a rejected child makes M_b(parent) the normalised
    (p_alpha M_b - M_s)+ and p_alpha(parent) its mass over (its mass + 1 - p_alpha); M_s is the child's row's p
    without the children already visited. ``reverse``: visit children last row first (a negative control)."""
    owner: dict[tuple[int, ...], int] = {(): 0}
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for k, row in enumerate(rows):
        for t in range(1, len(row) + 1):
            if row[:t] not in owner:
                owner[row[:t]] = k
                children.setdefault(row[: t - 1], []).append(row[:t])
    m_b = {node: target_probs[k, len(node)].clone() for node, k in owner.items()}
    visited = {node: [] for node in owner}
    p_alpha = {(): 1.0}
    law = torch.zeros(target_probs.shape, dtype=torch.float64)  # [K, L+1, V]
    reach = [1.0]

    def visit(node: tuple[int, ...]) -> None:
        for child in children.get(node, [])[:: -1 if reverse else 1]:
            m_s = draft_probs[owner[child], len(node)].clone()  # [V]
            m_s[visited[node]] = 0
            m_s = m_s / m_s.sum()
            p_alpha[child] = min(1.0, p_alpha[node] * float(m_b[node][child[-1]] / m_s[child[-1]]))
            visit(child)  # returns when every check in the child's subtree has rejected
            excess = (p_alpha[node] * m_b[node] - m_s).clamp_min(0)  # [V]
            mass = float(excess.sum())
            p_alpha[node] = mass / (mass + 1 - p_alpha[node]) if mass + 1 - p_alpha[node] > 0 else 0.0
            m_b[node] = excess / mass if mass > 0 else m_b[node]
            visited[node].append(child[-1])
        accept = 1.0 if node == () else min(p_alpha[node], 1.0)
        law[owner[node], len(node)] += reach[0] * accept * m_b[node]
        reach[0] *= 1 - accept

    visit(())
    return law


def random_tree(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:
    """K = 5 rows drawn from their laws (one law for all on even seeds, one per row on odd ones) over V = 3, L = 3:
    target ``[K, L+1, V]``, draft ``[K, L, V]`` (float64) and the rows."""
    generator = torch.Generator().manual_seed(seed)
    identical = seed % 2 == 0
    target = smooth_sequence_laws(generator, VOCAB, 4)
    drafts = [smooth_sequence_laws(generator, VOCAB, 3) for _ in range(1 if identical else 5)] * (5 if identical else 1)
    rows = []
    for laws in drafts:
        row: tuple[int, ...] = ()
        for _ in range(3):
            row += (int(torch.multinomial(laws[row], 1, generator=generator)),)
        rows.append(row)
    target_probs = torch.stack([torch.stack([target[row[:t]] for t in range(4)]) for row in rows])
    draft_probs = torch.stack([torch.stack([laws[row[:t]] for t in range(3)]) for laws, row in zip(drafts, rows)])
    return target_probs, draft_probs, rows


@pytest.mark.parametrize("seed", range(6))
def test_the_tensor_traversal_is_algorithm_1_transcribed(seed):
    """On random trees (K = 5 rows drawn from their laws over V = 3, L = 3, so that they share nodes often), the
    plugin's block law is the transcription's, entry by entry."""
    target_probs, draft_probs, rows = random_tree(seed)
    ours = TraversalVerification().block_law(target_probs, draft_probs, torch.tensor(rows))
    assert torch.allclose(ours, transcribed_law(target_probs, draft_probs, rows), atol=1e-12, rtol=0)


def test_negative_control_another_visiting_order_is_told_apart():
    """The comparison can fail: children visited last row first give another law (also lossless, but not this
    traversal's) on some of the same trees."""
    trees = [random_tree(seed) for seed in range(6)]
    differ = [
        not torch.allclose(
            TraversalVerification().block_law(target, draft, torch.tensor(rows)),
            transcribed_law(target, draft, rows, reverse=True),
            atol=1e-12,
            rtol=0,
        )
        for target, draft, rows in trees
    ]
    assert any(differ)


# ------------------------------------------------------------------ sampling: verify against block_law

ROWS = [(0, 1, 2), (0, 1, 3), (0, 2, 1), (0, 1, 2), (3, 0, 0)]
"""A tree over V = 4: a node shared by three rows, a duplicate row, a row that shares nothing."""


def smooth_sequence_laws(generator: torch.Generator, vocab: int, depth: int) -> dict[tuple[int, ...], torch.Tensor]:
    """A law ``[V]`` after every prefix shorter than ``depth``, none far from uniform (every row of ``ROWS`` likely, so
    that decisions fall on many nodes of the tree)."""
    prefixes = [prefix for n in range(depth) for prefix in itertools.product(range(vocab), repeat=n)]
    weights = torch.rand(len(prefixes), vocab, generator=generator, dtype=torch.float64) + 0.05  # [prefixes, V]
    return dict(zip(prefixes, weights / weights.sum(-1, keepdim=True)))


def tree_block(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The laws of ``ROWS`` under random sequence laws (rows with a common prefix share its laws): target
    ``[K, L+1, V]``, draft ``[K, L, V]`` (float64), tokens ``[K, L]``."""
    generator = torch.Generator().manual_seed(seed)
    vocab, length = 4, len(ROWS[0])
    target, draft = (smooth_sequence_laws(generator, vocab, depth) for depth in (length + 1, length))
    target_probs = torch.stack([torch.stack([target[row[:t]] for t in range(length + 1)]) for row in ROWS])
    draft_probs = torch.stack([torch.stack([draft[row[:t]] for t in range(length)]) for row in ROWS])
    return target_probs, draft_probs, torch.tensor(ROWS)


def sampled_outcomes(samples: int, seed: int) -> Counter:
    """The committed sequences of ``samples`` blocks decided in one ``verify`` call with keyed draws."""
    block = tree_block(seed)
    batch = [tensor.expand(samples, *tensor.shape) for tensor in block]
    decision = TraversalVerification().verify(*batch, Draws.batch(list(range(samples))))
    counts: Counter = Counter()
    for committed, accepted, row in zip(
        decision.tokens.tolist(), decision.num_accepted.tolist(), decision.row.tolist()
    ):
        assert tuple(committed[:accepted]) == ROWS[row][:accepted]
        counts[tuple(committed[: accepted + 1])] += 1
    return counts


def test_verify_samples_its_block_law_on_a_tree():
    """Chi-square of 8000 keyed decisions against block_law, on a tree where rows share nodes and commits come from
    several rows."""
    counts = sampled_outcomes(8000, seed=24)
    law = decision_outcomes(TraversalVerification().block_law(*tree_block(24)), torch.tensor(ROWS))
    assert abs(sum(law.values()) - 1) < 1e-12
    assert chi_square_p_value(counts, law) > 1e-4
    assert len({sequence[:-1] for sequence in counts}) >= 4, "commits should end at several nodes of the tree"


def test_negative_control_another_blocks_law_is_rejected():
    """The chi-square can fail: the same decisions against the block law of other random laws."""
    counts = sampled_outcomes(8000, seed=24)
    other = decision_outcomes(TraversalVerification().block_law(*tree_block(38)), torch.tensor(ROWS))
    assert chi_square_p_value(counts, other) < 1e-4


# ------------------------------------------------------------------ one row: block verification


def one_row_blocks(seed: int, batch: int = 2000, length: int = 5, vocab: int = 6):
    """``batch`` single-row blocks: target ``[B, 1, L+1, V]``, draft ``[B, 1, L, V]``, tokens ``[B, 1, L]`` drawn from
    the draft."""
    generator = torch.Generator().manual_seed(seed)
    target = random_distributions(generator, (batch, 1, length + 1, vocab))
    draft = random_distributions(generator, (batch, 1, length, vocab))
    tokens = torch.multinomial(draft.view(-1, vocab), 1, generator=generator).view(batch, 1, length)
    return target, draft, tokens


def test_one_row_decides_as_block_verification_from_the_same_draws():
    """K = 1: the same uniforms give the same decisions (the checks L, L-1, ..., 0 are block verification's stop
    tests h_t, and the token after comes from the same residual with the same draw), and the same block law."""
    block = one_row_blocks(seed=4)
    draws = Draws.batch(list(range(block[0].shape[0])))
    ours, theirs = TraversalVerification().verify(*block, draws), BlockVerification().verify(*block, draws)
    for field in ("tokens", "num_accepted", "row"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    assert 0 < ours.num_accepted.float().mean() < block[2].shape[-1]
    single = [tensor[0] for tensor in block]
    assert torch.allclose(
        TraversalVerification().block_law(*single), BlockVerification().block_law(*single), atol=1e-12
    )


def test_negative_control_other_draws_give_other_decisions():
    """The equality above is not vacuous: block verification with other keys decides otherwise somewhere."""
    block = one_row_blocks(seed=4)
    keys = list(range(block[0].shape[0]))
    ours = TraversalVerification().verify(*block, Draws.batch(keys))
    theirs = BlockVerification().verify(*block, Draws.batch([key + 1 for key in keys]))
    assert not torch.equal(ours.tokens, theirs.tokens)


def test_greedy_target_commits_its_argmax_path():
    """One-hot target laws (temperature 0): every committed token is the target's argmax, with no NaN on the way."""
    target, draft, tokens = one_row_blocks(seed=6, batch=300, length=3, vocab=4)
    rows = torch.cat([tokens, torch.zeros_like(tokens)], 1)  # [B, 2, L]: a second row of the argmax path
    target = torch.zeros_like(target).index_fill_(-1, torch.tensor([0]), 1.0).expand(-1, 2, -1, -1)
    decision = TraversalVerification().verify(target, draft.expand(-1, 2, -1, -1), rows, Draws.batch(list(range(300))))
    committed = decision.tokens.masked_fill(torch.arange(4) > decision.num_accepted.unsqueeze(-1), 0)  # [B, L+1]
    assert torch.equal(committed, torch.zeros_like(committed))
    assert bool((decision.num_accepted == 3).all()), "the argmax row is always accepted whole"


def valid(decision, tokens: torch.Tensor) -> bool:
    """Every sequence commits its row's first num_accepted draft tokens (tokens ``[B, K, L]``)."""
    drafted = tokens[torch.arange(tokens.shape[0]), decision.row]  # [B, L]
    kept = torch.arange(tokens.shape[-1]) < decision.num_accepted.unsqueeze(-1)  # [B, L]
    return bool(((decision.tokens[:, :-1] == drafted) | ~kept).all())


def test_every_kind_of_randomness_decides_validly():
    """Keyed draws (the engine's), one generator per sequence, and None (torch's own draws, a test's)."""
    block = [tensor.expand(64, *tensor.shape) for tensor in tree_block(24)]
    generators = [torch.Generator().manual_seed(seed) for seed in range(64)]
    for randomness in (Draws.batch(list(range(64))), generators, None):
        assert valid(TraversalVerification().verify(*block, randomness), block[2])
    decision = TraversalVerification().verify(*block, Draws.batch(list(range(64))))
    shifted = Decision(decision.tokens, decision.num_accepted, (decision.row + 1) % len(ROWS))
    assert not valid(shifted, block[2]), "negative control: another row's tokens are caught"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_decisions_are_the_cpus():
    """Keyed draws make the decision a function of the block alone: the same on the GPU as on the CPU."""
    block = [tensor.expand(512, *tensor.shape) for tensor in tree_block(24)]
    on_cpu = TraversalVerification().verify(*block, Draws.batch(list(range(512))))
    on_gpu = TraversalVerification().verify(*(t.cuda() for t in block), Draws.batch(list(range(512)), "cuda"))
    for field in ("tokens", "num_accepted", "row"):
        assert torch.equal(getattr(on_cpu, field), getattr(on_gpu, field).cpu()), field


# ------------------------------------------------------------------ the author's kit, through the registry's seam


def test_the_authors_kit_passes_through_the_registry_seam():
    registry = VerifierRegistry(extra={"traversal": TraversalVerification})
    cls = registry.load_class("traversal")
    assert cls is TraversalVerification and registry.contract_problem(cls) is None
    check_verifier(cls, samples=2000)


# ------------------------------------------------------------------ expected accepted length on one chain


def accepted_length(verifier, target_law, draft_laws, draft_length: int) -> float:
    """Expected draft tokens kept per block, by exact enumeration of every draft block."""
    law = committed_block_law(verifier, target_law, draft_laws, VOCAB, draft_length)
    return expected_committed_tokens(law) - 1


def chain_lengths(seed: int) -> tuple[float, float, float]:
    target_law, draft_laws = laws_of(seed, 1, 3, identical=True, sparsity=0.3 * (seed % 2))
    return tuple(accepted_length(rule, target_law, draft_laws, 3) for rule in CHAIN_RULES)


CHAIN_RULES = (TraversalVerification(), BlockVerification(), SpeculativeSampling())
CHAIN_LENGTHS = [chain_lengths(seed) for seed in range(12)]


def test_on_one_chain_traversal_keeps_as_many_as_block_and_block_at_least_speculative():
    """The issue's claim on one chain, over 12 random law sets (V = 3, L = 3): traversal = block (it is block
    verification there) >= speculative sampling (Sun et al.'s Theorem 2)."""
    for traversal_length, block_length, speculative_length in CHAIN_LENGTHS:
        assert abs(traversal_length - block_length) < 1e-12
        assert block_length >= speculative_length - 1e-12


def test_negative_control_the_ordering_is_strict_somewhere():
    """The comparison has power: block keeps strictly more than speculative sampling on some laws, so the reversed
    claim (speculative >= block) fails."""
    assert any(block > speculative + 1e-3 for _, block, speculative in CHAIN_LENGTHS)
    assert not all(speculative >= block - 1e-12 for _, block, speculative in CHAIN_LENGTHS)
