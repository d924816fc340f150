"""Seeded tokens of a fixed set of generations, to prove that a refactor changes no token (issue #31).

Every case decodes 3 prompts x 2 samples with a fixed seed through the public library API only
(``load_recipe``, ``SpeculativeDecoder.from_recipe`` and ``decoder.generate(prompts, num_samples,
batch_size=B, on_block=..., **changes)``), on tiny models built from configs
(``specdec_cli.testing.save_tiny_model``, no download), and records for each sample its token ids,
accepted mask, text, the blocks it committed (lengths, from ``on_block``) and the statistics that do not
depend on time (forwards, blocks, drafted / verified / accepted counts, stop reason). A case that is
refused records its error line instead, so a refusal that changes shows too.

    PYTHONPATH=<tree> python benchmarks/seeded_tokens.py --out before.json   # PYTHONPATH picks the code
    python benchmarks/seeded_tokens.py --compare before.json after.json      # exit 1 if any case differs
    python benchmarks/seeded_tokens.py --batch-invariance before.json        # cases whose B1 and B4 differ

The file holds {"meta": {versions, CPU, seconds, the models' digests}, "cases": {name: {"samples": [...],
"finish_order": [[prompt, sample], ...]} or {"error": "Type: first line"}}}; only "cases" is compared.

Cases: decoder-only (llama target, 1-layer llama draft; a gpt2 pair) and encoder-decoder (t5 pair; a
bart pair at batch 1 only: it numbers positions from the cache); greedy, temperature 1 and top-p 0.9;
batch size 1 and 4; verifiers none, speculative, block, specinfer, spectr, mentored (kl bound), is-lp and
is-truncated; drafters model, early-exit, prompt-lookup and model + prompt-lookup; kv_cache false at batch 1.
The script imports specdec_cli lazily (top-level names first), so one copy runs against any tree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FORMAT = 1
PROMPTS = ["a b c d a b c", "e d c b a e d c b", "a a b b c c a a b"]  # words of the tiny 8-token vocabulary
NUM_SAMPLES = 2
MAX_NEW_TOKENS = 24
SEED = 7
STATS = (
    "prompt_tokens",
    "new_tokens",
    "target_forwards",
    "draft_forwards",
    "blocks",
    "drafted_tokens",
    "verified_tokens",
    "accepted_tokens",
    "accepted_per_position",
    "drafted_per_position",
    "stop_reason",
)
"""SampleStats fields that do not depend on time (every *_time_s field is left out)."""

# Tiny checkpoints: (kind, seed, layers, sharpness); seeds as tests/conftest.py's, so drafts disagree with targets.
# At the tests' sharpness (6) the tied-embedding gpt2 and bart and the t5 pair copy their last token for ever
# (bart: always id 0), which would prove little; flatter heads give varied sampled tokens.
MODELS = {
    "llama-target": ("llama", 1, 2, 6.0),
    "llama-draft": ("llama", 2, 1, 6.0),
    "gpt2-target": ("gpt2", 3, 2, 0.7),
    "gpt2-draft": ("gpt2", 4, 1, 0.7),
    "t5-target": ("t5", 5, 2, 2.0),
    "t5-draft": ("t5", 6, 2, 2.0),
    "bart-target": ("bart", 7, 2, 0.5),
    "bart-draft": ("bart", 8, 1, 0.5),
}
# Recipes: name -> (target, draft entries, the recipe's verifier). A draft entry names a model above with "model".
PAIRS = {
    "llama": ("llama-target", [{"model": "llama-draft"}], "speculative"),
    "llama-draft-T0.6": ("llama-target", [{"model": "llama-draft", "temperature": 0.6}], "speculative"),
    "llama-early-exit": ("llama-target", [{"early_exit": 1}], "speculative"),
    "llama-lookup": ("llama-target", [{"drafter": "prompt-lookup"}], "speculative"),
    "llama-model+lookup": ("llama-target", [{"model": "llama-draft"}, {"drafter": "prompt-lookup"}], "specinfer"),
    "gpt2": ("gpt2-target", [{"model": "gpt2-draft"}], "speculative"),
    "t5": ("t5-target", [{"model": "t5-draft"}], "speculative"),
    "t5-lookup": ("t5-target", [{"drafter": "prompt-lookup"}], "speculative"),
    "bart": ("bart-target", [{"model": "bart-draft"}], "speculative"),
}

SAMPLED, GREEDY, TOP_P = {"temperature": 1.0}, {"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}
MULTI = {"specinfer": 2, "spectr": 2, "is-lp": 2, "is-truncated": 2}
"""Verifiers run with two drafts per draft model (num_drafts 2); the others with one."""


def verifier_changes(name: str, num_drafts: int | None = None) -> dict[str, Any]:
    changes: dict[str, Any] = {"verifier": name, "num_drafts": num_drafts or MULTI.get(name, 1)}
    if name == "mentored":
        changes["verifier_params"] = {"kl": 0.2}
    return changes


def cases() -> list[tuple[str, str, int, dict[str, Any]]]:
    """(case name, recipe, batch size, changes to generate) for every case, in a fixed order."""
    out: list[tuple[str, str, int, dict[str, Any]]] = []

    def add(pair: str, label: str, batches: tuple[int, ...], changes: dict[str, Any]) -> None:
        for batch in batches:
            out.append((f"{pair}/{label}/B{batch}", pair, batch, changes))

    both = (1, 4)
    every = ["none", "speculative", "block", "specinfer", "spectr", "mentored", "is-lp", "is-truncated"]
    for pair in ("llama", "t5"):
        for name in every:
            add(pair, f"{name}/T1", both, {**verifier_changes(name), **SAMPLED})
        for name in ("none", "speculative", "block", "spectr"):
            add(pair, f"{name}/greedy", both, {**verifier_changes(name), **GREEDY})
        for name in ("speculative", "specinfer"):
            add(pair, f"{name}/top-p0.9", both, {**verifier_changes(name), **TOP_P})
        for name in ("none", "speculative", "spectr"):
            add(pair, f"{name}/T1/no-kv-cache", (1,), {**verifier_changes(name), **SAMPLED, "kv_cache": False})
        add(pair, "speculative/T1/L2", both, {**verifier_changes("speculative"), **SAMPLED, "draft_length": 2})
        add(pair, "speculative/T1/seed3", both, {**verifier_changes("speculative"), **SAMPLED, "seed": 3})
        add(pair, "specinfer/T1", (2, 8), {**verifier_changes("specinfer"), **SAMPLED})  # 8: all samples in one batch
    add("llama", "speculative/top-k3", both, {**verifier_changes("speculative"), "temperature": 0.8, "top_k": 3})
    for name in ("speculative", "spectr"):  # the draft samples at its own temperature
        add("llama-draft-T0.6", f"{name}/T1", both, {**verifier_changes(name), **SAMPLED})
    for name in ("speculative", "block", "specinfer"):
        add("llama-early-exit", f"{name}/T1", both, {**verifier_changes(name), **SAMPLED})
    add("llama-early-exit", "speculative/greedy", both, {**verifier_changes("speculative"), **GREEDY})
    for pair in ("llama-lookup", "t5-lookup"):
        for name in ("speculative", "block", "spectr"):
            add(pair, f"{name}/T1", both, {**verifier_changes(name), **SAMPLED})
        add(pair, "speculative/greedy", both, {**verifier_changes("speculative"), **GREEDY})
    add(
        "llama-lookup",
        "speculative/T1/no-kv-cache",
        (1,),
        {**verifier_changes("speculative"), **SAMPLED, "kv_cache": False},
    )
    for name in ("specinfer", "is-lp", "is-truncated"):  # one row each from the model and prompt lookup
        add("llama-model+lookup", f"{name}/T1", both, {**verifier_changes(name, 1), **SAMPLED})
    add("llama-model+lookup", "specinfer/K2/T1", both, {**verifier_changes("specinfer", 2), **SAMPLED})
    add("llama-model+lookup", "specinfer/greedy", both, {**verifier_changes("specinfer", 1), **GREEDY})
    add("llama-model+lookup", "specinfer/top-p0.9", both, {**verifier_changes("specinfer", 1), **TOP_P})
    for name in ("none", "speculative", "specinfer"):
        add("gpt2", f"{name}/T1", both, {**verifier_changes(name), **SAMPLED})
    add("gpt2", "speculative/greedy", both, {**verifier_changes("speculative"), **GREEDY})
    for name in ("none", "speculative", "block", "specinfer"):  # BART numbers positions from the cache: batch 1
        add("bart", f"{name}/T1", (1,), {**verifier_changes(name), **SAMPLED})
    add("bart", "speculative/greedy", (1,), {**verifier_changes("speculative"), **GREEDY})
    add("bart", "speculative/T1/no-kv-cache", (1,), {**verifier_changes("speculative"), **SAMPLED, "kv_cache": False})
    # Refused today: what a user is told must not change either.
    add("llama-model+lookup", "refused/spectr/T1", (1,), {**verifier_changes("spectr", 1), **SAMPLED})
    add("bart", "refused/speculative/T1", (4,), {**verifier_changes("speculative"), **SAMPLED})
    add(
        "llama",
        "refused/speculative/T1/no-kv-cache",
        (4,),
        {**verifier_changes("speculative"), **SAMPLED, "kv_cache": False},
    )
    return out


# --------------------------------------------------------------------------- running


def public(name: str, module: str) -> Any:
    """A public name: from specdec_cli's top level if it is there, else from its module."""
    import importlib

    import specdec_cli

    try:
        return getattr(specdec_cli, name)
    except AttributeError:
        return getattr(importlib.import_module(f"specdec_cli.{module}"), name)


def file_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".safetensors", ".json"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="seeded-tokens-"))
    try:
        return run_in(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def describe_run(threads: int, elapsed: float, models: dict[str, Path]) -> dict[str, Any]:
    """The file's "meta": where and with what the cases ran (never compared)."""
    import torch
    import transformers

    import specdec_cli

    return {
        "format": FORMAT,
        "specdec_cli": str(Path(specdec_cli.__file__).resolve().parent),
        "version": getattr(specdec_cli, "__version__", "?"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "cpu": cpu_model(),
        "seconds": round(elapsed, 1),
        "prompts": PROMPTS,
        "num_samples": NUM_SAMPLES,
        "max_new_tokens": MAX_NEW_TOKENS,
        "seed": SEED,
        "models": {name: file_digest(path) for name, path in models.items()},
    }


def run_in(work: Path, args: argparse.Namespace) -> int:
    os.environ["SPECDEC_CACHE"] = str(work / "cache")  # before specdec_cli is imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    from transformers.utils import logging as hf_logging

    from specdec_cli.testing import save_tiny_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    load_recipe = public("load_recipe", "recipe")
    decoder_class = public("SpeculativeDecoder", "engine")

    started = time.perf_counter()
    models = {
        name: save_tiny_model(work / "models" / name, kind, seed=seed, layers=layers, sharpness=sharpness)
        for name, (kind, seed, layers, sharpness) in MODELS.items()
    }
    selected = [c for c in cases() if not args.only or any(part in c[0] for part in args.only)]
    decoders: dict[str, Any] = {}
    results: dict[str, Any] = {}
    for number, (case, pair, batch_size, changes) in enumerate(selected, 1):
        case_start = time.perf_counter()
        try:
            if pair not in decoders:
                decoders[pair] = decoder_class.from_recipe(load_recipe(write_recipe(work, pair, models)))
            results[case] = generate(decoders[pair], batch_size, changes | args.setting)
        except Exception as error:  # noqa: BLE001  (a refusal is a result: recorded, compared)
            line = (str(error).strip().splitlines() or [""])[0].replace(str(work), "<tmp>")
            results[case] = {"error": f"{type(error).__name__}: {line}"}
        outcome = results[case].get("error") or f"{sum(len(s['token_ids']) for s in results[case]['samples'])} tokens"
        print(
            f"[{number}/{len(selected)}] {case}: {outcome} ({time.perf_counter() - case_start:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    elapsed = time.perf_counter() - started
    meta = describe_run(args.threads, elapsed, models)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, meta, results)
    errors = [case for case, value in results.items() if "error" in value]
    unexpected = [case for case in errors if "/refused/" not in case]
    print(f"{len(results)} cases ({len(errors)} refused) in {elapsed:.0f} s -> {out}", file=sys.stderr)
    for case in unexpected:
        print(f"warning: {case} raised {results[case]['error']}", file=sys.stderr)
    return 0


def write_results(path: Path, meta: dict[str, Any], cases: dict[str, Any]) -> None:
    """The JSON file, one line per case (diffs stay readable)."""
    lines = [f"{json.dumps(name)}: {json.dumps(value, separators=(',', ':'))}" for name, value in cases.items()]
    path.write_text('{"meta": ' + json.dumps(meta, indent=1) + ',\n"cases": {\n' + ",\n".join(lines) + "\n}}\n")


def write_recipe(work: Path, pair: str, models: dict[str, Path]) -> Path:
    target, drafts, verifier = PAIRS[pair]
    entries = [{**entry, "model": str(models[entry["model"]])} if "model" in entry else dict(entry) for entry in drafts]
    for entry in entries:
        if "model" in entry:
            entry["device"] = "cpu"
    recipe = {
        "target": {"model": str(models[target]), "device": "cpu"},
        "drafts": entries,
        "verifier": {"name": verifier},
        "speculation": {"draft_length": 4, "num_drafts": 1},
        "generation": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "seed": SEED,
    }
    path = work / "recipes" / f"{pair}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=1))  # JSON is YAML
    return path


def generate(decoder: Any, batch_size: int, changes: dict[str, Any]) -> dict[str, Any]:
    blocks: dict[tuple[int, int], list[int]] = {}
    finished: list[tuple[int, int]] = []  # samples by their last block (the order a batch finishes them in)

    def on_block(prompt_index: int, sample_index: int, tokens: list[int], accepted: list[bool]) -> None:
        key = (prompt_index, sample_index)
        blocks.setdefault(key, []).append(len(tokens))
        if key in finished:
            finished.remove(key)
        finished.append(key)

    results = decoder.generate(PROMPTS, NUM_SAMPLES, on_block=on_block, batch_size=batch_size, **changes)
    samples = []
    for result in results:
        key = (result.prompt_index, result.sample_index)
        samples.append(
            {
                "prompt_index": result.prompt_index,
                "sample_index": result.sample_index,
                "token_ids": list(result.token_ids),
                "accepted_mask": [bool(a) for a in result.accepted_mask],
                "text": result.text,
                "block_lengths": blocks.get(key, []),
                "stats": {name: getattr(result.stats, name, "<missing>") for name in STATS},
            }
        )
    return {"samples": samples, "finish_order": [list(key) for key in finished]}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# --------------------------------------------------------------------------- comparing


def compare(before_path: str, after_path: str) -> int:
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    for label, data, path in (("A", before, before_path), ("B", after, after_path)):
        meta = data.get("meta", {})
        print(
            f"{label}: {path}: {meta.get('specdec_cli')} torch {meta.get('torch')} transformers "
            f"{meta.get('transformers')}, {len(data['cases'])} cases, {meta.get('seconds')} s"
        )
    if before.get("meta", {}).get("models") != after.get("meta", {}).get("models"):
        print("warning: the tiny models' files differ (save_tiny_model changed?): token differences may come from them")
    differing = []
    for case in sorted(set(before["cases"]) | set(after["cases"]), key=_order(before["cases"], after["cases"])):
        a, b = before["cases"].get(case), after["cases"].get(case)
        what = describe(a, b)
        if what:
            differing.append(case)
            print(f"DIFFERS {case}: {what}")
    same = len(set(before["cases"]) | set(after["cases"])) - len(differing)
    print(f"{same} cases identical, {len(differing)} differ")
    return 1 if differing else 0


def _order(a: dict, b: dict):
    names = list(a) + [n for n in b if n not in a]
    return names.index


def describe(a: Any, b: Any) -> str:
    """What differs between two records of a case ('' when nothing does)."""
    if a is None or b is None:
        return "only in " + ("B" if a is None else "A")
    if "error" in a or "error" in b:
        return "" if a == b else f"A: {a.get('error', 'ran')} | B: {b.get('error', 'ran')}"
    parts = []
    if len(a["samples"]) != len(b["samples"]):
        return f"{len(a['samples'])} samples against {len(b['samples'])}"
    for x, y in zip(a["samples"], b["samples"]):
        where = f"prompt {x['prompt_index']} sample {x['sample_index']}"
        if x["token_ids"] != y["token_ids"]:
            first = next(
                (i for i, (s, t) in enumerate(zip(x["token_ids"], y["token_ids"])) if s != t),
                min(len(x["token_ids"]), len(y["token_ids"])),
            )
            parts.append(f"{where}: tokens differ from position {first}")
            continue
        fields = [k for k in ("accepted_mask", "text", "block_lengths") if x.get(k) != y.get(k)]
        fields += [
            f"stats.{k}" for k in sorted(set(x["stats"]) | set(y["stats"])) if x["stats"].get(k) != y["stats"].get(k)
        ]
        if fields:
            parts.append(f"{where}: same tokens, {', '.join(fields)} differ")
    if a.get("finish_order") != b.get("finish_order"):
        parts.append("the order samples finish in differs")
    return "; ".join(parts)


def batch_invariance(path: str) -> int:
    """Within one file: the cases whose batch-size variants (…/B1, …/B4, …) do not all give the same samples."""
    data = json.loads(Path(path).read_text())["cases"]
    groups: dict[str, list[str]] = {}
    for case in data:
        stem, _, batch = case.rpartition("/B")
        if batch.isdigit() and "error" not in data[case]:
            groups.setdefault(stem, []).append(case)
    differing = 0
    for stem, names in groups.items():
        if len(names) < 2:
            continue
        base = names[0]
        for other in names[1:]:
            records = [{**data[n], "finish_order": None} for n in (base, other)]
            what = describe(*records)
            if what:
                differing += 1
                print(f"{base.rsplit('/', 1)[1]} vs {other.rsplit('/', 1)[1]} {stem}: {what}")
    print(f"{differing} batch-size pairs differ in this file (B1 against the others)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file to write (the tree under test is the one on PYTHONPATH)")
    parser.add_argument(
        "--compare", nargs=2, metavar=("A.json", "B.json"), help="print the cases that differ; exit 1 if any"
    )
    parser.add_argument(
        "--batch-invariance", metavar="FILE", help="list the cases whose samples depend on the batch size"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--only", nargs="*", help="run only cases whose name contains one of these")
    parser.add_argument(
        "--static-cache",
        dest="setting",
        action="store_const",
        const={"static_cache": True},
        default={},
        help="run every case with speculation.static_cache (its tokens are compared with the dynamic cache's)",
    )
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.batch_invariance:
        return batch_invariance(args.batch_invariance)
    if not args.out:
        parser.error("give --out FILE or --compare A.json B.json")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
