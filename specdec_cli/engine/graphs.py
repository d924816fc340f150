"""The verify step replayed from CUDA graphs: what ``speculation.compile`` (``--compile``) does on a GPU.

At batch 1 a GPU verifier costs what it launches (a few hundred operations of 5–20 µs each on the
host), not what its kernels compute. Captured once in a CUDA graph, a block's operations launch as one:
on an H100 the replay of ``speculative``'s block at V = 128256 took 0.13–0.14 ms against 1.6–1.8 ms
eager (benchmarks/results/verifier_speed_cuda.md).

The graph replays the eager kernels, so a replayed block decides exactly as the eager one, bit for bit.
A graph holds fixed shapes and addresses: one is captured per block shape, its inputs are copied into the
graph's own tensors before each replay, and the decision is copied out after it (the next replay
overwrites it). torch.compile's ``reduce-overhead`` mode does the same for compiled functions, but its
outputs are overwritten by the next call, which the engine's draft laws, kept across calls, cannot allow.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..base.randomness import Draws
from ..plugins.verifiers import BatchDecision, BlockVerifier, batch_decision_problem
from .device_path import capture_cuda_graph, count_block


@dataclass(frozen=True)
class _CapturedBlock:
    inputs: tuple[torch.Tensor, ...]
    """The graph's own target_probs [1, K, L+1, V], draft_probs [1, K, L, V], draft_tokens [1, K, L], key [1] and
    block start [1]."""
    replay: Callable[[], None]
    decision: BatchDecision
    """Where each replay leaves its decision."""


class CapturedVerifyStep:
    """``verifier.verify`` of a group of one sequence (B = 1) replayed from one CUDA graph per block shape, every graph
    in one memory pool (a decision is copied out before any other graph replays).

    Groups run ``fallback`` (the verify step compiled without graphs) where no graph can hold them: a group of
    several, a verifier that does not declare itself ``capturable``, randomness other than keyed ``Draws``, a
    verifier handed the
    laws it judges drafts by (``judged``: inputs the graphs do not hold), a block
    that reads the host (counted on the first block of each shape with
    :func:`~specdec_cli.device_path.count_block`), a decision the engine would refuse, or a capture
    that fails (an upload from the host, say).
    """

    def __init__(self, verifier: BlockVerifier, fallback: Callable[..., BatchDecision]) -> None:
        self.verifier = verifier
        self.fallback = fallback
        self._captured: dict[tuple, _CapturedBlock | None] = {}  # by the inputs' (shape, dtype, device)
        self._pool = None

    def __call__(self, target_probs, draft_probs, draft_tokens, randomness, **judged) -> BatchDecision:
        if judged or not self._may_capture(randomness, draft_tokens.shape[0]):  # judged laws: not captured
            return self.fallback(target_probs, draft_probs, draft_tokens, randomness, **judged)
        inputs = (target_probs, draft_probs, draft_tokens, randomness.key, randomness.block_start)
        signature = tuple((tensor.shape, tensor.dtype, tensor.device) for tensor in inputs)
        if signature not in self._captured:
            self._captured[signature] = self._capture(inputs)
        captured = self._captured[signature]
        if captured is None:
            return self.fallback(target_probs, draft_probs, draft_tokens, randomness)
        with torch.inference_mode():
            for own, given in zip(captured.inputs, inputs):
                own.copy_(given)
            captured.replay()
            decision = captured.decision
            return BatchDecision(decision.tokens.clone(), decision.num_accepted.clone(), decision.row.clone())

    def _may_capture(self, randomness, batch: int) -> bool:
        keyed = isinstance(randomness, Draws) and isinstance(randomness.offset, int) and randomness.offset == 0
        return self.verifier.capturable and keyed and batch == 1

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _CapturedBlock | None:
        """The graph of one block shape, or None where no graph can hold the block (see the class)."""
        device = inputs[0].device
        with torch.inference_mode():
            own = tuple(tensor.clone() for tensor in inputs)
            target_probs, draft_probs, draft_tokens, key, block_start = own
            draws = Draws(key, block_start)  # [1] each
            if count_block(self.verifier, target_probs[0], draft_probs[0], draft_tokens[0], draws.row(0)).reads:
                return None
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.current_stream(device)
            try:
                replay, decision = capture_cuda_graph(
                    lambda: self.verifier.verify(target_probs, draft_probs, draft_tokens, draws),
                    device,
                    self._pool,
                )
            except RuntimeError as error:  # what a capture refuses and eager allows (an upload from the host)
                torch.cuda.set_stream(stream)  # a failed capture can leave its own stream current
                warnings.warn(
                    f"verifier '{self.verifier.name}': its block could not be captured in a CUDA graph "
                    f"({str(error).splitlines()[0]}); it runs compiled instead",
                    stacklevel=2,
                )
                return None
        if batch_decision_problem(decision, 1, draft_tokens.shape[2] + 1, device) is not None:
            return None  # the fallback returns it again, and the engine names what is wrong
        return _CapturedBlock(own, replay, decision)
