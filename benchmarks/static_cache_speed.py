"""The static KV cache and the compiled steps beside the dynamic cache, on the offline default pair, in one process.

The default recipe's SmolLM2-135M-Instruct target and draft (float32 on the CPU), the chat prompts of
``examples/grounded_prompts.jsonl``, each configuration decoded in each mode through the same model objects
(``with_config``): the dynamic cache, ``speculation.static_cache``, and ``speculation.compile`` (the static cache
with compiled model steps, laws and verify step), interleaved round by round after an untimed warm-up (over every
prompt for the compiled mode, so that its timed rounds meet no new step shape, and one prompt for the others): the
target alone and speculative sampling, at batch sizes 1 and 4. Reported: tokens/s of each mode, its ratio to the
dynamic cache's, and how many samples have the dynamic cache's tokens (the same keyed randomness; they may differ
only by float rounding).

    python benchmarks/static_cache_speed.py --threads 2 > benchmarks/results/static_cache_speed_cpu.md
    python benchmarks/static_cache_speed.py --threads 2 --modes dynamic static compiled --batch-sizes 1 \
        > benchmarks/results/compiled_steps_speed_cpu.md
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
CONFIGURATIONS = [("target alone", "none"), ("speculative", "speculative")]
MODES = {"dynamic": {}, "static": {"static_cache": True}, "compiled": {"compile": True}}
"""Each mode's decoding settings (``compile`` turns the static cache on)."""


def timed(decoder: SpeculativeDecoder, prompts: list[str], batch_size: int) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    results = decoder.generate(prompts, batch_size=batch_size)
    return time.perf_counter() - began, [result.token_ids for result in results]


def measure(base: SpeculativeDecoder, prompts: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Every configuration in every mode, interleaved: seconds, tokens and token ids per mode."""
    decoders = {
        (label, size, mode): base.with_config(verifier=verifier, **MODES[mode])
        for label, verifier in CONFIGURATIONS
        for size in args.batch_sizes
        for mode in args.modes
    }
    for (_, size, mode), decoder in decoders.items():
        timed(decoder, prompts if mode == "compiled" else prompts[:1], size)  # untimed warm-up
    totals: dict[str, dict] = {}
    for _ in range(args.rounds):
        for (label, size, mode), decoder in decoders.items():
            seconds, tokens = timed(decoder, prompts, size)
            entry = totals.setdefault(f"{label}, B = {size}", {}).setdefault(mode, {})
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
    others = [mode for mode in args.modes if mode != "dynamic"]
    columns = [f"tokens/s {mode}" for mode in args.modes]
    columns += [f"{mode} ÷ dynamic" for mode in others] + [f"same tokens {mode}" for mode in others]
    print("| configuration | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, modes in totals.items():
        rates = {mode: run["tokens"] / run["seconds"] for mode, run in modes.items()}
        reference = modes["dynamic"]["token_ids"]
        cells = [f"{rates[mode]:.2f}" for mode in args.modes]
        cells += [f"{rates[mode] / rates['dynamic']:.2f}" for mode in others]
        cells += [
            f"{sum(a == b for a, b in zip(reference, modes[mode]['token_ids']))} of {len(reference)}" for mode in others
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
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
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="dynamic comes first")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = SpeculativeDecoder.from_recipe(load_recipe("default", [f"generation.max_new_tokens={args.max_new_tokens}"]))
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    args.modes = ["dynamic", *(mode for mode in args.modes if mode != "dynamic")]  # the reference of the ratios
    report(measure(base, prompts, args), args, len(prompts))


if __name__ == "__main__":
    main()
