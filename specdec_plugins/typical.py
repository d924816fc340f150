"""Typical acceptance as vLLM decides it: keep a draft token the target finds typical enough, a deterministic test
(lossy).

Sources: vLLM's ``TypicalAcceptanceSampler`` (vllm-project/vllm, ``vllm/model_executor/layers/
typical_acceptance_sampler.py`` at 60b5eb0cd23f43e347d2bf933470e465fe8cff9f, PR #5015), whose options
``posterior_threshold`` and ``posterior_alpha`` are this verifier's ``threshold`` ε and ``alpha`` δ, with vLLM's
defaults; it cites Cai et al., "Medusa" (2024, arXiv 2401.10774), §3.3.1. With q = target law (the sampling law vLLM
hands its sampler) and the draft token x ~ p at one position::

    H(q) = −Σ q ln(q + 1e-5)          vLLM's smoothed entropy in nats (it keeps the log finite at q = 0)
    τ    = min(ε, δ·exp(−H(q)))      the acceptance threshold
    keep x                            iff q(x) > τ (p is not consulted; no uniform can change it)
    otherwise output argmax q         vLLM's recovered token (torch.argmax: the first index on ties)

A block keeps the draft prefix up to the first position whose token fails, commits argmax q there and ends, as
vLLM's ``_create_output`` does; after a block kept whole the bonus token is drawn from q, keyed as every built-in's
bonus. These are vLLM's decisions wherever the argmax passes its own test: since exp(−H) ≤ max q + 1e-5, always for
δ < 1 and max q > δ·1e-5 / (1 − δ) (at vLLM's default δ = 0.3, max q > 4.3e-6: any law on fewer than 233k tokens).
Where the argmax fails too (δ ≥ 1, mostly), vLLM ends the block with argmax q, which may be x itself, while this
verifier, whose token-level contract counts an output equal to the draft token as accepted, counts it as accepted
and goes on along the draft: the committed text's law is the same, and vLLM's committed tokens are a prefix of this
block's (tests/test_rule_sources.py). Each position's output law is

    π(y) = p(y)·[q(y) > τ] + (Σ_x p(x)·[q(x) ≤ τ])·[y = argmax q],

and its acceptance P(output = x) = Σ_x p(x)·([q(x) > τ] + [q(x) ≤ τ and x = argmax q]). π is not q: the rule is
lossy, favouring the draft's typical tokens and the target's mode, with no bound on the divergence it spends.

``rule: medusa`` is Medusa's own ``evaluate_posterior`` (FasterDecoding/Medusa, ``medusa/model/utils.py``) instead,
which differs from vLLM's rule in the law it tests (softmax(logits / T) with no top-k or top-p: the verifier's
judged laws, ``untruncated``, which the engine computes beside the sampling laws) and in the token after the kept
prefix (the target's argmax, also after a prefix kept whole: the bonus is the argmax too).
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

import torch

from specdec_cli.plugins.single_draft import SingleDraftRule
from specdec_cli.plugins.verifiers import JudgedLaws

ENTROPY_SMOOTHING = 1e-5
"""vLLM's (and Medusa's) ε in −Σ q ln(q + ε): it moves τ, and so the decisions, on large vocabularies."""


class TypicalAcceptance(SingleDraftRule):
    name = "typical"
    lossless = False
    batches_by_vmap = True
    revisions: ClassVar[tuple[str, ...]] = ("vLLM's smoothed entropy −Σ q ln(q + 1e-5) (it was the exact one)",)

    def __init__(
        self,
        *,
        threshold: Annotated[float, "ε: the most the acceptance threshold can be (vLLM's posterior_threshold)"] = 0.09,
        alpha: Annotated[float, "δ: the threshold's scale on exp(−entropy) (vLLM's posterior_alpha)"] = 0.3,
        rule: Annotated[
            Literal["vllm", "medusa"],
            "vllm: test q as sampled, bonus drawn from q; medusa: test softmax(logits / T) without top-k or top-p, "
            "and commit the target's argmax after the kept prefix, a bonus too (Medusa's evaluate_posterior)",
        ] = "vllm",
    ):
        if not 0 < threshold <= 1:  # NaN fails it too
            raise ValueError(f"typical: threshold must be a number in (0, 1], got {threshold}")
        if not 0 < alpha < math.inf:
            raise ValueError(f"typical: alpha must be a finite number > 0, got {alpha}")
        # A rule outside the Literal is refused before this runs, in one line, by the parameters' type check.
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.rule = rule
        self.judged_laws = "untruncated" if rule == "medusa" else None

    def acceptance_threshold(self, target_probs: torch.Tensor) -> torch.Tensor:
        """τ = min(ε, δ·exp(−H(q))) ``[...]`` for target_probs ``[..., V]``, with vLLM's smoothed entropy."""
        # −H(q) = Σ q ln(q + ε), summed as vLLM sums q·ln(q + ε) (xlogy: the same products, one operation).
        minus_entropy = torch.xlogy(target_probs, target_probs + ENTROPY_SMOOTHING).sum(-1)  # [...]
        return (self.alpha * torch.exp(minus_entropy)).clamp(max=self.threshold)  # [...]

    def passes(self, target_probs: torch.Tensor, judged: JudgedLaws = None) -> torch.Tensor:
        """``[..., V]`` bool: the tokens kept as drafted, for target_probs ``[..., V]``: those whose tested probability
        (the judged law's, where the rule tests another) is above τ, and the argmax of q, which a failing test
        recovers."""
        tested = target_probs if judged is None else judged[0]  # [..., V]
        passed = tested > self.acceptance_threshold(tested).unsqueeze(-1)  # [..., V]
        return passed.scatter(-1, target_probs.argmax(-1, keepdim=True), True)  # [..., V]

    def _kept(self, target_probs: torch.Tensor, x: torch.Tensor, judged: JudgedLaws = None) -> torch.Tensor:
        """``[..., k]`` bool: whether each candidate of ``x`` ``[..., k]`` is kept as drafted (it passes the test, or
        it is the argmax the test would recover)."""
        return self.passes(target_probs, judged).gather(-1, x)  # [..., k]

    def acceptance(self, target_probs, draft_probs, x, judged: JudgedLaws = None):
        """1 where the candidate ``x`` ``[..., k]`` is kept, else 0 → ``[..., k]``; p is not consulted."""
        return self._kept(target_probs, x, judged).to(target_probs.dtype)  # [..., k]: 0 or 1

    def _output(self, target_probs: torch.Tensor, x: torch.Tensor, judged: JudgedLaws = None) -> torch.Tensor:
        """The token a position outputs ``[..., 1]`` for its draft token ``x`` ``[..., 1]``: x where kept, else the
        recovered argmax (the rule draws nothing)."""
        return torch.where(self._kept(target_probs, x, judged), x, target_probs.argmax(-1, keepdim=True))  # [..., 1]

    def conditional(self, target_probs, draft_probs, draft_tokens, judged: JudgedLaws = None):
        """One-hot at :meth:`_output` (the base class's law, without its arithmetic on 0s and 1s)."""
        token = self._output(target_probs, draft_tokens[..., :1], judged)  # [..., 1]
        return torch.zeros_like(target_probs).scatter(-1, token, 1.0)  # [..., V]

    def select(self, target_probs, draft_probs, draft_tokens, randomness=None):
        """:meth:`_output`, with no uniform drawn (every acceptance is 0 or 1)."""
        x = draft_tokens[..., :1]  # [..., 1]
        token = self._output(target_probs, x)  # [..., 1]
        return token.squeeze(-1), (token == x).squeeze(-1)  # [...] each

    def residual_weights(self, target_probs, draft_probs, x):
        """The argmax of q, one-hot ``[..., V]``: vLLM's recovered token."""
        return _one_hot_argmax(target_probs)  # [..., V]

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None, judged: JudgedLaws = None):
        """The base class's block; with rule medusa, the bonus is the argmax too (a one-hot law to draw it from).
        The acceptances are 0 or 1, so each uniform in ]0, 1[ decides as the test."""
        if self.rule == "medusa":
            target_probs = torch.cat([target_probs[:, :-1], _one_hot_argmax(target_probs[:, -1:])], 1)  # [1, L+1, V]
        return super().verify_block(target_probs, draft_probs, draft_tokens, randomness, judged)

    def acceptance_probability(self, target_probs, draft_probs, judged: JudgedLaws = None):
        p = draft_probs[..., 0, :]  # [..., V]
        return (p * self.passes(target_probs, judged).to(p.dtype)).sum(-1)  # [...]

    def output_law(self, target_probs, draft_probs, judged: JudgedLaws = None):
        """π(y) = p(y)·[y kept] + (Σ_x p(x)·[x not kept])·[y = argmax q]."""
        p = draft_probs[..., 0, :]  # [..., V]
        kept = p * self.passes(target_probs, judged).to(p.dtype)  # [..., V]
        replaced = (p - kept).sum(-1, keepdim=True)  # [..., 1]: the mass of the failing tokens
        return kept.scatter_add(-1, target_probs.argmax(-1, keepdim=True), replaced)  # [..., V]


def _one_hot_argmax(laws: torch.Tensor) -> torch.Tensor:
    """One-hot at the argmax of each law ``[..., V]`` (the first index on ties, as torch.argmax) → ``[..., V]``."""
    return torch.zeros_like(laws).scatter(-1, laws.argmax(-1, keepdim=True), 1.0)  # [..., V]
