"""Conformance checks a plugin author runs on their own drafter: :func:`check_drafter` (re-exported from
:mod:`specdec_cli.testing`).

It builds a tiny target (and, for a drafter that takes a model, a tiny draft) from configs in a temporary
folder, loads them through the real recipe path with the drafter registered under its name, and checks:

1. the class against the contract (what ``specdec drafters`` would report as a load failure);
2. every proposal of a few hundred generations: shapes, dtypes, devices and length (the engine's own
   checks), laws that sum to 1 and give their tokens positive mass, one-hot laws for a deterministic
   drafter;
3. exactness end to end: with speculative sampling, the first tokens follow the target's law
   (a chi-square against the law enumerated from the target alone), and greedy decoding equals the
   target's greedy output.

A failure raises :class:`ConformanceError` saying what is wrong. The built-in drafters pass it
(``tests/test_drafters.py``); a drafter that misreports its laws fails it.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .drafter_registry import DrafterRegistry
from .drafting import Drafter, Proposal
from .errors import SpecdecError
from .recipe import build_recipe
from .sampling import SamplingParams

PROMPTS = ("a b c d a b c", "e e a", "d c b a e d c b a")
"""Prompts over the tiny vocabulary, with repeats (for drafters that look back at the context)."""


class ConformanceError(AssertionError):
    """A drafter that breaks the contract, with what is wrong."""


class _Registered(DrafterRegistry):
    """The installed drafters plus the one under test, under its own name."""

    def __init__(self, cls: type[Drafter]):
        super().__init__()
        self.checked = cls

    def names(self) -> list[str]:
        return sorted({*super().names(), self.checked.name})

    def load_class(self, name: str) -> type:
        return self.checked if name == self.checked.name else super().load_class(name)


def check_drafter(cls: type[Drafter], params: dict[str, Any] | None = None, samples: int = 1000) -> None:
    """Check drafter class ``cls`` with parameters ``params`` (see the module docstring); ``samples``: generations
    in the chi-square test. Raises :class:`ConformanceError`; takes about a minute on a CPU."""
    problem = DrafterRegistry().contract_problem(cls)
    if problem is not None or not cls.name:
        raise ConformanceError(f"{cls.__name__}: {problem or 'its class does not set name'}")
    from .testing import save_tiny_model  # transformers: only when a check runs

    with tempfile.TemporaryDirectory() as folder:
        target = save_tiny_model(Path(folder) / "target", "llama", seed=1)
        entry: dict[str, Any] = {"drafter": cls.name, "params": dict(params or {})}
        if cls.uses_model:
            entry["model"] = str(save_tiny_model(Path(folder) / "draft", "llama", seed=2, layers=1))
        recipe = {"target": {"model": str(target), "device": "cpu"}, "drafts": [entry],
                  "verifier": {"name": "speculative"}, "speculation": {"draft_length": 3},
                  "generation": {"max_new_tokens": 3, "temperature": 1.0}}  # fmt: skip
        _check_exactness(cls, recipe, samples)
        _check_greedy(cls, recipe)


def _decoder(cls: type[Drafter], recipe: dict[str, Any], **generation: Any):
    from .engine import SpeculativeDecoder

    built = build_recipe({**recipe, "generation": {**recipe["generation"], **generation}})
    try:
        return SpeculativeDecoder.from_recipe(built, drafters=_Registered(cls))
    except SpecdecError as error:
        raise ConformanceError(f"{cls.name}: a decoder with it could not be built: {error}") from error


def _watch_proposals(decoder: Any, cls: type[Drafter]) -> None:
    """Check each proposal of the decoder's drafter as the engine receives it."""
    drafter = decoder.drafters[0]
    propose = drafter.propose

    def checked(request):
        proposal = propose(request)
        if isinstance(proposal, Proposal) and proposal.length:
            _check_laws(cls, proposal)
        return proposal

    drafter.propose = checked


def _check_laws(cls: type[Drafter], proposal: Proposal) -> None:
    laws, tokens = proposal.laws.double(), proposal.tokens  # [rows, n, V], [rows, n]
    if not torch.allclose(laws.sum(-1), torch.ones_like(laws[..., 0]), atol=1e-5):
        raise ConformanceError(f"{cls.name}: proposed laws that do not sum to 1")
    if not bool((laws.gather(-1, tokens.unsqueeze(-1)) > 0).all()):
        raise ConformanceError(f"{cls.name}: proposed a token its own law gives no mass (not drawn from that law)")
    if cls.deterministic and not bool((laws.amax(-1) == 1).all()):
        raise ConformanceError(f"{cls.name}: declares deterministic but proposed laws that are not one-hot")


def _run(cls: type[Drafter], decoder: Any, prompt: str, key: int) -> list[int]:
    try:
        tokens, _, _ = decoder.generate_ids(decoder.encode_prompt(prompt), key)
    except SpecdecError as error:  # the engine's checks of a proposal, or the plugin's own exception
        raise ConformanceError(f"{cls.name}: {error}") from error
    return tokens


def _check_exactness(cls: type[Drafter], recipe: dict[str, Any], samples: int) -> None:
    from .testing import EOS_ID, chi_square_p_value, exact_sequence_law

    decoder = _decoder(cls, recipe)
    _watch_proposals(decoder, cls)
    prompt_ids = decoder.encode_prompt(PROMPTS[0])
    counts = Counter(tuple(_run(cls, decoder, PROMPTS[0], key)) for key in range(samples))
    depth = recipe["generation"]["max_new_tokens"]
    law = exact_sequence_law(decoder.target.model, prompt_ids, depth, SamplingParams(1.0), decoder.vocab_size, {EOS_ID})
    p_value = chi_square_p_value(counts, law)
    if p_value < 1e-4:
        raise ConformanceError(f"{cls.name}: with speculative sampling the first {depth} tokens do not follow the "
                               f"target's law (chi-square p = {p_value:.2g} over {samples} samples): its reported "
                               "laws are not the laws its tokens were drawn from")  # fmt: skip


def _check_greedy(cls: type[Drafter], recipe: dict[str, Any]) -> None:
    decoder = _decoder(cls, recipe, temperature=0.0, max_new_tokens=24)
    _watch_proposals(decoder, cls)
    alone = decoder.with_config(verifier="none")
    for prompt in PROMPTS:
        if _run(cls, decoder, prompt, 0) != _run(cls, alone, prompt, 0):
            raise ConformanceError(f"{cls.name}: greedy decoding with it differs from the target's greedy output "
                                   f"on {prompt!r}")  # fmt: skip
