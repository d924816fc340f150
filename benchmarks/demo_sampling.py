"""Which sampling settings make the offline default demo read well? Text and acceptance per setting.

Runs the default recipe (SmolLM2-135M-Instruct, chat template, speculative sampling) on the same
prompts and seeds under several sampling settings, changing them per call on the same loaded
models, and prints each setting's texts, block efficiency and acceptance as Markdown.

    python benchmarks/demo_sampling.py > benchmarks/results/demo_sampling.md
"""

from __future__ import annotations

import argparse
import sys

from specdec_cli import SpeculativeDecoder, load_recipe
from specdec_cli.results.provenance import provenance

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Answer briefly.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new language.",
]
SETTINGS = [
    {"temperature": 1.0, "top_p": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 0.5, "top_p": 0.9},
    {"temperature": 0.3, "top_p": 0.9},
    {"temperature": 0.0},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    decoder = SpeculativeDecoder.from_recipe(
        load_recipe("default", [f"generation.max_new_tokens={args.max_new_tokens}"])
    )
    print(f"# Sampling settings for the offline default demo\n\n`{' '.join(sys.argv)}`\n")
    print(f"Provenance: `{provenance(decoder.device)}`\n")
    for settings in SETTINGS:
        results = decoder.generate(PROMPTS, **settings)
        accepted = sum(r.stats.accepted_tokens for r in results) / max(sum(r.stats.drafted_tokens for r in results), 1)
        efficiency = sum(r.stats.new_tokens for r in results) / sum(r.stats.target_forwards for r in results)
        label = ", ".join(f"{k} {v:g}" for k, v in settings.items())
        print(f"## {label}\n\nacceptance {accepted:.3f}, block efficiency {efficiency:.2f}\n")
        for result in results:
            text = " ".join(result.text.split())
            print(f"- *{result.prompt}* → {text}")
        print()


if __name__ == "__main__":
    main()
