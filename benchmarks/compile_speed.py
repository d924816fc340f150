"""Time one block's ``verify_block`` eager against ``torch.compile(fullgraph=True)`` (inductor), compile time apart.

Every built-in at V = 128256, L = 8 and K = 1, 2, 4 (as many as each takes), on verifier_speed.py's
laws with the block's keyed draws, in one process: the eager medians first (on the path a verifier
takes on this device, where a CPU path may read to skip work, and on the path it takes on a GPU,
the one compiled), then the first compiled call (tracing, inductor's code generation and one run:
the compile time), one more compiled call as the warm-up, and the compiled median. On a GPU the same again
with ``mode="reduce-overhead"``: torch.compile's own CUDA graphs around inductor's code (the engine's
``--compile`` captures the eager kernels instead, :mod:`specdec_cli.engine.graphs`: verifier_speed.py times
that). The time of a run includes the engine's read of the decision. A verifier whose ``verify_block``
does not trace into one graph is listed with the reason dynamo or inductor gave, instead of timed.

    python benchmarks/compile_speed.py --repeats 15 --threads 1 > benchmarks/results/compile_speed_cpu.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from specdec_cli import load_verifier
from specdec_cli.plugins.verifiers import device_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from verifier_speed import (  # noqa: E402
    VERIFIERS,
    benchmark_arguments,
    block_randomness,
    count_verification,
    median_seconds,
    start_report,
    time_verification,
    verifier_laws,
)


def compile_and_time(
    verifier, laws, randomness, device: str, repeats: int, mode: str | None = None
) -> tuple[float, float]:
    """(seconds of the first compiled call, median seconds of the compiled call); raises where it cannot compile.

    ``mode="reduce-overhead"`` also captures the compiled block in a CUDA graph: each call is one replay."""
    torch._dynamo.reset()  # a fresh cache: each verifier's compile is timed whole, not reused or over the limit
    compiled = torch.compile(verifier.verify_block, fullgraph=True, mode=mode)
    start = time.perf_counter()
    compiled(*laws, randomness).tokens.tolist()
    compile_seconds = time.perf_counter() - start
    return compile_seconds, median_seconds(lambda: lambda: compiled(*laws, randomness), device, repeats)


def why_not_compiled(error: Exception) -> str:
    """The error's first line, and the innermost line of this project's code in dynamo's "from user code" stack."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    where = [line for line in lines if line.startswith(f'File "{ROOT}/')]
    located = f" (at {where[-1].replace(str(ROOT) + '/', '')})" if where else ""
    return f"{type(error).__name__}: {lines[0] if lines else ''}{located}"


def main() -> None:
    parser = benchmark_arguments(__doc__.splitlines()[0], repeats=15)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--draft-length", type=int, default=8)
    parser.add_argument("--drafts", default="1,2,4", help="comma list of K")
    args = parser.parse_args()
    conditions = f"V = {args.vocab}, L = {args.draft_length}; median of {args.repeats} after one warm-up run"
    start_report(args.threads, args.device, "", conditions)
    graphs = args.device.startswith("cuda")
    print(
        "| verifier | K | ops per block | eager ms | eager ms, GPU path | compiled ms | compiled ÷ eager | compile s |"
        + (" reduce-overhead ms | reduce-overhead ÷ eager | capture s |" if graphs else "")
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if graphs else ""))
    failures = []
    for name in args.verifiers.split(","):
        params = VERIFIERS[name]
        for num_drafts in [int(k) for k in args.drafts.split(",")]:
            if num_drafts > (load_verifier(name, params).max_drafts or num_drafts):
                continue
            laws = verifier_laws(name, args.vocab, num_drafts, args.draft_length, args.device)
            count = count_verification(name, params, laws, args.device)
            eager = time_verification(name, params, laws, args.device, args.repeats)
            with device_path():
                eager_gpu_path = time_verification(name, params, laws, args.device, args.repeats)
            verifier = load_verifier(name, params)  # one instance for every compiled call: its graph is bound to it
            randomness = block_randomness(verifier, args.device)
            try:
                compile_seconds, compiled = compile_and_time(verifier, laws, randomness, args.device, args.repeats)
            except Exception as error:  # any failure to compile is a result to report, not a crash
                failures.append(
                    f"- {name}, K = {num_drafts} ({count.ops} ops, eager {1000 * eager:.2f} ms): "
                    f"{why_not_compiled(error)}"
                )
                continue
            row = (
                f"| {name} | {num_drafts} | {count.ops} | {1000 * eager:.2f} | {1000 * eager_gpu_path:.2f} | "
                f"{1000 * compiled:.2f} | {compiled / eager:.2f} | {compile_seconds:.1f} |"
            )
            if graphs:
                capture_seconds, replayed = compile_and_time(
                    verifier, laws, randomness, args.device, args.repeats, mode="reduce-overhead"
                )
                row += f" {1000 * replayed:.2f} | {replayed / eager:.2f} | {capture_seconds:.1f} |"
            print(row, flush=True)
    if failures:
        print("\nnot compiled (`fullgraph=True` refused the trace, or inductor failed):\n")
        print("\n".join(failures))


if __name__ == "__main__":
    main()
