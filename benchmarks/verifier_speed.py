"""Time one block's verification for every verifier, next to one target forward of the default model.

One verification = what the engine does per block: ``verify_block`` on the target's laws at the
K × (L+1) positions, the K × L draft laws and tokens and the block's keyed draws, then the one read
of the decision. Laws are random and peaked like a language model's, the drafts close to the target
(long accepted prefixes); is-lp needs a bounded draft support, so its laws are cut to their 50 most
likely tokens (as top-k 50 sampling would). Beside the time, the aten operations one
``verify_block`` dispatches on the same laws and the host reads among them
(:mod:`specdec_cli.device_path`): on a GPU at batch 1 the operations are the cost. On a GPU also the
same block captured in one CUDA graph and replayed, where it has no host read: the replay alone, which
``--compile`` runs there (specdec_cli/engine/graphs.py) after copying the block's laws into the graph's inputs.

The reference forward is the default recipe's target (SmolLM2-135M) unless ``--target`` names a real
shape built with random weights (``model_shapes.py``): on a GPU, Llama-3.1-8B is the target a
deployment would verify for.

    python benchmarks/verifier_speed.py --repeats 9 --threads 1 > benchmarks/results/verifier_speed_cpu.md
    python benchmarks/verifier_speed.py --repeats 9 --threads 1 --same-tokens --vocab 128256 \
        --verifiers specinfer,spectr,is-lp,is-truncated > benchmarks/results/verifier_speed_same_tokens_cpu.md
    python benchmarks/verifier_speed.py --device cuda --target llama-3.1-8b > benchmarks/results/verifier_speed_cuda.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from specdec_cli import BlockDecision, BlockVerifier, SpeculativeDecoder, load_recipe, load_verifier
from specdec_cli.base.randomness import Draws, Randomness
from specdec_cli.engine.device_path import BlockCount, capture_cuda_graph, count_block
from specdec_cli.engine.session import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import SHAPES, random_model  # noqa: E402
from verify_vs_hf import device_name  # noqa: E402

VERIFIERS = {
    "speculative": {},
    "block": {},
    "mentored": {"kl": 0.1},
    "specinfer": {},
    "spectr": {},
    "is-lp": {},
    "is-truncated": {},
}


def peaked_logits(shape: tuple[int, ...], generator: torch.Generator, top_k: int = 0) -> torch.Tensor:
    logits = torch.randn(shape, generator=generator) * 3  # [..., V]
    if top_k:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def block_laws(vocab, num_drafts, draft_length, device, top_k, same_tokens=False):
    """Target laws [K, L+1, V], draft laws [K, L, V] near them, tokens [K, L].

    Every row gets the same laws (one draft config whose rows share their prefix), so rows that
    draw equal tokens stay consistent; their tokens are drawn independently, or are all row 0's
    (``same_tokens``: every row stays alive until a correction, the multi-draft rules' costliest case).
    """
    generator = torch.Generator().manual_seed(0)
    target_logits = peaked_logits((1, draft_length + 1, vocab), generator, top_k)  # [1, L+1, V]
    noise = torch.randn(1, draft_length, vocab, generator=generator)  # [1, L, V]
    target = target_logits.softmax(-1).expand(num_drafts, -1, -1)  # [K, L+1, V]
    draft = (target_logits[:, :draft_length] + noise).softmax(-1).expand(num_drafts, -1, -1)  # [K, L, V]
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=generator).reshape(num_drafts, draft_length)
    if same_tokens:
        tokens = tokens[:1].expand(num_drafts, -1).contiguous()  # [K, L]
    return target.to(device), draft.to(device), tokens.to(device)


def block_randomness(verifier: BlockVerifier, device: str) -> Randomness:
    """The block's keyed draws, as the engine passes them; a seeded generator to a plugin that wants one."""
    if type(verifier).keyed_randomness:
        return Draws.create(key=1, block_start=0, device=device)
    return torch.Generator(device=device).manual_seed(1)


def verifier_laws(name: str, vocab: int, num_drafts: int, draft_length: int, device: str, same_tokens=False):
    """The laws every measurement of ``name`` uses (see the module docstring)."""
    return block_laws(vocab, num_drafts, draft_length, device, 50 if name == "is-lp" else 0, same_tokens)


def median_seconds(prepare: Callable[[], Callable[[], BlockDecision]], device: str, repeats: int) -> float:
    """Median over ``repeats`` runs, after one warm-up run, of one block's verification and the engine's
    read of its decision; ``prepare()`` (not timed) gives each run's verification call."""
    times = []
    for repeat in range(repeats + 1):
        verify = prepare()
        synchronize(device)
        start = time.perf_counter()
        decision = verify()
        torch.cat([decision.tokens, decision.num_accepted.view(1), decision.row.view(1)]).tolist()  # the engine's read
        if repeat:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_verification(name, params, laws, device, repeats) -> float:
    def fresh_verifier() -> Callable[[], BlockDecision]:  # nothing cached from the same laws a run ago
        verifier = load_verifier(name, params)
        randomness = block_randomness(verifier, device)
        return lambda: verifier.verify_block(*laws, randomness)

    return median_seconds(fresh_verifier, device, repeats)


def time_captured_verification(name, params, laws, device, repeats) -> float:
    """Median seconds of one block replayed from a CUDA graph (the replay the engine's ``--compile`` runs on
    a GPU, without its copies in and out) and the engine's read, for a block with no host read."""
    verifier = load_verifier(name, params)
    randomness = block_randomness(verifier, device)
    with torch.inference_mode():
        replay, decision = capture_cuda_graph(lambda: verifier.verify_block(*laws, randomness))
    return median_seconds(lambda: lambda: (replay(), decision)[1], device, repeats)


def count_verification(name, params, laws, device) -> BlockCount:
    """Operations and host reads of one ``verify_block`` on ``laws`` (the engine's read of the decision excluded)."""
    verifier = load_verifier(name, params)
    return count_block(verifier, *laws, block_randomness(verifier, device))


def benchmark_arguments(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options every verifier benchmark takes (this one and compile_speed.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--verifiers", default=",".join(VERIFIERS), help="comma list")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    return parser


def start_report(threads: int, device: str, versions: str, conditions: str) -> None:
    """Set torch's CPU threads (0: its default), then print the command and the machine with the load the
    timings start under: on a shared CPU both change every figure, and one thread is often the steadier.
    The verifier benchmarks (this one, compile_speed.py and mentored_speed.py) all start with it."""
    if threads:
        torch.set_num_threads(threads)
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"device: {device_name(device)}, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}"
        f"{versions}; date {time.strftime('%Y-%m-%d')}; {conditions}\n"
    )


def load_target(target: str, device: str):
    """The default recipe's target, or a real shape with random weights (bfloat16 on a GPU)."""
    if target == "default":
        return SpeculativeDecoder.from_recipe(
            load_recipe("default", [f"target.device={device}"]), autoregressive=True
        ).target.model
    return random_model(target, device, torch.bfloat16 if device.startswith("cuda") else torch.float32)


def time_target_forward(model, num_drafts: int, draft_length: int, repeats: int) -> float:
    device = str(model.device)
    context = torch.randint(0, 1000, (1, 64), device=model.device)
    times = []
    name = cache_argument(model)
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            cache = getattr(model(context, use_cache=True), name)
            cache.batch_repeat_interleave(num_drafts)
            block = torch.randint(0, 1000, (num_drafts, draft_length + 1), device=model.device)
            synchronize(device)
            start = time.perf_counter()
            model(block, use_cache=True, **{name: cache})
            synchronize(device)
            if repeat:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = benchmark_arguments(__doc__.splitlines()[0], repeats=5)
    parser.add_argument("--vocab", default="32000,50257,128256")
    parser.add_argument(
        "--target",
        default="default",
        choices=["default", *SHAPES],
        help="the model whose forward the verification is compared with",
    )
    parser.add_argument(
        "--same-tokens", action="store_true", help="every row draws row 0's tokens (all rows alive until a correction)"
    )
    args = parser.parse_args()
    start_report(args.threads, args.device, f", transformers {transformers.__version__}", f"median of {args.repeats}")
    graphs = args.device.startswith("cuda")
    print(
        "| verifier | V | K | L | ops per block | host reads | verification ms | ÷ target forward |"
        + (" CUDA graph ms | ÷ target forward |" if graphs else "")
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if graphs else ""))
    model = load_target(args.target, args.device)
    forwards = {}
    for vocab in [int(v) for v in args.vocab.split(",")]:
        for num_drafts in (1, 2, 4):
            for draft_length in (4, 8):
                key = (num_drafts, draft_length)
                if key not in forwards:
                    forwards[key] = time_target_forward(model, num_drafts, draft_length, args.repeats)
                for name in args.verifiers.split(","):
                    if num_drafts > (load_verifier(name, VERIFIERS[name]).max_drafts or num_drafts):
                        continue
                    laws = verifier_laws(name, vocab, num_drafts, draft_length, args.device, args.same_tokens)
                    count = count_verification(name, VERIFIERS[name], laws, args.device)
                    seconds = time_verification(name, VERIFIERS[name], laws, args.device, args.repeats)
                    row = (
                        f"| {name} | {vocab} | {num_drafts} | {draft_length} | {count.ops} | {count.reads} | "
                        f"{1000 * seconds:.2f} | {seconds / forwards[key]:.3f} |"
                    )
                    if graphs and count.reads:
                        row += " — | — |"  # a host read mid-block: no graph holds it
                    elif graphs:
                        replayed = time_captured_verification(name, VERIFIERS[name], laws, args.device, args.repeats)
                        row += f" {1000 * replayed:.3f} | {replayed / forwards[key]:.4f} |"
                    print(row, flush=True)
    print(
        f"\ntarget forward ({args.target}, {next(model.parameters()).dtype}, K rows × L+1 tokens after a "
        "64-token prefix):\n"
    )
    for (num_drafts, draft_length), seconds in sorted(forwards.items()):
        print(f"- K={num_drafts}, L={draft_length}: {1000 * seconds:.1f} ms")


if __name__ == "__main__":
    main()
