"""Whether a sample's tokens depend on its batch, on the offline default pair: the same prompts decoded at batch 1
and at ``--batch-size``, with the draft in each dtype given, counting the samples whose tokens are identical.

Keyed randomness makes a sample's draws its own, so tokens differ only where the laws round differently in a
batched forward; a bfloat16 draft rounds at 8 bits of mantissa, a float32 one at 24.

    python benchmarks/batch_invariance.py --prompts benchmarks/results/bench_batch_cpu/samples.jsonl --threads 2
"""

from __future__ import annotations

import argparse
import json

import torch

from specdec_cli import SpeculativeDecoder, load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help="a bench samples.jsonl: the prompts of its first cell")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the draft's dtypes to try")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    records = [json.loads(line) for line in open(args.prompts)]
    prompts = [record["prompt"] for record in records if record["cell"] == records[0]["cell"]]
    print(f"| draft dtype | samples identical at batch 1 and {args.batch_size} | first differing positions |")
    print("|---|---|---|")
    for dtype in args.dtypes.split(","):
        settings = [f"generation.max_new_tokens={args.max_new_tokens}", f"draft.dtype={dtype}"]
        decoder = SpeculativeDecoder.from_recipe(load_recipe("default", settings))
        alone, batched = decoder.generate(prompts), decoder.generate(prompts, batch_size=args.batch_size)
        firsts = sorted(
            next(i for i, (a, b) in enumerate(zip(one.token_ids, many.token_ids)) if a != b)
            for one, many in zip(alone, batched)
            if one.token_ids != many.token_ids
        )
        same = sum(one.token_ids == many.token_ids for one, many in zip(alone, batched))
        print(f"| {dtype} | {same} / {len(prompts)} | {', '.join(map(str, firsts)) or '—'} |")


if __name__ == "__main__":
    main()
