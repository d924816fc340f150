"""Prompt lookup on input-grounded prompts: specdec against the target alone and transformers' own prompt lookup.

The offline default target (SmolLM2-135M-Instruct, float32) on the prompts of
``examples/grounded_prompts.jsonl`` (copy-edit, rewrite, extract and summarise a paragraph: output that
copies spans of its input), chat-templated, with the default recipe's sampling (T = 0.3, top-p 0.9).
Four configurations run side by side in one process on the very same model object, interleaved prompt
by prompt after one untimed warm-up each:

- specdec with ``--drafter prompt-lookup --verifier speculative`` (L tokens per block at most);
- transformers' ``generate(prompt_lookup_num_tokens=L, max_matching_ngram_size=M)``, sampling;
- each target alone.

Reported: tokens/s, tokens per target forward (transformers' counted with a forward hook), and the
ratios the issue asks for (specdec prompt lookup ÷ specdec target alone, ÷ transformers' prompt lookup).

    python benchmarks/prompt_lookup_speed.py > benchmarks/results/prompt_lookup_speed_cpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import transformers

from specdec_cli import SpeculativeDecoder, load_recipe
from specdec_cli.base.recipe import DraftConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_vs_hf import cpu_name  # noqa: E402
from vs_hf_assisted import ForwardCounter, print_table, rate_ratio, run_interleaved, run_specdec  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "grounded_prompts.jsonl"


def report(totals: dict, args: argparse.Namespace, prompts: int, generation) -> None:
    """The run's conditions, the table, the two ratios and the raw figures, as committed under results/."""
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"device: cpu ({cpu_name()}, {torch.get_num_threads()} threads); torch {torch.__version__}, "
        f"transformers {transformers.__version__}; date {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{prompts} chat prompts from examples/grounded_prompts.jsonl × {args.rounds} rounds, max_new_tokens "
        f"{args.max_new_tokens}, T = {generation.temperature}, top-p {generation.top_p}; L = {args.draft_length}, "
        f"n-grams up to {args.max_ngram}; float32 target\n"
    )
    print_table(totals)
    print(
        f"\nspecdec prompt lookup ÷ specdec target alone, tokens/s: "
        f"{rate_ratio(totals, 'specdec prompt lookup', 'specdec target alone'):.2f}"
    )
    print(
        f"specdec prompt lookup ÷ transformers prompt lookup, tokens/s: "
        f"{rate_ratio(totals, 'specdec prompt lookup', 'transformers prompt lookup'):.2f}"
    )
    print("\nraw:\n```json\n" + json.dumps(totals, indent=1) + "\n```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--draft-length", type=int, default=8, help="L: specdec's draft length, transformers' num tokens"
    )
    parser.add_argument("--max-ngram", type=int, default=3, help="longest n-gram matched, on both sides")
    parser.add_argument(
        "--rounds", type=int, default=2, help="Passes over the prompts (each interleaves all configurations)."
    )
    args = parser.parse_args()
    recipe = load_recipe(
        "default", [f"generation.max_new_tokens={args.max_new_tokens}", f"speculation.draft_length={args.draft_length}"]
    )
    lookup_entry = DraftConfig(drafter="prompt-lookup", params={"max_ngram": args.max_ngram})
    recipe = dataclasses.replace(recipe, drafts=(lookup_entry,))  # what --drafter prompt-lookup does, with max_ngram
    lookup = SpeculativeDecoder.from_recipe(recipe)
    alone = lookup.with_config(verifier="none")
    target = lookup.target.model
    counter = ForwardCounter(target)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    encoded = [lookup.encode_prompt(prompt) for prompt in prompts]
    generation = recipe.generation

    def run_hf(lookup_tokens, ids, seed):
        torch.manual_seed(seed)
        before = counter.calls
        extra = (
            {"prompt_lookup_num_tokens": lookup_tokens, "max_matching_ngram_size": args.max_ngram}
            if lookup_tokens
            else {}
        )
        output = target.generate(
            torch.tensor([ids]),
            max_new_tokens=args.max_new_tokens,
            do_sample=True,
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=0,
            pad_token_id=target.generation_config.eos_token_id,
            **extra,
        )
        return output.shape[1] - len(ids), counter.calls - before, None

    configs = {
        "specdec prompt lookup": lambda ids, seed: run_specdec(lookup, ids, seed),
        "transformers prompt lookup": lambda ids, seed: run_hf(args.draft_length, ids, seed),
        "specdec target alone": lambda ids, seed: run_specdec(alone, ids, seed),
        "transformers target alone": lambda ids, seed: run_hf(0, ids, seed),
    }
    report(run_interleaved(configs, encoded, args.rounds), args, len(prompts), generation)


if __name__ == "__main__":
    main()
