"""Typical acceptance (``typical``, Medusa §3.3.1, vLLM's TypicalAcceptanceSampler): a draft token is kept iff
q(x) > τ = min(ε, δ·exp(−H(q))), else the target's argmax is committed; the bonus token is drawn from q.

The worked example by hand; the one-hot conditional, the output law and the acceptance by enumeration over the
draft token; the case δ ≥ 1 where the argmax itself fails the test (the recovered token is then x, accepted);
verify_block deterministic under every key (its {0, 1} acceptances against uniforms in ]0, 1[), its bonus the
keyed one; the author's kit; the device path (no read, a fixed count, one graph); vmap batching; one read per
block in the engine; parameters out of range refused in one line.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.base.sampling import sample_with
from specdec_cli.kit.testing import candidate_acceptance, enumerate_output_law, random_distributions
from specdec_cli.plugins.laws import single_draft_draws
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins.typical import TypicalAcceptance

pytestmark = pytest.mark.usefixtures("one_thread")

WORKED = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
"""The worked example's q: H = 1.1421 nats, exp(−H) = 0.3191, δ·exp(−H) = 0.0957 at δ = 0.3, so τ = ε = 0.09."""
FLAT = torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64)
"""At δ = 2, ε = 1: H = 1.0889, τ = min(1, 2·0.3366) = 0.6732 > max q, so every token fails, the argmax too."""
PARAMS = [{}, {"threshold": 0.3, "alpha": 0.5}, {"threshold": 1.0, "alpha": 2.0}, {"threshold": 0.05, "alpha": 5.0}]


def _typical(**params) -> TypicalAcceptance:
    return VerifierRegistry().create("typical", params)


def _output(verifier, q: torch.Tensor, x: int) -> torch.Tensor:
    """The conditional law ``[V]`` of the output given the draft token x (the draft law does not enter it)."""
    vocab = q.shape[-1]
    return verifier.conditional(q, torch.full((1, vocab), 1.0 / vocab, dtype=q.dtype), torch.tensor([x]))


def _one_hot(token: int, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).double()


# --------------------------------------------------------------------------- the rule at one position


def test_the_worked_example():
    entropy = -sum(float(v) * math.log(float(v) + 1e-5) for v in WORKED)  # vLLM's smoothed entropy
    assert entropy == pytest.approx(1.1420800, abs=1e-6)
    assert math.exp(-entropy) == pytest.approx(0.3191545, abs=1e-6)
    assert 0.3 * math.exp(-entropy) == pytest.approx(0.0957463, abs=1e-6)  # above ε: τ = ε
    verifier = _typical()
    assert (verifier.threshold, verifier.alpha) == (0.09, 0.3)  # vLLM's defaults
    assert float(verifier.acceptance_threshold(WORKED)) == pytest.approx(0.09, abs=1e-15)
    for x, expected in [(0, 0), (1, 1), (2, 2), (3, 0)]:  # 0.15 > 0.09 passes; 0.05 fails and becomes the argmax
        assert torch.equal(_output(verifier, WORKED, x), _one_hot(expected, 4)), x
    draft = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    law = verifier.output_law(WORKED, draft.view(1, 4))
    torch.testing.assert_close(law, torch.tensor([0.5, 0.2, 0.3, 0.0], dtype=torch.float64))
    assert float(verifier.acceptance_probability(WORKED, draft.view(1, 4))) == pytest.approx(0.6)


def test_alpha_sets_the_threshold_below_epsilon():
    """At δ = 0.1 the entropy term is the smaller: τ = 0.0319, and token 3 (0.05) passes too."""
    verifier = _typical(alpha=0.1)
    assert float(verifier.acceptance_threshold(WORKED)) == pytest.approx(0.1 * 0.3191545, abs=1e-6)
    assert torch.equal(_output(verifier, WORKED, 3), _one_hot(3, 4))


def test_the_test_is_strict():
    """q(x) = τ fails: with ε = 1/8 below δ·exp(−H) = 2^−1.75 (H = 1.75 ln 2), τ is 1/8 exactly, as is q(2)."""
    q = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    verifier = _typical(threshold=0.125, alpha=1.0)
    assert float(verifier.acceptance_threshold(q)) == 0.125
    assert torch.equal(_output(verifier, q, 2), _one_hot(0, 4))
    assert torch.equal(_output(verifier, q, 1), _one_hot(1, 4))
    uniform = torch.full((1, 4), 0.25, dtype=torch.float64)
    torch.testing.assert_close(verifier.output_law(q, uniform), torch.tensor([0.75, 0.25, 0, 0], dtype=torch.float64))
    assert float(verifier.acceptance_probability(q, uniform)) == 0.5
    target, draft, tokens = _block([q] * 3, [1, 2])  # float32, as the engine passes the laws
    decision = verifier.verify_block(target, draft, tokens, Draws.create(0, 0))
    assert int(decision.num_accepted) == 1 and decision.tokens[:2].tolist() == [1, 0]


def test_the_entropy_is_vllms_smoothed_one():
    """−Σ q ln(q + 1e-5): a one-hot q has H = −ln(1 + 1e-5) < 0, so τ = min(ε, δ·(1 + 1e-5)) (the exact entropy gives
    δ), and zeros in q add 0·ln(1e-5) = 0, leaving H as over the support."""
    one_hot = _one_hot(2, 5)
    assert float(_typical(threshold=1.0, alpha=0.4).acceptance_threshold(one_hot)) == pytest.approx(0.4 * (1 + 1e-5))
    padded = torch.cat([WORKED, torch.zeros(3, dtype=torch.float64)])
    verifier = _typical(alpha=0.2)
    assert float(verifier.acceptance_threshold(padded)) == float(verifier.acceptance_threshold(WORKED))


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_the_output_law_and_acceptance_by_enumeration(params, seed):
    """Σ_x p(x)·conditional(x) is output_law and P(output = x) is acceptance_probability, on random laws with exact
    zeros; each conditional is one-hot at x or at argmax q."""
    generator = torch.Generator().manual_seed(seed)
    q, p = random_distributions(generator, (2, 6), sparsity=0.3 if seed % 2 else 0.0)  # [V] each
    verifier = _typical(**params)
    torch.testing.assert_close(enumerate_output_law(verifier, q, p.view(1, 6)), verifier.output_law(q, p.view(1, 6)))
    acceptance = float(verifier.acceptance_probability(q, p.view(1, 6)))
    assert acceptance == pytest.approx(candidate_acceptance(verifier, q, p.view(1, 6)), abs=1e-12)
    tau, mode = float(verifier.acceptance_threshold(q)), int(q.argmax())
    for x in range(6):
        expected = x if float(q[x]) > tau or x == mode else mode
        assert torch.equal(_output(verifier, q, x), _one_hot(expected, 6))


def test_the_formulas_batch_over_leading_dimensions():
    generator = torch.Generator().manual_seed(5)
    q = random_distributions(generator, (3, 4, 7))  # [3, 4, V]
    p = random_distributions(generator, (3, 4, 1, 7))  # [3, 4, 1, V]
    x = torch.randint(0, 7, (3, 4, 1), generator=generator)  # [3, 4, 1]
    verifier = _typical(threshold=0.2, alpha=0.6)
    conditional = verifier.conditional(q, p, x)  # [3, 4, V]
    law = verifier.output_law(q, p)  # [3, 4, V]
    acceptance = verifier.acceptance_probability(q, p)  # [3, 4]
    assert conditional.shape == law.shape == (3, 4, 7) and acceptance.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            torch.testing.assert_close(conditional[i, j], verifier.conditional(q[i, j], p[i, j], x[i, j]))
            torch.testing.assert_close(law[i, j], verifier.output_law(q[i, j], p[i, j]))
            torch.testing.assert_close(acceptance[i, j], verifier.acceptance_probability(q[i, j], p[i, j]))


def test_it_is_lossy():
    """π ≠ q: the failing tokens' mass moves to the argmax (the negative control of a lossless rule)."""
    verifier = _typical()
    law = verifier.output_law(WORKED, WORKED.view(1, 4))
    torch.testing.assert_close(law, torch.tensor([0.55, 0.3, 0.15, 0.0], dtype=torch.float64))
    assert float(verifier.output_kl(WORKED, WORKED.view(1, 4))) == math.inf  # token 3 can never come out


def test_a_greedy_target_makes_it_greedy_matching():
    """q one-hot: every other token has q = 0 ≤ τ, so the output is argmax q whatever the draft."""
    q = _one_hot(1, 4)
    for params in PARAMS:
        verifier = _typical(**params)
        for x in range(4):
            assert torch.equal(_output(verifier, q, x), q)


# --------------------------------------------------------------------------- δ ≥ 1: the argmax can fail


def test_at_alpha_above_one_the_argmax_fails_and_counts_as_accepted():
    verifier = _typical(threshold=1.0, alpha=2.0)
    tau = float(verifier.acceptance_threshold(FLAT))
    assert tau == pytest.approx(2 * math.exp(-1.0888699758), abs=1e-9) and tau > float(FLAT.max())
    assert not (FLAT > tau).any()  # vLLM's mask rejects every token, the argmax too
    assert verifier.passes(FLAT).tolist() == [True, False, False]  # kept as drafted: the recovered argmax only
    assert torch.equal(_output(verifier, FLAT, 0), _one_hot(0, 3))  # the recovered token is x itself
    assert torch.equal(_output(verifier, FLAT, 1), _one_hot(0, 3))
    draft = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert float(verifier.acceptance_probability(FLAT, draft.view(1, 3))) == pytest.approx(0.2)  # P(output == x)
    torch.testing.assert_close(verifier.output_law(FLAT, draft.view(1, 3)), _one_hot(0, 3))


def test_at_alpha_above_one_a_block_of_argmax_tokens_is_accepted_whole():
    """The accepted argmax goes on along the draft: a block whose tokens are all the (failing) argmax earns its
    bonus token, and one that leaves the argmax stops there with the argmax."""
    verifier = _typical(threshold=1.0, alpha=2.0)
    target = FLAT.float().expand(1, 4, 3)  # [1, L+1, V]
    draft = torch.full((1, 3, 3), 1.0 / 3)  # [1, L, V]
    for key in range(20):
        whole = verifier.verify_block(target, draft, torch.tensor([[0, 0, 0]]), Draws.create(key, 0))
        assert int(whole.num_accepted) == 3 and whole.tokens[:3].tolist() == [0, 0, 0]
        stopped = verifier.verify_block(target, draft, torch.tensor([[0, 2, 0]]), Draws.create(key, 0))
        assert int(stopped.num_accepted) == 1 and stopped.tokens[:2].tolist() == [0, 0]


# --------------------------------------------------------------------------- the block


def _block(rows: list[torch.Tensor], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 target laws ``[1, L+1, V]`` from ``rows``, a flat draft law ``[1, L, V]``, draft tokens ``[1, L]``."""
    target = torch.stack(rows).float().unsqueeze(0)  # [1, L+1, V]
    vocab = target.shape[-1]
    return target, torch.full((1, len(tokens), vocab), 1.0 / vocab), torch.tensor([tokens])


def test_a_block_keeps_the_prefix_up_to_the_first_failing_token_under_every_key():
    """The acceptances are 0 or 1 and every uniform lies in ]0, 1[, so the keyed test is the deterministic one:
    tokens 1 and 2 pass, token 3 fails, the argmax 0 replaces it, and the token after it is never looked at."""
    target, draft, tokens = _block([WORKED] * 5, [1, 2, 3, 1])
    verifier = _typical()
    for key in range(200):
        draws = Draws.create(key, block_start=7 * key)
        table = single_draft_draws(draws, 4, torch.device("cpu"))  # [L+1, 3]: the uniforms the block takes
        assert bool(((table > 0) & (table < 1)).all())
        decision = verifier.verify_block(target, draft, tokens, draws)
        assert int(decision.num_accepted) == 2 and decision.tokens[:3].tolist() == [1, 2, 0]
        assert int(decision.row) == 0


def test_the_draft_law_does_not_enter_the_decision():
    target, draft, tokens = _block([WORKED] * 4, [0, 2, 3])
    verifier = _typical()
    other = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.97, 0.01, 0.01, 0.01], [0.0, 0.0, 0.0, 1.0]]])
    for key in range(10):
        first = verifier.verify_block(target, draft, tokens, Draws.create(key, 0))
        second = verifier.verify_block(target, other, tokens, Draws.create(key, 0))
        assert torch.equal(first.tokens, second.tokens) and int(first.num_accepted) == int(second.num_accepted) == 2


def test_the_correction_is_the_argmax_of_its_position_first_index_on_ties():
    tied = torch.tensor([0.1, 0.4, 0.05, 0.4, 0.05], dtype=torch.float64)
    first = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)
    target, draft, tokens = _block([first, tied, first], [0, 4])  # 0 passes; 4 (0.05 ≤ 0.09) fails at a tie 1 / 3
    decision = _typical().verify_block(target, draft, tokens, Draws.create(3, 0))
    assert int(decision.num_accepted) == 1 and decision.tokens[:2].tolist() == [0, 1]


def test_the_bonus_is_the_keyed_draw_from_q():
    """After a block accepted whole the token is q's at the BONUS uniform of offset L, as every built-in draws it;
    over keys it follows q."""
    bonus_law = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    target, draft, tokens = _block([WORKED, WORKED, bonus_law], [0, 1])
    verifier = _typical()
    counts = torch.zeros(4)
    for key in range(2000):
        draws = Draws.create(key, block_start=key % 5)
        decision = verifier.verify_block(target, draft, tokens, draws)
        assert int(decision.num_accepted) == 2
        uniform = single_draft_draws(draws, 2, torch.device("cpu"))[2, 2]  # (L, BONUS)
        assert int(decision.tokens[2]) == int(sample_with(target[0, 2], uniform))
        counts[int(decision.tokens[2])] += 1
    torch.testing.assert_close(counts / counts.sum(), bonus_law.float(), atol=0.035, rtol=0)


# --------------------------------------------------------------------------- the device path and batches


# --------------------------------------------------------------------------- the engine and the command line
