"""specdec: speculative decoding with exact, pluggable verifiers.

The library is usable without the CLI::

    from specdec_cli import load_recipe, SpeculativeDecoder
    decoder = SpeculativeDecoder.from_recipe(load_recipe("my-recipe.yaml"))
    results = decoder.generate(["Write a haiku about the sea."])
    results = decoder.generate(["Write a haiku about the sea."], verifier="block", draft_length=8)  # same models
"""

from importlib.metadata import PackageNotFoundError, version

from .decoding import Draft
from .engine import SpeculativeDecoder
from .errors import SpecdecError
from .model_pool import ModelPool
from .recipe import DecodingConfig, Recipe, load_recipe
from .sampling import SamplingParams, probs_from_logits
from .stats import GenerationResult, SampleStats
from .verifiers import BlockDecision, BlockVerifier, Verifier, load_verifier

try:
    __version__ = version("specdec-cli")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BlockDecision",
    "BlockVerifier",
    "DecodingConfig",
    "Draft",
    "GenerationResult",
    "ModelPool",
    "Recipe",
    "SampleStats",
    "SamplingParams",
    "SpecdecError",
    "SpeculativeDecoder",
    "Verifier",
    "__version__",
    "load_recipe",
    "load_verifier",
    "probs_from_logits",
]
