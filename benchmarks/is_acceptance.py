"""Tokens each block commits under multi-draft verifiers, end to end through ``verify_block`` (issue #20 §2).

Synthetic language-model laws over a large vocabulary (default V = 128256, Llama 3's): every law is a
pure function of (context, prefix), so rows that share a prefix share their laws, as in the engine.
The target's logits are 1.5 N(0, 1) with 20 tokens raised by U(0, peak); a cheap draft adds
``--draft-noise`` N(0, 1) to them (one draft law sampled K times), or with ``--different`` row k also
divides its logits by a temperature in 0.7, 1.0, 1.3, … (the multi-draft paper's different drafts).
Each block drafts K rows of L tokens, and every verifier decides the same drafted block. A block
commits num_accepted + 1 tokens, so the mean is the tokens per target forward. Two figures per
verifier: the exact expectation given the drafted block (a recursion over the rows still alive, with the
verifier's ``conditional`` law at each position: the walk's continuations, where a residual returns
another row's token, are counted), and one sampled ``verify_block`` decision (end to end, noisier).
Differences to specinfer are paired (same drafted blocks).

Verifiers that take keyed draws get the block's ``Draws``; others (a checkout before issue #20) a
generator seeded from the block, so the same script measures both::

    python benchmarks/is_acceptance.py --blocks 200
    mkdir /tmp/before && git archive 241fc30 specdec_plugins | tar -x -C /tmp/before  # the plugins before
    PYTHONPATH=/tmp/before:. python benchmarks/is_acceptance.py --blocks 200
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec_cli import load_verifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_vs_hf import device_name  # noqa: E402


def law(context: int, prefix: tuple[int, ...], args, temperature: float | None = None) -> torch.Tensor:
    """The target's law after ``prefix`` ``[V]`` (float32), or a draft's with ``temperature``."""
    seed = int.from_bytes(hashlib.sha256(repr((context, prefix)).encode()).digest()[:7], "little")
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(args.vocab, generator=generator) * 1.5  # [V]
    boosted = torch.randint(0, args.vocab, (20,), generator=generator)  # [20]
    logits[boosted] += torch.rand(20, generator=generator) * args.peak
    if temperature is not None:
        logits = (logits + args.draft_noise * torch.randn(args.vocab, generator=generator)) / temperature
    if args.top_k:
        logits = logits.masked_fill(logits < logits.topk(args.top_k).values[-1], -torch.inf)
    return logits.softmax(-1)


def drafted_block(context: int, num_drafts: int, args) -> tuple[torch.Tensor, ...]:
    """target_probs ``[K, L+1, V]``, draft_probs ``[K, L, V]``, draft_tokens ``[K, L]`` of one block."""
    generator = torch.Generator().manual_seed(context)
    temperatures = [0.7 + 0.3 * k if args.different else 1.0 for k in range(num_drafts)]
    rows, drafts = [], []
    for temperature in temperatures:
        prefix, laws = (), []
        for _ in range(args.draft_length):
            laws.append(law(context, prefix, args, temperature))
            prefix += (int(torch.multinomial(laws[-1], 1, generator=generator)),)
        rows.append(prefix)
        drafts.append(torch.stack(laws))
    targets = [torch.stack([law(context, row[:t], args) for t in range(args.draft_length + 1)]) for row in rows]
    return torch.stack(targets), torch.stack(drafts), torch.tensor(rows)


def expected_committed(verifier, target_probs, draft_probs, draft_tokens, t: int = 0, alive=None) -> float:
    """E[tokens the block commits from position t on] given the rows ``alive`` at t (all at t = 0): one
    token at t, and if it is some alive row's token x, what the rows with x go on to commit."""
    alive = list(range(len(draft_tokens))) if alive is None else alive
    if t == draft_tokens.shape[1]:
        return 1.0  # the bonus token
    with torch.inference_mode():
        law = verifier.conditional(target_probs[alive[0], t], draft_probs[alive, t], draft_tokens[alive, t])  # [V]
    expected = 1.0
    for token in sorted({int(draft_tokens[k, t]) for k in alive}):
        survivors = [k for k in alive if int(draft_tokens[k, t]) == token]
        following = expected_committed(verifier, target_probs, draft_probs, draft_tokens, t + 1, survivors)
        expected += float(law[token]) * following
    return expected


def committed(verifier, block, index: int) -> int:
    """Tokens one ``verify_block`` commits, with keyed draws (or a generator for a plugin without them)."""
    if getattr(verifier, "keyed_randomness", False):
        from specdec_cli.base.randomness import Draws

        randomness = Draws.create(key=index, block_start=0)
    else:
        randomness = torch.Generator().manual_seed(index)
    with torch.inference_mode():
        return int(verifier.verify_block(*block, randomness).num_accepted) + 1


def mean_and_error(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values) / math.sqrt(len(values)):.3f}"


def paired(results: dict[str, list[float]], name: str, reference: str) -> str:
    return mean_and_error([a - b for a, b in zip(results[name], results[reference])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifiers", default="specinfer,is-truncated")
    parser.add_argument("--num-drafts", default="2,3,4")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--peak", type=float, default=12.0)
    parser.add_argument("--draft-noise", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="cut every law to its k likeliest tokens (is-lp needs it)")
    parser.add_argument("--different", action="store_true", help="row k's draft at temperature 0.7 + 0.3 k")
    args = parser.parse_args()
    names = args.verifiers.split(",")
    verifiers = {name: load_verifier(name) for name in names}
    print(
        f"`{' '.join(['python benchmarks/is_acceptance.py', *sys.argv[1:]])}`: {device_name('cpu')}, "
        f"torch {torch.__version__}\n"
    )
    print(
        "Tokens per block: exact expectation given the drafted block (sampled verify_block), mean ± standard "
        "error over the blocks.\n"
    )
    differences = [f"{name} - {names[0]}" for name in names[1:]]
    print("| K | " + " | ".join(names + differences) + " | s/block |")
    print("|---" * (2 * len(names) + 1) + "|")
    for num_drafts in map(int, args.num_drafts.split(",")):
        started = time.perf_counter()
        exact, sampled = {name: [] for name in names}, {name: [] for name in names}
        for index in range(args.blocks):
            block = drafted_block(1000 * num_drafts + index, num_drafts, args)
            for name, verifier in verifiers.items():
                exact[name].append(expected_committed(verifier, *block))
                sampled[name].append(committed(verifier, block, index))
        seconds = (time.perf_counter() - started) / args.blocks
        cells = [f"{mean_and_error(exact[name])} ({mean_and_error(sampled[name])})" for name in names]
        cells += [f"{paired(exact, name, names[0])} ({paired(sampled, name, names[0])})" for name in names[1:]]
        print(f"| {num_drafts} | " + " | ".join(cells) + f" | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
