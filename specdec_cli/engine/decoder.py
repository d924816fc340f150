"""The speculative decoding engine: draft → score → verify → commit, block after block, for every batch size.

A run advances B sequences (prompts × samples) together, each at its own pace; a single sample is a batch of one.
One step is one block for every sequence of the batch, with K draft rows (every draft config's ``num_drafts``
samples) and up to L draft tokens:

1. every drafter proposes for every sequence (:meth:`~specdec_cli.drafting.Drafter.propose`: the model drafter runs
   one forward per position for all rows); each sequence's block length is its own (its drafters' proposals, its
   remaining tokens), and the model drafters are asked last, for what the others leave to verify;
2. the target scores all B × K rows in one forward (:class:`~specdec_cli.engine.session.ModelSession`);
3. the verifier decides every sequence's block on the device, one call of its
   :meth:`~specdec_cli.verifiers.BlockVerifier.verify` per distinct block shape and rule, for a group of one as for
   several (compiled under ``--compile``, and a group of one replayed from a CUDA graph on a GPU);
4. EOS, finiteness and every model's longest-agreeing row are folded in on the device, and the step reads the
   device once for the whole batch; each sequence then commits its own tokens and keeps its own cache rows.

No other value crosses from the device to the host inside a step. The target alone is the same loop with no
drafts (L = 0: each block is one target forward and the token drawn from it), so baseline and speculative runs
share sampler and stopping. Sequences that finish leave the batch after the step and waiting ones join it, so a
long answer does not hold the others. A sequence's draws are keyed by its own (seed, prompt, sample) and its own
block starts, so its tokens do not depend on what else is in its batch, up to the float rounding of batched
forwards. docs/block-loop.md walks through it.

Exact first (``speculation.exact_first`` N > 0 with a lossy verifier): a block that starts after g < N generated
tokens is decided by a lossless rule (``speculation.exact_verifier``) and drafts at most N − g tokens, so that no
block straddles N. Its draft tokens lie at positions g .. N − 1 and its correction before N (a bonus token, at N at
the latest, is drawn from q anyway); a lossless block commits tokens distributed as the target's own continuation,
and the rule and cap of each block depend on the tokens before it only, so the first N tokens follow the target's
law exactly. One rule decides a whole block, so without the cap a block from before N would either let the exact
rule decide tokens past N or let the lossy one decide tokens before it. Blocks that start at g >= N are the run's
verifier's. One step may hold sequences of both phases: each is a group of its own, decided on the device before
the step's one read.

Where it lives: :mod:`.building` (:class:`SpeculativeDecoder`: from a recipe, prompts, memory advice), :mod:`.run`
(:class:`DecodingRun`: the block loop, handed its step functions), :mod:`.block_steps` (:class:`Steps`: the draft
step, the target's scoring, the sampling law, the verify steps) and :mod:`.guards` (the checks of plugin calls and
of a step's read). This module keeps the engine's import path.
"""

from __future__ import annotations

from .block_steps import DraftStep, Steps, TargetLaws, VerifyStep, score_target, verify_step
from .building import PromptTypeError, SpeculativeDecoder
from .guards import PluginGuards
from .run import BlockCallback, DecodingRun, SequenceJob

__all__ = [
    "BlockCallback",
    "DecodingRun",
    "DraftStep",
    "PluginGuards",
    "PromptTypeError",
    "SequenceJob",
    "SpeculativeDecoder",
    "Steps",
    "TargetLaws",
    "VerifyStep",
    "score_target",
    "verify_step",
]
