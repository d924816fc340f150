"""Cactus (``cactus``, docs/verifiers.md): speculative sampling against h^x, the target law with the drafted token x
raised to h_x = q(x) + sqrt(2δ q(x)(1 − q(x))) and the rest scaled down. It replays the authors' vLLM patch on the
same laws and uniforms (vLLM draws the recovered token by an exponential race: the replay draws from the source's
recovered law with specdec's uniform, and compares the laws apart); at δ = 0 it is speculative sampling; its output
law (O(V log V)) and acceptance are exact; the author's kit passes; the KL it spends is not δ, and mentored accepts
at least as much at that KL; a bad δ is one line."""

from __future__ import annotations

import pytest
import torch

from specdec_cli.base.randomness import Draws
from specdec_cli.base.sampling import sample_with
from specdec_cli.kit.testing import (
    adversarial_distribution_pairs,
    candidate_acceptance,
    enumerate_output_law,
    random_distributions,
)
from specdec_cli.plugins.divergences import kl_divergence
from specdec_cli.plugins.laws import excess_weights, single_draft_draws
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins.cactus import Cactus
from tests.conftest import BLOCK_KINDS, random_block

pytestmark = pytest.mark.usefixtures("one_thread")

DELTAS = [0.0, 0.01, 0.1, 1.0, 25.0]
"""δ: speculative sampling, small, moderate, the default (the Cactus README's), and large enough to accept most draft
tokens."""

BLOCKS = 90
"""Keyed blocks per δ in the replay."""


def _cactus(delta: float) -> Cactus:
    return VerifierRegistry().create("cactus", {"delta": delta})


# --------------------------------------------------------------------------- (a) the source, replayed


def solve_constraint(target_probs, draft_probs, selected_indices, delta, selected_only=False):
    """``solve_constraint`` of MANGA-UOFA/Cactus, ``cactus/cactus.py`` at 3b01b816d18bf1e02ce93d0c5d43b42d8814427b,
    literally (target_probs, draft_probs ``[B, L, V]``, selected_indices ``[B, L]``)."""
    index = selected_indices.unsqueeze(-1)  # [B, L, 1]
    q_n = target_probs.gather(-1, index).squeeze(-1)  # [B, L]
    h_n = q_n + torch.sqrt(2 * delta * q_n * (1 - q_n))
    h_n = h_n.clamp(min=0.0, max=1.0)  # [B, L]
    if selected_only:
        return h_n
    h = target_probs * ((1 - h_n) / (1 - q_n)).nan_to_num(nan=1.0, posinf=1.0, neginf=0.0).unsqueeze(-1)  # [B, L, V]
    h.scatter_(-1, index, h_n.unsqueeze(-1))  # [B, L, V]
    h = h.clamp(min=0.0, max=1.0)  # [B, L, V]
    return h  # [B, L, V]


def cactus_get_accepted(target_probs, draft_probs, draft_token_ids, uniform_rand, delta):
    """``CactusRejectionSampler._get_accepted`` (same file and commit), literally; ``uniform_rand`` ``[B, L]`` stands
    for vLLM's ``self._create_uniform_samples(seeded_seqs, batch_size, k - 1, device)`` (k uniforms per row)."""
    batch_size, k, _ = draft_probs.shape
    batch_indices = torch.arange(batch_size, device=target_probs.device)[:, None]
    probs_indices = torch.arange(k, device=target_probs.device)
    selected_draft_probs = draft_probs[batch_indices, probs_indices, draft_token_ids]  # [B, L]
    h_n = solve_constraint(target_probs, draft_probs, draft_token_ids, delta, selected_only=True)
    capped_ratio = torch.minimum(h_n / selected_draft_probs, torch.full((1,), 1, device=target_probs.device))
    accepted = uniform_rand < capped_ratio
    return accepted


def cactus_get_recovered_probs(target_probs, draft_probs, draft_token_ids, delta):
    """``CactusRejectionSampler._get_recovered_probs`` (same file and commit), literally → ``[B, L, V]``."""
    h = solve_constraint(target_probs, draft_probs, draft_token_ids, delta)
    h_minus_p_phi = torch.clamp(h - draft_probs, min=0.0)
    recovered_probs = h_minus_p_phi / h_minus_p_phi.sum(dim=-1, keepdim=True)
    recovered_probs = torch.nan_to_num(recovered_probs, nan=0.0, posinf=1.0, neginf=0.0)
    return recovered_probs


def vllm_create_output(accepted, substitute_token_ids, draft_token_ids, bonus_token_ids, num_bonus_tokens=1):
    """``SpecDecodeBaseSampler._create_output`` of vLLM 0.7.3 (the version Cactus pins in its pyproject.toml;
    vllm/model_executor/layers/spec_decode_base_sampler.py), literally, without the counters: the accepted prefix,
    then the first rejected position's recovered token, or the bonus token after a block accepted whole; -1 after."""
    batch_size, k = substitute_token_ids.shape
    bonus_token_ids = bonus_token_ids.squeeze(-1)
    limits = (accepted == 0).max(1).indices
    limits[~(accepted == 0).any(1)] = k
    indices = torch.arange(k, device=accepted.device).unsqueeze(0)
    accepted_mask = indices < limits.unsqueeze(1)
    after_false_mask = indices == limits.unsqueeze(1)
    output_with_bonus_tokens = -torch.ones((batch_size, k + num_bonus_tokens), dtype=torch.int64)
    output = output_with_bonus_tokens[:, :k]
    output[:, :k] = torch.where(accepted_mask, draft_token_ids, -torch.ones_like(draft_token_ids))
    output_with_bonus_tokens[:, -1] = torch.where(output[:, -1] != -1, bonus_token_ids, -1)
    output.mul_(~after_false_mask).add_(substitute_token_ids.mul(after_false_mask))
    return output_with_bonus_tokens


def _source_block(target, draft, tokens, table, delta) -> tuple[list[int], torch.Tensor]:
    """The authors' sampler on one block (target ``[L+1, V]``, draft ``[L, V]``, tokens ``[L]``) → (the tokens it
    commits, its recovered laws ``[L, V]``). Its uniforms are the block's ACCEPT column of ``table``; vLLM's
    ``_multinomial`` draws each position's recovered token by an exponential race over V exponentials, here by
    inverse CDF with specdec's RESIDUAL uniform at that position (the same law; the laws are compared apart); the
    bonus token, which vLLM's sampler draws from q at position L, with specdec's BONUS uniform."""
    length = tokens.shape[0]
    target_probs, draft_probs, draft_token_ids = target[:-1].unsqueeze(0), draft.unsqueeze(0), tokens.unsqueeze(0)
    uniform_rand = table[:length, 0].unsqueeze(0)  # [1, L]
    accepted = cactus_get_accepted(target_probs, draft_probs, draft_token_ids, uniform_rand, delta)  # [1, L]
    recovered_probs = cactus_get_recovered_probs(target_probs, draft_probs, draft_token_ids, delta)[0]  # [L, V]
    recovered = torch.stack([sample_with(recovered_probs[n], table[n, 1]) for n in range(length)]).unsqueeze(0)
    bonus = sample_with(target[-1], table[length, 2]).view(1, 1)  # [1, 1]
    output = vllm_create_output(accepted, recovered, draft_token_ids, bonus)[0].tolist()  # [L+1]
    return output[: output.index(-1) if -1 in output else length + 1], recovered_probs


class ResidualOfQ(Cactus):
    """Negative control: draws after a rejection from speculative sampling's (q − p)+, not from (h^x − p)+."""

    name = "residual-of-q"

    def residual_weights(self, target_probs, draft_probs, x):
        return excess_weights(target_probs, draft_probs)


class NoFactorTwo(Cactus):
    """Negative control: h_x = q(x) + sqrt(δ q(x)(1 − q(x))), the factor 2 under the root dropped."""

    name = "no-factor-two"

    def boosted(self, target_x):
        return (target_x + torch.sqrt(self.delta * target_x * (1 - target_x))).clamp(0.0, 1.0)


def _block(seed: int, length: int = 4, vocab: int = 12, dtype=torch.float32):
    """float32 laws (vLLM's probs dtype) of a target ``[L+1, V]`` and a draft ``[L, V]`` halfway to it, and draft
    tokens drawn from the draft ``[L]``; in every third block the draft is pushed onto the target's fifth least likely
    token (p(x) near 1, q(x) small: rejected often even at a large δ, where the residuals of q and of h^x differ)."""
    generator = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(length + 1, vocab, generator=generator, dtype=dtype) * 2  # [L+1, V]
    draft_logits = (target_logits[:-1] + torch.randn(length, vocab, generator=generator, dtype=dtype) * 2) / 2
    if seed % 3 == 0:
        overrated = target_logits[:-1].argsort(-1)[:, 4:5]  # [L, 1]
        draft_logits.scatter_add_(-1, overrated, torch.full((length, 1), 6.0, dtype=dtype))
    target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)  # [L+1, V], [L, V]
    tokens = torch.multinomial(draft.double(), 1, generator=generator).view(-1)  # [L]
    return target, draft, tokens


@pytest.mark.parametrize("delta", DELTAS)
def test_it_decides_as_the_authors_sampler(delta):
    """Over 90 keyed blocks per δ: the same number accepted and the same committed tokens as the transcription run
    with vLLM 0.7.3's output semantics, and at the rejected position the same recovered law (to float32 rounding).
    The negative controls, fed the same blocks, disagree with it wherever δ > 0."""
    verifier, wrong = _cactus(delta), [ResidualOfQ(delta=delta), NoFactorTwo(delta=delta)]
    disagreements, rejections = [0, 0], 0
    for seed in range(BLOCKS):
        target, draft, tokens = _block(seed)
        draws = Draws.create(seed, 5 * seed)
        table = single_draft_draws(draws, 4, torch.device("cpu"))  # [L+1, 3]: the uniforms the block takes
        expected, recovered = _source_block(target, draft, tokens, table, delta)
        block = (target.unsqueeze(0), draft.unsqueeze(0), tokens.unsqueeze(0), draws)
        decision = verifier.verify_block(*block)
        accepted = int(decision.num_accepted)
        assert (accepted, decision.tokens[: accepted + 1].tolist()) == (len(expected) - 1, expected), seed
        if accepted < 4:
            rejections += 1
            n = torch.tensor(accepted)
            ours = verifier.residual_weights(target[n], draft[n], tokens[n].view(1))  # [V]
            torch.testing.assert_close(ours / ours.sum(), recovered[accepted], rtol=1e-5, atol=1e-7)
        for index, variant in enumerate(wrong):
            committed = variant.verify_block(*block)
            disagreements[index] += committed.tokens[: int(committed.num_accepted) + 1].tolist() != expected
    assert rejections > 5  # the recovered draw is exercised at every δ
    if delta > 0:
        assert all(count > 0 for count in disagreements), disagreements


# --------------------------------------------------------------------------- (b) δ = 0 is speculative sampling


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_at_delta_zero_it_decides_as_speculative_sampling(kind):
    """h = q to the bit at δ = 0 (sqrt(0) = 0, (1 − q)/(1 − q) = 1): the same tokens for the same draws, 50 keys."""
    target, draft, tokens = random_block(kind, 1, 5, 16, seed=3, identical_drafts=True)
    cactus, speculative = _cactus(0.0), VerifierRegistry().create("speculative", {})
    for key in range(50):
        draws = Draws.create(key, 7 * key)
        ours, theirs = (v.verify_block(target, draft, tokens, draws) for v in (cactus, speculative))
        assert (ours.tokens.tolist(), int(ours.num_accepted)) == (theirs.tokens.tolist(), int(theirs.num_accepted))


# --------------------------------------------------------------------------- (c) the output law and the acceptance


def brute_force_law(q: torch.Tensor, p: torch.Tensor, delta: float) -> torch.Tensor:
    """π(y) = Σ_x p(x) [a(x)·[y = x] + (1 − a(x))·r^x(y)] by the source's own functions, every x at once (V × V):
    solve_constraint for h^x, _get_accepted's ratio, _get_recovered_probs for r^x."""
    vocab = q.shape[-1]
    x = torch.arange(vocab).view(1, vocab)  # [1, V]: row x drafts token x
    target, draft = q.expand(1, vocab, vocab), p.expand(1, vocab, vocab)  # [1, V, V]
    boosted_x = solve_constraint(target, draft, x, delta, selected_only=True)[0]  # [V]
    accept = torch.where(p > 0, (boosted_x / p).clamp(max=1.0), 0.0)  # [V]
    recovered = cactus_get_recovered_probs(target, draft, x, delta)[0]  # [V(x), V(y)]
    return p * accept + ((p * (1 - accept)).unsqueeze(-1) * recovered).sum(0)  # [V]


def _edge_pairs(vocab: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(q, p) float64: q with zeros where p has mass, p with zeros where q has mass, q one-hot on a token p drafts
    and on one it never drafts, p one-hot where q is 0, and q(x) near 1."""

    def law(values):
        values = torch.tensor(values, dtype=torch.float64)
        return values / values.sum()

    return [
        (law([0.5, 0.0, 0.3, 0.0, 0.2]), law([0.1, 0.4, 0.1, 0.3, 0.1])),
        (law([0.2, 0.3, 0.1, 0.25, 0.15]), law([0.0, 0.6, 0.0, 0.4, 0.0])),
        (law([0.0, 1.0, 0.0, 0.0, 0.0]), law([0.2, 0.2, 0.2, 0.2, 0.2])),
        (law([0.0, 0.0, 0.0, 0.0, 1.0]), law([0.5, 0.5, 0.0, 0.0, 0.0])),
        (law([0.3, 0.3, 0.4, 0.0, 0.0]), law([0.0, 0.0, 0.0, 1.0, 0.0])),
        (law([1 - 4e-9, 1e-9, 1e-9, 1e-9, 1e-9]), law([0.1, 0.6, 0.1, 0.1, 0.1])),
    ]


@pytest.mark.parametrize("delta", DELTAS)
def test_output_law_and_acceptance_are_exact(delta):
    """output_law against the brute force and the kit's enumeration of conditional, acceptance_probability
    Σ min(p, h_x) against the kit's candidate acceptance: random laws (some sparse), the kit's adversarial pairs
    and the edge cases."""
    verifier = _cactus(delta)
    generator = torch.Generator().manual_seed(7)
    random = [tuple(random_distributions(generator, (2, v), 0.4 * (i % 2))) for v in (3, 6) for i in range(6)]
    for q, p in random + adversarial_distribution_pairs(5) + _edge_pairs():
        draft = p.view(1, -1)  # [1, V]
        output = verifier.output_law(q, draft)  # [V]
        torch.testing.assert_close(output, brute_force_law(q, p, delta), atol=1e-12, rtol=0)
        torch.testing.assert_close(output, enumerate_output_law(verifier, q, draft), atol=1e-12, rtol=0)
        assert float(output.min()) >= 0 and float(output.sum()) == pytest.approx(1.0, abs=1e-12)
        claimed = float(verifier.acceptance_probability(q, draft))
        assert claimed == pytest.approx(candidate_acceptance(verifier, q, draft), abs=1e-12)


def test_output_law_takes_a_real_vocabulary():
    """On 2048-token laws (as `specdec acceptance` hands it, float32 and batched over positions) the O(V log V) law
    is the V × V brute force's; the laws sum to 1."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 3, 2048, generator=generator, dtype=torch.float64) * 3  # [2, T, V]
    q, p = logits.softmax(-1).float()  # [T, V] each
    verifier = _cactus(0.05)
    output = verifier.output_law(q, p.unsqueeze(1))  # [T, V]
    assert output.dtype == torch.float32
    for t in range(3):
        exact = brute_force_law(q[t].double(), p[t].double(), 0.05)  # [V]
        torch.testing.assert_close(output[t].double(), exact, atol=1e-7, rtol=0)
    torch.testing.assert_close(output.double().sum(-1), torch.ones(3, dtype=torch.float64))


# --------------------------------------------------------------------------- (d) the author's kit


# --------------------------------------------------------------------------- (e) δ is not the KL it spends


def test_the_kl_it_spends_is_not_delta_and_mentored_accepts_as_much_there():
    """The worked example q = [0.6, 0.3, 0.1], p = [0.2, 0.5, 0.3] at δ = 0.01 spends KL(q ‖ π) = 0.0241 nats, 2.4×
    δ, to accept 0.707 (speculative sampling: 0.6; mentored at kl = 0.0241: 0.709). On random 6-token laws it spends
    more than δ on most, less on some. Wherever it spends D, mentored at kl = D (the KL-optimal rule) accepts at
    least as much."""
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    p = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64)
    spent = float(kl_divergence(q, _cactus(0.01).output_law(q, p)))
    assert spent == pytest.approx(0.0240953, rel=1e-5)
    assert float(_cactus(0.01).acceptance_probability(q, p)) == pytest.approx(0.7072338, rel=1e-6)
    mentored = VerifierRegistry().create("mentored", {"kl": spent})
    assert float(mentored.acceptance_probability(q, p)) == pytest.approx(0.7094515, rel=1e-6)

    generator, registry, ratios = torch.Generator().manual_seed(1), VerifierRegistry(), []
    for _ in range(40):
        q, p = random_distributions(generator, (2, 6), 0.0)  # [V] each
        for delta in (0.01, 0.1):
            verifier = _cactus(delta)
            spent = float(kl_divergence(q, verifier.output_law(q, p.view(1, -1))))
            ratios.append(spent / delta)
            mentored = registry.create("mentored", {"kl": spent})
            claimed = float(verifier.acceptance_probability(q, p.view(1, -1)))
            assert claimed <= float(mentored.acceptance_probability(q, p.view(1, -1))) + 1e-12
    assert max(ratios) > 1.4 and min(ratios) < 1  # above δ on some laws, below on others
    assert sum(ratio > 1 for ratio in ratios) > len(ratios) / 2


def test_delta_is_half_the_chi_square_of_h_from_q_and_not_the_kl_of_the_output():
    """What δ is: each h^x is at χ²(h^x ‖ q) = (h_x − q(x))² / (q(x)(1 − q(x))) = 2δ from q, the second-order
    expansion of KL(h^x ‖ q) ≤ δ, wherever h_x is not clamped at 1. What it is not: on 1000-token laws (a draft halfway
    to the target) the output law, a mixture over x, spends KL(q ‖ π) tens of times δ at δ = 0.01."""
    generator = torch.Generator().manual_seed(2)
    target_logits = torch.randn(20, 1000, generator=generator, dtype=torch.float64) * 2  # [T, V]
    draft_logits = (target_logits + torch.randn(20, 1000, generator=generator, dtype=torch.float64) * 2) / 2
    q, p = target_logits.softmax(-1), draft_logits.softmax(-1)  # [T, V] each
    verifier = _cactus(0.01)
    x = p.argmax(-1, keepdim=True)  # [T, 1]
    boosted = verifier.boosted_law(q, x)  # [T, V]
    assert bool((boosted.gather(-1, x) < 1).all())
    chi_square = ((boosted - q) ** 2 / q).sum(-1)  # [T]
    torch.testing.assert_close(chi_square, torch.full_like(chi_square, 2 * 0.01))
    spent = kl_divergence(q, verifier.output_law(q, p.unsqueeze(1)))  # [T]
    assert float(spent.mean()) > 10 * 0.01


# --------------------------------------------------------------------------- (f) a bad δ
