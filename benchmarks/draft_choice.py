"""Which offline draft serves the default target best? Measures each candidate draft on the same prompts.

For each draft (early-exit depths, lower-precision copies of the target) it runs speculative
generation and reports block efficiency, acceptance rate, the draft/target cost ratio c and the
measured token rate next to the target-only baseline from the same run.

    python benchmarks/draft_choice.py --prompts 4 --max-new-tokens 48 > benchmarks/results/draft_choice.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import transformers

from specdec_cli import SpeculativeDecoder, load_recipe

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new language.",
    "What is the capital of France? Answer briefly and then describe the city.",
    "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system in order.",
]

EARLY_EXIT = "draft={early_exit: %d}"
CANDIDATES = {
    "early_exit 6": [EARLY_EXIT % 6],
    "early_exit 12": [EARLY_EXIT % 12],
    "early_exit 18": [EARLY_EXIT % 18],
    "early_exit 24": [EARLY_EXIT % 24],
    "bfloat16 copy": ["draft.dtype=bfloat16"],
    "float16 copy": ["draft.dtype=float16"],
}


def run(overrides: list[str], prompts: list[str], autoregressive: bool = False) -> dict:
    sampling = ["generation.temperature=1", "generation.top_p=1"]  # as measured (the demo default is T = 0.3)
    decoder = SpeculativeDecoder.from_recipe(
        load_recipe("default", sampling + overrides), autoregressive=autoregressive
    )
    decoder.generate(prompts[:1])  # warm-up, excluded
    results = decoder.generate(prompts)
    stats = [r.stats for r in results]
    tokens = sum(s.new_tokens for s in stats)
    target_forwards = sum(s.target_forwards for s in stats)
    draft_forwards = sum(s.draft_forwards for s in stats)
    return {
        "tokens": tokens,
        "block_efficiency": tokens / target_forwards,
        "acceptance_rate": sum(s.accepted_tokens for s in stats) / max(1, sum(s.drafted_tokens for s in stats)),
        "tokens_per_s": tokens / sum(s.wall_time_s for s in stats),
        "target_s_per_forward": sum(s.target_time_s for s in stats) / target_forwards,
        "draft_s_per_forward": sum(s.draft_time_s for s in stats) / draft_forwards if draft_forwards else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    prompts = PROMPTS[: args.prompts]
    common = [f"generation.max_new_tokens={args.max_new_tokens}", f"generation.temperature={args.temperature}"]
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"device: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}, transformers {transformers.__version__}; date {time.strftime('%Y-%m-%d')}\n"
    )
    baseline = run(common, prompts, autoregressive=True)
    print(
        f"target alone: {baseline['tokens_per_s']:.2f} tokens/s, "
        f"{1000 * baseline['target_s_per_forward']:.1f} ms per target forward\n"
    )
    print("| draft | block efficiency | acceptance rate | c = draft/target forward time | tokens/s | speedup |")
    print("|---|---|---|---|---|---|")
    raw = {"baseline": baseline}
    for name, overrides in CANDIDATES.items():
        measured = run(common + overrides, prompts)
        raw[name] = measured
        cost_ratio = measured["draft_s_per_forward"] / baseline["target_s_per_forward"]
        print(
            f"| {name} | {measured['block_efficiency']:.3f} | {measured['acceptance_rate']:.3f} | "
            f"{cost_ratio:.3f} | {measured['tokens_per_s']:.2f} | "
            f"{measured['tokens_per_s'] / baseline['tokens_per_s']:.3f} |",
            flush=True,
        )
    print("\nraw:\n```json\n" + json.dumps(raw, indent=1) + "\n```")


if __name__ == "__main__":
    main()
