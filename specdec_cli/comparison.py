"""Several decoding configurations on the same prompts and seeds, with the models loaded once.

:func:`compare` runs every configuration on each (prompt, sample) in turn, so slow drift of the
machine (thermal, other load) falls on all of them alike, after one untimed warm-up each. A
configuration's figures are pooled over its samples: tokens per second is all its tokens over all
its generation time, excluding model loading and the warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .engine import SpeculativeDecoder, sample_seed
from .stats import GenerationResult

TokenCallback = Callable[[int], None]
"""on_tokens(count): tokens committed (or, at a sample's end, the rest of its budget) for progress."""


@dataclass(kw_only=True)
class ConfigurationResult:
    """One configuration's samples and their pooled figures."""

    label: str
    decoder: SpeculativeDecoder
    results: list[GenerationResult] = field(default_factory=list)
    speedup: float | None = None
    """Token rate over the target alone's, when the comparison includes it."""

    @property
    def speculative(self) -> bool:
        return self.decoder.verifier is not None

    def _total(self, name: str) -> float:
        return sum(getattr(r.stats, name) for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        wall = self._total("wall_time_s")
        return self._total("new_tokens") / wall if wall > 0 else 0.0

    @property
    def block_efficiency(self) -> float:
        forwards = self._total("target_forwards")
        return self._total("new_tokens") / forwards if forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted positions; None for the target alone (nothing is drafted)."""
        if not self.speculative:
            return None
        drafted = self._total("drafted_tokens")
        return self._total("accepted_tokens") / drafted if drafted else 0.0

    def summary(self) -> dict:
        config = self.decoder.config
        return {
            "label": self.label, "verifier": config.verifier.name, "verifier_params": dict(config.verifier.params),
            "draft_length": self.decoder.draft_length, "num_drafts": config.speculation.num_drafts,
            "samples": len(self.results), "new_tokens": int(self._total("new_tokens")),
            "wall_time_s": self._total("wall_time_s"), "tokens_per_second": self.tokens_per_second,
            "block_efficiency": self.block_efficiency, "acceptance_rate": self.acceptance_rate,
            "speedup": self.speedup,
        }  # fmt: skip


def compare(
    decoders: dict[str, SpeculativeDecoder], prompts: Sequence[str], num_samples: int = 1,
    on_tokens: TokenCallback | None = None,
) -> list[ConfigurationResult]:  # fmt: skip
    """Every configuration (label → decoder over the same models) on every prompt and sample, interleaved."""
    encoded = {label: [d.encode_prompt(p) for p in prompts] for label, d in decoders.items()}  # all checked first
    rows = [ConfigurationResult(label=label, decoder=decoder) for label, decoder in decoders.items()]
    for row in rows:
        row.decoder.warm_up(encoded[row.label][0])
    for prompt_index, prompt in enumerate(prompts):
        for sample_index in range(num_samples):
            seed = sample_seed(rows[0].decoder.config.seed, prompt_index, sample_index)
            for row in rows:
                row.results.append(_sample(row.decoder, prompt, prompt_index, sample_index,
                                           encoded[row.label][prompt_index], seed, on_tokens))  # fmt: skip
    baseline = next((row for row in rows if not row.speculative), None)
    if baseline is not None and baseline.tokens_per_second:
        for row in rows:
            row.speedup = row.tokens_per_second / baseline.tokens_per_second
    return rows


def _sample(decoder: SpeculativeDecoder, prompt: str, prompt_index: int, sample_index: int, ids: list[int], seed: int,
            on_tokens: TokenCallback | None) -> GenerationResult:  # fmt: skip
    progress = None if on_tokens is None else (lambda tokens, _mask: on_tokens(len(tokens)))
    tokens, mask, stats = decoder.generate_ids(ids, seed, progress)
    if on_tokens is not None:
        on_tokens(decoder.config.generation.max_new_tokens - len(tokens))  # a sample that stopped early
    text = decoder.target.tokenizer.decode(tokens, skip_special_tokens=True)
    return GenerationResult(prompt, prompt_index, sample_index, tokens, text, stats, mask)
