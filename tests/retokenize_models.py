"""What the two retokenize drafters' tests share: a tiny target and drafts of other vocabularies, saved to be loaded
through the real recipe path, their recipes, and the chi-square of the first tokens against the target's law."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specdec_cli.base.sampling import SamplingParams
from specdec_cli.kit.testing import (
    EOS_ID,
    PAD_ID,
    TINY_VOCAB,
    exact_sequence_law,
    keyed_samples,
    save_tiny_model,
    tiny_model,
    tiny_tokenizer,
)
from specdec_cli.results.stats import GenerationResult

DRAFT_VOCAB = ["<pad>", "</s>", "<unk>", "e", "d", "c", "b", "a", "f", "g"]
"""The target's words under other ids, and two words it does not have."""
PROMPTS = ["a b c d a b c", "e e a", "d c b a e d c b a", "b"]


def retokenize_models(root: Path) -> dict[str, Path]:
    """A tiny llama target over :data:`TINY_VOCAB`; drafts over :data:`DRAFT_VOCAB`: the target's own weights
    ("same-weights", whose greedy text is the target's) and a random GPT-2 ("gpt2"); and a llama draft of the
    target's tokenizer ("same-tokenizer")."""
    target = save_tiny_model(root / "target", "llama", seed=1)
    return {
        "target": target,
        "same-weights": _target_weights_under_draft_ids(target, root / "same"),
        "gpt2": save_draft(root / "gpt2-draft", "gpt2", DRAFT_VOCAB),
        "same-tokenizer": save_tiny_model(root / "same-tokenizer", "llama", seed=2, layers=1),
    }


def save_draft(path: Path, kind: str, words: list[str], positions: int | None = None) -> Path:
    """A one-layer tiny ``kind`` model over ``words`` (reading at most ``positions`` tokens, where given)."""
    model = tiny_model(kind, seed=4, layers=1, vocab_size=len(words))
    if positions is not None:
        model.config.max_position_embeddings = positions
    model.save_pretrained(path)
    tiny_tokenizer(words).save_pretrained(path)
    return path


def _target_weights_under_draft_ids(target: Path, path: Path) -> Path:
    """The target's model with its embedding and head rows moved to the draft vocabulary's ids (a word the target
    lacks takes <pad>'s rows, which a tie gives to <pad>, the lower id): its greedy text is the target's."""
    model = AutoModelForCausalLM.from_pretrained(target)
    rows = torch.tensor([TINY_VOCAB.index(word) if word in TINY_VOCAB else PAD_ID for word in DRAFT_VOCAB])
    embedding = model.get_input_embeddings().weight.detach()[rows].clone()  # [V_draft, d]
    head = model.get_output_embeddings().weight.detach()[rows].clone()  # [V_draft, d]
    model.resize_token_embeddings(len(DRAFT_VOCAB))
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embedding)
        model.get_output_embeddings().weight.copy_(head)
    model.save_pretrained(path)
    tiny_tokenizer(DRAFT_VOCAB).save_pretrained(path)
    return path


def retokenize_recipe(models, draft="same-weights", entry=None, drafter="retokenize", **generation) -> dict:
    """Speculative sampling at temperature 1, L = 3, three tokens, with one draft entry (``entry``, or ``drafter``
    over ``models[draft]``); ``generation`` overrides."""
    return {
        "target": {"model": str(models["target"]), "device": "cpu"},
        "drafts": [entry or {"drafter": drafter, "model": str(models[draft]), "device": "cpu"}],
        "verifier": {"name": "speculative"},
        "speculation": {"draft_length": 3},
        "generation": {"max_new_tokens": 3, "temperature": 1.0, **generation},
        "seed": 0,
    }


def first_tokens(decoder, samples: int, batch_size: int) -> tuple[Counter, dict, list[GenerationResult]]:
    """The first tokens of ``samples`` keyed samples of ``PROMPTS[0]`` counted, the law enumerated from the target
    alone, and the samples (their acceptance: tests/row_acceptance.py)."""
    prompt = PROMPTS[0]
    results = keyed_samples(decoder, prompt, samples, batch_size)
    counts = Counter(tuple(result.token_ids) for result in results)
    depth = decoder.config.generation.max_new_tokens
    ids = decoder.encode_prompt(prompt)
    law = exact_sequence_law(decoder.target.model, ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    return counts, law, results


def samples_in_order(decoder, prompt: str, samples: int, batch_size: int) -> list[list[int]]:
    """The tokens of keyed samples 0 .. ``samples`` - 1, in key order (a batch hands them back as they finish)."""
    results = keyed_samples(decoder, prompt, samples, batch_size)
    return [result.token_ids for result in sorted(results, key=lambda result: result.prompt_index)]
