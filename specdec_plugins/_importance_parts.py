"""The device pieces of importance sampling (:mod:`._importance` states the scheme): a block's selection problems
(:class:`Problems`, :class:`Chain`), its table of draws (:class:`BlockUniforms`), the plan of one stage
(:class:`Plan`) and the committed runs (:func:`commit_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_cli.base.randomness import Draws, Randomness, Stream, uniforms_from
from specdec_cli.base.sampling import sample_with
from specdec_cli.plugins.laws import TINY, normalized_or
from specdec_cli.plugins.verifiers import BlockDecision, reads_are_free

__all__ = ["BlockUniforms", "Chain", "Plan", "Problems", "BONUS_ROW", "commit_runs", "scheme_steps", "where_rows"]


@dataclass
class Problems:
    """P selection problems: a target law and up to K candidates (laws and tokens) in member order."""

    target: torch.Tensor  # [P, V] q
    laws: torch.Tensor  # [R, V]: the candidates' laws, indexed by ``rows``
    rows: torch.Tensor  # [P, K] int64: row of ``laws`` for each candidate slot
    tokens: torch.Tensor  # [P, K] int64: candidate tokens (slots that hold no candidate are filler)
    members: torch.Tensor  # [P, K] bool: the slot holds a candidate (the first 1..K slots do)
    first_laws: torch.Tensor  # [P, V]: the first candidate's law (a view where the layout allows)
    leader: torch.Tensor | None = None  # [K, L] (blocks): the first row sharing row j's prefix before t

    def candidate_laws(self) -> list[torch.Tensor]:
        """Each slot's law ``[P, V]`` (a slot without a candidate: another row's, never used)."""
        if len(self.rows) == 1 and reads_are_free(self.rows):  # one problem on the CPU: views of its rows
            return [self.first_laws, *(self.laws[row][None] for row in self.rows[0, 1:].tolist())]
        # Indexing, not index_select: the same gather, several times faster on a CPU for rows of 128k.
        rest = [self.laws[self.rows[:, slot]] for slot in range(1, self.rows.shape[1])]
        return [self.first_laws, *rest]

    @classmethod
    def independent(cls, target_probs, draft_probs, draft_tokens) -> "Problems":
        """One problem per leading index: target ``[..., V]``, drafts ``[..., K, V]``, tokens ``[..., K]``."""
        vocab, num_drafts = target_probs.shape[-1], draft_probs.shape[-2]
        target = target_probs.reshape(-1, vocab)  # [P, V]
        count = target.shape[0]
        rows = torch.arange(count * num_drafts, device=target.device).view(count, num_drafts)  # [P, K]
        tokens = draft_tokens.reshape(count, num_drafts)  # [P, K]
        members = torch.ones_like(tokens, dtype=torch.bool)  # [P, K]
        laws = draft_probs.reshape(-1, vocab)  # [P K, V]
        return cls(target, laws, rows, tokens, members, laws[::num_drafts])

    @classmethod
    def at(cls, target_probs, draft_probs, draft_tokens, position: int, alive: list[int]) -> "Problems":
        """The one problem the walk reaches (P = 1): ``position``, candidates the ``alive`` rows (host ints, in
        row order: the leader first), as many slots as rows. The device path's problem (leader, position)
        has the same members in the same order, and slots without a member change none of its numbers."""
        rows = torch.tensor(alive, device=draft_tokens.device)  # [K']
        laws = draft_probs[:, position]  # [K, V]: a view, indexed by ``rows``
        tokens = draft_tokens[:, position].index_select(0, rows)[None]  # [1, K']
        members = torch.ones_like(tokens, dtype=torch.bool)  # [1, K']
        target = target_probs[alive[0], position][None]  # [1, V]
        return cls(target, laws, rows[None], tokens, members, laws[alive[0]][None])

    @classmethod
    def block(cls, target_probs, draft_probs, draft_tokens) -> "Problems":
        """Problem (k, t), at index k L + t: position t, candidates the rows j ≥ k that share row k's prefix.

        The rows alive at t (those whose tokens equal every output so far) are exactly the prefix class
        of the first of them, so the problem of (t, first alive row) is the one the block needs.
        """
        num_drafts, draft_length = draft_tokens.shape
        differ = draft_tokens[:, None, :] != draft_tokens[None, :, :]  # [K, K, L]
        shared = torch.nn.functional.pad(differ[..., :-1], (1, 0)).cumsum(-1) == 0  # [K, K, L]: prefixes before t equal
        later = torch.ones(num_drafts, num_drafts, dtype=torch.bool, device=differ.device).triu_()  # [K(k), K(j)]
        member = (shared & later[..., None]).transpose(1, 2)  # [K(k), L, K(j)]
        flags, order = member.to(torch.uint8).sort(dim=-1, descending=True, stable=True)  # [K, L, K]: members first
        positions = torch.arange(draft_length, device=differ.device).view(1, -1, 1)  # [1, L, 1]
        rows = (order * draft_length + positions).reshape(-1, num_drafts)  # [K L, K]: index j L + t
        target = target_probs[:, :draft_length].reshape(-1, target_probs.shape[-1])  # [K L, V]
        laws = draft_probs.reshape(-1, draft_probs.shape[-1])  # [K L, V]
        leader = shared.to(torch.uint8).argmax(0)  # [K, L]: the first k whose prefix equals row j's
        tokens = draft_tokens.reshape(-1)[rows]  # [K L, K]
        # A problem's first member is its own row k, so the first laws are the table itself.
        return cls(target, laws, rows, tokens, flags.reshape(-1, num_drafts).bool(), laws, leader)


@dataclass
class Chain:
    """Candidates tested in turn against what is left of the target c, SpecInfer's steps (Miao et al. 2024,
    Algorithm 2; docs/verifiers.md §3) kept unnormalised: R_0 = c, R_s = (R_{s-1} - ρ_{s-1} p_s)+ with
    ρ_s = Σ R_s, so R_s / ρ_s is SpecInfer's residual after s rejections. Step s keeps its candidate x with
    probability min(1, R_{s-1}(x) / (ρ_{s-1} p_s(x))). Lossless because each step's candidate is
    independent of the earlier ones, with a known law p_s (the scheme's first step: Y, of law p_I)."""

    accepts: torch.Tensor  # [P, n = Σ n_s]: every step's acceptance of each token it may test (0 for a skipped step)
    residual: torch.Tensor  # [P, V]: R after the last step, what no candidate took
    acceptance: torch.Tensor  # [P]: P(some step keeps its candidate) = ρ_0 - ρ_last

    @classmethod
    def of(cls, target: torch.Tensor, proposals, tokens, live) -> "Chain":
        """target ``[P, V]``; per step its law ``[P, V]``, the tokens its candidate may be ``[P, n_s]`` and
        whether the problem has that candidate ``[P, 1]`` (else the step is skipped)."""
        left = target  # [P, V]
        mass = start = target.sum(-1, keepdim=True)  # [P, 1]
        at_token, offered, skipped = [], [], []  # per step [P, n_s] each: R(x), ρ p_s(x), step skipped
        for law, x, alive in zip(proposals, tokens, live):  # [P, V], [P, n_s], [P, 1]
            share = law * (mass * alive)  # [P, V]: ρ p_s, or nothing (a skipped step)
            at_token.append(left.gather(1, x))
            offered.append(share.gather(1, x))
            skipped.append(~alive.expand_as(x))
            left = (left - share).clamp(min=0)  # clamp, not clamp_: vmap (verify_batch) has no rule for clamp_
            mass = left.sum(-1, keepdim=True)
        accepts = (torch.cat(at_token, 1) / torch.cat(offered, 1).clamp_min(TINY)).clamp(max=1)  # [P, n]
        return cls(accepts.masked_fill_(torch.cat(skipped, 1), 0), left, (start - mass).squeeze(-1))

    def output_law(self, target: torch.Tensor, tokens, choice) -> torch.Tensor:
        """The chain's output law ``[P, V]``; per step the tokens ``[P, n_s]`` and the probability that the
        candidate is each of them ``[P, n_s]``; what no step keeps comes from R normalised (target if empty)."""
        law = torch.zeros_like(target)  # [P, V]
        reach = torch.ones_like(target[:, :1])  # [P, 1]: no earlier step kept its candidate
        for x, kept in zip(tokens, (choice * self.accepts).split([x.shape[1] for x in tokens], 1)):
            law = law.scatter_add(1, x, reach * kept)
            reach = reach * (1 - kept.sum(1, keepdim=True))
        return law + reach * normalized_or(self.residual, target)


_STREAMS = (Stream.ACCEPT, Stream.RESIDUAL, Stream.BONUS, Stream.SELECT, Stream.OUTSIDE, Stream.OUTSIDE_TOKEN)
BONUS_ROW = _STREAMS.index(Stream.BONUS)  # the BONUS stream's row in a block's table of draws
assert [int(stream) for stream in _STREAMS] == list(range(_STREAMS[0], _STREAMS[0] + len(_STREAMS)))


@dataclass
class BlockUniforms:
    """Every uniform a block draws (float64), in one keyed evaluation: the streams it needs are consecutive
    numbers, so one ``Draws.uniforms`` call with a column of streams gives (stream, position 0..L, lane k).
    Problem k L + t takes position t's."""

    select: torch.Tensor  # [P]: stream SELECT, the candidate
    accept: torch.Tensor  # [P, K]: stream ACCEPT, lane k for candidate k (the scheme's candidate: lane 0)
    residual: torch.Tensor  # [P]: stream RESIDUAL
    bonus: torch.Tensor  # [1]: stream BONUS at offset L
    outside: torch.Tensor | None  # [P]: stream OUTSIDE, the alphabet coin (None without an alphabet)
    outside_token: torch.Tensor | None  # [P]: stream OUTSIDE_TOKEN, the draw off the alphabet

    @classmethod
    def of(cls, randomness: Randomness, num_drafts: int, draft_length: int, device, alphabet: bool):
        """The uniforms of a block of K = ``num_drafts`` rows and L = ``draft_length`` positions (P = K L problems);
        the OUTSIDE streams only with an ``alphabet``."""
        drawn = cls.table(randomness, num_drafts, draft_length, device, alphabet)  # [S, L+1, K]
        # [S, K(problem's row), L, K(lane)] → [S, K L, K]: every row k's problem at t takes position t's draws
        per_problem = drawn[:, None, :draft_length].expand(-1, num_drafts, -1, -1).reshape(len(drawn), -1, num_drafts)
        return cls.of_problems(per_problem, drawn[BONUS_ROW, draft_length, :1])

    @classmethod
    def at(cls, drawn: torch.Tensor, position: int, width: int) -> "BlockUniforms":
        """The uniforms of the one problem the walk reaches at ``position`` with ``width`` candidates (P = 1), from
        the block's ``drawn`` table ``[S, L+1, K]``: the same (stream, position, lane) as that problem's on the
        device path, whose slots are its members in row order, as here."""
        return cls.of_problems(drawn[:, position : position + 1, :width], drawn[BONUS_ROW, -1, :1])

    @staticmethod
    def table(randomness: Randomness, num_drafts: int, draft_length: int, device, alphabet: bool) -> torch.Tensor:
        """Every draw of a block ``[S, L+1, K]`` (stream, position, lane), streams from ACCEPT on (see ``_STREAMS``)."""
        streams = len(_STREAMS) if alphabet else 4  # ACCEPT, RESIDUAL, BONUS, SELECT (+ OUTSIDE, OUTSIDE_TOKEN)
        shape = (streams, draft_length + 1, num_drafts)
        if isinstance(randomness, Draws):
            numbers = torch.arange(_STREAMS[0], _STREAMS[0] + streams, device=device).view(-1, 1, 1)  # [S, 1, 1]
            return randomness.uniforms(numbers, draft_length + 1, num_drafts)  # [S, L+1, K]
        return uniforms_from(randomness, Stream.ACCEPT, shape, device)  # [S, L+1, K]: a generator's next draws

    @classmethod
    def of_problems(cls, per_problem: torch.Tensor, bonus: torch.Tensor) -> "BlockUniforms":
        """From each problem's draws ``[S, P, K]`` (stream, problem, lane) and the bonus draw ``[1]``."""
        accept, residual, _, select, *outside = per_problem.unbind(0)  # [P, K] each
        first_lane = [uniforms[:, 0] for uniforms in (select, residual, *outside)]  # [P] each
        return cls(first_lane[0], accept, first_lane[1], bonus, *(first_lane[2:] or (None, None)))


@dataclass
class Plan:
    """Every problem's scheme, SpecInfer beside it, and which of the two it runs.

    The scheme's chain tests Y, the winner of the pair (x1, x2), then x3 … xK; SpecInfer's tests x1 … xK.
    """

    target: torch.Tensor  # [P, V] q
    inside_mass: torch.Tensor  # [P, 1] q(O)
    outside: torch.Tensor | None  # [P, V] q off the alphabet O (None when O is always q's support)
    chosen: torch.Tensor  # [P, 2]: P(Y = x1), P(Y = x2) given the problem's tokens
    scheme: Chain  # against q~ (q on O, renormalised); its first step tests Y, of law p_I
    fallback: Chain  # SpecInfer, against q
    use_scheme: torch.Tensor  # [P] bool: the scheme accepts at least what SpecInfer does

    def acceptance(self) -> torch.Tensor:
        """P(some step keeps its candidate) ``[P]`` under the rule each problem runs."""
        scheme = self.inside_mass.squeeze(-1) * self.scheme.acceptance  # [P]
        return torch.where(self.use_scheme, scheme, self.fallback.acceptance)

    def output_law(self, tokens: torch.Tensor) -> torch.Tensor:
        """The law of the output given the candidates ``[P, K]`` → ``[P, V]``."""
        choice = torch.cat([self.chosen, torch.ones_like(tokens[:, 2:], dtype=self.chosen.dtype)], 1)  # [P, K]
        scheme = self.scheme.output_law(self.target, scheme_steps(tokens), choice)  # [P, V]
        if self.outside is not None:
            scheme = self.inside_mass * scheme + (1 - self.inside_mass) * self.outside
        fallback = self.fallback.output_law(self.target, list(tokens.split(1, 1)), torch.ones_like(choice))
        return torch.where(self.use_scheme[:, None], scheme, fallback)

    def sample(self, tokens: torch.Tensor, uniforms: BlockUniforms) -> torch.Tensor:
        """Every problem's output token ``[P]``, given its candidates ``tokens`` ``[P, K]``: the first step that
        keeps its candidate, else a draw from the residual; with an alphabet, a draw off it unless the coin
        keeps the scheme's output."""
        use = self.use_scheme[:, None]  # [P, 1]
        taken, kept = self._steps(tokens, uniforms, use)  # [P, K], [P, 1]
        output = torch.where(taken.any(1), kept.squeeze(1), self._residual_draw(uniforms, use))  # [P]
        if self.outside is None:
            return output
        return torch.where(self._inside(uniforms), output, sample_with(self.outside, uniforms.outside_token))

    def sample_reading(self, tokens: torch.Tensor, uniforms: BlockUniforms) -> int:
        """:meth:`sample` of one problem (P = 1) with host reads, for the CPU: the same output from the same
        uniforms, but the residual and off-alphabet draws (a float64 pass over V each) only when taken."""
        if self.outside is not None and not bool(self._inside(uniforms)):
            return int(sample_with(self.outside, uniforms.outside_token))
        use = self.use_scheme[:, None]  # [1, 1]
        taken, kept = self._steps(tokens, uniforms, use)  # [1, K], [1, 1]
        return int(kept) if bool(taken.any()) else int(self._residual_draw(uniforms, use))

    def _steps(self, tokens, uniforms: BlockUniforms, use: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which steps keep their candidate ``[P, K]`` bool, and the first kept candidate ``[P, 1]``; ``use``
        ``[P, 1]``: the problem runs the scheme.

        The scheme's steps are (Y, x3 … xK), tested with ACCEPT lanes (0, 2 … K-1); SpecInfer's are
        x1 … xK with lanes 0 … K-1.
        """
        pick = sample_with(self.chosen, uniforms.select).unsqueeze(1)  # [P, 1]: 0 or 1, Y's slot
        # [P, K]: Y's step, x3 … xK's, and a last column that is never taken (the scheme has K - 1 steps)
        scheme_taken = torch.cat(
            [
                uniforms.accept[:, :1] < self.scheme.accepts.gather(1, pick),
                uniforms.accept[:, 2:] < self.scheme.accepts[:, 2:],
                pick < 0,
            ],
            1,
        )
        taken = torch.where(use, scheme_taken, uniforms.accept < self.fallback.accepts)  # [P, K]
        scheme_tokens = torch.cat([tokens.gather(1, pick), tokens[:, 2:], tokens[:, :1]], 1)  # [P, K]
        kept = torch.where(use, scheme_tokens, tokens).gather(1, taken.long().argmax(1, keepdim=True))  # [P, 1]
        return taken, kept

    def _residual_draw(self, uniforms: BlockUniforms, use: torch.Tensor) -> torch.Tensor:
        """The draw ``[P]`` from what no step took, R normalised (stream RESIDUAL); ``use`` as in :meth:`_steps`."""
        residual = where_rows(use, self.scheme.residual, self.fallback.residual)  # [P, V]
        # An empty residual belongs to a candidate accepted with probability 1: never drawn, kept a law.
        residual = where_rows(residual.sum(1, keepdim=True) > 0, residual, self.target)  # [P, V]
        return sample_with(residual, uniforms.residual)

    def _inside(self, uniforms: BlockUniforms) -> torch.Tensor:
        """``[P]`` bool: the output is the scheme's (SpecInfer ignores O; the scheme's is kept with prob. q(O))."""
        return ~self.use_scheme | (uniforms.outside < self.inside_mass.squeeze(1))


def where_rows(condition: torch.Tensor, chosen: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``torch.where(condition, chosen, other)`` for a per-problem ``condition`` ``[P, 1]`` and rows ``[P, V]``; for
    one problem on the CPU the operand itself, read from the condition (a pass over V costs more than a read)."""
    if len(condition) == 1 and reads_are_free(condition):
        return chosen if bool(condition) else other
    return torch.where(condition, chosen, other)


def scheme_steps(tokens: torch.Tensor) -> list[torch.Tensor]:
    """The scheme chain's tokens per step: (x1, x2) for Y ``[P, 2]``, then x3 … xK ``[P, 1]`` each."""
    return list(tokens.split([min(2, tokens.shape[1])] + [1] * (tokens.shape[1] - 2), 1))


def commit_runs(outputs, leader, draft_tokens, target_probs, bonus_uniform) -> BlockDecision:
    """The block's decision from every problem's output ``outputs`` ``[K, L]`` (problem (k, t)).

    Row j survives position t when its token equals the output of its prefix class's problem,
    (leader ``[K, L]``[j, t], t): the walk over positions with an alive set, as masks. The rows alive
    after position t are those that survived every position up to t, so the block accepts the longest
    run of survivals and follows a row that has it; its class's output at the end of the run is the
    correction, or all L survived and a bonus token is drawn from q with ``bonus_uniform`` ``[1]``.
    """
    draft_length = draft_tokens.shape[1]
    governing = outputs.gather(0, leader)  # [K, L]: the output row j's class draws at t
    runs = (governing == draft_tokens).long().cumprod(1).sum(1)  # [K]: positions row j survives in a row
    num_accepted, row = runs.max(0)  # [], []: the first row with the longest run
    followed = governing.index_select(0, row.view(1)).squeeze(0)  # [L]: its tokens up to the run, then the correction
    bonus_law = target_probs[:, draft_length][row.view(1)]  # [1, V]
    bonus = sample_with(bonus_law, bonus_uniform)  # [1]: kept when all L survived
    return BlockDecision(torch.cat([followed, bonus]), num_accepted, row)
