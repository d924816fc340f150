"""Real model shapes with random weights, for timing where the hub cannot be reached.

A forward's cost depends on the shapes, not on the weights' values, so a model built from the real
configuration with random weights times like the real one. RoPE scaling is left out: it changes
which angles are used, not the work done.
"""

from __future__ import annotations

import torch
import transformers

# The published configurations' shape fields (config.json on the hub).
SHAPES = {
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    # Not a published model: a few kilobytes of the same architecture, for smoke checks of the benchmarks on a CPU.
    "llama-tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
}


def random_model(shape: str, device: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """A Llama-architecture causal LM of the named shape, random weights, in eval mode on ``device``."""
    config = transformers.LlamaConfig(max_position_embeddings=8192, rms_norm_eps=1e-5, **SHAPES[shape])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
