"""Results with their spread: a speedup carries its interval over the paired samples (or says one sample cannot
give one), and a token rate says how many tokens it counts; in generate's comparison and in bench's table."""

from __future__ import annotations

import random

import matplotlib.pyplot as plt
import pytest

from specdec_cli import SpeculativeDecoder
from specdec_cli.base.recipe import build_recipe
from specdec_cli.bench.metrics import speedup_interval_fields
from specdec_cli.bench.report import figure, rows
from specdec_cli.bench.results import summarize
from specdec_cli.generation.comparison import Comparison, comparison_recipes
from specdec_cli.plugins.registry import VerifierRegistry
from specdec_cli.results.stats import (
    RunRate,
    SampleStats,
    describe_speedup,
    speedup_interval,
    token_count,
)
from tests.conftest import BASELINE_CELL, SPECULATIVE_CELL, tiny_recipe


def _pairs(count: int, speedup: float, noise: float, seed: int = 1) -> list[tuple[RunRate, RunRate]]:
    """``count`` prompts of 20 to 60 tokens; the run takes 1/``speedup`` of the baseline's time, each time off
    by up to ± ``noise`` (a share of it)."""
    draws = random.Random(seed)
    pairs = []
    for _ in range(count):
        tokens = draws.randint(20, 60)
        base = tokens / 20 * (1 + draws.uniform(-noise, noise))
        mine = tokens / 20 / speedup * (1 + draws.uniform(-noise, noise))
        pairs.append((RunRate(tokens, mine), RunRate(tokens, base)))
    return pairs


def _pooled_speedup(pairs: list[tuple[RunRate, RunRate]]) -> float:
    mine, theirs = ([sum(getattr(pair[i], name) for pair in pairs) for name in ("tokens", "seconds")] for i in (0, 1))
    return mine[0] / mine[1] / (theirs[0] / theirs[1])


def test_the_interval_holds_the_speedup_and_narrows_with_more_samples():
    few, many = _pairs(8, 1.5, 0.4), _pairs(200, 1.5, 0.4)
    for pairs in (few, many):
        low, high = speedup_interval(pairs)
        assert low < _pooled_speedup(pairs) < high and low > 1  # clearly faster: 1 is outside
    assert speedup_interval(few) == speedup_interval(few)  # seeded: the same samples, the same interval
    width = [high - low for low, high in map(speedup_interval, (few, many))]
    assert width[1] < width[0] / 2


def test_noise_around_no_speedup_gives_an_interval_across_one():
    """The negative control: a configuration as fast as the baseline, timed with noise, is not called faster."""
    low, high = speedup_interval(_pairs(12, 1.0, 0.5))
    assert low < 1 < high


def test_equal_ratios_give_a_point_and_one_sample_gives_none():
    same = [(RunRate(10, 1.0), RunRate(10, 2.0)), (RunRate(30, 3.0), RunRate(30, 6.0))]
    assert speedup_interval(same) == pytest.approx((2.0, 2.0))
    assert speedup_interval(same[:1]) is None and speedup_interval([]) is None


def test_the_words():
    assert describe_speedup(0.18, None, 1, "×") == "0.18× (1 sample: no interval)"
    assert describe_speedup(1.234, (1.1, 1.37), 5, "×") == "1.23× [1.10–1.37]"
    assert describe_speedup(1.234, None, 5) == "1.23"
    assert (token_count(40), token_count(1), token_count(19.4)) == ("(40 tokens)", "(1 token)", "(19 tokens)")


def _compared(tiny_models, prompts: list[str], samples: int) -> dict:
    recipe = build_recipe(tiny_recipe(tiny_models, "llama", generation={"max_new_tokens": 6}))
    recipes = comparison_recipes(recipe, ["speculative", "none"], None, VerifierRegistry())
    base = SpeculativeDecoder.from_recipe(recipes["speculative"])
    comparison = Comparison(
        {
            label: base.with_config(verifier=r.verifier.name, verifier_params=r.verifier.params)
            for label, r in recipes.items()
        }
    )
    list(comparison.run(prompts, samples))
    return {row.label: row for row in comparison.rows}


def test_a_comparison_gives_the_interval_over_its_rounds(tiny_models, one_thread):
    rows_ = _compared(tiny_models, ["a b", "c d e"], 2)  # 4 rounds
    speculative, alone = rows_["speculative"], rows_["none"]
    rounds = [
        (RunRate(a.stats.new_tokens, a.stats.wall_time_s), RunRate(b.stats.new_tokens, b.stats.wall_time_s))
        for a, b in zip(speculative.results, alone.results)
    ]
    assert speculative.speedup_interval == speedup_interval(rounds) is not None
    low, high = speculative.speedup_interval
    assert speculative.speedup_text() == f"{speculative.speedup:.2f}× [{low:.2f}–{high:.2f}]"
    assert alone.speedup_text() == "1.00×" and alone.speedup_interval is None
    summary = speculative.summary()
    assert (summary["speedup_low"], summary["speedup_high"], summary["speedup_samples"]) == (low, high, 4)
    tokens = sum(r.stats.new_tokens for r in speculative.results)
    assert speculative.tokens_per_second_text() == f"{speculative.tokens_per_second:.1f} ({tokens} tokens)"


def test_a_one_round_comparison_says_it_has_no_interval(tiny_models, one_thread):
    speculative = _compared(tiny_models, ["a b"], 1)["speculative"]
    assert speculative.speedup_interval is None and speculative.summary()["speedup_low"] is None
    assert speculative.speedup_text() == f"{speculative.speedup:.2f}× (1 sample: no interval)"


def _stats(tokens: int, seconds: float) -> dict:
    """The stats of a sample that drafted nothing: ``tokens`` in ``seconds``."""
    return SampleStats(prompt_tokens=2, new_tokens=tokens, target_forwards=tokens, wall_time_s=seconds).to_dict()


@pytest.mark.parametrize("examples", [1, 3])
def test_the_bench_table_gives_the_interval_and_the_tokens(examples):
    """One seed: the speedup column carries the interval over the examples (or says one example has none), and
    the tok/s column the tokens it counts. The interval's fields are added to the seed's metrics as bench's summary
    is to add them (:func:`speedup_interval_fields`)."""
    config = {
        "cells": [BASELINE_CELL, SPECULATIVE_CELL],
        "task": {"name": "xsum", "metrics": [], "per_category": False},
        "data": {"examples": examples},
        "recipe": {"target": {"model": "t"}, "generation": {"max_new_tokens": 12}},
    }
    pairs = [(_stats(10 + i, 0.4 + 0.3 * i), _stats(10 + i, 1.0)) for i in range(examples)]  # speedups 2.5, 1.4, 1
    records = [
        {"cell": cell, "seed": 0, "example_id": str(i), "index": i, "text": "x", "reference": None, "stats": stats}
        for i, pair in enumerate(pairs)
        for cell, stats in zip(("speculative K=1 L=3 T=1", "baseline T=1"), pair)
    ]
    results = summarize(config, records)
    baseline, speculative = (cell.per_seed["0"] for cell in results.cells)
    speculative.update(speedup_interval_fields(pairs))  # what bench's summary adds to each seed's metrics
    header, body = rows(results)
    tokens = sum(10 + example for example in range(examples))
    assert body[0][header.index("tok/s (tokens)")] == f"{baseline['tokens_per_second']:.1f} ({tokens})"
    speedup = body[1][header.index("speedup")]
    axis = figure(results).axes[0]
    if examples == 1:
        assert speedup == f"{speculative['speedup']:.2f} (1 sample: no interval)"
        assert axis.get_xlabel().endswith("(one seed: no spread)")
    else:
        low, high = speedup_interval([tuple(RunRate(s["new_tokens"], s["wall_time_s"]) for s in p) for p in pairs])
        assert speedup == f"{speculative['speedup']:.2f} [{low:.2f}–{high:.2f}]" and low < high
        assert axis.get_xlabel().endswith("(one seed: 95% interval over the examples)")
        bars = next(c for c in axis.containers if hasattr(c, "errorbar"))
        (start, _), (end, _) = bars.errorbar.lines[2][0].get_segments()[1]  # the speculative bar's
        assert (start, end) == pytest.approx((low, high))
    plt.close(axis.figure)
