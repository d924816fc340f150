"""The single-draft rule base: a token-level rule with one draft token per position, written as two hooks.

Notation (q = target law, p = draft law at one position, x ~ p the draft token there). Every single-draft rule the
project ships decides a position the same way, and differs only in two laws:

    accept x         with probability acceptance(q, p, x)
    otherwise draw   from residual_weights(q, p, x), normalised

and a block tests all L positions at once, ends at the first rejection with a draw from the residual there, or,
accepted whole, with a bonus token drawn from q (:func:`~specdec_cli.plugins.laws.single_draft_block`). A plugin
that subclasses :class:`SingleDraftRule` writes those two hooks; the base class writes ``conditional``, ``select``,
``verify_block``, ``acceptance_probability`` (Σ_x p(x)·acceptance(x)) and ``block_law`` from them. A rule with a
closed form (an acceptance without the sum over V, an output law) overrides that method.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..base.randomness import Randomness
from .block_verifier import JudgedLaws
from .decisions import BlockDecision
from .laws import first_accepted, one_hot_mass, single_draft_block, uniforms_like
from .token_level import Verifier

__all__ = ["SingleDraftRule"]


class SingleDraftRule(Verifier):
    """A token-level rule with one draft (docs/verifiers.md, "Single-draft rules"): implement :meth:`acceptance`
    and :meth:`residual_weights`; every other method comes from them.

    The hooks take laws batched over leading dimensions ``[..., V]`` and candidates ``x`` ``[..., k]``. A rule that
    judges drafts by other laws (``judged_laws``) gets them as ``judged=`` in :meth:`acceptance`: (the target's
    ``[..., V]``, the draft's ``[..., V]``), beside the sampling laws; a rule that does not is never passed it.
    """

    max_drafts = 1
    keyed_randomness = True  # every draw below goes through the keyed helpers of laws.py

    @abstractmethod
    def acceptance(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The probability of accepting each candidate of ``x`` ``[..., k]`` drawn from draft_probs, against
        target_probs (``[..., V]`` each) → ``[..., k]`` in [0, 1]."""

    @abstractmethod
    def residual_weights(self, target_probs: torch.Tensor, draft_probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What a position draws from after rejecting ``x`` ``[..., 1]``: non-negative weights ``[..., V]`` with mass
        in every row (where the residual is empty, x is accepted with probability 1 and any law will do:
        :func:`~specdec_cli.plugins.laws.excess_or` falls back). The base class normalises them where it needs a
        law; a draw takes them as they are."""

    def _accepts(self, target_probs, draft_probs, x, judged: JudgedLaws) -> torch.Tensor:
        """:meth:`acceptance`, passed ``judged`` only where there are judged laws."""
        if judged is None:
            return self.acceptance(target_probs, draft_probs, x)  # [..., k]
        return self.acceptance(target_probs, draft_probs, x, judged=judged)  # [..., k]

    def conditional(self, target_probs, draft_probs, draft_tokens, judged: JudgedLaws = None):
        q, p, x = target_probs, draft_probs[..., 0, :], draft_tokens[..., :1]  # [..., V], [..., V], [..., 1]
        accept = self._accepts(q, p, x, _one_draft(judged))  # [..., 1]
        weights = self.residual_weights(q, p, x)  # [..., V]
        residual = weights / weights.sum(-1, keepdim=True)  # [..., V]: the law drawn from after a rejection
        return one_hot_mass((1 - accept) * residual, x, accept)  # [..., V]

    def select(self, target_probs, draft_probs, draft_tokens, randomness: Randomness = None):
        q, p, x = target_probs, draft_probs[..., 0, :], draft_tokens[..., :1]  # [..., V], [..., V], [..., 1]
        accept = self.acceptance(q, p, x)  # [..., 1]
        return first_accepted(uniforms_like(accept, randomness), accept, x, self.residual_weights(q, p, x), randomness)

    def verify_block(
        self, target_probs, draft_probs, draft_tokens, randomness: Randomness = None, judged: JudgedLaws = None
    ) -> BlockDecision:
        """All L positions tested at once on the block's one row (``[1, L+1, V]``, ``[1, L, V]``, ``[1, L]``: the
        hooks take the row's leading 1 as a batch dimension, which spares selecting it), the residual computed at
        the first rejected position only."""
        candidates = draft_tokens.unsqueeze(-1)  # [1, L, 1]
        compared = None if judged is None else (judged[0][:, :-1], judged[1])  # [1, L, V] each
        accept = self._accepts(target_probs[:, :-1], draft_probs, candidates, compared).view(-1)  # [L]

        def residual_at(position: torch.Tensor) -> torch.Tensor:  # [V]: after a rejection at ``position`` []
            index = position.view(1)  # [1]
            rows = (laws.index_select(1, index) for laws in (target_probs, draft_probs, candidates))  # [1, 1, ·] each
            return self.residual_weights(*rows).view(-1)  # [V]

        return single_draft_block(accept, residual_at, target_probs[0], draft_tokens[0], randomness)

    def acceptance_probability(self, target_probs, draft_probs, judged: JudgedLaws = None):
        """Σ_x p(x)·acceptance(x): every token of the vocabulary tested as the candidate."""
        p = draft_probs[..., 0, :]  # [..., V]
        every = torch.arange(p.shape[-1], device=p.device).expand(p.shape)  # [..., V]: each token as x
        return (p * self._accepts(target_probs, p, every, _one_draft(judged))).sum(-1)  # [...]

    def block_law(self, target_probs, draft_probs, draft_tokens):
        """The exact law of :meth:`verify_block` (host loops: for tests and the author's kit): x_t accepted with its
        acceptance, else the block ends with a draw from the residual, which may repeat x_t (the walk over
        ``conditional`` would go on where the output equals the draft token)."""
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        accept = self.acceptance(q[:-1], p, x.unsqueeze(-1)).squeeze(-1).tolist()  # [L]
        law = torch.zeros((1, *q.shape), dtype=q.dtype)  # [1, L+1, V]
        mass = 1.0
        for t, kept in enumerate(accept):
            weights = self.residual_weights(q[t], p[t], x[t : t + 1])  # [V]
            law[0, t] += mass * (1 - kept) * weights / weights.sum()
            mass *= kept
        law[0, -1] += mass * q[-1]
        return law


def _one_draft(judged: JudgedLaws) -> JudgedLaws:
    """The judged laws of the token-level methods (target ``[..., V]``, drafts ``[..., 1, V]``) with the draft's one
    row taken, as the methods take the handed draft law's."""
    return None if judged is None else (judged[0], judged[1][..., 0, :])
