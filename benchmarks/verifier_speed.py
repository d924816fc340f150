"""Time one block's verification for every verifier, next to one target forward of the default model.

One verification = what the engine does per block: ``verify_block`` on the target's laws at the
K × (L+1) positions, the K × L draft laws and tokens, then the one read of the decision. Laws are
random and peaked like a language model's, the drafts close to the target (long accepted
prefixes); is-lp needs a bounded draft support, so its laws are cut to their 50 most likely
tokens (as top-k 50 sampling would). Runs on the CPU, and on CUDA too when a GPU is present.

    python benchmarks/verifier_speed.py > benchmarks/results/verifier_speed_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from specdec_cli import SpeculativeDecoder, load_recipe, load_verifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_vs_hf import cpu_name  # noqa: E402

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


def block_laws(vocab, num_drafts, draft_length, device, top_k):
    """Target laws [K, L+1, V], draft laws [K, L, V] near them, tokens [K, L].

    Every row gets the same laws (one draft config whose rows share their prefix), so rows that
    draw equal tokens stay consistent; their tokens are drawn independently.
    """
    generator = torch.Generator().manual_seed(0)
    target_logits = peaked_logits((1, draft_length + 1, vocab), generator, top_k)  # [1, L+1, V]
    noise = torch.randn(1, draft_length, vocab, generator=generator)  # [1, L, V]
    target = target_logits.softmax(-1).expand(num_drafts, -1, -1)  # [K, L+1, V]
    draft = (target_logits[:, :draft_length] + noise).softmax(-1).expand(num_drafts, -1, -1)  # [K, L, V]
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=generator).reshape(num_drafts, draft_length)
    return target.to(device), draft.to(device), tokens.to(device)


def time_verification(name, params, vocab, num_drafts, draft_length, device, repeats) -> float:
    verifier = load_verifier(name, params)
    target, drafts, tokens = block_laws(vocab, num_drafts, draft_length, device, 50 if name == "is-lp" else 0)
    sampler = torch.Generator(device=device).manual_seed(1)
    times = []
    for repeat in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        decision = verifier.verify_block(target, drafts, tokens, sampler)
        torch.cat([decision.tokens, decision.num_accepted.view(1), decision.row.view(1)]).tolist()  # the engine's read
        if repeat:  # the first run warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_target_forward(device: str, num_drafts: int, draft_length: int, repeats: int) -> float:
    decoder = SpeculativeDecoder.from_recipe(load_recipe("default", [f"target.device={device}"]), autoregressive=True)
    model = decoder.target.model
    context = torch.randint(0, 1000, (1, 64), device=model.device)
    times = []
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            cache = model(context, use_cache=True).past_key_values
            cache.batch_repeat_interleave(num_drafts)
            block = torch.randint(0, 1000, (num_drafts, draft_length + 1), device=model.device)
            synchronize(device)
            start = time.perf_counter()
            model(block, past_key_values=cache, use_cache=True)
            synchronize(device)
            if repeat:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", default="32000,50257,128256")
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"command: python {' '.join(sys.argv)}")
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} CPU threads{gpu}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; date {time.strftime('%Y-%m-%d')}; median of {args.repeats}\n")
    for device in devices:
        print(f"## {device}\n")
        print("| verifier | V | K | L | verification ms | ÷ target forward |")
        print("|---|---|---|---|---|---|")
        forwards = {}
        for vocab in [int(v) for v in args.vocab.split(",")]:
            for num_drafts in (1, 2, 4):
                for draft_length in (4, 8):
                    key = (num_drafts, draft_length)
                    if key not in forwards:
                        forwards[key] = time_target_forward(device, num_drafts, draft_length, args.repeats)
                    for name, params in VERIFIERS.items():
                        verifier = load_verifier(name, params)
                        if verifier.max_drafts is not None and num_drafts > verifier.max_drafts:
                            continue
                        seconds = time_verification(name, params, vocab, num_drafts, draft_length, device, args.repeats)
                        print(f"| {name} | {vocab} | {num_drafts} | {draft_length} | {1000 * seconds:.2f} | "
                              f"{seconds / forwards[key]:.3f} |", flush=True)
        print("\ntarget forward of the default model (SmolLM2-135M, K rows × L+1 tokens after a 64-token prefix):\n")
        for (num_drafts, draft_length), seconds in sorted(forwards.items()):
            print(f"- K={num_drafts}, L={draft_length}: {1000 * seconds:.1f} ms")
        print()


if __name__ == "__main__":
    main()
