"""FLy: speculative sampling with entropy-gated deferred rejection (lossy, decided per block).

Sources: "Training-Free Loosely Speculative Decoding" (FLy, arXiv 2511.22972) and vLLM's implementation
(docs/features/speculative_decoding/fly.md: ``rejection_sample_method="fly"`` with ``fly_window_size``,
``fly_entropy_threshold`` and ``fly_entropy_top_k``), for probabilistic draft sampling with p/q acceptance.

With q_t = target law and p_t = draft law at position t of a block of L draft tokens x_0..x_{L-1}:

1. Native decisions, speculative sampling's own: accept x_t natively iff u_t < a_t = min(1, q_t(x_t) / p_t(x_t)),
   one uniform u_t per position (stream ACCEPT at offset t, as speculative sampling draws it).
2. A native rejection at i is deferred (kept as an acceptance) iff all of

   - the target is unsure there: H_k(q_i) = −Σ_{j among the k largest entries of q_i} q_ij ln q_ij ≥ θ
     (the k largest probabilities of the full law, not renormalised, 0·ln 0 = 0; k capped at V);
   - the target can produce x_i at all: q_i(x_i) > 0;
   - the window fits in the block: i + W < L, so that positions i+1..i+W exist;
   - the draft stays aligned after it: the native decisions at i+1..i+W are all acceptances.

3. accepted_t = native_t or deferred_t; the block keeps the accepted prefix, n = the first t not accepted
   (or L). At n the next token is drawn from the residual (q_n − p_n)+ normalised, as speculative sampling
   draws it (stream RESIDUAL at offset n); after a block accepted whole the bonus token comes from q_L
   (stream BONUS at offset L).

Where no deferral can happen (θ above every entropy, or W ≥ L) the decisions are speculative sampling's on the
same keyed draws. W is fixed once per run, as vLLM fixes ``FLY_WINDOW_SIZE`` per engine: the one given, or vLLM's
default min(6, K − 1) from the configured draft length K (``speculation.draft_length``, vLLM's
``num_speculative_tokens``), told by :meth:`set_draft_length`. Like vLLM, a run refuses K < 2 and a window W ≥ K.
A block shorter than K (near the end of an output, under the adaptive schedule) keeps that W, so its last W
positions cannot defer, as in vLLM's kernel (``pos + FLY_WINDOW_SIZE < num_draft_tokens``). A verifier used
without a run (a test, the author's kit) is never told K and takes each block's own L for it.

The rule is lossy (a deferred token is kept where the target would have resampled) and not token-level: the
decision at i depends on the native decisions at i+1..i+W, so neither a per-position output law nor a per-token
acceptance is defined (``acceptance`` says so). ``block_law`` gives the exact law of a block's decision by
enumerating the 2^L native patterns (for tests). On the device the window test is a difference of a cumulative
sum over the L native decisions: a fixed number of operations, no read.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Annotated, ClassVar

import torch

from specdec_cli.plugins.laws import (
    commit_after,
    excess_weights,
    normalized_excess,
    ratio_acceptance,
    row_at,
    single_draft_draws,
)
from specdec_cli.plugins.verifiers import BlockVerifier


class FLyVerification(BlockVerifier):
    name = "fly"
    lossless = False
    max_drafts = 1
    batches_by_vmap = True
    revisions: ClassVar[tuple[str, ...]] = (
        "the default window is vLLM's min(6, K − 1) from the configured draft length K, fixed per run (it was taken "
        "from each block's own length)",
    )

    def __init__(
        self,
        *,
        window_size: Annotated[
            int | None,
            "W: a rejection is deferred only when the next W draft tokens are natively accepted "
            "(default: vLLM's min(6, K − 1) for the configured draft length K; must be below K)",
        ] = None,
        entropy_threshold: Annotated[
            float, "θ: a rejection is deferred only where the target's top-k entropy is at least θ nats"
        ] = 0.3,
        entropy_top_k: Annotated[int, "k: how many of the target's largest probabilities the entropy sums"] = 3,
    ):
        # The types are the base class's to check (check_parameters, before this runs); the ranges are the rule's.
        for parameter, value in (("window_size", window_size), ("entropy_top_k", entropy_top_k)):
            if value is not None and value < 1:
                raise ValueError(f"fly: {parameter} must be a whole number >= 1, got {value!r}")
        if not (math.isfinite(entropy_threshold) and entropy_threshold >= 0):
            raise ValueError(f"fly: entropy_threshold must be a finite number >= 0, got {entropy_threshold!r}")
        self.window_size = None if window_size is None else int(window_size)
        self.entropy_threshold = float(entropy_threshold)
        self.entropy_top_k = int(entropy_top_k)
        self.configured_length: int | None = None
        """K, the run's configured draft length (None: never told, each block's L stands for it)."""

    def set_draft_length(self, draft_length: int) -> None:
        """Fix W from the run's configured K, refusing what vLLM's speculative config refuses."""
        if draft_length < 2:
            raise ValueError("fly needs at least two draft tokens per block, as vLLM does; set draft_length >= 2")
        if self.window_size is not None and self.window_size >= draft_length:
            raise ValueError(
                f"window_size {self.window_size} must be smaller than the draft length, as vLLM requires; "
                f"give window_size <= {draft_length - 1} or a longer draft"
            )
        self.configured_length = draft_length

    def window(self, draft_length: int) -> int:
        """W for a block of ``draft_length`` draft tokens: the one given, else vLLM's min(6, K − 1) from the
        configured K (this block's L where the verifier was never told K)."""
        if self.window_size is not None:
            return self.window_size
        return min(6, (self.configured_length or draft_length) - 1)

    def top_k_entropy(self, target_probs: torch.Tensor) -> torch.Tensor:
        """H_k(q) = −Σ q_j ln q_j over the k largest entries of each law ``[..., V]`` → ``[...]`` (0·ln 0 = 0)."""
        largest = target_probs.topk(min(self.entropy_top_k, target_probs.shape[-1]), dim=-1).values  # [..., k]
        return -torch.xlogy(largest, largest).sum(-1)  # [...]

    def deferrable(self, target_probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
        """``[L]`` bool: where a native rejection may be deferred, before the window test (entropy ≥ θ, q(x) > 0).

        target_probs ``[L, V]``: q at the drafted positions; draft_tokens ``[L]``.
        """
        target_x = target_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [L]
        return (self.top_k_entropy(target_probs) >= self.entropy_threshold) & (target_x > 0)  # [L]

    def window_accepted(self, native: torch.Tensor) -> torch.Tensor:
        """``[L]`` bool: position i's window fits (i + W < L) and is natively accepted throughout (i+1..i+W),
        from the native decisions ``[L]`` bool by a difference of their cumulative sum."""
        draft_length = native.shape[0]
        window = self.window(draft_length)
        if not 0 < window < draft_length:  # no window fits: nothing is deferred
            return torch.zeros_like(native)
        counts = torch.cat([native.new_zeros(1, dtype=torch.long), native.long().cumsum(0)])  # [L+1]: c_t = Σ_{s<t}
        fits = (counts[window + 1 :] - counts[1 : draft_length - window + 1]) == window  # [L-W]: i = 0..L-W-1
        return torch.cat([fits, torch.zeros_like(native[:window])])  # [L]

    def verify_block(self, target_probs, draft_probs, draft_tokens, randomness=None):
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        draft_length = x.shape[0]
        accept = ratio_acceptance(q[:-1], p, x.unsqueeze(-1)).squeeze(-1)  # [L]: min(1, q(x_t)/p(x_t))
        draws = single_draft_draws(randomness, draft_length, x.device)  # [L+1, 3]
        native = draws[:-1, 0] < accept.double()  # [L]: speculative sampling's decisions
        accepted = native | (self.deferrable(q[:-1], x) & self.window_accepted(native))  # [L]
        num_accepted = accepted.long().cumprod(0).sum()  # []
        stopped_at = num_accepted.clamp(max=draft_length - 1)  # []: a valid row even when all L were accepted
        residual = excess_weights(row_at(q, stopped_at), row_at(p, stopped_at))  # [V]
        return commit_after(num_accepted, residual, q, x, draws)

    def block_law(self, target_probs, draft_probs, draft_tokens):
        """Σ over the 2^L native patterns (mass Π a_t or 1 − a_t) of the pattern's mass times the law of the
        token after its accepted prefix (host loops: for tests only)."""
        q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]  # [L+1, V], [L, V], [L]
        draft_length = x.shape[0]
        accept = ratio_acceptance(q[:-1], p, x.unsqueeze(-1)).squeeze(-1).tolist()  # [L]
        deferrable = self.deferrable(q[:-1], x).tolist()  # [L]
        following = torch.cat([normalized_excess(q[:-1], p), q[-1:]])  # [L+1, V]
        law = torch.zeros((1, *q.shape), dtype=q.dtype, device=q.device)  # [1, L+1, V]
        for native in product((True, False), repeat=draft_length):
            mass = math.prod(a if kept else 1 - a for a, kept in zip(accept, native))
            if mass == 0:
                continue
            stop = next((t for t in range(draft_length) if not self._kept(t, native, deferrable)), draft_length)
            law[0, stop] += mass * following[stop]
        return law

    def _kept(self, t: int, native: tuple[bool, ...], deferrable: list[bool]) -> bool:
        """Whether position t is accepted, natively or by deferral, given the native pattern (host values)."""
        size = self.window(len(native))
        window = native[t + 1 : t + 1 + size]
        fits = size > 0 and t + size < len(native)
        return native[t] or (deferrable[t] and fits and all(window))
