"""Several decoding configurations on the same prompts and seeds, with the models loaded once.

:class:`Comparison` runs every configuration on each (prompt, sample) in turn, so slow drift of
the machine (thermal, other load) falls on all of them alike, after one untimed warm-up each. A
configuration's figures are pooled over its samples: tokens per second is all its tokens over all
its generation time, excluding model loading and the warm-up.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..base.errors import UsageError
from ..base.recipe import AUTOREGRESSIVE, Recipe, VerifierConfig, target_alone
from ..engine.decoder import SpeculativeDecoder
from ..plugins.registry import VerifierRegistry
from ..results.stats import (
    GenerationResult,
    RunRate,
    describe_speedup,
    engine_counters,
    position_totals,
    speedup_interval,
    token_count,
)

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
    speedup_interval: tuple[float, float] | None = None
    """The speedup's confidence interval from the rounds (:func:`~specdec_cli.results.stats.speedup_interval`),
    set when a run ends: None for the target alone, with one round, or without the target alone."""

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

    def tokens_per_second_text(self) -> str:
        """'21.3 (40 tokens)': the token rate with the tokens it counts."""
        return f"{self.tokens_per_second:.1f} {token_count(self._total('new_tokens'))}"

    def speedup_text(self) -> str:
        """'0.96× [0.81–1.10]', or '0.96× (1 sample: no interval)'; '1.00×' for the target alone, '—' when the
        comparison does not include it."""
        if self.speedup is None:
            return "—"
        if not self.speculative:
            return describe_speedup(self.speedup, None, 0, "×")
        return describe_speedup(self.speedup, self.speedup_interval, len(self.results), "×")

    def _engine_counters(self) -> dict:
        """vLLM's counters pooled over the samples (:func:`~specdec_cli.results.stats.engine_counters`): ``num_drafts``
        counts drafts (blocks that proposed), and ``num_accepted_tokens_per_pos`` has L entries, as every sample's."""
        accepted = position_totals([r.stats.accepted_per_position for r in self.results])
        return engine_counters(
            int(self._total("num_drafts")),
            int(self._total("drafted_tokens")),
            int(self._total("accepted_tokens")),
            accepted,
        )

    def summary(self) -> dict:
        """The configuration's settings and pooled figures. Its speculation settings keep the recipe's names under
        ``speculation`` (K is ``speculation.num_drafts``; None for the target alone, which drafts nothing), so that
        the engines' counters beside them keep theirs."""
        config = self.decoder.config
        low, high = self.speedup_interval or (None, None)
        return {
            "label": self.label,
            "verifier": config.verifier.name,
            "verifier_params": dict(config.verifier.params),
            "draft_length": self.decoder.draft_length,
            "speculation": dataclasses.asdict(config.speculation) if self.speculative else None,
            "samples": len(self.results),
            "new_tokens": int(self._total("new_tokens")),
            "wall_time_s": self._total("wall_time_s"),
            "tokens_per_second": self.tokens_per_second,
            "block_efficiency": self.block_efficiency,
            "acceptance_rate": self.acceptance_rate,
            "speedup": self.speedup,
            "speedup_low": low,
            "speedup_high": high,
            "speedup_samples": len(self.results),
            **self._engine_counters(),
        }


class Comparison:
    """Configurations (label → decoder over the same models) run side by side, one round at a time.

    A round is one (prompt, sample): every configuration runs it in turn, with the same seed. Its
    results join :attr:`rows` only once every configuration has finished it, so a run stopped
    part-way (Ctrl-C) still compares the configurations on the same samples.
    """

    def __init__(self, decoders: dict[str, SpeculativeDecoder]):
        self.rows = [ConfigurationResult(label=label, decoder=decoder) for label, decoder in decoders.items()]

    @property
    def rounds(self) -> int:
        """Complete rounds so far: the samples each configuration's figures are pooled over."""
        return len(self.rows[0].results)

    def run(
        self, prompts: Sequence[str], num_samples: int = 1, on_tokens: TokenCallback | None = None
    ) -> Iterator[list[GenerationResult]]:
        """Warm every configuration up, then yield each round's results (in the order of :attr:`rows`)
        once they are added to the rows; speedups are updated after each round, their intervals at the end."""
        encoded = {row.label: [row.decoder.encode_prompt(p) for p in prompts] for row in self.rows}  # all checked first
        for row in self.rows:
            row.decoder.warm_up(encoded[row.label][0])
        progress = None if on_tokens is None else (lambda tokens, _mask: on_tokens(len(tokens)))
        try:
            for prompt_index, sample_index in itertools.product(range(len(prompts)), range(num_samples)):
                results = []
                for row in self.rows:
                    ids = encoded[row.label][prompt_index]
                    results.append(row.decoder.sample(prompts[prompt_index], prompt_index, sample_index, ids, progress))
                    if on_tokens is not None:
                        on_tokens(
                            row.decoder.config.generation.max_new_tokens - len(results[-1].token_ids)
                        )  # stopped early
                for row, result in zip(self.rows, results):
                    row.results.append(result)
                self._update_speedups()
                yield results
        finally:  # a stop between two appends must not leave one configuration a round ahead
            for row in self.rows:
                del row.results[min(len(r.results) for r in self.rows) :]
            self._update_speedups()
            self._update_intervals()

    def _update_speedups(self) -> None:
        baseline = next((row for row in self.rows if not row.speculative), None)
        if baseline is not None and baseline.tokens_per_second:
            for row in self.rows:
                row.speedup = row.tokens_per_second / baseline.tokens_per_second

    def _update_intervals(self) -> None:
        """The speedups' intervals over the rounds: once, at the end (a bootstrap per round would cost a run of
        many rounds more than its figures are worth)."""
        baseline = next((row for row in self.rows if not row.speculative), None)
        for row in self.rows:
            if baseline is not None and row.speculative and row.speedup is not None:
                rounds = [(_run_rate(mine), _run_rate(theirs)) for mine, theirs in zip(row.results, baseline.results)]
                row.speedup_interval = speedup_interval(rounds)


def _run_rate(result: GenerationResult) -> RunRate:
    return RunRate(tokens=result.stats.new_tokens, seconds=result.stats.wall_time_s)


def comparison_recipes(
    recipe: Recipe, names: list[str], kl: float | None, registry: VerifierRegistry
) -> dict[str, Recipe]:
    """The recipe for each listed verifier (its parameters from the recipe, --kl where it has a KL bound), each
    verifier resolved once (the decoders find it built) and checked against the recipe's drafts before any model
    loads."""
    labels = [AUTOREGRESSIVE if target_alone(n) else registry.canonical(n) for n in names]
    if len(set(labels)) < len(labels):
        raise UsageError(f"--verifier lists a verifier twice ({', '.join(names)}); give each once")
    speculative = [label for label in labels if not target_alone(label)]  # not empty: two labels, at most one none
    bounded = [label for label in speculative if registry.verifier_class(label).kl_bound_parameter]
    if kl is not None and not bounded:  # the one-line error naming verifiers that have a bound
        raise registry.no_kl_bound(speculative[:1])
    recipes = {}
    for name in labels:
        label, verifier = name, VerifierConfig(name=name)
        if name in speculative:
            chosen = registry.resolve(
                name,
                recipe.verifier.params,
                kl_bound=kl if name in bounded else None,
                draft_length=recipe.speculation.draft_length,
                taken_only=True,
            )
            label = label if chosen.bound is None else f"{name} D={chosen.bound:g}"
            verifier = chosen.config
        recipes[label] = dataclasses.replace(recipe, verifier=verifier)
        SpeculativeDecoder.check_recipe(recipes[label], registry)
    return recipes
