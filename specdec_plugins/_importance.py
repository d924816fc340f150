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

from specdec_cli.base.randomness import Draws, Randomness
from specdec_cli.base.sampling import sample_with
from specdec_cli.plugins.laws import normalized_or
from specdec_cli.plugins.verifiers import (
    BlockDecision,
    Decision,
    Verifier,
    decide_blocks,
    device_path,
    reads_are_free,
)

from ._importance_parts import BONUS_ROW, BlockUniforms, Chain, Plan, Problems, commit_runs, scheme_steps, where_rows
from ._pair_selection import FreeSet, Tail, solve_free_problems
from .speculative import SpeculativeSampling

_ONE_DRAFT = SpeculativeSampling()  # built once: torch.compile cannot trace a verifier's construction

_MAX_SOLVED = 100_000  # cached free-LP solutions per verifier before the cache starts over


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
            output = int(sample_with(target_probs[alive[0], draft_length][None], drawn[BONUS_ROW, -1, :1]))
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
            steps, alive = scheme_steps(problems.tokens), [members[0], *members[2:]]
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
