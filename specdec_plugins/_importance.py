"""Importance-weighted sampling (Khisti et al., "Multi-Draft Speculative Sampling", §3-4), lossless.

The rule in the project's notation: docs/verifiers.md §5.

Two steps, the canonical architecture of Theorem 1 (eqs. 2-4; different drafts: Theorem 4, eqs.
38-40): (a) an importance-weighted selection (Definition 1, eq. 1) picks one candidate Y of the pair
(x1, x2) with weights that depend only on the candidates, which gives Y a law p_I
(:mod:`._pair_selection`: free LP weights on the top tokens, a closed-form tail rule on the rest);
(b) speculative sampling of Y against q: accept with min(1, q(Y)/p_I(Y)), else draw from
(q - p_I)+ normalised. Lossless for any weights; the acceptance is Σ_y min(q(y), p_I(y)) (eq. 2's
objective).

K > 2: after Y, the candidates x3 … xK are tested in turn against what is left of q, SpecInfer's
steps (Miao et al. 2024, Algorithm 2; :class:`Chain`), lossless because each is independent of the
earlier ones and has a known law. Remark 4's successive pairs (Y1, x3), (Y2, x4), … would make a
later pair's LP wait for the earlier one's solution (a second trip to the host per pair), and their
tail rules alone cost about 60 operations per pair: at K = 4 the block came to 434 operations
against the issue's budget of 400.

Per problem the verifier keeps the better of this scheme and SpecInfer on the same candidates, by
their exact acceptance (:attr:`Plan.use_scheme`): the choice depends on the laws only, never on the
candidates or the uniforms, so the output law is q either way, and no position accepts less than
under specinfer (benchmarks/results/is_acceptance_cpu.md).

The device path (issue #20 §2). A block's problems are "position t, the rows j ≥ k that share row
k's prefix" for every (k, t), found by comparing tokens (:meth:`Problems.block`). Every problem's
output is drawn at once with the keyed uniforms of its position t (:class:`BlockUniforms`): stream
SELECT for the candidate Y, ACCEPT (lane k for slot k), RESIDUAL, and OUTSIDE and OUTSIDE_TOKEN for
the alphabet truncation. The block then follows the rows whose tokens equal their prefix class's
outputs for longest (:func:`commit_runs`), and draws the BONUS token at offset L. The number of
dispatched operations does not depend on the data: 314, 335 and 355 at K = 2, 3, 4 for any L ≤ 8
and any V (the host LP dispatches none). One read per block: every problem's free LP (``[P, 4 M +
2]`` numbers) crosses to the host in :func:`_solve_on_host`, called from ``verify_block`` itself so
that under dynamo it is the graph's one break, and the weights come back.

The CPU path (``reads_are_free``: a read costs nothing there, a pass over V does). The block's walk
needs one problem per position it reaches, (t, the rows alive at t), and stops at the first
correction, so :meth:`ImportanceSampling._walk_reading` plans only those, one at a time
(:meth:`Problems.at`, P = 1), with the device path's functions and its uniforms
(:meth:`BlockUniforms.at`); residual and off-alphabet draws are made only when taken. It makes the
device path's decisions from the same keyed draws (tests/test_importance_device.py compares the two
block by block). A problem with K' ≥ 2 candidates still costs about 300 small operations, some 40
passes over V and one free LP on the host, so a block costs 5-8 times SpecInfer's on a CPU (V = 32000
and 128256, K = 2-4, L = 8), where planning all K L problems cost 25-170 times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_cli.base.randomness import Draws, Randomness, Stream, uniforms_from
from specdec_cli.base.sampling import sample_with
from specdec_cli.plugins.laws import TINY, normalized_or
from specdec_cli.plugins.verifiers import (
    BlockDecision,
    Decision,
    Verifier,
    decide_blocks,
    device_path,
    reads_are_free,
)

from ._pair_selection import FreeSet, Tail, solve_free_problems
from .speculative import SpeculativeSampling

_ONE_DRAFT = SpeculativeSampling()  # built once: torch.compile cannot trace a verifier's construction

_MAX_SOLVED = 100_000  # cached free-LP solutions per verifier before the cache starts over


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
_BONUS = _STREAMS.index(Stream.BONUS)  # the BONUS stream's row in a block's table of draws
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
        return cls.of_problems(per_problem, drawn[_BONUS, draft_length, :1])

    @classmethod
    def at(cls, drawn: torch.Tensor, position: int, width: int) -> "BlockUniforms":
        """The uniforms of the one problem the walk reaches at ``position`` with ``width`` candidates (P = 1), from
        the block's ``drawn`` table ``[S, L+1, K]``: the same (stream, position, lane) as that problem's on the
        device path, whose slots are its members in row order, as here."""
        return cls.of_problems(drawn[:, position : position + 1, :width], drawn[_BONUS, -1, :1])

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
        scheme = self.scheme.output_law(self.target, _scheme_steps(tokens), choice)  # [P, V]
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


def _scheme_steps(tokens: torch.Tensor) -> list[torch.Tensor]:
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


@torch._dynamo.disable
def _solve_on_host(verifier: "ImportanceSampling", packed: torch.Tensor) -> torch.Tensor:
    """The block's one read: the free LPs ``packed`` ``[P, 4 M + 2]`` (:attr:`FreeSet.lp_inputs`, then whether
    the problem has a second candidate, then its support size) → the LP weights and free laws ``[P, M M + M]``.

    Kept out of dynamo's graph (``torch._dynamo.disable``): the host work is the graph's one break.
    """
    host = packed.numpy(force=True)  # [P, 4 M + 2]
    width = (host.shape[1] - 2) // 4
    active = host[:, -2] > 0.5  # [P]
    verifier.check_support(host[active, -1])
    if len(verifier.solved) > _MAX_SOLVED:
        verifier.solved.clear()
    weights, laws = solve_free_problems(host[active, : 4 * width].reshape(-1, 4, width), verifier.solved)
    solution = np.zeros((len(host), width * width + width))
    solution[active] = np.concatenate([weights.reshape(len(weights), -1), laws], 1)
    return torch.as_tensor(solution, device=packed.device)


class ImportanceSampling(Verifier):
    """Shared body of ``is-lp`` and ``is-truncated``: they choose the free width and the alphabet."""

    lossless = True
    max_drafts = None
    capturable = True
    reading_cpu_path = True

    @property
    def solved(self) -> dict:
        """Free LP solutions met so far, by the sub-problem's numbers (see :func:`solve_free_problems`)."""
        if "_solutions" not in self.__dict__:
            self._solutions: dict = {}
        return self._solutions

    @property
    def free_width(self) -> int:
        """How many of the top-ranked support tokens of the first pair get free LP weights."""
        raise NotImplementedError

    def check_support(self, support_sizes: np.ndarray) -> None:
        """Refuse problems whose drafts' support is too large (host array of the active problems' sizes)."""

    @property
    def has_alphabet(self) -> bool:
        """Whether :meth:`alphabet_mask` restricts O (then a block draws the OUTSIDE streams too)."""
        return False

    def alphabet_mask(self, target: torch.Tensor) -> torch.Tensor | None:
        """The alphabet O ``[P, V]`` bool the scheme runs on, or None for q's whole support."""
        return None

    # ----------------------------------------------------------------------- contract

    def conditional(self, target_probs, draft_probs, draft_tokens):
        problems = Problems.independent(target_probs, draft_probs, draft_tokens)
        law = self.plan(problems).output_law(problems.tokens)  # [P, V]
        return law.reshape(target_probs.shape).to(target_probs.dtype)

    def acceptance_probability(self, target_probs, draft_probs):
        """max(q(O) Σ_y min(q~(y), p_I(y)), SpecInfer's acceptance) per position.

        Step (b)'s acceptance for the scheme: the engine also continues a block when the residual
        happens to return another candidate, so the true P(output ∈ candidates) can be higher: this
        value is a lower bound.
        """
        tokens = torch.zeros(draft_probs.shape[:-1], dtype=torch.long, device=draft_probs.device)  # [..., K]
        acceptance = self.plan(Problems.independent(target_probs, draft_probs, tokens)).acceptance()  # [P]
        return acceptance.reshape(target_probs.shape[:-1]).to(target_probs.dtype)

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        """One block, on the device, with one host read (the free LPs; see the module docstring)."""
        num_drafts, draft_length = draft_tokens.shape
        if num_drafts == 1:  # one candidate: the scheme is speculative sampling
            return _ONE_DRAFT.verify_block(target_probs, draft_probs, draft_tokens, randomness)
        if reads_are_free(target_probs):
            return self._walk_reading(target_probs, draft_probs, draft_tokens, randomness)
        problems = Problems.block(target_probs, draft_probs, draft_tokens)
        pair = self._first_pair(problems)
        # Called here, not deeper: under dynamo the host call is then the one break of verify_block's graph.
        solution = _solve_on_host(self, pair.packed)
        return self._decide_solved(problems, pair, solution, target_probs, draft_tokens, randomness)

    def verify(self, target_probs, draft_probs, draft_tokens, randomness=None, judged=None):
        """B blocks with one host read in all: every block's free LPs are packed on the device (mapped over the batch
        by ``torch.func.vmap``), solved in one host call, and the blocks decided with them (mapped again). On the
        CPU, where reads are free, and with one draft or a generator, the blocks are decided one by one."""
        batch, num_drafts, _ = draft_tokens.shape
        if num_drafts == 1 or not isinstance(randomness, Draws) or reads_are_free(target_probs):
            return decide_blocks(self, target_probs, draft_probs, draft_tokens, randomness)

        def packed(target, draft, tokens):  # one block's free LPs [P, 4 M + 2]
            return self._first_pair(Problems.block(target, draft, tokens)).packed

        def decide(target, draft, tokens, solution, key, block_start):  # one block, its LPs solved
            problems = Problems.block(target, draft, tokens)
            decision = self._decide_solved(
                problems, self._first_pair(problems), solution, target, tokens, Draws(key, block_start)
            )
            return decision.tokens, decision.num_accepted, decision.row

        with device_path():
            lps = torch.func.vmap(packed)(target_probs, draft_probs, draft_tokens)  # [B, P, 4 M + 2]
        solutions = _solve_on_host(self, lps.flatten(0, 1)).view(batch, lps.shape[1], -1)  # [B, P, M M + M]
        with device_path():
            fields = torch.func.vmap(decide)(
                target_probs, draft_probs, draft_tokens, solutions, randomness.key, randomness.block_start
            )
        return Decision(*fields).as_long()  # tokens [B, L+1], num_accepted [B], row [B]

    def _decide_solved(
        self,
        problems: Problems,
        pair: "_FirstPair",
        solution: torch.Tensor,
        target_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        randomness: Randomness,
    ) -> BlockDecision:
        """A block's decision once its free LPs are solved (``solution`` ``[P, M M + M]``); target_probs
        ``[K, L+1, V]``, draft_tokens ``[K, L]``."""
        num_drafts, draft_length = draft_tokens.shape
        plan = self._plan(problems, pair, solution)
        uniforms = BlockUniforms.of(randomness, num_drafts, draft_length, draft_tokens.device, plan.outside is not None)
        outputs = plan.sample(problems.tokens, uniforms).view(num_drafts, draft_length)  # [K, L]
        return commit_runs(outputs, problems.leader, draft_tokens, target_probs, uniforms.bonus)

    def _walk_reading(self, target_probs, draft_probs, draft_tokens, randomness) -> BlockDecision:
        """The CPU path, where a read is free: the walk over alive rows position by position, planning only the
        problem it reaches at each (:meth:`Problems.at`) and stopping at the block's end, where the device path
        plans all K L problems at once. Each problem takes the device path's uniforms (:meth:`BlockUniforms.at`)
        and runs the same plan, so the walk makes the device path's decisions (tests/test_importance_device.py)."""
        num_drafts, draft_length = draft_tokens.shape
        tokens = draft_tokens.tolist()  # [K][L]
        device = draft_tokens.device
        drawn = BlockUniforms.table(randomness, num_drafts, draft_length, device, self.has_alphabet)  # [S, L+1, K]
        alive, position = list(range(num_drafts)), 0
        while position < draft_length:
            problem = Problems.at(target_probs, draft_probs, draft_tokens, position, alive)
            output = self.plan(problem).sample_reading(problem.tokens, BlockUniforms.at(drawn, position, len(alive)))
            survivors = [row for row in alive if tokens[row][position] == output]
            if not survivors:  # a correction: the block ends here
                break
            alive, position = survivors, position + 1
        else:  # every position kept a candidate: the bonus token, from q after the followed row
            output = int(sample_with(target_probs[alive[0], draft_length][None], drawn[_BONUS, -1, :1]))
        committed = tokens[alive[0]][:position] + [output] * (draft_length + 1 - position)  # past the output: filler
        return BlockDecision(
            torch.tensor(committed, device=device),
            torch.tensor(position, device=device),
            torch.tensor(alive[0], device=device),
        )

    # ----------------------------------------------------------------------- planning

    def plan(self, problems: Problems) -> Plan:
        """Every problem's scheme and its SpecInfer fallback; the free LPs in one host call."""
        pair = self._first_pair(problems)
        return self._plan(problems, pair, None if pair.free is None else _solve_on_host(self, pair.packed))

    def _first_pair(self, problems: Problems) -> "_FirstPair":
        """Everything before the free LPs: the alphabet, the candidates' laws, the first pair's tail and free set."""
        scheme_target, inside_mass, outside = self._alphabet(problems)
        laws = problems.candidate_laws()  # K × [P, V]
        if len(laws) == 1:  # one candidate: nothing to select
            return _FirstPair(scheme_target, inside_mass, outside, laws, None, None, problems.members[:, :0])
        tail = Tail.of(laws[0], laws[1], scheme_target)
        free = FreeSet.of(tail, scheme_target, self.free_width)
        return _FirstPair(scheme_target, inside_mass, outside, laws, tail, free, problems.members[:, 1:2])

    def _plan(self, problems: Problems, pair: "_FirstPair", solution: torch.Tensor | None) -> Plan:
        """The plan once the host has solved the free LPs (``solution`` ``[P, M M + M]``, None for one candidate)."""
        members = list(problems.members.split(1, 1))  # K × [P, 1]
        fallback = Chain.of(problems.target, pair.laws, list(problems.tokens.split(1, 1)), members)
        if solution is None and pair.scheme_target is problems.target:  # one candidate against q: the same chain
            scheme, chosen = fallback, torch.ones_like(pair.laws[0][:, :1])  # [P, 1]
        else:
            selected, chosen = pair.laws[0], torch.ones_like(pair.laws[0][:, :1])  # [P, V], [P, 1]: one candidate
            if solution is not None:
                selected, chosen = pair.solved(solution, problems.tokens)  # [P, V], [P, 2]
            steps, alive = _scheme_steps(problems.tokens), [members[0], *members[2:]]
            scheme = Chain.of(pair.scheme_target, [selected, *pair.laws[2:]], steps, alive)
        use_scheme = pair.inside_mass.squeeze(-1) * scheme.acceptance >= fallback.acceptance  # [P]
        return Plan(problems.target, pair.inside_mass, pair.outside, chosen, scheme, fallback, use_scheme)

    def _alphabet(self, problems: Problems) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q~ = q on the alphabet, renormalised, for problems of two or more candidates; q's whole support
        for one (one candidate needs no selection, and the scheme is then speculative sampling).
        → (q~ ``[P, V]``, q(O) ``[P, 1]``, q off O normalised ``[P, V]`` or None)."""
        target = problems.target  # [P, V]
        inside = self.alphabet_mask(target)
        if inside is None:
            return target, torch.ones_like(target[:, :1]), None
        inside = inside | (problems.members.sum(1, keepdim=True) < 2)  # [P, V]
        kept = torch.where(inside, target, 0)  # [P, V]
        inside_mass = kept.sum(-1, keepdim=True)  # [P, 1]
        return kept / inside_mass, inside_mass, normalized_or(target - kept, target)


@dataclass
class _FirstPair:
    """A plan's parts before the free LPs of its first pair (x1, x2)."""

    scheme_target: torch.Tensor  # [P, V] q~: q on the alphabet O, renormalised
    inside_mass: torch.Tensor  # [P, 1] q(O)
    outside: torch.Tensor | None  # [P, V] q off O, normalised (None when O is always q's support)
    laws: list[torch.Tensor]  # K × [P, V]: the candidates' laws
    tail: Tail | None  # the pair's tail rule (None with one candidate)
    free: FreeSet | None  # the pair's free tokens and their LP inputs (None with one candidate)
    active: torch.Tensor  # [P, 1] bool: the problem has a second candidate

    @property
    def packed(self) -> torch.Tensor:
        """What the host needs ``[P, 4 M + 2]`` float64: the free LPs, whether each applies, the support size."""
        return torch.cat([self.free.lp_inputs.flatten(1), self.active, self.free.support_size[:, None]], 1).double()

    def solved(self, solution: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """p_I ``[P, V]`` and P(Y = x1), P(Y = x2) ``[P, 2]`` from the host's ``solution`` ``[P, M M + M]``."""
        width = self.free.ids.shape[1]
        weights, free_law = solution.to(self.tail.law.dtype).split([width * width, width], 1)  # [P, M M], [P, M]
        keep = self.free.first_keep(tokens, weights, self.tail.keep(tokens))  # [P, 1]
        keep = keep.masked_fill_(~self.active, 1)  # [P, 1]: P(Y = x1)
        law = self.tail.law.scatter(1, self.free.ids, free_law)  # [P, V]
        return where_rows(self.active, law, self.laws[0]), torch.cat([keep, 1 - keep], 1)
