"""specdec: speculative decoding with exact, pluggable verifiers.

The library is usable without the CLI::

    from specdec_cli import load_recipe, SpeculativeDecoder
    decoder = SpeculativeDecoder.from_recipe(load_recipe("my-recipe.yaml"))
    results = decoder.generate(["Write a haiku about the sea."])
"""

from importlib.metadata import PackageNotFoundError, version

from .engine import SpeculativeDecoder
from .errors import SpecdecError
from .recipe import Recipe, load_recipe
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
    "GenerationResult",
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
