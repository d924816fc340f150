"""Each lossy rule named after an engine or a paper decides as its source does: the source's own code (called where
it is installed, transcribed literally below where it is not, each with repository, path and commit) and specdec's
verifier get the same laws and the same uniforms, block after block, at several settings, and must commit the same
tokens. Each replay has a negative control: the rule as specdec had it before (or a plausible misreading) must
disagree with the source on the same blocks.

Where a source draws a token otherwise than by inverse CDF on one uniform (torch.multinomial, vLLM's exponential
race for recovered tokens, FlashInfer's block scan), the replay hands it that law and draws from it with the uniform
specdec uses there (stream RESIDUAL at the rejected position, BONUS after a block accepted whole): the same law,
drawn with the same randomness. Sample matching (``match``) and Cactus have their replays beside their other tests
(tests/test_match.py, tests/test_cactus.py).
"""

from __future__ import annotations

import inspect
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from specdec_cli.base.randomness import Draws
from specdec_cli.base.sampling import SamplingParams, sample_with, sampling_law
from specdec_cli.plugins.laws import excess_weights, single_draft_draws
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_plugins.ensemble import StaticEnsemble
from specdec_plugins.fly import FLyVerification
from specdec_plugins.fuzzy import FSD_DIVERGENCES, FuzzySpeculative
from specdec_plugins.threshold import ThresholdAcceptance
from specdec_plugins.typical import TypicalAcceptance

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCKS = 40
"""Keyed blocks per setting: each replay compares this many decisions."""


def _create(name: str, **params):
    return VerifierRegistry().create(name, params)


def _logits_block(seed: int, length: int, vocab: int, spread: float = 2.0, dtype=torch.float64):
    """Raw logits of a target ``[L+1, V]`` and of a draft ``[L, V]`` halfway to it, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(length + 1, vocab, generator=generator, dtype=dtype) * spread  # [L+1, V]
    noise = torch.randn(length, vocab, generator=generator, dtype=dtype) * spread  # [L, V]
    return target, (target[:-1] + noise) / 2  # [L+1, V], [L, V]


def _sampled(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The engine's sampling law of ``logits`` ``[..., V]``, in their dtype."""
    return sampling_law(logits, params)[0].to(logits.dtype)  # [..., V]


def _drafted(draft_probs: torch.Tensor, seed: int) -> torch.Tensor:
    """Draft tokens ``[L]`` drawn from the draft laws ``[L, V]``."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    return torch.multinomial(draft_probs.double(), 1, generator=generator).view(-1)  # [L]


def _committed(decision) -> list[int]:
    """The tokens a decision commits."""
    return decision.tokens[: int(decision.num_accepted) + 1].tolist()


def _next_uniform(table: torch.Tensor, accepted: int, length: int) -> torch.Tensor:
    """The uniform specdec draws the block's last token with: RESIDUAL at the rejected offset, or BONUS at L."""
    return table[accepted, 1] if accepted < length else table[length, 2]


# ------------------------------------------------------------------ transformers' static ensemble (installed)

try:
    from transformers.generation.utils import _speculative_sampling
except ImportError:  # pragma: no cover - transformers always has it; its signature is checked below
    _speculative_sampling = None

HAS_ENSEMBLE_WEIGHT = _speculative_sampling is not None and (
    "assistant_ensemble_weight" in inspect.signature(_speculative_sampling).parameters
)


def _transformers_block(target_probs, draft_probs, tokens, table, weight) -> list[int]:
    """transformers' own ``_speculative_sampling`` (huggingface/transformers, src/transformers/generation/utils.py,
    PR #45979; installed here), called on the block: its ``candidate_logits`` are the draft's log-law, its
    ``new_logits`` the target's. Its ``torch.rand_like`` gives the block's ACCEPT uniforms; its one
    ``torch.multinomial`` law is recorded and drawn from with specdec's uniform for that token."""
    length = tokens.shape[0]
    recorded = []

    def multinomial(law, num_samples=1, **_):
        recorded.append(law[0])
        return torch.zeros(1, 1, dtype=torch.long)

    uniforms = table[:length, 0]  # [L]
    with (
        mock.patch("torch.rand_like", lambda ratio: uniforms.to(ratio.dtype).reshape(ratio.shape)),
        mock.patch("torch.multinomial", multinomial),
    ):
        _, matches = _speculative_sampling(
            tokens.view(1, -1),
            torch.log(draft_probs).unsqueeze(0),
            length,
            torch.log(target_probs).unsqueeze(0),
            assistant_ensemble_weight=weight,
        )
    accepted = int(matches)
    token = int(sample_with(recorded[0], _next_uniform(table, accepted, length)))
    return tokens[:accepted].tolist() + [token]


class DraftShareEnsemble(StaticEnsemble):
    """Negative control: the ensemble as specdec had it, its weight the draft's share of the blend."""

    name = "draft-share-ensemble"

    def blend(self, target_probs, draft_probs):
        return self.weight * draft_probs + (1 - self.weight) * target_probs


@pytest.mark.skipif(not HAS_ENSEMBLE_WEIGHT, reason="this transformers has no assistant_ensemble_weight")
@pytest.mark.parametrize("weight", [None, 0.0, 0.25, 0.6, 0.9, 1.0])
def test_ensemble_decides_as_transformers(weight):
    verifier, wrong = _create("ensemble", weight=weight), DraftShareEnsemble(weight=weight)
    disagreements = 0
    for seed in range(BLOCKS):
        target_logits, draft_logits = _logits_block(seed, 4, 12)
        target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)  # [L+1, V], [L, V]
        tokens, draws = _drafted(draft, seed), Draws.create(seed, 5 * seed)
        table = single_draft_draws(draws, 4, torch.device("cpu"))  # [L+1, 3]
        expected = _transformers_block(target, draft, tokens, table, weight)
        block = (target.unsqueeze(0), draft.unsqueeze(0), tokens.unsqueeze(0), draws)
        assert _committed(verifier.verify_block(*block)) == expected, seed
        disagreements += _committed(wrong.verify_block(*block)) != expected
    if weight != 0.5:
        assert disagreements > 0  # the draft's share at the same number decides otherwise (but at one half)


# ------------------------------------------------------------------ vLLM's typical acceptance (transcribed)


def _vllm_typical_block(target_probs, tokens, table, posterior_threshold, posterior_alpha) -> list[int]:
    """vLLM's ``TypicalAcceptanceSampler.forward`` (vllm-project/vllm, vllm/model_executor/layers/
    typical_acceptance_sampler.py at 60b5eb0cd23f43e347d2bf933470e465fe8cff9f) for one sequence, literally:
    ``_evaluate_accepted_tokens``, ``_get_recovered_token_ids`` and the base class's ``_create_output`` (the first
    rejected position takes the recovered token; a block accepted whole takes the bonus token, which vLLM's sampler
    draws from q: here with specdec's BONUS uniform)."""
    length = tokens.shape[0]
    probs = target_probs[:-1].unsqueeze(0)  # [1, L, V]
    draft_token_ids = tokens.unsqueeze(0)  # [1, L]
    candidates_prob = torch.gather(probs, dim=-1, index=draft_token_ids.unsqueeze(-1)).squeeze(-1)
    epsilon = 1e-5
    posterior_entropy = -torch.sum(probs * torch.log(probs + epsilon), dim=-1)
    threshold = torch.minimum(
        torch.ones_like(posterior_entropy) * posterior_threshold,
        torch.exp(-posterior_entropy) * posterior_alpha,
    )
    accepted_mask = (candidates_prob > threshold)[0].tolist()  # [L]
    recovered = torch.argmax(probs, dim=-1)[0].tolist()  # [L]
    limit = accepted_mask.index(False) if False in accepted_mask else length
    if limit < length:
        return tokens[:limit].tolist() + [recovered[limit]]
    return tokens.tolist() + [int(sample_with(target_probs[-1], table[length, 2]))]


class ExactEntropyTypical(TypicalAcceptance):
    """Negative control: typical acceptance as specdec had it, with the exact entropy −Σ q ln q."""

    name = "exact-entropy-typical"

    def acceptance_threshold(self, target_probs):
        entropy = -torch.xlogy(target_probs, target_probs).sum(-1)  # [...]
        return (self.alpha * torch.exp(-entropy)).clamp(max=self.threshold)  # [...]


def _typical_block(seed: int, vocab: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 laws over a large vocabulary (where vLLM's smoothing moves τ), and draft tokens, half of them drawn
    from a draft law and half the target's least likely token above the exact entropy's τ (where the two entropies
    disagree)."""
    target_logits, draft_logits = _logits_block(seed, 4, vocab, spread=1.5, dtype=torch.float32)
    target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)  # [L+1, V], [L, V]
    tokens = _drafted(draft, seed)  # [L]
    if seed % 2:
        exact = ExactEntropyTypical(alpha=alpha).acceptance_threshold(target[:-1]).unsqueeze(-1)  # [L, 1]
        above = torch.where(target[:-1] > exact, target[:-1], torch.inf)  # [L, V]
        tokens = above.argmin(-1)  # [L]: passes the exact test by the least margin
    return target, draft, tokens


@pytest.mark.parametrize(("threshold", "alpha"), [(0.09, 0.3), (0.3, 0.5), (0.05, 0.09), (1.0, 0.9)])
def test_typical_decides_as_vllm(threshold, alpha):
    verifier, wrong = (
        _create("typical", threshold=threshold, alpha=alpha),
        ExactEntropyTypical(threshold=threshold, alpha=alpha),
    )
    disagreements = 0
    for seed in range(BLOCKS):
        target, draft, tokens = _typical_block(seed, 4096, alpha)
        draws = Draws.create(seed, 3 * seed)
        table = single_draft_draws(draws, 4, torch.device("cpu"))  # [L+1, 3]
        expected = _vllm_typical_block(target, tokens, table, threshold, alpha)
        block = (target.unsqueeze(0), draft.unsqueeze(0), tokens.unsqueeze(0), draws)
        assert _committed(verifier.verify_block(*block)) == expected, seed
        disagreements += _committed(wrong.verify_block(*block)) != expected
    assert disagreements > 0  # the exact entropy decides otherwise on a large vocabulary


def test_typical_where_vllms_argmax_fails_its_own_test_vllms_tokens_are_a_prefix():
    """δ ≥ 1 on a flat law: every token fails, the argmax too. vLLM ends the block with the argmax, which is the draft
    token x when x is the argmax; specdec counts that token accepted and goes on (the same text law, longer blocks)."""
    flat = torch.tensor([0.4, 0.3, 0.3]).expand(4, 3)  # [L+1, V]
    tokens = torch.tensor([0, 0, 2])  # [L]: the argmax twice, then another token
    verifier = _create("typical", threshold=1.0, alpha=2.0)
    for key in range(10):
        draws = Draws.create(key, 0)
        table = single_draft_draws(draws, 3, torch.device("cpu"))
        expected = _vllm_typical_block(flat, tokens, table, 1.0, 2.0)
        ours = _committed(verifier.verify_block(flat.unsqueeze(0), flat[:3].unsqueeze(0), tokens.unsqueeze(0), draws))
        assert expected == [0] and ours == [0, 0, 0]
        assert ours[: len(expected)] == expected


# ------------------------------------------------------------------ SGLang's acceptance thresholds (transcribed)


def _sglang_chain(target_probs, tokens, table, threshold_single, threshold_acc) -> list[int]:
    """sgl-kernel's ``TreeSpeculativeSamplingTargetOnly`` (sgl-project/sglang, sgl-kernel/csrc/speculative/
    speculative_sampling.cuh at 120affb9613cc3f5bcd055ec09c7621d3ced0ebc) for one chain, literally: node 0 is the
    last verified token and node j the j-th draft token, each node's only child the next; the coin of level j is
    ``uniform_samples[j - 1]`` (the block's ACCEPT uniforms), prob_acc sums the target's probabilities of the level's
    candidates, and the host wrapper floors threshold_acc at ``fmaxf(threshold_acc, 1e-9f)``. The last token is drawn
    from relu(target_probs − draft_probs) with the final coin (specdec's RESIDUAL or BONUS uniform)."""
    dtype = torch.float32
    q = target_probs.to(dtype)  # [L+1, V]: the kernel's DType
    draft_probs = torch.zeros_like(q)  # [L+1, V]: target-only mode
    threshold_acc = max(threshold_acc, float(torch.tensor(1e-9, dtype=dtype)))  # capped_threshold_acc
    single, acc = torch.tensor(threshold_single, dtype=dtype), torch.tensor(threshold_acc, dtype=dtype)
    length, accepted, offset = tokens.shape[0], 0, 0
    for level in range(1, length + 1):
        coin = table[level - 1, 0].to(dtype)
        draft_token_id = int(tokens[level - 1])
        prob_acc = torch.zeros((), dtype=dtype) + q[offset, draft_token_id]
        if coin <= prob_acc / acc or q[offset, draft_token_id] >= single:
            accepted, offset = accepted + 1, level
            continue
        draft_probs[offset, draft_token_id] = q[offset, draft_token_id]
        break
    final = (q[offset] - draft_probs[offset]).clamp_min(0)  # [V]
    return tokens[:accepted].tolist() + [int(sample_with(final, _next_uniform(table, accepted, length)))]


class UnflooredThreshold(ThresholdAcceptance):
    """Negative control: SGLang's thresholds without the kernel's floor on acc (specdec took acc as given)."""

    name = "unfloored-threshold"

    def acceptance_at(self, target_x):
        return torch.where(target_x >= self.single, 1.0, (target_x / self.acc).clamp(max=1.0))


class KeepsTheRejected(ThresholdAcceptance):
    """Negative control: after a rejection it draws from q itself, the rejected token included (a kernel that
    forgot to write draft_probs[x] = q(x))."""

    name = "keeps-the-rejected"

    def residual_weights(self, target_probs, draft_probs, x):
        return target_probs


def _threshold_block(seed: int, tiny: bool):
    """float32 laws of a block and draft tokens; ``tiny``: tokens the target gives about 1e-12 (where acc's floor
    decides)."""
    target_logits, draft_logits = _logits_block(seed, 4, 10, spread=3.0, dtype=torch.float32)
    target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)  # [L+1, V], [L, V]
    if tiny:
        target[:-1, 0] = 1e-12
        target = target / target.sum(-1, keepdim=True)
        return target, draft, torch.zeros(4, dtype=torch.long)
    return target, draft, _drafted(draft, seed)


SGLANG_SETTINGS = [(1.0, 1.0), (0.5, 0.5), (1.0, 0.2), (0.0, 1.0), (1.5, 1.0), (-0.5, 1.0), (1.0, 0.0), (1.0, 3.0)]
"""(single, acc): the defaults, lowered thresholds, and numbers SGLang takes beyond [0, 1] (acc = 0 floored)."""


@pytest.mark.parametrize(("single", "acc"), SGLANG_SETTINGS)
def test_threshold_decides_as_the_sglang_kernel(single, acc):
    verifier = _create("threshold", single=single, acc=acc)
    wrong = [KeepsTheRejected(single=single, acc=acc)] + ([UnflooredThreshold(single=single, acc=acc)] * (acc == 0))
    disagreements = [0] * len(wrong)
    for seed in range(BLOCKS):
        target, draft, tokens = _threshold_block(seed, tiny=seed % 4 == 0)
        draws = Draws.create(seed, 7 * seed)
        table = single_draft_draws(draws, 4, torch.device("cpu"))  # [L+1, 3]
        expected = _sglang_chain(target, tokens, table, single, acc)
        block = (target.unsqueeze(0), draft.unsqueeze(0), tokens.unsqueeze(0), draws)
        assert _committed(verifier.verify_block(*block)) == expected, seed
        for index, variant in enumerate(wrong):
            disagreements[index] += _committed(variant.verify_block(*block)) != expected
    if single > 0 and acc > 1e-9:  # where any token is ever rejected, the rejected token must not come again
        assert disagreements[0] > 0
    assert all(count > 0 for count in disagreements[1:])  # acc = 0 unfloored accepts a token of q = 1e-12


# ------------------------------------------------------------------ Fuzzy Speculative Decoding (transcribed)


def _fsd_backoff(candidate_logits, unprocessed_draft, new_logits, unprocessed_target, div_type, threshold, table):
    """``_speculative_backoff_sampling`` of FSD's reference code (its patched transformers utils.py, found by
    find_string '_speculative_backoff_sampling' in the search tool's index: the FSD authors' repository) for a block,
    literally where it decides: its ``q`` is the draft's law and its ``p`` the target's; the default divergences
    compare the unprocessed laws (no epsilon: no div_logits_processor), the ``_processed`` ones the processed laws
    plus 1e-10, renormalised; ``is_accepted = divs <= div_threshold``; after the first rejection (or the whole block)
    the next token comes from the processed target law there (its torch.multinomial: here specdec's uniform). The EOS
    special case (``is_done_candidate``) is the engine's, not the rule's, and is left out."""
    candidate_length = candidate_logits.shape[1]
    if div_type.endswith("_processed"):
        epsilon = 1e-10
        q = candidate_logits.softmax(dim=-1)
        p = new_logits[:, :candidate_length, :].softmax(dim=-1)
        q = q + epsilon
        p = p + epsilon
        p = p / p.sum(dim=-1, keepdim=True)
        q = q / q.sum(dim=-1, keepdim=True)
    else:
        q = unprocessed_draft.softmax(dim=-1)
        p = unprocessed_target[:, :candidate_length, :].softmax(dim=-1)
    if div_type in ("kl_div", "kl_div_processed"):
        divs = F.kl_div(torch.log(p), q, reduction="none").sum(dim=-1)
    elif div_type in ("kl_div_reversed", "kl_div_reversed_processed"):
        divs = F.kl_div(torch.log(q), p, reduction="none").sum(dim=-1)
    elif div_type in ("js_div", "js_div_processed"):
        m = 0.5 * (p + q)
        divs = (
            0.5 * F.kl_div(torch.log(p), m, reduction="none") + 0.5 * F.kl_div(torch.log(q), m, reduction="none")
        ).sum(dim=-1)
    else:
        divs = 0.5 * torch.abs(p - q).sum(dim=-1)
    is_accepted = divs <= threshold
    n_matches = int(((~is_accepted).cumsum(dim=-1) < 1).sum())
    p_prime = new_logits.softmax(dim=-1)[0, n_matches, :]
    return n_matches, int(sample_with(p_prime, _next_uniform(table, n_matches, candidate_length)))


class SpecdecFuzzyBefore(FuzzySpeculative):
    """Negative control: fuzzy as specdec had it: speculative sampling where Div > T, Div the true JS or KL(q ‖ p) of
    the sampling laws."""

    name = "fuzzy-before"

    def divergences(self, target_probs, draft_probs):
        target, draft = target_probs.double(), draft_probs.double()
        if self.divergence == "kl":
            return (torch.xlogy(target, target) - torch.xlogy(target, draft)).sum(-1)
        middle = (target + draft) / 2
        return (FSD_DIVERGENCES["kl_reversed"](target, middle) + FSD_DIVERGENCES["kl_reversed"](draft, middle)) / 2


FSD_SETTINGS = [
    ("js_div", "js", 0.02),
    ("js_div", "js", 0.08),
    ("kl_div", "kl", 0.1),
    ("kl_div_reversed", "kl_reversed", 0.1),
    ("tv_div", "tv", 0.25),
    ("js_div_processed", "js", 0.05),
    ("kl_div_processed", "kl", 0.2),
]
"""(FSD's div_type, fuzzy's divergence, the threshold): the default unprocessed laws, then the processed ones."""


@pytest.mark.parametrize(("div_type", "divergence", "threshold"), FSD_SETTINGS)
def test_fuzzy_decides_as_fsds_reference(div_type, divergence, threshold):
    """The engine's sampling laws at temperature 0.7 and top-p 0.9 are handed as ``target_probs``/``draft_probs``,
    the laws at temperature 1 over the whole vocabulary as the judged laws (FSD's default compares those)."""
    laws = "sampling" if div_type.endswith("_processed") else "unprocessed"
    verifier = _create("fuzzy", threshold=threshold, divergence=divergence, laws=laws)
    wrong = SpecdecFuzzyBefore(threshold=threshold, divergence="kl" if divergence.startswith("kl") else "js")
    params = SamplingParams(temperature=0.7, top_k=0, top_p=0.9)
    disagreements, accepted = 0, 0
    for seed in range(BLOCKS):
        target_logits, draft_logits = _logits_block(seed, 4, 10, spread=1.0)
        target, draft = _sampled(target_logits, params), _sampled(draft_logits, params)  # [L+1, V], [L, V]
        tokens, draws = _drafted(draft, seed), Draws.create(seed, 11 * seed)
        table = single_draft_draws(draws, 4, torch.device("cpu"))  # [L+1, 3]
        matches, token = _fsd_backoff(
            torch.log(draft).unsqueeze(0),
            draft_logits.unsqueeze(0),
            torch.log(target).unsqueeze(0),
            target_logits.unsqueeze(0),
            div_type,
            threshold,
            table,
        )
        expected = tokens[:matches].tolist() + [token]
        judged = (target_logits.softmax(-1).unsqueeze(0), draft_logits.softmax(-1).unsqueeze(0))
        block = (target.unsqueeze(0), draft.unsqueeze(0), tokens.unsqueeze(0), draws)
        extra = {"judged": judged} if verifier.judged_laws else {}
        assert _committed(verifier.verify_block(*block, **extra)) == expected, seed
        disagreements += _committed(wrong.verify_block(*block)) != expected
        accepted += matches
    assert 0 < accepted < BLOCKS * 4  # the threshold falls inside the blocks' divergences
    assert disagreements > 0


# ------------------------------------------------------------------ vLLM's FLy (transcribed)

_FLY_ENTROPY_TOP_K = 3


def _vllm_fly_entropy(target_probs: torch.Tensor) -> torch.Tensor:
    """``compute_fly_entropy`` (vllm-project/vllm, vllm/v1/spec_decode/fly.py at
    04329df5bd81550bea15d142c3ba8fe213f4cbb6) on the target's processed probabilities, literally."""
    top_k = min(_FLY_ENTROPY_TOP_K, target_probs.shape[-1])
    top_probs = torch.topk(target_probs.to(torch.float32), k=top_k, dim=-1).values
    top_log_probs = top_probs.log()
    entropy_terms = torch.where(top_probs > 0, top_probs * top_log_probs, torch.zeros_like(top_probs))
    return -entropy_terms.sum(dim=-1)


def _vllm_fly_block(target_probs, draft_probs, tokens, table, window, entropy_threshold) -> list[int]:
    """vLLM's FLy for one request (vllm/v1/spec_decode/fly.py at 04329df5bd81550bea15d142c3ba8fe213f4cbb6),
    literally: ``apply_fly_random_acceptance_kernel`` sets the uniform of each deferrable rejection to 0, then the
    native ``rejection_random_sample_kernel`` (vllm/v1/sample/rejection_sampler.py) accepts while
    ``draft_prob > 0 and target_prob / draft_prob >= uniform``; its recovered token's law (q − p)+ and its bonus law q
    are drawn from with specdec's uniforms. ``window`` is FLY_WINDOW_SIZE, fixed per engine."""
    num_draft_tokens, vocab_size = tokens.shape[0], target_probs.shape[-1]
    uniform_probs = table[:num_draft_tokens, 0].clone()  # [L]
    fly_entropy = _vllm_fly_entropy(target_probs[:-1])  # [L]

    def natively_accepted(pos: int) -> bool:
        draft_token_id = int(tokens[pos])
        valid = 0 <= draft_token_id < vocab_size
        draft_prob = float(draft_probs[pos, draft_token_id]) if valid else 0.0
        target_prob = float(target_probs[pos, draft_token_id]) if valid else 0.0
        return valid and draft_prob > 0 and target_prob / draft_prob >= float(uniform_probs[pos])

    deferred = []
    for pos in range(num_draft_tokens):
        draft_token_id = int(tokens[pos])
        can_defer = (
            not natively_accepted(pos)
            and float(draft_probs[pos, draft_token_id]) > 0
            and float(target_probs[pos, draft_token_id]) > 0
            and pos + window < num_draft_tokens
            and float(fly_entropy[pos]) >= entropy_threshold
        )
        for offset in range(1, window + 1):
            in_bounds = pos + offset < num_draft_tokens
            can_defer = can_defer and in_bounds and natively_accepted(pos + offset)
        deferred.append(can_defer)
    for pos, defer in enumerate(deferred):  # the kernel reads the original uniforms, then stores its zeros
        if defer:
            uniform_probs[pos] = 0.0
    for pos in range(num_draft_tokens):
        if not natively_accepted(pos):
            recovered_law = excess_weights(target_probs[pos], draft_probs[pos])  # [V]
            return tokens[:pos].tolist() + [int(sample_with(recovered_law, table[pos, 1]))]
    return tokens.tolist() + [int(sample_with(target_probs[-1], table[num_draft_tokens, 2]))]


class PerBlockWindowFLy(FLyVerification):
    """Negative control: FLy as specdec had it, the default window taken from each block's own length."""

    name = "per-block-window-fly"

    def window(self, draft_length):
        return min(6, draft_length - 1) if self.window_size is None else self.window_size


@pytest.mark.parametrize(
    ("configured", "params"),
    [(8, {}), (4, {}), (6, {"window_size": 2}), (8, {"entropy_threshold": 0.1}), (5, {"entropy_threshold": 0.6})],
)
def test_fly_decides_as_vllm(configured, params):
    """Blocks of every length up to the configured K (the end of an output, an adaptive schedule), W fixed from K."""
    verifier = _create("fly", **params)
    verifier.set_draft_length(configured)
    window = verifier.window(configured)
    assert window == params.get("window_size", min(6, configured - 1))
    wrong = PerBlockWindowFLy(**params)
    disagreements = 0
    for seed in range(BLOCKS * 2):
        length = 2 + seed % (configured - 1)
        target_logits, draft_logits = _logits_block(seed, length, 8, spread=1.2, dtype=torch.float32)
        target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)  # [L+1, V], [L, V]
        tokens, draws = _drafted(draft, seed), Draws.create(seed, 13 * seed)
        table = single_draft_draws(draws, length, torch.device("cpu"))  # [L+1, 3]
        expected = _vllm_fly_block(target, draft, tokens, table, window, verifier.entropy_threshold)
        block = (target.unsqueeze(0), draft.unsqueeze(0), tokens.unsqueeze(0), draws)
        assert _committed(verifier.verify_block(*block)) == expected, (seed, length)
        disagreements += _committed(wrong.verify_block(*block)) != expected
    if "window_size" not in params:
        assert disagreements > 0  # a per-block window defers in short blocks where vLLM cannot


def test_the_transcriptions_reject_what_they_should():
    """The replays are not vacuous: on one block, each source's rule keeps fewer tokens at a stricter setting."""
    target_logits, draft_logits = _logits_block(3, 4, 10)
    target, draft = target_logits.softmax(-1), draft_logits.softmax(-1)
    tokens, draws = _drafted(draft, 3), Draws.create(3, 0)
    table = single_draft_draws(draws, 4, torch.device("cpu"))
    loose = _sglang_chain(target, tokens, table, 0.0, 1.0)
    strict = _sglang_chain(target, tokens, table, 1.0, 1.0)
    assert len(loose) == 5 and len(strict) <= len(loose)
    assert (
        _fsd_backoff(
            draft.log().unsqueeze(0), draft_logits[None], target.log()[None], target_logits[None], "tv_div", 1.0, table
        )[0]
        == 4
    )
    assert (
        _fsd_backoff(
            draft.log().unsqueeze(0), draft_logits[None], target.log()[None], target_logits[None], "tv_div", 0.0, table
        )[0]
        == 0
    )
    assert math.isfinite(float(_vllm_fly_entropy(target).sum()))
