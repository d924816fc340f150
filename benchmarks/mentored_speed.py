"""Mentored decoding's block against speculative sampling's, CPU time, same process (issue #20 §3).

For each kind of law the two verifiers alternate on the same blocks, each block with its own keyed
draws (so the positions a block reaches, and the solves it needs, vary as in generation); the table
gives the median over the blocks, the ratio of the medians, and the mean number of accepted draft
tokens. Kinds, at V = 128256 and L = 8 by default:

- ``peaked``: benchmarks/verifier_speed.py's ``block_laws`` (target logits N(0, 3²), draft logits
  the target's plus N(0, 1) noise): KL(q ‖ p) ≈ 0.5 nats at every position, above D = 0.1, and
  speculative sampling rejects most first tokens, so nearly every block needs one or two solves;
- ``near_one_token``: the target sharpened 12× (about T = 0.3 with top-p 0.9 on a real model) and a
  draft a tenth as noisy: almost all mass on one token, KL(q ‖ p) mostly ≤ D;
- ``one_token_equal``: q = p, one-hot (the offline default pair's usual case).

    python benchmarks/mentored_speed.py --threads 1 --blocks 100 > benchmarks/results/mentored_speed_cpu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec_cli import load_verifier
from specdec_cli.base.randomness import Draws

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verifier_speed import block_laws, start_report  # noqa: E402

KINDS = ("peaked", "near_one_token", "one_token_equal")


def laws(kind: str, vocab: int, draft_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target laws ``[1, L+1, V]``, draft laws ``[1, L, V]`` and draft tokens ``[1, L]`` of one kind."""
    target, draft, tokens = block_laws(vocab, 1, draft_length, "cpu", 0)
    if kind == "peaked":
        return target, draft, tokens
    sharpness = 12.0 if kind == "near_one_token" else 1e4
    noise = draft.log() - target[:, :-1].log()  # [1, L, V]: the draft's noise on the logits (and a constant)
    target = (target.log() * sharpness).softmax(-1)  # [1, L+1, V]
    draft = (
        target[:, :-1] if kind == "one_token_equal" else (target[:, :-1].log() + 0.1 * sharpness * noise).softmax(-1)
    )
    generator = torch.Generator().manual_seed(1)
    tokens = torch.multinomial(draft[0], 1, generator=generator).view(1, draft_length)
    return target, draft, tokens


def time_blocks(kind: str, vocab: int, draft_length: int, kl: float, blocks: int) -> dict[str, tuple[float, float]]:
    """(median ms, mean accepted) per verifier, the two alternating on the same blocks."""
    target, draft, tokens = laws(kind, vocab, draft_length)
    verifiers = {"speculative": load_verifier("speculative"), "mentored": load_verifier("mentored", {"kl": kl})}
    seconds: dict[str, list[float]] = {name: [] for name in verifiers}
    accepted: dict[str, list[int]] = {name: [] for name in verifiers}
    for block in range(blocks + 2):  # the first two warm up
        for name, verifier in verifiers.items():
            draws = Draws.create(key=7, block_start=block * (draft_length + 1))
            start = time.process_time()
            decision = verifier.verify_block(target, draft, tokens, draws)
            committed = torch.cat([decision.tokens, decision.num_accepted.view(1)]).tolist()  # the engine's read
            if block >= 2:
                seconds[name].append(time.process_time() - start)
                accepted[name].append(committed[-1])
    return {name: (1000 * statistics.median(seconds[name]), statistics.mean(accepted[name])) for name in verifiers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--draft-length", type=int, default=8)
    parser.add_argument("--kl", type=float, default=0.1)
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    conditions = (
        f"V = {args.vocab}, L = {args.draft_length}, D = {args.kl}; median of {args.blocks} blocks; "
        f"CPU time (time.process_time) on {os.cpu_count()} CPUs"
    )
    start_report(args.threads, "cpu", "", conditions)
    print("| laws | speculative ms | mentored ms | mentored ÷ speculative | accepted: speculative | mentored |")
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        timed = time_blocks(kind, args.vocab, args.draft_length, args.kl, args.blocks)
        (spec_ms, spec_accepted), (mentored_ms, mentored_accepted) = timed["speculative"], timed["mentored"]
        print(
            f"| {kind} | {spec_ms:.2f} | {mentored_ms:.2f} | {mentored_ms / spec_ms:.2f} | "
            f"{spec_accepted:.2f} | {mentored_accepted:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
