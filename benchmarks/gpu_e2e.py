"""End to end on a GPU: specdec eager and ``--compile`` beside transformers, on the same model objects, in one process.

Random weights from the real configurations (:mod:`model_shapes`: a Llama-3.1-8B-shaped target, a Llama-3.2-1B-shaped
draft), bfloat16, temperature 1 over the full vocabulary, L = 4, prompts of random ids. Configurations run in the
order below, most telling first, each after one untimed warm-up (which pays its compilation and CUDA graphs); the
run stops starting new ones past ``--budget-s``, and every finished one is already a line of ``--out`` (JSON lines),
so a slot that ends early still returns what it measured.

Per run: tokens/s (all sequences' new tokens over the wall time of the batch, synchronised at its end), tokens per
target forward, and from specdec's region timers the draft step (forward, law and draw), the target step, the verify
step per block and the engine's own share of the wall time. The floor is one read of the weights at the card's
memory bandwidth. Random weights make acceptance low (≈1.6 tokens per target forward for lossless verifiers at
L = 4); timing does not depend on the weights' values.

    python benchmarks/gpu_e2e.py --out results.jsonl --budget-s 420
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import DecodingConfig
from specdec_cli.engine.decoder import DecodingRun, SequenceJob
from specdec_cli.engine.decoding import Draft
from specdec_cli.models.loading import LoadedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import random_model  # noqa: E402

MENTORED = {"verifier": "mentored", "verifier_params": {"kl": 0.5}}
STATIC_CACHE = {"cache_implementation": "static"}
"""transformers' ``generate`` with its static cache, which it compiles on a GPU."""
BANDWIDTH_TB_S = {"H200": 4.8, "H100": 3.35}
"""Peak memory bandwidth of the cards this runs on (NVIDIA's data sheets), for the floor."""


class _Ids:
    """The tokenizer the engine needs for ids with no text: its size, and a decode for the result's text."""

    def __init__(self, size: int) -> None:
        self.size, self.eos_token_id, self.chat_template = size, None, None

    def __len__(self) -> int:
        return self.size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def _loaded(shape: str, device: str, dtype: torch.dtype) -> LoadedModel:
    model = random_model(shape, device, dtype)
    model.generation_config.eos_token_id = None  # every run writes its whole length
    return LoadedModel(model, _Ids(model.config.vocab_size), shape, False)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _synchronised_seconds(run: Callable[[], object]) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    value = run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - began, value


def specdec_run(decoder: SpeculativeDecoder, prompts: list[list[int]], batch: int) -> dict:
    """One timed pass of ``decoder`` over ``prompts`` (``batch`` at a time) after an untimed warm-up of one batch."""
    jobs = [SequenceJob("", index, 0, ids) for index, ids in enumerate(prompts)]
    # Warm-up, untimed: a compiled decoder's over every job, so that every step shape the timed pass meets (a short
    # last block, fewer rows as sequences end) has compiled and recorded its CUDA graph; an eager one's over one batch.
    list(DecodingRun(decoder, batch).run(jobs if decoder.config.speculation.compile else jobs[:batch]))
    seconds, results = _synchronised_seconds(lambda: list(DecodingRun(decoder, batch).run(jobs)))
    stats = [result.stats for result in results]
    tokens, target_forwards = sum(s.new_tokens for s in stats), sum(s.target_forwards for s in stats)
    per = {
        "draft_step_ms": _per(stats, "draft_time_s", "draft_forwards"),
        "target_step_ms": _per(stats, "target_time_s", "target_forwards"),
        "verify_block_ms": _per(stats, "verify_time_s", "blocks"),
    }
    models = sum(s.draft_time_s + s.target_time_s + s.verify_time_s for s in stats)
    wall = sum(s.wall_time_s for s in stats)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "tokens_per_target_forward": round(tokens / max(target_forwards, 1), 3),
        **per,
        "engine_share": round(1 - models / wall, 3) if wall else None,
        "notes": decoder.cache_notes,
    }


def _per(stats, seconds: str, count: str) -> float | None:
    total = sum(getattr(s, count) for s in stats)
    return round(1000 * sum(getattr(s, seconds) for s in stats) / total, 3) if total else None


def hf_run(model, prompts: list[list[int]], batch: int, new_tokens: int, **extra) -> dict:
    """transformers' ``generate`` over ``prompts`` (equal lengths, ``batch`` at a time), after one untimed batch."""
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": 0}
    batches = [torch.tensor(prompts[i : i + batch], device=model.device) for i in range(0, len(prompts), batch)]

    def generate(ids: torch.Tensor) -> int:
        output = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **sampling, **extra)
        return (output.shape[1] - ids.shape[1]) * ids.shape[0]

    generate(batches[0])
    seconds, tokens = _synchronised_seconds(lambda: sum(generate(ids) for ids in batches))
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}


def configurations(target: LoadedModel, draft: LoadedModel, args) -> list[tuple[str, Callable[[], dict]]]:
    """(label, run) in the order they are measured: the issue's targets first, the wide grid last."""
    config = DecodingConfig().replace(
        max_new_tokens=args.new_tokens, temperature=1.0, top_k=0, top_p=1.0, draft_length=args.draft_length
    )
    alone = SpeculativeDecoder(target, [], config)
    speculative = SpeculativeDecoder(target, [Draft(draft)], config.replace(verifier="speculative"))
    prompts = _prompts(target.model.config.vocab_size, args.prompt_tokens, max(args.batches) * 2)
    few = prompts[: args.prompts]
    hf = target.model

    def spec(decoder, batch=1, **changes):
        return lambda: specdec_run(decoder.with_config(**changes), few if batch == 1 else prompts[: 2 * batch], batch)

    assistant = {"assistant_model": draft.model, "num_assistant_tokens": args.draft_length}
    assistant |= {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    runs = [
        ("transformers eager, B=1", lambda: hf_run(hf, few, 1, args.new_tokens)),
        ("specdec target alone eager, B=1", spec(alone)),
        ("specdec target alone --compile, B=1", spec(alone, compile=True)),
        ("specdec speculative --compile, B=1", spec(speculative, compile=True)),
        ("specdec mentored kl 0.5 --compile, B=1", spec(speculative, compile=True, **MENTORED)),
        ("transformers static cache compiled, B=1", lambda: hf_run(hf, few, 1, args.new_tokens, **STATIC_CACHE)),
        ("specdec speculative eager, B=1", spec(speculative)),
        ("transformers assisted L constant, B=1", lambda: hf_run(hf, few, 1, args.new_tokens, **assistant)),
        ("specdec specinfer K=2 --compile, B=1", spec(speculative, compile=True, verifier="specinfer", num_drafts=2)),
    ]
    for batch in args.batches[1:]:
        runs += [
            (f"specdec target alone --compile, B={batch}", spec(alone, batch, compile=True)),
            (f"specdec speculative --compile, B={batch}", spec(speculative, batch, compile=True)),
            (f"transformers eager, B={batch}", lambda b=batch: hf_run(hf, prompts[: 2 * b], b, args.new_tokens)),
            (f"specdec target alone eager, B={batch}", spec(alone, batch)),
            (f"specdec speculative eager, B={batch}", spec(speculative, batch)),
        ]
    return runs


def _prompts(vocab: int, length: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (count, length), generator=generator).tolist()


def header(target: LoadedModel, draft: LoadedModel, args) -> dict:
    name = torch.cuda.get_device_name() if target.device.type == "cuda" else platform.processor() or "cpu"
    bandwidth = next((tb for card, tb in BANDWIDTH_TB_S.items() if card in name), None)
    floors = {
        role: round(_weight_bytes(model.model) / (bandwidth * 1e12) * 1000, 3) if bandwidth else None
        for role, model in (("target", target), ("draft", draft))
    }
    return {
        "device": name,
        "host_cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv),
        "bandwidth_tb_s": bandwidth,
        "weight_read_floor_ms": floors,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="llama-3.1-8b")
    parser.add_argument("--draft", default="llama-3.2-1b")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--device", default="cuda", help="cpu: a smoke check of this script (tiny shapes).")
    parser.add_argument("--budget-s", type=float, default=420.0, help="Start no configuration after this long.")
    parser.add_argument("--only", help="Run only the configurations whose label contains this.")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines: the header, then one line per run.")
    args = parser.parse_args()
    began = time.perf_counter()
    target, draft = (_loaded(shape, args.device, torch.bfloat16) for shape in (args.target, args.draft))
    with args.out.open("w") as out:
        _write(out, header(target, draft, args))
        for label, run in configurations(target, draft, args):
            if args.only and args.only not in label:
                continue
            if time.perf_counter() - began > args.budget_s:
                _write(out, {"run": label, "skipped": "past --budget-s"})
                continue
            try:
                _write(out, {"run": label, **run()})
            except Exception as error:  # a configuration that fails is a result too; the others still run
                _write(out, {"run": label, "failed": f"{type(error).__name__}: {str(error).splitlines()[0]}"})


def _write(out, record: dict) -> None:
    line = json.dumps(record)
    out.write(line + "\n")
    out.flush()
    print(line, flush=True)


if __name__ == "__main__":
    main()
