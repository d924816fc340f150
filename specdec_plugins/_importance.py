"""Importance-weighted sampling (Khisti et al., "Multi-Draft Speculative Sampling", §3-4).

The rule in the project's notation: docs/verifiers.md §5.

Canonical two-step architecture: (a) select one candidate Y from the drafts with weights
β_y(S), whose law is p_I(y); (b) speculative sampling of Y against q: accept with
min(1, q(Y)/p_I(Y)), else sample (q - p_I)+ normalised. Lossless for any weights; the
acceptance Σ_y min(q(y), p_I(y)) is maximised by a linear program (Theorem 1). K > 2 drafts:
successive pairwise selection, (x1, x2) → Y1 of law p_I1, then (Y1, x3) with laws (p_I1, p_3), …
(Remark 4). One stage is :mod:`._pair_selection`; each stage solves both tails and keeps, per
problem, the one that reaches the larger Σ min(c, p_I): lossless either way, the choice depending
on the laws only.

Everything over the vocabulary stays on the tensors' device. Each stage reads the device once,
for its free LPs (a few hundred numbers); with two drafts that is the block's only read besides
the engine's. In a block, the problems are "position t, the rows that share row k's prefix"
(found by comparing tokens, never laws); the walk (:func:`~specdec_cli.verifiers.walk_alive_rows`)
draws at each position the output of the problem its alive rows make, indexed on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_cli.sampling import sample
from specdec_cli.verifiers import Verifier, walk_alive_rows

from ._laws import normalized_or, ratio_acceptance
from ._pair_selection import COIN, RANKED, StageInputs, coin_tail, ranked_tail, solve_free_problems, stage_inputs
from .speculative import SpeculativeSampling

_MAX_SOLVED = 100_000  # cached free-LP solutions per verifier before the cache starts over


@dataclass
class Problems:
    """P selection problems: a target law and up to K candidates (laws and tokens) in member order."""

    target: torch.Tensor  # [P, V] q
    laws: torch.Tensor  # [R, V]: the candidates' laws, indexed by ``rows``
    rows: torch.Tensor  # [P, K] int64: row of ``laws`` for each candidate slot
    tokens: torch.Tensor  # [P, K] int64: candidate tokens (slots past ``count`` are filler)
    count: torch.Tensor  # [P] int64 in 1..K: how many candidates the problem has
    stage_rows: list[int]  # [K-1]: only problems 0 .. stage_rows[j-1]-1 can have a stage j
    first_laws: torch.Tensor  # [P, V]: the first candidate's law (a view where the layout allows)

    def candidate_law(self, slot: int, upto: int) -> torch.Tensor:
        if slot == 0:
            return self.first_laws[:upto]
        return self.laws.index_select(0, self.rows[:upto, slot])  # [upto, V]

    @classmethod
    def independent(cls, target_probs, draft_probs, draft_tokens) -> "Problems":
        """One problem per leading index: target ``[..., V]``, drafts ``[..., K, V]``, tokens ``[..., K]``."""
        vocab, num_drafts = target_probs.shape[-1], draft_probs.shape[-2]
        target = target_probs.reshape(-1, vocab)  # [P, V]
        count = target.shape[0]
        rows = torch.arange(count * num_drafts, device=target.device).view(count, num_drafts)  # [P, K]
        tokens = draft_tokens.reshape(count, num_drafts)  # [P, K]
        full = torch.full((count,), num_drafts, device=target.device)  # [P]
        laws = draft_probs.reshape(-1, vocab)  # [P K, V]
        return cls(target, laws, rows, tokens, full, [count] * (num_drafts - 1), laws[::num_drafts])

    @classmethod
    def block(cls, target_probs, draft_probs, draft_tokens) -> "Problems":
        """Problem (k, t), at index k L + t: position t, candidates the rows j ≥ k that share row k's prefix.

        The walk's alive rows at t are exactly the prefix class of the first of them, so the problem
        of (t, first alive row) is the one the walk needs; a row that cannot lead a class of j+1 rows
        (k > K-1-j) never needs stage j, hence ``stage_rows``.
        """
        num_drafts, draft_length = draft_tokens.shape
        device = draft_tokens.device
        same = draft_tokens[:, None, :] == draft_tokens[None, :, :]  # [K, K, L]
        before = torch.ones_like(same[..., :1])  # [K, K, 1]: the empty prefix is shared
        shared = torch.cat([before, same.long().cumprod(-1)[..., :-1].bool()], -1)  # [K, K, L]: prefixes equal
        slots = torch.arange(num_drafts, device=device)  # [K]
        member = (shared & (slots[None, :] >= slots[:, None])[..., None]).transpose(1, 2)  # [K(k), L, K(j)]
        order = torch.argsort((~member).to(torch.uint8), dim=-1, stable=True)  # [K, L, K]: members first
        positions = torch.arange(draft_length, device=device)[None, :, None]  # [1, L, 1]
        rows = (order * draft_length + positions).reshape(-1, num_drafts)  # [K L, K]: index j L + t
        vocab = target_probs.shape[-1]
        target = target_probs[:, :draft_length].reshape(-1, vocab)  # [K L, V]
        laws = draft_probs.reshape(-1, vocab)  # [K L, V]
        stage_rows = [(num_drafts - j) * draft_length for j in range(1, num_drafts)]
        # A problem's first member is its own row k, so the first laws are the table itself.
        return cls(target, laws, rows, draft_tokens.reshape(-1)[rows], member.sum(-1).reshape(-1), stage_rows, laws)


@dataclass
class Stage:
    """One solved selection stage, for the A problems it applies to (device tensors)."""

    rows: torch.Tensor  # [A] int64: the problems with a (j+1)-th candidate
    free_ids: torch.Tensor  # [A, M]
    free_valid: torch.Tensor  # [A, M] bool
    weights: torch.Tensor  # [A, M, M]: the kept tail's LP weights
    coin: torch.Tensor  # [A] bool: the kept tail is the fair coin (else ranked)
    rank_key: torch.Tensor | None  # [A, V] int32: ranks by (key, token id) (None without a ranked tail)
    law: torch.Tensor  # [A, V]: p_I after this stage

    def keep_first(self, tokens: torch.Tensor, second: int) -> torch.Tensor:
        """P(Y = x_i | X1 = x_i, X2 = x_second) for each candidate slot i of ``tokens`` ``[A, K]`` → ``[A, K]``."""
        match = (tokens[:, :, None] == self.free_ids[:, None, :]) & self.free_valid[:, None, :]  # [A, K, M]
        free = match.any(-1)  # [A, K]
        position = match.long().argmax(-1)  # [A, K]
        width = self.free_ids.shape[-1]
        weight_rows = self.weights.gather(1, position[:, :, None].expand(-1, -1, width))  # [A, K, M]
        weight = weight_rows.gather(2, position[:, second, None, None].expand(-1, tokens.shape[1], 1)).squeeze(-1)
        ranked = torch.zeros_like(weight)  # [A, K]
        if self.rank_key is not None:  # the higher rank wins: the larger key, then the larger id
            keys, other = self.rank_key.gather(1, tokens), self.rank_key.gather(1, tokens[:, second, None])  # [A, K], [A, 1]
            above = (keys > other) | ((keys == other) & (tokens > tokens[:, second, None]))  # [A, K]
            ranked = above.to(weight.dtype)
        tail = torch.where(self.coin[:, None], torch.full_like(ranked, 0.5), ranked)  # [A, K]
        keep = torch.where(free & free[:, second, None], weight, tail)  # [A, K]
        return torch.where(tokens == tokens[:, second, None], torch.ones_like(keep), keep)


@dataclass
class Plan:
    """Every problem's solved scheme: its alphabet, its stages and the law p_I of the selected candidate."""

    scheme_target: torch.Tensor  # [P, V] q~: q on the alphabet O, renormalised
    inside_mass: torch.Tensor  # [P, 1] q(O)
    outside: torch.Tensor | None  # [P, V] q off the alphabet (None when O is always q's support)
    selected_law: torch.Tensor  # [P, V] p_I after every stage
    stages: list[Stage]

    def selection(self, tokens: torch.Tensor) -> torch.Tensor:
        """P(Y = candidate slot i) given the candidates ``[P, K]`` → ``[P, K]``."""
        chosen = torch.zeros_like(tokens, dtype=torch.float64)  # [P, K]
        chosen[:, 0] = 1.0
        for second, stage in enumerate(self.stages, start=1):
            before = chosen.index_select(0, stage.rows)  # [A, K]
            keep = stage.keep_first(tokens.index_select(0, stage.rows), second)  # [A, K]
            after = before * keep
            after[:, second] += (before * (1 - keep)).sum(-1)
            chosen = chosen.index_copy(0, stage.rows, after)
        return chosen

    def acceptance(self) -> torch.Tensor:
        return self.inside_mass.squeeze(-1) * torch.minimum(self.scheme_target, self.selected_law).sum(-1)  # [P]

    def _step_b(self, tokens: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """For the problems ``rows`` ``[n]``: q~ ``[n, V]``, the candidates' acceptance min(1, q~/p_I) ``[n, K]``
        and the residual (q~ - p_I)+ ``[n, V]``; tokens ``[n, K]``."""
        target, law = self.scheme_target.index_select(0, rows), self.selected_law.index_select(0, rows)  # [n, V]
        accept = ratio_acceptance(target, law, tokens)  # [n, K]
        return target, accept, torch.sub(target, law).clamp_(min=0)

    def output_law(self, tokens: torch.Tensor) -> torch.Tensor:
        """The law of the output given the candidates ``[P, K]`` → ``[P, V]``."""
        chosen = self.selection(tokens)  # [P, K]
        target, accept, residual = self._step_b(tokens, torch.arange(len(tokens), device=tokens.device))
        rejected = (chosen * (1 - accept)).sum(-1, keepdim=True).to(residual.dtype)  # [P, 1]
        inner = torch.zeros_like(residual).scatter_add(1, tokens, (chosen * accept).to(residual.dtype))  # [P, V]
        inner = inner + rejected * normalized_or(residual, target)
        if self.outside is None:
            return inner
        return self.inside_mass * inner + (1 - self.inside_mass) * self.outside

    def sample(self, chosen: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, generator) -> torch.Tensor:
        """One output for each problem of ``rows`` ``[n]`` (device indices), on the device → ``[n]``.

        chosen ``[P, K]``: :meth:`selection` of every problem's candidates ``tokens`` ``[P, K]``.
        """
        tokens = tokens.index_select(0, rows)  # [n, K]
        target, accept, residual = self._step_b(tokens, rows)
        slot = sample(chosen.index_select(0, rows), generator)[:, None]  # [n, 1]
        uniform = torch.rand(slot.shape, generator=generator, device=slot.device, dtype=accept.dtype)  # [n, 1]
        taken = uniform < accept.gather(1, slot)  # [n, 1]
        empty = residual.sum(-1, keepdim=True) <= 0  # [n, 1]: p_I = q~, so a rejection has probability 0
        fallback = sample(torch.where(empty, target, residual, out=residual), generator)  # [n]
        output = torch.where(taken.squeeze(1), tokens.gather(1, slot).squeeze(1), fallback)  # [n]
        if self.outside is None:
            return output
        uniform = torch.rand(output.shape, generator=generator, device=output.device, dtype=accept.dtype)  # [n]
        outside = sample(self.outside.index_select(0, rows), generator)  # [n]
        return torch.where(uniform < self.inside_mass.index_select(0, rows).squeeze(1), output, outside)


class ImportanceSampling(Verifier):
    """Shared body of ``is-lp`` and ``is-truncated``: they choose the free width, the tails and the alphabet."""

    lossless = True
    max_drafts = None
    tails: tuple[str, ...] = (RANKED, COIN)
    """The tail rules each stage solves (the better one per problem is kept)."""

    @property
    def _solved(self) -> dict:
        """Free LP solutions met so far, by the sub-problem's numbers (see :func:`solve_free_problems`)."""
        if "_solutions" not in self.__dict__:
            self._solutions: dict = {}
        return self._solutions

    @property
    def free_width(self) -> int:
        """How many of the top-ranked support tokens get free LP weights."""
        raise NotImplementedError

    def check_support(self, support_sizes: np.ndarray) -> None:
        """Refuse problems whose drafts' support is too large (host array of the active problems' sizes)."""

    def alphabet_mask(self, target: torch.Tensor) -> torch.Tensor | None:
        """The alphabet O ``[P, V]`` bool the scheme runs on, or None for q's whole support."""
        return None

    # ----------------------------------------------------------------------- contract

    def conditional(self, target_probs, draft_probs, draft_tokens):
        problems = Problems.independent(target_probs, draft_probs, draft_tokens)
        law = self.plan(problems).output_law(problems.tokens)  # [P, V]
        return law.reshape(target_probs.shape).to(target_probs.dtype)

    def acceptance_probability(self, target_probs, draft_probs):
        """Σ_y min(q(y), p_I(y)) (times q(O) under alphabet truncation).

        This is the canonical acceptance of step (b); the engine also continues a block when the
        residual happens to return another candidate, so the true P(output ∈ candidates) can be
        higher: this value is a lower bound.
        """
        tokens = torch.zeros(draft_probs.shape[:-1], dtype=torch.long, device=draft_probs.device)  # [..., K]
        acceptance = self.plan(Problems.independent(target_probs, draft_probs, tokens)).acceptance()  # [P]
        return acceptance.reshape(target_probs.shape[:-1]).to(target_probs.dtype)

    def verify_block(self, target_probs, draft_probs, draft_tokens, generator=None):
        num_drafts, draft_length = draft_tokens.shape
        if num_drafts == 1:  # one candidate: the scheme is speculative sampling, decided on the device
            return SpeculativeSampling().verify_block(target_probs, draft_probs, draft_tokens, generator)
        problems = Problems.block(target_probs, draft_probs, draft_tokens)
        plan = self.plan(problems)
        chosen = plan.selection(problems.tokens)  # [K L, K]

        def choose(t: int, alive: torch.Tensor, leader: torch.Tensor) -> torch.Tensor:
            problem = (leader * draft_length + t).view(1)  # [1]: the problem of (leader, t), drawn alone
            return plan.sample(chosen, problems.tokens, problem, generator).squeeze(0)

        return walk_alive_rows(choose, target_probs, draft_tokens, generator)

    # ----------------------------------------------------------------------- planning

    def plan(self, problems: Problems) -> Plan:
        """Solve every problem's stages: one device read and one LP call per stage."""
        plan = self._alphabet_plan(problems)
        for second, upto in enumerate(problems.stage_rows, start=1):
            inputs = stage_inputs(plan.selected_law[:upto], problems.candidate_law(second, upto),
                                  plan.scheme_target[:upto], self.free_width, self.tails)  # fmt: skip
            stage = self._solve_stage(inputs, problems.count[:upto] > second)
            plan.selected_law = plan.selected_law.index_copy(0, stage.rows, stage.law)
            plan.stages.append(stage)
        return plan

    def _alphabet_plan(self, problems: Problems) -> Plan:
        """q~ = q on the alphabet, renormalised, for problems of two or more candidates; q itself for one.

        One candidate needs no selection LP, so no alphabet either: the scheme is then exactly
        speculative sampling, as every multi-draft scheme must be with one draft.
        """
        target = problems.target  # [P, V]
        selected = problems.candidate_law(0, target.shape[0])  # [P, V]
        inside = self.alphabet_mask(target)
        if inside is None:
            return Plan(target, torch.ones_like(target[:, :1]), None, selected, [])
        inside = inside | (problems.count < 2)[:, None]  # [P, V]
        inside_mass = target.masked_fill(~inside, 0).sum(-1, keepdim=True)  # [P, 1]
        scheme = torch.where(inside, target / inside_mass, torch.zeros_like(target))  # [P, V]
        scheme = torch.where(problems.count[:, None] < 2, target, scheme)  # exactly q with one candidate
        inside_mass = torch.where(problems.count[:, None] < 2, torch.ones_like(inside_mass), inside_mass)
        outside = normalized_or(target.masked_fill(inside, 0), target)  # [P, V]
        return Plan(scheme, inside_mass, outside, selected, [])

    def _solve_stage(self, inputs: StageInputs, active: torch.Tensor) -> Stage:
        """The free LPs of the problems with a second candidate on the host (the stage's one read), then,
        on the device and for those problems only, each tail's law and the better tail per problem."""
        host = torch.cat([inputs.host_arrays(), active.double()[:, None]], -1).numpy(force=True)
        is_active = host[:, -1] > 0.5
        self.check_support(host[is_active, -2])
        if len(self._solved) > _MAX_SOLVED:
            self._solved.clear()
        weights, free_laws, free_acceptance = (
            torch.as_tensor(array, device=inputs.first.device)
            for array in solve_free_problems(host[is_active, :-1], inputs.free_ids.shape[-1], len(self.tails),
                                             self._solved)
        )  # [A, T, M, M], [A, T, M], [A, T]  # fmt: skip
        inputs = inputs.restricted(torch.as_tensor(np.flatnonzero(is_active), device=inputs.first.device))
        laws, rank_key = self._tail_laws(inputs)  # T × [A, V]
        best, best_total = laws[0], _nonfree_acceptance(inputs, laws[0]) + free_acceptance[:, 0]  # [A, V], [A]
        choice = torch.zeros_like(best_total, dtype=torch.long)  # [A]: the first tail on ties (ranked before coin)
        for tail in range(1, len(laws)):
            total = _nonfree_acceptance(inputs, laws[tail]) + free_acceptance[:, tail]  # [A]
            better = total > best_total
            best, best_total = torch.where(better[:, None], laws[tail], best), torch.maximum(total, best_total)
            choice = torch.where(better, tail, choice)
        problem = torch.arange(len(choice), device=choice.device)  # [A]
        free_law = free_laws[problem, choice].to(best.dtype)  # [A, M]
        kept = torch.where(inputs.free_valid, free_law, best.gather(1, inputs.free_ids))  # [A, M]
        is_coin = torch.tensor([tail == COIN for tail in self.tails], device=choice.device)[choice]  # [A]
        return Stage(inputs.rows, inputs.free_ids, inputs.free_valid, weights[problem, choice], is_coin, rank_key,
                     best.scatter(1, inputs.free_ids, kept))  # fmt: skip

    def _tail_laws(self, inputs: StageInputs) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each tail's p_I off the free set ``[A, V]``, and the ranked tail's rank keys if it is one of them."""
        laws, rank_key = [], None
        for tail in self.tails:
            if tail == COIN:
                laws.append(coin_tail(inputs.first, inputs.second))
            else:
                law, rank_key = ranked_tail(inputs)
                laws.append(law)
        return laws, rank_key


def _nonfree_acceptance(inputs: StageInputs, law: torch.Tensor) -> torch.Tensor:
    """Σ over the non-free tokens of min(c, p_I) ``[P_j]``."""
    everywhere = torch.minimum(inputs.target, law).sum(-1)  # [P_j]
    on_free = torch.minimum(inputs.target.gather(1, inputs.free_ids), law.gather(1, inputs.free_ids))  # [P_j, M]
    return everywhere - (on_free * inputs.free_valid).sum(-1)
