"""The verify step replayed from CUDA graphs: what ``speculation.compile`` (``--compile``) does on a GPU.

At batch 1 a GPU verifier costs what it launches (a few hundred operations of 5–20 µs each on the
host), not what its kernels compute. Captured once in a CUDA graph, a block's operations launch as one:
on an H100 ``speculative`` at V = 128256 took 1.6–1.8 ms eager and 0.13–0.14 ms replayed
(benchmarks/results/verifier_speed_cuda.md).

The graph replays the eager kernels, so a replayed block decides exactly as the eager one, bit for bit.
A graph holds fixed shapes and addresses: one is captured per block shape, its inputs are copied into the
graph's own tensors before each replay, and the decision is copied out after it (the next replay
overwrites it). torch.compile's ``reduce-overhead`` mode does the same for compiled functions, but its
outputs are overwritten by the next call, which the engine's draft laws, kept across calls, cannot allow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .device_path import capture_cuda_graph, count_block
from .randomness import Draws
from .verifiers import BlockDecision, BlockVerifier


@dataclass(frozen=True)
class _CapturedBlock:
    inputs: tuple[torch.Tensor, ...]
    """The graph's own target_probs, draft_probs, draft_tokens, draws key and block start."""
    replay: Callable[[], None]
    decision: BlockDecision
    """Where each replay leaves its decision."""


class CapturedVerifyStep:
    """``verifier.verify_block`` replayed from one CUDA graph per block shape.

    A verifier that reads the host during a block (counted on the first block of each shape with
    :func:`~specdec_cli.device_path.count_block`) cannot be captured, nor can randomness other than keyed
    ``Draws``: such blocks run ``fallback`` (the verify step compiled without graphs).
    """

    def __init__(self, verifier: BlockVerifier, fallback: Callable[..., BlockDecision]) -> None:
        self.verifier = verifier
        self.fallback = fallback
        self._captured: dict[tuple, _CapturedBlock | None] = {}

    def __call__(self, target_probs, draft_probs, draft_tokens, randomness) -> BlockDecision:
        if not isinstance(randomness, Draws) or not isinstance(randomness.offset, int) or randomness.offset:
            return self.fallback(target_probs, draft_probs, draft_tokens, randomness)
        inputs = (target_probs, draft_probs, draft_tokens, randomness.key, randomness.block_start)
        shape = tuple((tensor.shape, tensor.dtype) for tensor in inputs)
        if shape not in self._captured:
            self._captured[shape] = self._capture(inputs)
        captured = self._captured[shape]
        if captured is None:
            return self.fallback(target_probs, draft_probs, draft_tokens, randomness)
        with torch.inference_mode():
            for own, given in zip(captured.inputs, inputs):
                own.copy_(given)
            captured.replay()
            decision = captured.decision
            return BlockDecision(decision.tokens.clone(), decision.num_accepted.clone(), decision.row.clone())

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _CapturedBlock | None:
        """The graph of one block shape, or None where the block reads the host (no graph can hold a read)."""
        with torch.inference_mode():
            own = tuple(tensor.clone() for tensor in inputs)
            target_probs, draft_probs, draft_tokens, key, block_start = own
            draws = Draws(key, block_start)
            if count_block(self.verifier, target_probs, draft_probs, draft_tokens, draws).reads:
                return None
            replay, decision = capture_cuda_graph(
                lambda: self.verifier.verify_block(target_probs, draft_probs, draft_tokens, draws))  # fmt: skip
        return _CapturedBlock(own, replay, decision)
