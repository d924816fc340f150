"""Sample matching: the target draws its own token at every drafted position and keeps the draft while they agree
(llama.cpp's and MLX-LM's verification), lossless.

Sources: ml-explore/mlx-lm, ``mlx_lm/generate.py``, ``speculative_generate_step`` (at commit
0024613ba012d9b4901532921d53f17b9f293d4f: the target's ``sampler`` draws ``tokens`` at all ``num_draft + 1``
positions, and the loop ``while n < num_draft: ... if tn != dtn: break`` keeps the draft while it matches, then
yields ``tokens[n]``); ggml-org/llama.cpp, ``common/sampling.cpp``, ``common_sampler_sample_and_accept_n`` (at
00efb3e184262872916bf136b3df63c1822a19bd: sample at each index, push the sample, stop when ``draft[i] != id``, and
sample the bonus index after a draft matched whole), as ``examples/speculative-simple/speculative-simple.cpp`` calls
it.

The rule in the project's notation, with q_t the target law after the first t draft tokens and x_t ~ p_t the
draft tokens (t = 0..L-1)::

    y_t ~ q_t                  the target's own token at every drafted position, drawn whatever x_t is
    accept x_t                 iff y_t = x_t (and every earlier position was accepted)
    at the first mismatch n    commit y_n, the target's own draw there (not a residual)
    after a block kept whole   commit the bonus y_L ~ q_L

Every committed token is a draw from q after the committed prefix, with a uniform used nowhere else, so the
output law is q at every position whatever the drafts are (lossless); the draft only decides how far one target
forward reaches. A position accepts P(y = x) = Σ_x p(x) q(x). Speculative sampling (docs/verifiers.md §1) accepts
Σ_x min(p(x), q(x)) = Σ_x p q + Σ_x min(p, q)·(1 − max(p, q)) instead: by reading p it keeps a token the draft
under-proposes (q(x) ≥ p(x)) always, where matching keeps it only with probability q(x). The two are equal only
where min(p, q) = 0 or max(p, q) = 1 at every token, e.g. for a greedy (one-hot) draft or target; sample matching
needs no draft law at all. Per position, its law given x is q for every x, the same as SGLang's thresholds at their
defaults (``threshold``, §10: accept with probability q(x), else draw from q without x), with one uniform instead
of two.

Several draft rows (``max_drafts = None``): y_t ~ q_t after the committed prefix, and the block follows every row
whose token equals y_t (the base class's walk over alive rows with ``conditional = q``); each committed token is
still a fresh draw from q, so it stays lossless, and a position accepts Σ_y q(y)·(1 − Π_k (1 − p_k(y))).

Draws (keyed, one uniform per position, no host read, a fixed operation count): y_t from stream RESIDUAL at offset
t (the draw the base class's ``select`` makes for a conditional law, so the block, the multi-row walk and
``select`` draw the same y_t), the bonus y_L from stream BONUS at offset L, as every built-in's bonus. The ACCEPT
stream is unused: there is no separate test.
"""

from __future__ import annotations

import torch

from specdec_cli.base.randomness import Randomness, Stream, stream_table_from, uniforms_from
from specdec_cli.plugins.laws import sample_with
from specdec_cli.plugins.verifiers import BlockDecision, Verifier, walk_alive_rows


class SampleMatching(Verifier):
    name = "match"
    lossless = True
    max_drafts = None
    dependent_drafts = True
    batches_by_vmap = True

    def conditional(self, target_probs, draft_probs, draft_tokens):
        return target_probs  # [..., V]: the output is the target's own draw, whatever the candidates are

    def acceptance_probability(self, target_probs, draft_probs):
        missed = (1 - draft_probs).prod(-2)  # [..., V]: P(no candidate is y), the K draws being independent
        return (target_probs * (1 - missed)).sum(-1)  # [...]: Σ_y q(y) P(some x_k = y); Σ p q with one draft

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        if draft_tokens.shape[0] == 1:
            return _one_row(target_probs[0], draft_tokens[0], randomness)
        return _rows(target_probs, draft_tokens, randomness)


def _one_row(target_probs: torch.Tensor, draft_tokens: torch.Tensor, randomness: Randomness) -> BlockDecision:
    """One draft row: target_probs ``[L+1, V]``, draft_tokens ``[L]``. All L + 1 target draws are made at once (one
    keyed evaluation, one inverse-CDF pass); they are the committed tokens themselves, since the accepted ones equal
    the draft's and the one at the first mismatch (or the bonus) is y_n."""
    draft_length = draft_tokens.shape[0]
    # Columns RESIDUAL and BONUS (consecutive streams) in one evaluation; position L takes BONUS, the others RESIDUAL.
    table = stream_table_from(randomness, Stream.RESIDUAL, 2, draft_length + 1, draft_tokens.device)  # [L+1, 2]
    uniforms = torch.cat([table[:-1, 0], table[-1:, 1]])  # [L+1]
    sampled = sample_with(target_probs, uniforms)  # [L+1]: y_t ~ q_t
    num_accepted = (sampled[:-1] == draft_tokens).long().cumprod(0).sum()  # []: the matches before the first miss
    return BlockDecision(sampled, num_accepted, torch.zeros_like(num_accepted))


def _rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, randomness: Randomness) -> BlockDecision:
    """K draft rows: target_probs ``[K, L+1, V]``, draft_tokens ``[K, L]``. Each row's y_t is drawn with the same
    uniform u_t, so the leader's (the first alive row's, whose q_t is the alive rows' shared law) is the walk's
    output at t: every row's draws in one pass, then :func:`walk_alive_rows` follows the rows that match."""
    num_rows, draft_length = draft_tokens.shape
    uniforms = uniforms_from(randomness, Stream.RESIDUAL, (draft_length,), draft_tokens.device)  # [L]
    sampled = sample_with(target_probs[:, :-1], uniforms.expand(num_rows, -1))  # [K, L]: y_t after each row's prefix

    def choose(t: int, alive: torch.Tensor, leader: torch.Tensor) -> torch.Tensor:
        return sampled[:, t].index_select(0, leader.view(1)).squeeze(0)  # []: y_t under the committed prefix

    return walk_alive_rows(choose, target_probs, draft_tokens, randomness)  # the bonus from BONUS at offset L
