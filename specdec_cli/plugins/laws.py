"""The law helpers the built-in verifiers are made of, public for plugin authors (pure tensor functions on the
tensors' device, no host reads).

- **Residuals**: :func:`normalized_excess` ((q - p)+ normalised), :func:`excess_weights` (the same as weights to
  draw from), :func:`normalized_or` and :func:`excess_or` (with a fallback where the excess has no mass).
- **Sampling from a law**: :func:`sample` (keyed, stream and offset) and :func:`sample_with` (one given uniform);
  :func:`uniforms_like` gives keyed uniforms shaped like a block's candidates.
- **Acceptance**: :func:`ratio_acceptance` (min(1, q(x) / p(x))), :func:`one_hot_mass`.
- **The accepted prefix**: :func:`single_draft_block` (a whole single-draft block: acceptance tests, first
  rejection, the correction or bonus draw), :func:`first_accepted` (the first accepted of K candidates, or a residual
  draw), :func:`first_rejection`, :func:`commit_after`, :func:`commit_following` and :func:`commit_with_uniform`
  (the :class:`~specdec_cli.verifiers.BlockDecision` once the number of accepted tokens is known).

Every draw takes its uniforms from the block's :class:`~specdec_cli.randomness.Randomness`, so a verifier built
from these is a pure function of (seed, sample, position, stream). ``examples/verifier-plugin`` uses them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base.randomness import Randomness, Stream, stream_table_from, uniforms_from
from ..base.sampling import sample, sample_with
from .verifiers import BlockDecision, commit_following, commit_with_uniform, first_rejection

__all__ = [
    "TINY",
    "commit_after",
    "commit_following",
    "commit_known",
    "commit_with_uniform",
    "excess_or",
    "excess_weights",
    "first_accepted",
    "first_rejection",
    "normalized_excess",
    "normalized_or",
    "one_hot_mass",
    "ratio_acceptance",
    "row_at",
    "sample",
    "sample_with",
    "single_draft_block",
    "single_draft_draws",
    "uniforms_like",
]

TINY = torch.finfo(torch.float64).tiny


def normalized_or(excess: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``excess`` ``[..., V]`` normalised; ``fallback`` in the rows where it has no mass.

    A residual with no mass belongs to a candidate accepted with probability 1, so that row is
    never sampled; the fallback only keeps it a valid law without a division by zero.
    """
    mass = excess.sum(-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, excess / mass.clamp_min(TINY), fallback)


def normalized_excess(target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """(target - proposal)+ normalised ``[..., V]``; ``target`` itself where the excess is empty."""
    return normalized_or((target - proposal).clamp_min(0), target)


def excess_or(excess: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """The residual's weights for a draw: ``excess`` ``[..., V]`` where it has mass, else ``fallback``.
    :func:`~specdec_cli.sampling.sample_with` takes any non-negative weights, so a block's one draw
    needs no normalisation (three operations fewer than :func:`normalized_or`)."""
    return torch.where(excess.sum(-1, keepdim=True) > 0, excess, fallback)


def excess_weights(target: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """(target - proposal)+ ``[..., V]`` as weights to draw from (:func:`excess_or`); ``target`` where empty."""
    return excess_or((target - proposal).clamp_min(0), target)


def ratio_acceptance(target: torch.Tensor, proposal: torch.Tensor, x: torch.Tensor, scale=1.0) -> torch.Tensor:
    """min(1, target(x) / (scale · proposal(x))) for candidates ``x`` ``[..., k]`` → ``[..., k]``.

    proposal(x) > 0 for a candidate drawn from it; the floor only guards unused rows.
    """
    target_x, proposal_x = target.gather(-1, x), proposal.gather(-1, x)  # [..., k]
    return (target_x / (scale * proposal_x).clamp_min(TINY)).clamp(max=1.0)


def one_hot_mass(law: torch.Tensor, x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``law`` plus ``mass`` ``[..., 1]`` on token ``x`` ``[..., 1]``."""
    return law.scatter_add(-1, x, mass)


def first_accepted(
    uniforms: torch.Tensor,
    accepts: torch.Tensor,
    draft_tokens: torch.Tensor,
    residual: torch.Tensor,
    randomness: Randomness,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate k is accepted when ``uniforms[..., k] < accepts[..., k]``; the first accepted one is
    the output, otherwise a draw from ``residual`` ``[..., V]`` (stream RESIDUAL, row i at offset i)
    → (token ``[...]``, accepted ``[...]``). Uniforms are float64, so the test is made in float64.
    """
    taken = uniforms < accepts.double()  # [..., K]
    first = taken.long().argmax(-1, keepdim=True)  # [..., 1]
    accepted = taken.any(-1)  # [...]
    token = torch.where(accepted, draft_tokens.gather(-1, first).squeeze(-1), sample(residual, randomness))
    return token, accepted


def uniforms_like(accepts: torch.Tensor, randomness: Randomness, stream: Stream = Stream.ACCEPT) -> torch.Tensor:
    """float64 uniforms shaped like the candidates' acceptance ``accepts`` ``[..., K]``: keyed draws put the
    leading dimensions at positions 0, 1, ... (flattened) and the K candidates in lanes."""
    return uniforms_from(randomness, stream, tuple(accepts.shape), accepts.device, lanes_last=True)


def row_at(laws: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``laws[index]`` for a 0-dim device index, without turning the index into a Python int."""
    return laws.index_select(0, index.view(1)).squeeze(0)


_SINGLE_DRAFT_STREAMS = 3
"""ACCEPT, RESIDUAL and BONUS: consecutive streams, so one keyed evaluation gives all of a block's draws."""


def single_draft_draws(randomness: Randomness, draft_length: int, device: torch.device) -> torch.Tensor:
    """Every draw a single-draft block makes, from one evaluation → float64 ``[L+1, 3]``: at offset t, column
    0 is the acceptance test (stream ACCEPT), 1 the correction after a rejection there (RESIDUAL) and 2
    the bonus token (BONUS, used at offset L only)."""
    return stream_table_from(randomness, Stream.ACCEPT, _SINGLE_DRAFT_STREAMS, draft_length + 1, device)


def single_draft_block(
    accept: torch.Tensor,
    residual_at: Callable[[torch.Tensor], torch.Tensor],
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockDecision:
    """A single-draft token-level block decided at once (gpt-fast's and vLLM's rejection sampler).

    accept ``[L]``: each draft token's acceptance probability; one uniform per position (stream
    ACCEPT), the first rejection by a cumulative product, and one draw: from ``residual_at(n)``
    ``[V]`` at the first rejected position n, or the bonus token (see :func:`commit_after`).
    draft_tokens ``[L]``.
    """
    draft_length = draft_tokens.shape[0]
    draws = single_draft_draws(randomness, draft_length, accept.device)  # [L+1, 3]
    accepted = draws[:-1, 0] < accept.double()  # [L]
    num_accepted = accepted.long().cumprod(0).sum()  # []
    rejected_at = num_accepted.clamp(max=draft_length - 1)  # []: a valid row even when none was rejected
    return commit_after(num_accepted, residual_at(rejected_at), target_probs, draft_tokens, draws)


def commit_after(
    num_accepted: torch.Tensor,
    residual: torch.Tensor,
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draws: torch.Tensor,
) -> BlockDecision:
    """The single-draft decision once ``num_accepted`` ``[]`` draft tokens are kept: the next token from
    ``residual`` ``[V]`` after a rejection, or the bonus token from q after the whole block (target_probs
    ``[L+1, V]``), placed after the accepted prefix of draft_tokens ``[L]``. ``draws`` ``[L+1, 3]``:
    :func:`single_draft_draws` (the correction at offset n, or the bonus at offset L)."""
    after_all = num_accepted == draft_tokens.shape[0]  # []
    draw_index = num_accepted * _SINGLE_DRAFT_STREAMS + 1 + after_all  # []: (n, RESIDUAL), or (L, BONUS)
    uniform = draws.view(-1).index_select(0, draw_index.view(1)).view(())  # []
    bonus_law = target_probs[-1]  # [V]
    return commit_with_uniform(num_accepted, draft_tokens, residual, bonus_law, uniform, torch.zeros_like(num_accepted))


def commit_known(
    num_accepted: int, law: torch.Tensor, draft_tokens: torch.Tensor, draws: torch.Tensor
) -> BlockDecision:
    """:func:`commit_after` where the host already knows ``num_accepted`` (the CPU paths, where reads are free):
    the same draw, from ``law`` ``[V]`` (the residual's weights after a rejection, the bonus law after the whole
    block), without choosing between the two on the device."""
    stream = 1 if num_accepted < draft_tokens.shape[0] else 2  # (n, RESIDUAL), or (L, BONUS): single_draft_draws
    kept = torch.tensor(num_accepted, device=draft_tokens.device)  # []
    return commit_with_uniform(kept, draft_tokens, law, law, draws[num_accepted, stream], torch.zeros_like(kept))
