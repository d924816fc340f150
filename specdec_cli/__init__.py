"""specdec: speculative decoding with exact, pluggable verifiers.

The library is usable without the CLI::

    from specdec_cli import load_recipe, SpeculativeDecoder
    decoder = SpeculativeDecoder.from_recipe(load_recipe("my-recipe.yaml"))
    results = decoder.generate(["Write a haiku about the sea."])
    results = decoder.generate(["Write a haiku about the sea."], verifier="block", draft_length=8)  # same models

Names are imported on first use, so commands that never run a model never import torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("specdec-cli")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

_WHERE = {
    "Draft": "engine.decoding",
    "SpeculativeDecoder": "engine.decoder",
    "SpecdecError": "errors",
    "ModelPool": "models.pool",
    "DecodingConfig": "recipe",
    "Recipe": "recipe",
    "load_recipe": "recipe",
    "SamplingParams": "sampling",
    "probs_from_logits": "sampling",
    "GenerationResult": "results.stats",
    "SampleStats": "results.stats",
    "BlockDecision": "verifiers",
    "BlockVerifier": "verifiers",
    "Verifier": "verifiers",
    "load_verifier": "verifiers",
}

__all__ = ["__version__", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
