"""What a forward costs as the batch grows, for the offline default's target and draft: the ceiling of what
batched decoding can gain on this device.

For rows in (1, 8) and new tokens in (1, 5), after a KV cache of ``--context`` tokens per row, the median
of ``--repeats`` forwards, each with the batch engine's additive 4D mask and per-row positions and, beside
it, without (transformers' own causal path; every row the same length). A device where 8 rows cost about
what 1 does is memory-bound and gains up to 8× from batching; a compute-bound one gains the ratio printed.

    python benchmarks/batch_forward_cost.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec_cli import load_recipe
from specdec_cli.engine.session import cache_argument
from specdec_cli.models.pool import ModelPool
from specdec_cli.plugins.drafter_registry import DrafterRegistry


def median_ms(step, repeats: int) -> float:
    step()  # untimed: the first call allocates
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def forward_costs(model, rows: int, new: int, context: int, repeats: int) -> tuple[float, float]:
    """(ms without a mask, ms with the batch engine's mask) of a forward of ``new`` tokens per row."""
    dtype = model.dtype
    name = cache_argument(model)
    cache = getattr(model(input_ids=torch.randint(100, 1000, (rows, context)), use_cache=True), name)
    tokens = torch.randint(100, 1000, (rows, new))  # [rows, new]
    columns = torch.arange(context + new)  # [context + new]
    seen = columns <= context + columns[:new].view(new, 1)  # [new, context + new]
    mask = torch.zeros(rows, 1, new, context + new, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    positions = (context + torch.arange(new)).expand(rows, -1)  # [rows, new]

    def plain():
        model(input_ids=tokens, use_cache=True, **{name: cache})
        cache.crop(-new)

    def masked():
        model(input_ids=tokens, use_cache=True, attention_mask=mask, position_ids=positions, **{name: cache})
        cache.crop(-new)

    return median_ms(plain, repeats), median_ms(masked, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = load_recipe("default", [])
    pool = ModelPool()
    target = pool.target(recipe.target)
    draft = pool.drafts(recipe.drafts, target, DrafterRegistry())[0].model
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, context {args.context} tokens per row\n")
    print("| model | rows × new tokens | no mask (ms) | batch mask (ms) | cost per token vs 1 × 1 |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name, loaded in ((f"target ({target.model.dtype})", target), (f"draft ({draft.model.dtype})", draft)):
            single = None
            for rows, new in ((1, 1), (1, 5), (8, 1), (8, 5)):
                plain, masked = forward_costs(loaded.model, rows, new, args.context, args.repeats)
                single = single or masked
                per_token = masked / single / (rows * new)
                print(f"| {name} | {rows} × {new} | {plain:.1f} | {masked:.1f} | {per_token:.2f} |")


if __name__ == "__main__":
    main()
