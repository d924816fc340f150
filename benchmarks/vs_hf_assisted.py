"""End to end on the offline default pair: specdec against transformers' assisted generation, side by side.

Both use the very same model objects: the float32 SmolLM2-135M-Instruct target and its bfloat16
copy as the draft (the shipped default recipe), the same chat-templated prompts, temperature 1 over the
full vocabulary (no top-k, no top-p), γ = L = 4 draft tokens, and the same max_new_tokens; and
both targets alone as baselines. Configurations are interleaved prompt by prompt, after one
warm-up generation each. Reported: tokens/s, tokens per target forward (target forwards counted
with a forward hook for transformers), and specdec's engine overhead (share of wall time outside
the models' forward calls).

    python benchmarks/vs_hf_assisted.py > benchmarks/results/vs_hf_assisted_cpu.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from specdec_cli import SpeculativeDecoder, load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_vs_hf import cpu_name  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.txt"


class ForwardCounter:
    """Counts a model's forward calls (one per target step in transformers' assisted generation)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_hook(self.hook)

    def hook(self, *_):
        self.calls += 1


def hf_generate(model, input_ids, max_new_tokens: int, assistant=None) -> int:
    """New tokens from transformers' generate (assisted when ``assistant`` is given), T = 1, full vocabulary."""
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    extra = {}
    if assistant is not None:
        assistant.generation_config.update(
            num_assistant_tokens=4,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
            **sampling,
        )
        extra["assistant_model"] = assistant
    output = model.generate(
        input_ids, max_new_tokens=max_new_tokens, pad_token_id=model.generation_config.eos_token_id, **sampling, **extra
    )
    return output.shape[1] - input_ids.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=2, help="Passes over the prompts (each interleaves all configurations)."
    )
    args = parser.parse_args()
    recipe = load_recipe(
        "default",
        [f"generation.max_new_tokens={args.max_new_tokens}", "generation.temperature=1", "generation.top_p=1"],
    )  # as measured (the demo default is T = 0.3)
    speculative = SpeculativeDecoder.from_recipe(recipe)
    target = speculative.target
    alone = speculative.with_config(verifier="none")
    draft = speculative.drafts[0].model.model
    counter = ForwardCounter(target.model)
    prompts = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()][: args.prompts]
    encoded = [speculative.encode_prompt(p) for p in prompts]

    def run_hf(assistant, ids, seed):
        torch.manual_seed(seed)
        before = counter.calls
        new = hf_generate(target.model, torch.tensor([ids]), args.max_new_tokens, assistant)
        return new, counter.calls - before, None

    configs = {
        "specdec speculative": lambda ids, seed: run_specdec(speculative, ids, seed),
        "transformers assisted": lambda ids, seed: run_hf(draft, ids, seed),
        "specdec target alone": lambda ids, seed: run_specdec(alone, ids, seed),
        "transformers target alone": lambda ids, seed: run_hf(None, ids, seed),
    }
    totals = run_interleaved(configs, encoded, args.rounds)
    report(totals, len(prompts), args)


def run_specdec(decoder: SpeculativeDecoder, ids: list[int], seed: int) -> tuple[int, int, float]:
    """One specdec generation as a configuration of :func:`run_interleaved` counts it."""
    _, _, stats = decoder.generate_ids(ids, seed)
    return stats.new_tokens, stats.target_forwards, stats.forward_time_s


def run_interleaved(configs: dict, encoded: list[list[int]], rounds: int) -> dict:
    """Every configuration on every prompt, ``rounds`` times, in alternating order prompt by prompt, after one
    untimed warm-up each → name → totals (tokens, target forwards, seconds, forward seconds, per-prompt rates).
    A configuration is ``(ids, seed) -> (new tokens, target forwards, forward seconds or None)``."""
    totals = {name: {"tokens": 0, "forwards": 0, "seconds": 0.0, "forward_s": 0.0, "rates": []} for name in configs}
    with torch.inference_mode():
        for run in configs.values():
            run(encoded[0], 12345)  # warm-up, excluded
        for round_index in range(rounds):
            for index, ids in enumerate(encoded):
                names = list(configs) if (round_index + index) % 2 == 0 else list(reversed(configs))
                for name in names:
                    start = time.perf_counter()
                    tokens, forwards, forward_s = configs[name](ids, 1000 * round_index + index)
                    seconds = time.perf_counter() - start
                    total = totals[name]
                    total["tokens"] += tokens
                    total["forwards"] += forwards
                    total["seconds"] += seconds
                    total["forward_s"] += forward_s or 0.0
                    total["rates"].append(tokens / seconds)
    return totals


def print_table(totals: dict) -> None:
    """One row per configuration (engine overhead for specdec's)."""
    print(
        "| configuration | tokens | tokens/s | median tokens/s per prompt | tokens per target forward "
        "| engine overhead |"
    )
    print("|---|---|---|---|---|---|")
    for name, total in totals.items():
        overhead = f"{1 - total['forward_s'] / total['seconds']:.3f}" if name.startswith("specdec") else "—"
        print(
            f"| {name} | {total['tokens']} | {total['tokens'] / total['seconds']:.2f} | "
            f"{statistics.median(total['rates']):.2f} | {total['tokens'] / total['forwards']:.2f} | {overhead} |"
        )


def rate_ratio(totals: dict, first: str, second: str) -> float:
    """Tokens/s of configuration ``first`` over ``second``."""
    return (totals[first]["tokens"] / totals[first]["seconds"]) / (totals[second]["tokens"] / totals[second]["seconds"])


def report(totals: dict, num_prompts: int, args: argparse.Namespace) -> None:
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"device: cpu ({cpu_name()}, {torch.get_num_threads()} threads); torch {torch.__version__}, "
        f"transformers {transformers.__version__}; date {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{num_prompts} chat prompts from examples/prompts.txt × {args.rounds} rounds, max_new_tokens "
        f"{args.max_new_tokens}, temperature 1, full vocabulary, L = γ = 4; float32 target, bfloat16 draft\n"
    )
    print_table(totals)
    ratio = rate_ratio(totals, "specdec speculative", "transformers assisted")
    print(f"\nspecdec speculative ÷ transformers assisted, tokens/s: {ratio:.2f}")
    print("\nraw:\n```json\n" + json.dumps(totals, indent=1) + "\n```")


if __name__ == "__main__":
    main()
