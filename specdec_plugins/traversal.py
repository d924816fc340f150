"""Traversal verification (Weng, Hu, Chen, Liu, Mei, Qiu, Tian, Shi, "Traversal Verification for Speculative Tree
Decoding", NeurIPS 2025, arXiv 2505.12398, its Algorithm 1), K draft rows verified as one token tree, lossless.

The rule in the project's notation (q = target law, p = draft law). The K rows of a block are a token tree: rows that
drew the same first t tokens share the node of that prefix, which is *owned* by the first of them; a node's children
are its rows' next tokens, in the order of their owners. Every node v carries a weight w(v) (the paper's p_α, the
acceptance of the whole sequence from the root to v), the target's law Q_v of the token after it (the paper's M_b)
and the set of its children already visited. The root has w = 1 and Q = q. A child x of u, entered when the
traversal first reaches it, gets

    w(x) = min(1, w(u) · Q_u(x) / P_u(x))                                                    (entry: p_α's recursion)

with P_u the law x was drawn from: its owner's p at u, given that it differs from the children of u visited
before it (p with them removed, renormalised; the paper's M_s update). Deeper nodes of the same row start from
their fresh q and p. The traversal visits the tree leaf to root, in post-order (children by owner): it accepts the
node v it checks with probability w(v), committing the path root → v and then a token drawn from Q_v (from q, the
bonus law, at a leaf of depth L). When it rejects v it deletes v and updates v's parent u with r = (w(u) Q_u - P_v)+
(P_v: the law v's token was drawn from):

    Q_u ← r / Σ r,     w(u) ← Σ r / (Σ r + 1 - w(u))                                   (deletion: M_b and p_α's update)

then moves to u's next child, or checks u itself once it has none left. The root ends with w = 1, so a block
always commits at least one token. On one row (K = 1) the checks are the chain's L, L-1, ..., 0 with w(L) = w_L and
w(t) = Σ r_t / (Σ r_t + 1 - w_t) at the time it is checked: block verification's stop probabilities h_t (Sun et al.
2025, docs/verifiers.md §7), so the two decide alike from the same uniforms.

Why it is lossless: by induction over the tree, the checks of a subtree entered with weight w commit a continuation
distributed as w · (the target's law after it) and reject with probability 1 - w, whatever rows it holds, and the
deletion update keeps that true for the siblings still to come (the rejected mass min(P, wQ) leaves exactly
(wQ - P)+). The rows are drawn independently, so the next child of u is its owner's draw given that it avoided the
children seen before: hence the removal of visited tokens from P (without it the law departs from q).

Every check until the first acceptance is made as though all before it rejected, so the traversal is one fixed
sequence of K L + 1 checks (:func:`traverse`), computed for the whole batch at once on the tensors' device:
``verify`` takes the first check whose uniform falls below its acceptance; ``block_law`` weighs each check by the
chance that every earlier one rejected.

Sources: the stored copy of the paper (arxiv.org/html/2505.12398v2) showed its abstract and introduction, not its
algorithm box, so the formulas above are the paper's named quantities (p_α, the sequence's acceptance from the root,
min(p_α(parent) · ratio, 1); M_b and M_s updated on each deletion; leaf-to-root post-order; block verification on a
chain) written out in the project's notation, and held to the paper's claims by tests/test_traversal.py: one row
decides as ``block`` does from the same draws, the block law is the target's by exact enumeration, and the tensor
form equals a node-by-node transcription of the traversal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_cli.base.randomness import Draws, Randomness, Stream, uniforms_from
from specdec_cli.plugins.laws import TINY, normalized_or, sample_with
from specdec_cli.plugins.verifiers import BlockVerifier, Decision


class TraversalVerification(BlockVerifier):
    name = "traversal"
    lossless = True
    max_drafts = None
    dependent_drafts = True
    keyed_randomness = True

    def verify(self, target_probs, draft_probs, draft_tokens, randomness=None, judged=None):
        """B blocks from one traversal of their trees (:func:`traverse`): each sequence commits at its first check
        whose uniform (stream ACCEPT, offset t - 1, lane k for the node of row k at depth t) falls below the check's
        acceptance, then draws the next token from that node's law (RESIDUAL at offset t, lane k; BONUS at offset L
        after a leaf of depth L): the draws block verification takes on one row."""
        batch, num_rows, draft_length = draft_tokens.shape
        traversal = traverse(target_probs, draft_probs, draft_tokens)
        tests = _uniforms(randomness, Stream.ACCEPT, (batch, draft_length, num_rows), draft_tokens.device)  # [B, L, K]
        sequences = torch.arange(batch, device=draft_tokens.device)  # [B]
        uniforms = tests[sequences, (traversal.depths - 1).clamp_min(0), traversal.rows]  # [S, B]
        first = (uniforms < traversal.accepts).long().argmax(0, keepdim=True)  # [1, B]: the root's check always takes
        row, depth = traversal.rows.gather(0, first)[0], traversal.depths.gather(0, first)[0]  # [B] each
        law = traversal.laws[sequences, row, depth]  # [B, V]
        token = sample_with(law, _following_uniform(randomness, row, depth, num_rows, draft_length)).unsqueeze(-1)
        committed = torch.cat([draft_tokens[sequences, row], token], -1).scatter(1, depth.unsqueeze(-1), token)
        return Decision(committed, depth, row)  # tokens [B, L+1], num_accepted [B], row [B]

    def block_law(self, target_probs, draft_probs, draft_tokens):
        """Σ over the checks s of P(the checks before s all reject) · accept_s · (the law of the token after node s),
        placed at [owner row, depth]: the traversal's law, exact (no sampling)."""
        num_rows, draft_length = draft_tokens.shape
        traversal = traverse(target_probs.unsqueeze(0), draft_probs.unsqueeze(0), draft_tokens.unsqueeze(0))
        accepts = traversal.accepts[:, 0]  # [S]
        reach = torch.cat([accepts.new_ones(1), (1 - accepts).cumprod(0)[:-1]])  # [S]: every earlier check rejected
        stops = accepts.new_zeros(num_rows, draft_length + 1)  # [K, L+1]: P(the block ends at the node)
        stops.index_put_((traversal.rows[:, 0], traversal.depths[:, 0]), reach * accepts, accumulate=True)
        return stops.unsqueeze(-1) * traversal.laws[0]  # [K, L+1, V]


@dataclass(frozen=True)
class Traversal:
    """The checks of B traversals, each made as if every earlier check had rejected (Weng et al.'s Algorithm 1 until
    the root): check s is of the node (owner row, depth) ``rows[s]``, ``depths[s]``, accepted with ``accepts[s]``."""

    rows: torch.Tensor
    """[S, B] int64 (S = K L + 1): the node's owner row."""
    depths: torch.Tensor
    """[S, B] int64 in 0..L: its depth (the root is 0), the number of draft tokens it commits."""
    accepts: torch.Tensor
    """[S, B] float64: w(v) when it is checked (1 at the root, 0 for the checks after it)."""
    laws: torch.Tensor
    """[B, K, L+1, V] float64: Q_v at [owner row, depth], as it stood at v's check (no later check changes it)."""


def traverse(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor) -> Traversal:
    """The K L + 1 checks of B token trees (a sequence whose root has been checked has no more: accept 0), at most one
    per node. target_probs ``[B, K, L+1, V]``, draft_probs ``[B, K, L, V]``, draft_tokens ``[B, K, L]``."""
    state = _Traversal.start(target_probs, draft_probs, draft_tokens)
    rows, depths, accepts = [], [], []
    for _ in range(draft_tokens.shape[1] * draft_tokens.shape[2] + 1):
        rows.append(state.row)
        depths.append(state.depth)
        accepts.append(state.acceptance())
        state.reject()
    return Traversal(torch.stack(rows), torch.stack(depths), torch.stack(accepts), state.target)


@dataclass(frozen=True)
class _Tree:
    """The token tree of B blocks' rows: for row k and depth t, the node on row k's path at depth t is owned by
    ``owner[b, k, t]`` (the first row with that prefix); ``sibling[b, k, t]`` is the owner of the next child of its
    parent after the node owned by k (K where there is none)."""

    owner: torch.Tensor  # [B, K, L+1] int64
    sibling: torch.Tensor  # [B, K, L+1] int64

    @classmethod
    def of(cls, draft_tokens: torch.Tensor) -> "_Tree":
        """From draft_tokens ``[B, K, L]``."""
        num_rows, draft_length = draft_tokens.shape[1:]
        device = draft_tokens.device
        equal = draft_tokens.unsqueeze(2) == draft_tokens.unsqueeze(1)  # [B, K, K, L]
        shared = equal.long().cumprod(-1).sum(-1)  # [B, K, K]: the length of rows k and j's common prefix
        depths = torch.arange(draft_length + 1, device=device)  # [L+1]
        owner = (shared.unsqueeze(-1) >= depths).long().argmax(2)  # [B, K, L+1]: the first row on the node
        rows = torch.arange(num_rows, device=device)  # [K]
        later = rows.unsqueeze(0) > rows.unsqueeze(1)  # [K, K]: [k, j] is j > k
        branch = (shared * later.T).amax(-1)  # [B, K]: the depth where row j leaves every earlier row
        # j is the child after k's node at depth t: j > k leaves the earlier rows at t - 1, on k's path.
        child = later.unsqueeze(-1) & (branch.unsqueeze(1).unsqueeze(-1) == depths - 1)  # [B, K, K, L+1]
        child = child & (shared.unsqueeze(-1) >= depths - 1)  # [B, K, K, L+1]
        sibling = torch.where(child.any(2), child.long().argmax(2), num_rows)  # [B, K, L+1]
        return cls(owner, sibling)


@dataclass
class _Traversal:
    """Algorithm 1's state while every check so far has rejected, for B trees. Each node's fields live at [b, owner
    row, depth]; the tensors are the traversal's own and updated in place (the caller's are never written)."""

    target: torch.Tensor  # [B, K, L+1, V] float64: Q_v (q, then residuals after deletions)
    draft: torch.Tensor  # [B, K, L, V] float64: p at each row's positions
    tokens: torch.Tensor  # [B, K, L]
    tree: _Tree
    weights: torch.Tensor  # [B, K, L+1] float64: w(v), set when the traversal enters v's row (entry)
    visited: torch.Tensor  # [B, K, L, V] bool: the tokens of a node's children visited so far
    fresh: torch.Tensor  # [B, K, L] float64: log(q(x)/p(x)) of each draft token against its row's fresh laws
    row: torch.Tensor  # [B] int64: the node to check next (its owner row)
    depth: torch.Tensor  # [B] int64: and its depth
    done: torch.Tensor  # [B] bool: the root has been checked

    @classmethod
    def start(cls, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor) -> "_Traversal":
        """At row 0's leaf, the first in post-order, with row 0's weights from the root (w = 1)."""
        batch, num_rows, draft_length = draft_tokens.shape
        device = draft_tokens.device
        target, draft = target_probs.double(), draft_probs.double()  # [B, K, L+1, V], [B, K, L, V]
        drafted = draft_tokens.unsqueeze(-1)  # [B, K, L, 1]
        ratio = target[:, :, :-1].gather(-1, drafted) / draft.gather(-1, drafted).clamp_min(TINY)  # [B, K, L, 1]
        weights = torch.zeros(batch, num_rows, draft_length + 1, dtype=torch.float64, device=device)  # [B, K, L+1]
        traversal = cls(
            target=target.clone(),
            draft=draft,
            tokens=draft_tokens,
            tree=_Tree.of(draft_tokens),
            weights=weights,
            visited=torch.zeros(draft.shape, dtype=torch.bool, device=device),
            fresh=ratio.squeeze(-1).log(),
            row=torch.zeros(batch, dtype=torch.long, device=device),
            depth=torch.full((batch,), draft_length, dtype=torch.long, device=device),
            done=torch.zeros(batch, dtype=torch.bool, device=device),
        )
        traversal.weights[:, 0, 0] = 1.0
        first = torch.ones(batch, dtype=torch.long, device=device)  # [B]
        traversal.enter(traversal.row, first, traversal.fresh[:, 0, 0], torch.ones_like(traversal.done))
        return traversal

    def acceptance(self) -> torch.Tensor:
        """w(v) of the current node ``[B]``: 1 at the root (deletions keep it 1), 0 once the root has been checked."""
        sequences = torch.arange(self.row.shape[0], device=self.row.device)  # [B]
        weight = self.weights[sequences, self.row, self.depth]  # [B]
        accept = torch.where(self.depth == 0, torch.ones_like(weight), weight)  # [B]
        return torch.where(self.done, torch.zeros_like(accept), accept)

    def reject(self) -> None:
        """Delete the current node: update its parent (deletion), then move to the parent's next child (entering
        that row: entry) or to the parent itself."""
        sequences = torch.arange(self.row.shape[0], device=self.row.device)  # [B]
        live = ~self.done & (self.depth > 0)  # [B]: a node below the root was rejected
        above = (self.depth - 1).clamp_min(0)  # [B]: the parent's depth
        parent = self.tree.owner[sequences, self.row, above]  # [B]
        node = (sequences, parent, above)
        weight, law = self.weights[node], self.target[node]  # [B], [B, V]
        drawn_from = _unvisited(self.draft[sequences, self.row, above], self.visited[node])  # [B, V]: P_v
        excess = (weight.unsqueeze(-1) * law - drawn_from).clamp_min(0)  # [B, V]: r = (w(u) Q_u - P_v)+
        mass = excess.sum(-1)  # [B]
        stays = mass + 1 - weight  # [B]
        updated = torch.where(stays > 0, (mass / stays.clamp_min(TINY)).clamp(max=1), torch.zeros_like(mass))  # [B]
        self.weights[node] = torch.where(live, updated, weight)
        self.target[node] = torch.where(live.unsqueeze(-1), normalized_or(excess, law), law)
        token = self.tokens[sequences, self.row, above]  # [B]: the deleted node's token
        self.visited[(*node, token)] = self.visited[(*node, token)] | live
        self._move(sequences, parent, above, live)

    def _move(self, sequences: torch.Tensor, parent: torch.Tensor, above: torch.Tensor, live: torch.Tensor) -> None:
        """To the next child of ``parent`` (owner ``[B]``, depth ``above`` ``[B]``), entering its row, or to the
        parent itself; ``live`` ``[B]``: the sequences whose current node was rejected below the root."""
        num_rows = self.tokens.shape[1]
        following = self.tree.sibling[sequences, self.row, self.depth]  # [B]
        entering = live & (following < num_rows)  # [B]
        child = following.clamp(max=num_rows - 1)  # [B]
        node = (sequences, parent, above)
        token = self.tokens[sequences, child, above].unsqueeze(-1)  # [B, 1]: the child's token
        proposal = self.draft[sequences, child, above]  # [B, V]: its row's p at the parent
        unvisited = proposal.masked_fill(self.visited[node], 0.0).sum(-1)  # [B]: p's mass off the visited children
        drawn = proposal.gather(-1, token).squeeze(-1) / torch.where(unvisited > 0, unvisited, 1.0)  # [B]: P_u(x)
        at_token = self.target[node].gather(-1, token).squeeze(-1) / drawn.clamp_min(TINY)  # [B]: Q_u(x) / P_u(x)
        first = (self.weights[node] * at_token).log()  # [B]: log w(u) Q_u(x) / P_u(x)
        self.enter(child, self.depth, first, entering)
        self.done = self.done | (self.depth == 0)
        self.row = torch.where(entering, child, torch.where(live, parent, self.row))
        self.depth = torch.where(entering, self.tokens.shape[2], torch.where(live, above, self.depth))

    def enter(self, row: torch.Tensor, start: torch.Tensor, first: torch.Tensor, entering: torch.Tensor) -> None:
        """Set row ``row``'s weights from depth ``start`` ``[B]`` to L (entry): w = min(1, w_prev · ratio), with
        the first ratio ``first`` (log, ``[B]``) against the branch node's state and then the row's fresh ones;
        only where ``entering`` ``[B]``. In logs, w_t = exp(S_t - max(0, max_{j ≤ t} S_j)) (block.py's form)."""
        sequences = torch.arange(row.shape[0], device=row.device)  # [B]
        depths = torch.arange(1, self.tokens.shape[2] + 1, device=row.device)  # [L]
        fresh = self.fresh[sequences, row]  # [B, L]
        after = depths > start.unsqueeze(-1)  # [B, L]
        steps = torch.where(after, fresh, torch.where(depths == start.unsqueeze(-1), first.unsqueeze(-1), 0.0))
        sums = steps.cumsum(-1)  # [B, L]
        chain = (sums - sums.cummax(-1).values.clamp_min(0)).exp()  # [B, L]
        kept = self.weights[sequences, row]  # [B, L+1]
        own = entering.unsqueeze(-1) & (depths >= start.unsqueeze(-1))  # [B, L]
        self.weights[sequences, row] = torch.cat([kept[:, :1], torch.where(own, chain, kept[:, 1:])], -1)


def _unvisited(draft: torch.Tensor, visited: torch.Tensor) -> torch.Tensor:
    """p ``[B, V]`` given that the draw differs from the ``visited`` ``[B, V]`` tokens: p with them removed,
    renormalised (the next child's law once its earlier siblings are known; p itself where none is)."""
    return normalized_or(draft.masked_fill(visited, 0.0), draft)


def _uniforms(
    randomness: Randomness | list[torch.Generator],
    stream: Stream,
    shape: tuple[int, int, int],
    device: torch.device,
    offset: int = 0,
) -> torch.Tensor:
    """float64 ``[B, positions, lanes]`` (``shape``) from ``offset`` on: each sequence's keyed draws
    (:meth:`Draws.batch_uniforms`), or fresh ones from each sequence's generator (from torch's for None: a test's)."""
    if isinstance(randomness, Draws):
        return randomness.at(offset).batch_uniforms(stream, shape[1], shape[2])
    if isinstance(randomness, list):  # one generator per sequence (what the contract hands an unkeyed caller)
        return torch.stack([uniforms_from(generator, stream, shape[1:], device) for generator in randomness])
    return uniforms_from(randomness, stream, shape, device)


def _following_uniform(
    randomness: Randomness | list[torch.Generator],
    row: torch.Tensor,
    depth: torch.Tensor,
    num_rows: int,
    draft_length: int,
) -> torch.Tensor:
    """The uniform ``[B]`` of the token after the committed prefix (row ``[B]``, depth ``[B]``): RESIDUAL at offset
    depth after an inner node, BONUS at offset L after a leaf of depth L; lane = the row."""
    batch, device = row.shape[0], row.device
    sequences = torch.arange(batch, device=device)  # [B]
    residual = _uniforms(randomness, Stream.RESIDUAL, (batch, draft_length, num_rows), device)  # [B, L, K]
    bonus = _uniforms(randomness, Stream.BONUS, (batch, 1, num_rows), device, draft_length)[:, 0]  # [B, K]
    inner = residual[sequences, depth.clamp(max=draft_length - 1), row]  # [B]
    return torch.where(depth == draft_length, bonus[sequences, row], inner)
