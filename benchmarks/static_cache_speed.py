"""The static KV cache beside the dynamic one, on the offline default pair, in one process.

The default recipe's SmolLM2-135M-Instruct target and draft (float32 on the CPU), the chat prompts of
``examples/grounded_prompts.jsonl``, each configuration decoded with ``speculation.static_cache`` off and on
through the same model objects (``with_config``), interleaved round by round after one untimed warm-up each:
the target alone and speculative sampling, at batch sizes 1 and 4. Reported: tokens/s of each cache, their ratio,
and how many samples have the same tokens under both (the same keyed randomness; they may differ only by float
rounding).

    python benchmarks/static_cache_speed.py --threads 2 > benchmarks/results/static_cache_speed_cpu.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

from specdec_cli import SpeculativeDecoder, load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_vs_hf import cpu_name  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "grounded_prompts.jsonl"
CONFIGURATIONS = [("target alone", "none", 1), ("speculative", "speculative", 1)]
CONFIGURATIONS += [("target alone", "none", 4), ("speculative", "speculative", 4)]


def timed(decoder: SpeculativeDecoder, prompts: list[str], batch_size: int) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    results = decoder.generate(prompts, batch_size=batch_size)
    return time.perf_counter() - began, [result.token_ids for result in results]


def measure(base: SpeculativeDecoder, prompts: list[str], rounds: int) -> dict[str, dict]:
    """Every configuration under both caches, interleaved: seconds, tokens and token ids per cache."""
    decoders = {
        (label, size, static): base.with_config(verifier=verifier, static_cache=static)
        for label, verifier, size in CONFIGURATIONS
        for static in (False, True)
    }
    for (_, size, _), decoder in decoders.items():
        timed(decoder, prompts[:1], size)  # untimed warm-up
    totals: dict[str, dict] = {}
    for _ in range(rounds):
        for (label, size, static), decoder in decoders.items():
            seconds, tokens = timed(decoder, prompts, size)
            entry = totals.setdefault(f"{label}, B = {size}", {}).setdefault("static" if static else "dynamic", {})
            entry["seconds"] = entry.get("seconds", 0.0) + seconds
            entry["tokens"] = entry.get("tokens", 0) + sum(map(len, tokens))
            entry["token_ids"] = tokens  # the last round's: every round draws the same keyed samples
    return totals


def report(totals: dict[str, dict], args: argparse.Namespace, prompts: int) -> None:
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"device: cpu ({cpu_name()}, {torch.get_num_threads()} threads); torch {torch.__version__}, "
        f"transformers {transformers.__version__}; date {time.strftime('%Y-%m-%d')}"
    )
    print(f"{prompts} chat prompts × {args.rounds} rounds, max_new_tokens {args.max_new_tokens}, default recipe\n")
    print("| configuration | tokens/s dynamic | tokens/s static | static ÷ dynamic | same tokens |")
    print("|---|---|---|---|---|")
    for name, caches in totals.items():
        rates = {cache: run["tokens"] / run["seconds"] for cache, run in caches.items()}
        same = sum(a == b for a, b in zip(caches["dynamic"]["token_ids"], caches["static"]["token_ids"]))
        print(
            f"| {name} | {rates['dynamic']:.2f} | {rates['static']:.2f} | {rates['static'] / rates['dynamic']:.2f} "
            f"| {same} of {len(caches['dynamic']['token_ids'])} |"
        )
    raw = {
        name: {c: {k: v for k, v in r.items() if k != "token_ids"} for c, r in cs.items()}
        for name, cs in totals.items()
    }
    print("\nraw:\n```json\n" + json.dumps(raw, indent=1) + "\n```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts (each interleaves all)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = SpeculativeDecoder.from_recipe(load_recipe("default", [f"generation.max_new_tokens={args.max_new_tokens}"]))
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    report(measure(base, prompts, args.rounds), args, len(prompts))


if __name__ == "__main__":
    main()
