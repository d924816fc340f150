"""Several samples of one prompt in one batch: what sharing the prompt's read saves (engine/session.py, ``add``).

The samples of a prompt join a batch one after another; since commit bbcaa15 each model reads the prompt once
and the later samples copy that read, where before each sample ran its own prefill forward. This script times
``SpeculativeDecoder.generate(prompts, num_samples=N, batch_size=N)`` on the offline default recipe, in the
process of whichever tree ``PYTHONPATH`` names, and prints one JSON line: the tree's commit, the CPU, the median
and every repeat's seconds, and a digest of the samples' tokens (equal before and after: the numbers are the same).
Run it once per tree, alternating, in one session:

    git worktree add /tmp/wt-before 437e996 --detach
    for tree in /tmp/wt-before . /tmp/wt-before .; do
        (cd /tmp && PYTHONPATH=$(realpath $tree) python /work/main/benchmarks/shared_prompt_read.py) >> results.jsonl
    done
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

import specdec_cli
from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import load_recipe
from specdec_cli.results.provenance import cpu_model

GROUNDED = Path(__file__).resolve().parents[1] / "examples" / "grounded_prompts.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8, help="samples of each prompt, all in one batch")
    parser.add_argument("--prompts", type=int, default=2, help="grounded prompts, one after the other")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = GROUNDED.read_text().splitlines()[: args.prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    recipe = load_recipe(None, [f"generation.max_new_tokens={args.max_new_tokens}", "target.device=cpu"])
    decoder = SpeculativeDecoder.from_recipe(recipe)
    decoder.generate(prompts[:1], num_samples=2, batch_size=2)  # warm-up: first forwards, thread pools
    seconds, tokens = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        results = decoder.generate(prompts, num_samples=args.samples, batch_size=args.samples)
        seconds.append(time.perf_counter() - start)
        tokens = [result.token_ids for result in results]
    tree = Path(specdec_cli.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(
        json.dumps(
            {
                "tree": str(tree),
                "commit": commit.stdout.strip(),
                "cpu": cpu_model(),
                "threads": args.threads,
                "torch": torch.__version__,
                "prompts": args.prompts,
                "samples_per_prompt": args.samples,
                "prompt_tokens": [len(decoder.encode_prompt(prompt)) for prompt in prompts],
                "new_tokens": sum(len(row) for row in tokens),
                "seconds": [round(s, 3) for s in seconds],
                "median_s": round(statistics.median(seconds), 3),
                "tokens_digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            }
        )
    )


if __name__ == "__main__":
    main()
