"""Typical acceptance (Medusa): keep a draft token the target finds typical enough, a deterministic test (lossy).

Sources: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (2024,
arXiv 2401.10774), §3.3.1; vLLM's ``TypicalAcceptanceSampler`` (PR #5015), whose options ``posterior_threshold``
and ``posterior_alpha`` are this verifier's ``threshold`` ε and ``alpha`` δ, with vLLM's defaults.

With q = target law and p = draft law at one position and the draft token x ~ p::

    H(q) = −Σ q ln q                  the target's entropy in nats (0 ln 0 = 0)
    τ    = min(ε, δ·exp(−H(q)))      the acceptance threshold
    keep x                            iff q(x) > τ (p is not consulted; no uniform can change it)
    otherwise output argmax q         vLLM's recovered token (torch.argmax: the first index on ties)

A block keeps the draft prefix up to the first position whose token fails, commits argmax q there, and after a
block kept whole draws the bonus token from q, keyed as every built-in's bonus. The entropy is the exact one
(``torch.xlogy``); Medusa and vLLM take ``−Σ q ln(q + 1e-5)``, which moves τ by a hair.

For δ < 1 the argmax always passes (exp(−H) ≤ max q, so τ < max q). For δ ≥ 1 it may fail too; then the
recovered token is x itself when x is the argmax, and this verifier counts it as accepted and goes on along the
draft, where vLLM ends the block with the same token. Each position's output is the same either way (the next
block's first position sees the same q and a fresh x ~ p), so the law of the text is vLLM's; only the number of
target forwards differs. Each position's output law is

    π(y) = p(y)·[q(y) > τ] + (Σ_x p(x)·[q(x) ≤ τ])·[y = argmax q],

and its acceptance P(output = x) = Σ_x p(x)·([q(x) > τ] + [q(x) ≤ τ and x = argmax q]). π is not q: the rule is
lossy, favouring the draft's typical tokens and the target's mode, with no bound on the divergence it spends.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch

from specdec_cli.plugins.laws import row_at, single_draft_block
from specdec_cli.plugins.verifiers import Verifier


class TypicalAcceptance(Verifier):
    name = "typical"
    lossless = False
    max_drafts = 1
    batches_by_vmap = True

    def __init__(
        self,
        *,
        threshold: Annotated[float, "ε: the most the acceptance threshold can be (vLLM's posterior_threshold)"] = 0.09,
        alpha: Annotated[float, "δ: the threshold's scale on exp(−entropy) (vLLM's posterior_alpha)"] = 0.3,
    ):
        if not 0 < threshold <= 1:  # NaN fails it too
            raise ValueError(f"typical: threshold must be a number in (0, 1], got {threshold}")
        if not 0 < alpha < math.inf:
            raise ValueError(f"typical: alpha must be a finite number > 0, got {alpha}")
        self.threshold = float(threshold)
        self.alpha = float(alpha)

    def acceptance_threshold(self, target_probs: torch.Tensor) -> torch.Tensor:
        """τ = min(ε, δ·exp(−H(q))) ``[...]`` for target_probs ``[..., V]``, with the exact entropy."""
        entropy = -torch.xlogy(target_probs, target_probs).sum(-1)  # [...]
        return (self.alpha * torch.exp(-entropy)).clamp(max=self.threshold)  # [...]

    def passes(self, target_probs: torch.Tensor) -> torch.Tensor:
        """[q(y) > τ] ``[..., V]`` bool: the tokens the test keeps (the argmax not always among them)."""
        return target_probs > self.acceptance_threshold(target_probs).unsqueeze(-1)  # [..., V]

    def _kept(self, target_probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Whether the output is the draft token ``[...]`` bool, for target_probs ``[..., V]`` and draft_tokens
        ``[...]``: it passes the test, or it is the argmax the test would recover."""
        probability = target_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [...]
        passed = probability > self.acceptance_threshold(target_probs)  # [...]
        return passed | (draft_tokens == target_probs.argmax(-1))  # [...]

    def conditional(self, target_probs, draft_probs, draft_tokens):
        x = draft_tokens[..., 0]  # [...]
        token = torch.where(self._kept(target_probs, x), x, target_probs.argmax(-1))  # [...]
        return torch.zeros_like(target_probs).scatter(-1, token.unsqueeze(-1), 1.0)  # [..., V]: one-hot

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, x = target_probs[0], draft_tokens[0]  # [L+1, V], [L]
        accept = self._kept(q[:-1], x).to(q.dtype)  # [L]: 0 or 1, so each uniform in ]0, 1[ decides as the test

        def recovered(n: torch.Tensor) -> torch.Tensor:  # [V]: one-hot at argmax q_n, where the block stops
            row = row_at(q, n)  # [V]
            return torch.zeros_like(row).scatter(0, row.argmax().view(1), 1.0)  # [V]

        return single_draft_block(accept, recovered, q, x, randomness)

    def acceptance_probability(self, target_probs, draft_probs):
        p = draft_probs[..., 0, :]  # [..., V]
        mode = torch.zeros_like(target_probs).scatter(-1, target_probs.argmax(-1, keepdim=True), 1.0)  # [..., V]
        kept = self.passes(target_probs).to(p.dtype).maximum(mode)  # [..., V]: kept as drafted
        return (p * kept).sum(-1)  # [...]

    def output_law(self, target_probs, draft_probs):
        """π(y) = p(y)·[q(y) > τ] + (Σ_x p(x)·[q(x) ≤ τ])·[y = argmax q]."""
        p = draft_probs[..., 0, :]  # [..., V]
        kept = p * self.passes(target_probs).to(p.dtype)  # [..., V]
        replaced = (p - kept).sum(-1, keepdim=True)  # [..., 1]: the mass of the failing tokens
        return kept.scatter_add(-1, target_probs.argmax(-1, keepdim=True), replaced)  # [..., V]
