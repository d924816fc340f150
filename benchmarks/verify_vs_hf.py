"""One block's verification, from logits to committed tokens: specdec against transformers, side by side.

transformers' ``_speculative_sampling`` (what assisted generation calls with ``do_sample=True``)
takes the draft's and the target's logits of one block and returns the committed tokens. specdec's
equivalent is the target's sampling law, the verifier's ``verify_block`` and the engine's one read
of the decision. The draft's law is computed while drafting in specdec (the draft samples from
it), so it is timed separately: "specdec + draft law" adds it, for exactly the same inputs as
transformers'. Both run in this process on the same tensors, interleaved, median of the repeats.
specdec's verifiers take the keyed draws the engine hands them. On a GPU one more column replays
specdec's whole step, target law included, from one CUDA graph (no launch per operation; ``--compile``
captures the verify step alone and runs the law compiled, without a graph).

    python benchmarks/verify_vs_hf.py > benchmarks/results/verify_vs_hf_cpu.md
    python benchmarks/verify_vs_hf.py --device cuda > benchmarks/results/verify_vs_hf_cuda.md
"""

from __future__ import annotations

import argparse
import inspect
import platform
import statistics
import sys
import time

import torch
import transformers
from transformers.generation.utils import _speculative_sampling

from specdec_cli import load_verifier
from specdec_cli.base.randomness import Draws
from specdec_cli.base.sampling import SamplingParams, sampling_law
from specdec_cli.engine.device_path import capture_cuda_graph

PARAMS = SamplingParams(temperature=1.0)
# Older transformers (before 5.2x) also ask whether the last candidate is an end of sequence: it is not.
HF_EXTRA = (
    {"is_done_candidate": False} if "is_done_candidate" in inspect.signature(_speculative_sampling).parameters else {}
)


def block_inputs(vocab: int, draft_length: int, generator: torch.Generator):
    """Logits of one block: a draft close to the target, as real drafts are (long accepted prefixes)."""
    target_logits = torch.randn(1, draft_length + 1, vocab, generator=generator) * 3  # [1, L+1, V]
    draft_logits = target_logits[:, :draft_length] + torch.randn(
        1, draft_length, vocab, generator=generator
    )  # [1, L, V]
    draft_tokens = torch.multinomial(draft_logits[0].softmax(-1), 1, generator=generator).T  # [1, L]
    prompt = torch.randint(0, vocab, (1, 32), generator=generator)  # [1, 32]
    return target_logits, draft_logits, draft_tokens, torch.cat([prompt, draft_tokens], dim=1)


def specdec_step(verifier, target_logits, draft_probs, draft_tokens, draws) -> torch.Tensor:
    """The engine's block from the target's logits: its law, the verification, the decision packed for one read."""
    target_probs, finite = sampling_law(target_logits, PARAMS)  # [1, L+1, V], [1, L+1]
    decision = verifier.verify_block(target_probs, draft_probs, draft_tokens, draws)
    return torch.cat([decision.tokens, decision.num_accepted.view(1), finite.all().long().view(1)])  # [L+3]


def specdec_block(verifier, target_logits, draft_probs, draft_tokens, draws) -> list[int]:
    return specdec_step(verifier, target_logits, draft_probs, draft_tokens, draws).tolist()  # the engine's one read


def time_once(function, device: str) -> float:
    start = time.perf_counter()
    function()
    if device.startswith("cuda"):  # transformers' function may return before the GPU is done
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(vocab: int, draft_length: int, repeats: int, device: str) -> dict[str, float]:
    generator = torch.Generator().manual_seed(vocab + draft_length)
    draws = Draws.create(1, device=device)  # keyed, as the engine hands them
    torch.manual_seed(1)  # transformers draws from the global generator
    inputs = block_inputs(vocab, draft_length, generator)
    target_logits, draft_logits, draft_tokens, candidate_ids = (tensor.to(device) for tensor in inputs)
    draft_probs, _ = sampling_law(draft_logits, PARAMS)
    verifiers = {name: load_verifier(name) for name in ("speculative", "block")}
    runs = {
        "transformers": lambda: _speculative_sampling(
            candidate_ids, draft_logits, draft_length, target_logits, **HF_EXTRA
        ),
        "specdec speculative": lambda: specdec_block(
            verifiers["speculative"], target_logits, draft_probs, draft_tokens, draws
        ),
        "specdec speculative + draft law": lambda: specdec_block(
            verifiers["speculative"], target_logits, sampling_law(draft_logits, PARAMS)[0], draft_tokens, draws
        ),
        "specdec block": lambda: specdec_block(verifiers["block"], target_logits, draft_probs, draft_tokens, draws),
    }
    if device.startswith("cuda"):  # the same step replayed from one CUDA graph: its launches are the cost
        replay, packed = capture_cuda_graph(
            lambda: specdec_step(verifiers["speculative"], target_logits, draft_probs, draft_tokens, draws)
        )
        runs["specdec speculative, CUDA graph"] = lambda: (replay(), packed.tolist())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        order = list(runs) if repeat % 2 else list(reversed(runs))  # interleaved, alternating order
        for name in order:
            seconds = time_once(runs[name], device)
            if repeat:  # the first round warms up
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model and thread count."""
    if device.startswith("cuda"):
        return f"cuda ({torch.cuda.get_device_name(device)}; host CPU {cpu_name()})"
    return f"cpu ({cpu_name()}, {torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--vocab", default="32000,49152,128256")
    parser.add_argument("--draft-length", default="4,8")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"device: {device_name(args.device)}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; date {time.strftime('%Y-%m-%d')}; "
        f"median of {args.repeats} interleaved repeats; temperature 1, K = 1\n"
    )
    graphs = args.device.startswith("cuda")
    print(
        "| V | L | transformers ms | specdec speculative ms | ÷ transformers | + draft law ms | ÷ transformers "
        "| specdec block ms | ÷ transformers |" + (" speculative, CUDA graph ms | ÷ transformers |" if graphs else "")
    )
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if graphs else ""))
    for vocab in [int(v) for v in args.vocab.split(",")]:
        for draft_length in [int(v) for v in args.draft_length.split(",")]:
            t = measure(vocab, draft_length, args.repeats, args.device)
            hf = t["transformers"]
            cells = [t["specdec speculative"], t["specdec speculative + draft law"], t["specdec block"]]
            cells += [t["specdec speculative, CUDA graph"]] if graphs else []
            print(
                f"| {vocab} | {draft_length} | {1000 * hf:.3f} | "
                + " | ".join(f"{1000 * c:.3f} | {c / hf:.2f}" for c in cells)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
