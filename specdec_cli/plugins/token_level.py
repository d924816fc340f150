"""The token-level verifier contract: a selection rule at one position, given the K candidates there.

Plugins implement :meth:`Verifier.conditional` and :meth:`Verifier.acceptance_probability`; the base class builds
the block call from :meth:`Verifier.select` (all positions at once with one draft, the walk over the rows still
alive with several).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..base.randomness import Randomness, at
from ..base.sampling import sample
from .block_verifier import BlockVerifier
from .decisions import BlockDecision
from .walks import first_rejection, shared_prefix_length, walk_alive_rows

__all__ = ["Verifier"]


class _DrawsOnlyThroughVerifier:
    """``keyed_randomness`` of a :class:`Verifier` subclass that neither sets it nor is ``capturable``: True when
    it overrides none of the methods that draw, all of which draw keyed (``select`` through
    :func:`~specdec_cli.sampling.sample`, the others through it, :func:`first_rejection`, :func:`walk_alive_rows`)."""

    def __get__(self, instance: object, owner: type) -> bool:
        drawing = ("select", "select_alive", "verify_block", "verify_batch", "verify")
        return all(getattr(owner, method) is getattr(Verifier, method) for method in drawing)


class Verifier(BlockVerifier):
    """A token-level verifier. All methods are batched over leading dimensions ``[...]``.

    Plugins implement :meth:`conditional` and :meth:`acceptance_probability`; :meth:`select`
    samples ``conditional`` unless overridden with something cheaper. The block call walks the
    positions with a mask of the rows still alive (their tokens equal every output so far) and
    stops committing at the first position where none survives; a row alive after all L earns a
    bonus token from q. With one draft the positions are independent, so it decides all of them
    in one batched ``select``.
    """

    token_level = True
    keyed_randomness = _DrawsOnlyThroughVerifier()

    @abstractmethod
    def conditional(
        self, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The exact law of the output token given the candidates.

        target_probs ``[..., V]``, draft_probs ``[..., K, V]``, draft_tokens ``[..., K]`` → ``[..., V]``.
        """

    @abstractmethod
    def acceptance_probability(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """P(output ∈ candidates) when ``x_k ~ draft_probs[..., k, :]`` independently → ``[...]``."""

    def select(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: Randomness = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample from :meth:`conditional` → (token ``[...]``, accepted ``[...]``).

        ``accepted`` says whether the token equals one of the candidates. Keyed draws put row i of the
        leading dimensions at offset i (a block's positions).
        """
        token = sample(self.conditional(target_probs, draft_probs, draft_tokens), randomness)  # [...]
        accepted = (draft_tokens == token.unsqueeze(-1)).any(-1)  # [...]
        return token, accepted

    def select_alive(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        alive: torch.Tensor,
        randomness: Randomness = None,
    ) -> torch.Tensor:
        """:meth:`select` among the candidates with ``alive`` set, in their order → token ``[]``.

        target_probs ``[V]``, draft_probs ``[K, V]``, draft_tokens ``[K]``, alive ``[K]`` bool (the
        result is unused when no row is alive). How many rows are alive is not known on the host,
        so this default selects among the first k alive rows for every k = 1..K and keeps the one
        for the true count; verifiers that can mask dead candidates override it.
        """
        num_drafts = draft_tokens.shape[0]
        if num_drafts == 1:
            return self.select(target_probs, draft_probs, draft_tokens, randomness)[0]
        order = torch.argsort((~alive).to(torch.uint8), stable=True)  # [K]: alive rows first, in order
        outputs = [
            self.select(target_probs, draft_probs[order[:k]], draft_tokens[order[:k]], randomness)[0]
            for k in range(1, num_drafts + 1)
        ]
        count = alive.sum().clamp(min=1)  # []
        return torch.stack(outputs).gather(0, (count - 1).view(1)).squeeze(0)

    def prepare(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> None:
        """Optional: called once per block with the positions' laws, before the positions are walked.

        target_probs ``[n, V]``, draft_probs ``[n, K, V]`` as if all drafts were alive (the device walk
        passes all L positions; where the tokens are known on the host, only the first
        :func:`shared_prefix_length` positions, the ones where that can happen). A scheme that solves
        a problem per position can solve them here in one batched call; the default does nothing.
        """

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None) -> BlockDecision:
        if draft_tokens.shape[0] == 1:
            tokens, accepted = self.select(
                target_probs[0, :-1], draft_probs.transpose(0, 1), draft_tokens.transpose(0, 1), randomness
            )  # [L] each; inputs [L, V], [L, 1, V], [L, 1]
            return first_rejection(accepted, tokens, target_probs[0, -1], randomness)
        return self._walk(target_probs, draft_probs, draft_tokens, randomness)

    def _walk(self, target_probs, draft_probs, draft_tokens, randomness) -> BlockDecision:
        """The multi-draft walk over positions with an alive mask, all on the device."""
        draft_length = draft_tokens.shape[1]
        self.prepare(target_probs[0, :draft_length], draft_probs.transpose(0, 1))  # [L, V], [L, K, V]

        def choose(t: int, alive: torch.Tensor, leader: torch.Tensor) -> torch.Tensor:
            target = target_probs[:, t].index_select(0, leader.view(1)).squeeze(0)  # [V]: q of the alive rows
            return self.select_alive(target, draft_probs[:, t], draft_tokens[:, t], alive, at(randomness, t))

        return walk_alive_rows(choose, target_probs, draft_tokens, randomness)

    def block_law(self, target_probs, draft_probs, draft_tokens):
        """The walk's exact law, by recursion over the alive sets (host loops: for tests only)."""
        num_drafts, draft_length = draft_tokens.shape
        law = torch.zeros(target_probs.shape, dtype=target_probs.dtype)  # [K, L+1, V]
        shared = shared_prefix_length(draft_tokens.numpy(force=True))
        self.prepare(target_probs[0, :shared], draft_probs[:, :shared].transpose(0, 1))

        def walk(t: int, alive: list[int], mass: float) -> None:
            if t == draft_length:
                law[alive[0], t] += mass * target_probs[alive[0], t]
                return
            output = self.conditional(target_probs[alive[0], t], draft_probs[alive, t], draft_tokens[alive, t])  # [V]
            for token in torch.nonzero(output).flatten().tolist():
                survivors = [k for k in alive if int(draft_tokens[k, t]) == token]
                if survivors:
                    walk(t + 1, survivors, mass * float(output[token]))
                else:
                    law[alive[0], t, token] += mass * float(output[token])

        walk(0, list(range(num_drafts)), 1.0)
        return law
