"""Logits → probabilities, shared by the target and every draft.

The verifier's exactness rests on one fact: ``draft_probs`` is the very law each draft token
was sampled from. So target and drafts go through the same function here (temperature,
then top-k, then top-p, in float32), and drafts sample from the tensor they hand on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import NonFiniteLogitsError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy: the law is one-hot on the argmax."""
    top_k: int = 0
    """0 = off."""
    top_p: float = 1.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams, source: str = "model") -> torch.Tensor:
    """The sampling law for ``logits`` ``[..., V]``: a float32 ``[..., V]`` tensor whose rows sum to 1.

    Raises :class:`NonFiniteLogitsError` when a row holds NaN or +inf logits, or nothing but -inf
    (``source`` names the model in the message).
    """
    logits = logits.float()  # [..., V]
    if params.temperature == 0:
        probs = torch.zeros_like(logits)  # [..., V]
        probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    else:
        logits = logits / params.temperature  # [..., V]
        if 0 < params.top_k < logits.shape[-1]:
            kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        probs = logits.softmax(-1)  # [..., V]
        if params.top_p < 1.0:
            probs = _top_p_filter(probs, params.top_p)
    if not bool(torch.isfinite(probs).all()):
        raise NonFiniteLogitsError(
            f"the {source} produced NaN or infinite logits; check its weights and dtype "
            "(float16 overflows on some models: try --dtype float32 or bfloat16)"
        )
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``, renormalised."""
    sorted_probs, order = probs.sort(-1, descending=True)  # [..., V], [..., V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., V]: mass of strictly more likely tokens
    # Keep a token while the mass before it is below top_p; the most likely token is always kept.
    keep_sorted = mass_before < top_p  # [..., V]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # [..., V]
    kept = probs * keep  # [..., V]
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``probs`` ``[..., V]`` → ``[...]`` (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])  # [rows, V]
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
