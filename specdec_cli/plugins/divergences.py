"""Divergences between two laws over the vocabulary, for lossy verifiers and for what ``acceptance`` reports
(pure tensor functions on the tensors' device, batched over leading dimensions, in nats where a log is taken).

Each takes the target's law q and another law π, both ``[..., V]``, and gives ``[...]``:

- :func:`kl_divergence`: KL(q ‖ π) = Σ q ln(q / π); +inf where π rules out a token q allows (mentored's bound).
- :func:`total_variation`: TV(q, π) = ½ Σ |q − π| = Σ (q − π)+, in [0, 1] (the static ensemble's bias).
- :func:`js_divergence`: JS(q, π) = ½ KL(q ‖ m) + ½ KL(π ‖ m) with m = ½ (q + π), in [0, ln 2]
  (Fuzzy Speculative Decoding's default).

:data:`DIVERGENCES` names them as a verifier's ``divergence`` parameter takes them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["DIVERGENCES", "js_divergence", "kl_divergence", "total_variation"]


def kl_divergence(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(q ‖ π) ``[...]`` for q = ``target`` and π = ``other`` ``[..., V]``; 0 ln 0 counts as 0."""
    return (torch.xlogy(target, target) - torch.xlogy(target, other)).sum(-1)  # [...]


def total_variation(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """TV(q, π) = Σ (q − π)+ ``[...]``: the mass q has where π has less (half the L1 distance of two laws)."""
    return (target - other).clamp_min(0).sum(-1)  # [...]


def js_divergence(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """JS(q, π) ``[...]``: the mean KL of q and of π from their midpoint m = (q + π) / 2."""
    middle = (target + other) / 2  # [..., V]
    return (kl_divergence(target, middle) + kl_divergence(other, middle)) / 2  # [...]


DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": kl_divergence,
    "tv": total_variation,
    "js": js_divergence,
}
"""Each divergence by the name a ``divergence`` parameter (and ``acceptance``'s output) gives it."""
