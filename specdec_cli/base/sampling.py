"""Logits → probabilities, shared by the target and every draft, and the one sampler.

The verifier's exactness rests on one fact: ``draft_probs`` is the very law each draft token
was sampled from. So target and drafts go through the same function here (temperature,
then top-k, then top-p, in float32), and drafts sample from the tensor they hand on.

Nothing here reads the device: a row whose logits are not finite is reported as a flag that the
engine reads together with the block's decision (one device read per block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import NonFiniteLogitsError
from .randomness import Randomness, Stream, uniforms_from

__all__ = [
    "SamplingParams",
    "judged_params",
    "non_finite_message",
    "probs_from_logits",
    "sample",
    "sample_with",
    "sampling_law",
]

_BELOW_ONE = 1.0 - 2.0**-52
"""Largest factor that keeps u · total strictly below total in float64 (so no zero-mass tail is drawn)."""


_SMALLEST_TEMPERATURE = 2.0**-149
"""The smallest positive float32. A temperature below it rounds to 0 in the float32 division (0/0 at the
largest logit), so it is sampled as greedy, the law's limit as the temperature goes to 0."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy: the law is one-hot on the argmax (as is any temperature below the smallest float32)."""
    top_k: int = 0
    """0 = off."""
    top_p: float = 1.0


def judged_params(params: SamplingParams, view: str) -> SamplingParams:
    """The settings of the law a verifier judges drafts by (its ``judged_laws``), for a model sampled with ``params``:
    ``unprocessed``, temperature 1 over the whole vocabulary (softmax of the raw logits); ``untruncated``, the same
    temperature with no top-k or top-p."""
    if view == "unprocessed":
        return SamplingParams()
    if view == "untruncated":
        return SamplingParams(temperature=params.temperature)
    raise ValueError(f"no judged law '{view}': unprocessed or untruncated")


def sampling_law(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling law for ``logits`` ``[..., V]`` → (probs float32 ``[..., V]``, finite ``[...]`` bool).

    ``finite`` is False for a row whose logits hold NaN or +inf, or nothing but -inf; such a
    row's probabilities are meaningless (NaN). Checking one entry per row is enough: softmax
    spreads NaN over the whole row in every one of these cases.

    Any temperature the model's logits allow works: the logits are shifted so their largest is 0
    before dividing, so a tiny temperature sends the others to -inf (probability 0) instead of
    overflowing the largest to +inf, which would make every row NaN and blame the model.
    """
    logits = logits.float()  # [..., V]
    if params.temperature < _SMALLEST_TEMPERATURE:
        best, index = logits.max(-1, keepdim=True)  # [..., 1] each
        probs = torch.zeros_like(logits).scatter_(-1, index, 1.0)  # [..., V]
        return probs, torch.isfinite(best.squeeze(-1))
    if params.temperature != 1:
        # softmax is unchanged by the shift; a row with NaN, +inf or only -inf still comes out NaN.
        logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature  # [..., V]
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = logits.softmax(-1)  # [..., V]
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs, torch.isfinite(probs[..., 0])


def probs_from_logits(logits: torch.Tensor, params: SamplingParams, source: str = "model") -> torch.Tensor:
    """:func:`sampling_law`, checked: raises :class:`NonFiniteLogitsError` on a non-finite row.

    The check reads the device; the engine's hot loop uses :func:`sampling_law` and folds the flag
    into its one read per block instead.
    """
    probs, finite = sampling_law(logits, params)
    if not bool(finite.all()):
        raise NonFiniteLogitsError(non_finite_message(source))
    return probs


def non_finite_message(source: str) -> str:
    return (
        f"the {source} produced NaN or infinite logits; check its weights and dtype "
        "(float16 overflows on some models: try --dtype float32 or bfloat16)"
    )


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``, renormalised."""
    sorted_probs, order = probs.sort(-1, descending=True)  # [..., V], [..., V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [..., V]: mass of strictly more likely tokens
    # Keep a token while the mass before it is below top_p; the most likely token is always kept, also
    # when top_p is so small that float32 rounds it to 0.
    keep_sorted = mass_before < top_p  # [..., V]
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # [..., V]
    kept = probs * keep  # [..., V]
    return kept / kept.sum(-1, keepdim=True)


def sample(
    probs: torch.Tensor, randomness: Randomness = None, stream: Stream = Stream.RESIDUAL, offset: torch.Tensor | int = 0
) -> torch.Tensor:
    """One token id per row of ``probs`` ``[..., V]`` (any non-negative weights) → ``[...]`` int64.

    The uniforms come from ``randomness`` (:func:`~specdec_cli.randomness.uniforms_from`): keyed by
    ``stream`` with row i at position ``offset + i``, or a generator's next draws.
    """
    uniform = uniforms_from(randomness, stream, tuple(probs.shape[:-1]), probs.device, offset)  # [...]
    return sample_with(probs, uniform)


def sample_with(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token at ``uniform`` ``[...]`` (float64 in ]0, 1[) of each row of ``probs`` ``[..., V]`` → ``[...]`` int64.

    Inverse-CDF sampling in float64: a cumulative sum and a search, on the tensor's device, with no
    host synchronisation (``torch.multinomial`` validates its input on the host and draws V
    exponentials per row, which costs more than the rest of a block's verification). The threshold
    stays strictly below the total mass, so a token of zero weight is never drawn.
    """
    cumulative = probs.cumsum(-1, dtype=torch.float64)  # [..., V]
    total = cumulative[..., -1:]  # [..., 1]
    threshold = torch.minimum(uniform.unsqueeze(-1) * total, total * _BELOW_ONE)  # [..., 1]
    index = torch.searchsorted(cumulative, threshold, right=True)  # [..., 1]: first token whose CDF passes it
    return index.clamp(max=probs.shape[-1] - 1).squeeze(-1)  # a NaN row gives some valid id; its flag says why
