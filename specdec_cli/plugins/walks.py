"""The block walks the built-in rules are made of: the single-draft first rejection, the multi-draft walk over the
rows still alive (on the device, with every problem solved at once, or reading on the CPU), and the draw that ends
a block. Each decides one block ``[K, L]`` and returns a :class:`~.decisions.BlockDecision`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..base.randomness import Randomness, Stream, uniforms_from
from ..base.sampling import sample, sample_with
from .decisions import BlockDecision

__all__ = [
    "commit_following",
    "commit_with_uniform",
    "decide_problems",
    "first_rejection",
    "prefix_agreement",
    "problem_members",
    "shared_prefix_length",
    "walk_alive_rows",
    "walk_reading",
]


def walk_alive_rows(
    choose: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockDecision:
    """The multi-draft block decision, on the device: follow the rows that match every output so far.

    ``choose(t, alive, leader)`` gives the output token ``[]`` at position t, where alive ``[K]`` bool
    marks the rows whose tokens equal every output before t and leader ``[]`` is the first of
    them (alive rows share the committed prefix, so their q_t are equal). The block stops committing
    at the first position where no row survives; a row alive after all L earns a bonus token from q.
    target_probs ``[K, L+1, V]``, draft_tokens ``[K, L]``.
    """
    num_drafts, draft_length = draft_tokens.shape
    device = draft_tokens.device
    alive = torch.ones(num_drafts, dtype=torch.bool, device=device)  # [K]: rows matching every output so far
    ended = torch.zeros((), dtype=torch.bool, device=device)  # []: a position had no survivor
    num_accepted = torch.zeros((), dtype=torch.long, device=device)  # []
    outputs = []
    for t in range(draft_length):
        token = choose(t, alive, alive.to(torch.uint8).argmax())
        survivors = alive & (draft_tokens[:, t] == token)  # [K]
        outputs.append(token)
        num_accepted = num_accepted + (~ended & survivors.any()).long()
        ended = ended | ~survivors.any()
        alive = torch.where(ended, alive, survivors)  # the last non-empty set: the rows followed
    row = alive.to(torch.uint8).argmax()  # []
    bonus_law = target_probs[:, draft_length].index_select(0, row.view(1))  # [1, V]
    outputs.append(sample(bonus_law, randomness, Stream.BONUS, draft_length).squeeze(0))  # kept if no position ended
    tokens = torch.stack(outputs)  # [L+1]: position num_accepted holds the correction or the bonus
    return BlockDecision(tokens, num_accepted, row)


def prefix_agreement(draft_tokens: torch.Tensor) -> torch.Tensor:
    """``[K, K, L+1]`` bool: entry (i, j, t) says rows i and j of draft_tokens ``[K, L]`` drew the same tokens
    before position t (so they are alive together at t, or dead together)."""
    same = (draft_tokens[:, None, :] == draft_tokens[None, :, :]).long()  # [K, K, L]
    empty_prefix = torch.ones_like(same[..., :1])  # [K, K, 1]
    return torch.cat([empty_prefix, same.cumprod(-1)], -1).bool()  # [K, K, L+1]


def problem_members(agreement: torch.Tensor) -> torch.Tensor:
    """``[K, L, K]`` bool: the candidates of problem (k, t), the rows j ≥ k that agree with row k before t.

    agreement ``[K, K, L+1]`` (:func:`prefix_agreement`). When k is the first row alive at t, these are
    exactly the walk's alive rows there; the other problems are solved too, and never used.
    """
    num_rows = agreement.shape[0]
    rows = torch.arange(num_rows, device=agreement.device)  # [K]
    later = (rows[None, :] >= rows[:, None]).unsqueeze(-1)  # [K(k), K(j), 1]
    return (agreement[..., :-1] & later).transpose(1, 2)  # [K(k), L, K(j)]


def decide_problems(
    accepts: torch.Tensor,
    residuals: torch.Tensor,
    agreement: torch.Tensor,
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockDecision:
    """The multi-draft walk when every problem (k, t) of :func:`problem_members` is solved at once: a fixed
    number of small operations and no read, for any data.

    accepts ``[K, L, K]``: candidate j's acceptance probability in problem (k, t), given the candidates
    before it were rejected (0 for a non-member); residuals ``[K, L, V]``: what the output is drawn from
    (any non-negative weights) when all are rejected. Candidate j at offset t is tested with the uniform
    (stream ACCEPT, t, lane j); the walk starts at problem (0, 0) and, after accepting candidate j at t,
    goes on with the first row that agrees with j through t. target_probs ``[K, L+1, V]``, draft_tokens ``[K, L]``.
    """
    num_rows, draft_length = draft_tokens.shape
    uniforms = uniforms_from(randomness, Stream.ACCEPT, (draft_length, num_rows), draft_tokens.device, lanes_last=True)
    taken = uniforms < accepts.double()  # [K, L, K]
    accepted = taken.any(-1).flatten()  # [K L]: problem (k, t) at k L + t
    first = taken.to(torch.uint8).argmax(-1)  # [K, L]: the accepted candidate
    output = draft_tokens.gather(0, first).flatten()  # [K L]: its token
    # The first row that agrees with the accepted candidate through t leads the rows alive at t + 1.
    through = agreement[:, :, 1:].transpose(1, 2)  # [K(i), L, K(j)]: rows i, j agree through t
    following = through.gather(0, first.unsqueeze(-1).expand_as(through)).to(torch.uint8).argmax(-1).flatten()  # [K L]
    leader = torch.zeros((), dtype=torch.long, device=draft_tokens.device)  # []
    going = torch.ones((), dtype=torch.bool, device=draft_tokens.device)  # []: every position so far accepted
    num_accepted = torch.zeros_like(leader)  # []
    path = []
    for t in range(draft_length):
        problem = (leader * draft_length + t).view(1)  # [1]
        going = going & accepted.gather(0, problem).squeeze(0)
        num_accepted = num_accepted + going.long()
        leader = torch.where(going, following.gather(0, problem).squeeze(0), leader)
        path.append(problem)
    path = torch.cat(path)  # [L]: the problem solved at each position
    ended_at = path.gather(0, num_accepted.clamp(max=draft_length - 1).view(1))  # [1]
    residual = residuals.flatten(0, 1).index_select(0, ended_at).squeeze(0)  # [V]
    bonus_law = target_probs[:, draft_length].index_select(0, leader.view(1)).squeeze(0)  # [V]
    return commit_following(num_accepted, output.gather(0, path), residual, bonus_law, randomness, leader)


def walk_reading(
    decide: Callable[[int, list[int], list[list[int]], list[list[float]]], tuple[int | None, torch.Tensor | None]],
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockDecision:
    """The multi-draft walk with host reads, for the CPU, where a read is free: position by position, and
    only as far as the block goes.

    ``decide(t, alive, tokens, uniforms)`` gets the alive rows (host ints, first = the leader), every
    row's tokens ``[K][L]`` and the ACCEPT uniforms ``[L][K]`` (candidate j at offset t: ``uniforms[t][j]``,
    as :func:`decide_problems` uses them) and returns (the accepted row, None) or (None, the residual
    ``[V]`` the block ends with). target_probs ``[K, L+1, V]``, draft_tokens ``[K, L]``.
    """
    num_rows, draft_length = draft_tokens.shape
    tokens = draft_tokens.tolist()  # [K][L]
    uniforms = uniforms_from(
        randomness, Stream.ACCEPT, (draft_length, num_rows), draft_tokens.device, lanes_last=True
    ).tolist()
    alive, num_accepted, law = list(range(num_rows)), 0, None
    while law is None and num_accepted < draft_length:
        accepted, law = decide(num_accepted, alive, tokens, uniforms)
        if accepted is not None:
            alive = [i for i in alive if tokens[i][num_accepted] == tokens[accepted][num_accepted]]
            num_accepted += 1
    row = torch.tensor(alive[0], device=draft_tokens.device)  # []
    law = target_probs[alive[0], draft_length] if law is None else law  # [V]: the bonus law when all were accepted
    return commit_following(
        torch.tensor(num_accepted, device=row.device), draft_tokens[alive[0]], law, law, randomness, row
    )


def commit_following(
    num_accepted: torch.Tensor,
    tokens: torch.Tensor,
    residual: torch.Tensor,
    bonus_law: torch.Tensor,
    randomness: Randomness,
    row: torch.Tensor,
) -> BlockDecision:
    """The decision once ``num_accepted`` ``[]`` of the L ``tokens`` ``[L]`` are kept: the next token is drawn
    from ``residual`` ``[V]`` after a rejection (stream RESIDUAL at offset n) or from ``bonus_law`` ``[V]``
    when all L were accepted (stream BONUS at offset L), in one keyed evaluation and one draw."""
    stream = torch.where(num_accepted < tokens.shape[0], int(Stream.RESIDUAL), int(Stream.BONUS))  # []
    uniform = uniforms_from(randomness, stream, (), residual.device, num_accepted)  # []
    return commit_with_uniform(num_accepted, tokens, residual, bonus_law, uniform, row)


def commit_with_uniform(
    num_accepted: torch.Tensor,
    tokens: torch.Tensor,
    residual: torch.Tensor,
    bonus_law: torch.Tensor,
    uniform: torch.Tensor,
    row: torch.Tensor,
) -> BlockDecision:
    """:func:`commit_following` with the draw's ``uniform`` ``[]`` float64 already taken (from the stream
    that :func:`commit_following` names). A caller that already knows which law is drawn from (a host walk)
    passes it as both, and no choice over V is made."""
    law = residual if residual is bonus_law else torch.where(num_accepted < tokens.shape[0], residual, bonus_law)  # [V]
    token = sample_with(law, uniform).view(1)  # [1]
    committed = torch.cat([tokens, token]).scatter(0, num_accepted.view(1), token)  # [L+1]
    return BlockDecision(committed, num_accepted, row)


def shared_prefix_length(draft_tokens: np.ndarray) -> int:
    """Positions at which all rows of ``draft_tokens`` ``[K, L]`` can still be alive together.

    Rows are alive together at position t only if they drew the same tokens before it, so a
    scheme that prepares "all rows alive" problems needs positions 0..n-1 only: n is one past
    the first position where the rows differ, or L.
    """
    differs = (draft_tokens != draft_tokens[:1]).any(0)  # [L]
    return int(np.argmax(differs)) + 1 if differs.any() else draft_tokens.shape[1]


def first_rejection(
    accepted: torch.Tensor, tokens: torch.Tensor, bonus_law: torch.Tensor, randomness: Randomness
) -> BlockDecision:
    """The single-draft block decision from per-position outcomes, on the device.

    accepted ``[L]`` bool and tokens ``[L]`` (the draft token where accepted, else the correction
    drawn there); bonus_law ``[V]``: q after all L draft tokens. The block commits the accepted
    prefix and the token at its first rejection, or a bonus token drawn from ``bonus_law``.
    """
    num_accepted = accepted.long().cumprod(0).sum()  # []
    bonus = sample(bonus_law.unsqueeze(0), randomness, Stream.BONUS, len(tokens))  # [1]; kept when all L were accepted
    committed = torch.cat([tokens, bonus])  # [L+1]
    return BlockDecision(committed, num_accepted, torch.zeros_like(num_accepted))
