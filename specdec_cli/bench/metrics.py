"""Quality and speed metrics of a benchmark cell."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

from ..results.stats import RunRate, engine_counters, position_totals, speedup_interval


def corpus_quality(metrics: Sequence[str], hypotheses: list[str], references: list[str | None]) -> dict:
    """Corpus BLEU and chrF (sacrebleu, with their signatures) and mean ROUGE-L F1 (rouge-score)."""
    pairs = [(h, r) for h, r in zip(hypotheses, references) if r is not None]
    if not pairs:
        return {}
    hyps, refs = [h for h, _ in pairs], [r for _, r in pairs]
    scores: dict = {}
    if "bleu" in metrics or "chrf" in metrics:
        from sacrebleu.metrics import BLEU, CHRF

        for name, metric in (("bleu", BLEU()), ("chrf", CHRF())):
            if name in metrics:
                scores[name] = metric.corpus_score(hyps, [refs]).score
                scores[f"{name}_signature"] = str(metric.get_signature())
    if "rougeL" in metrics:
        scores["rougeL"] = rouge_l(hyps, refs)
    return scores


def rouge_l(hypotheses: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F1 × 100 over the pairs (rouge-score, with stemming)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    values = [scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hypotheses, references)]
    return 100 * sum(values) / len(values)


def expected_speedup(alpha: float, draft_length: int, cost_ratio: float) -> float:
    """Leviathan et al. (2023), Theorem 3.8: (1 - α^(L+1)) / ((1 - α)(L c + 1))."""
    if alpha >= 1:
        return (draft_length + 1) / (draft_length * cost_ratio + 1)
    return (1 - alpha ** (draft_length + 1)) / ((1 - alpha) * (draft_length * cost_ratio + 1))


STAT_TOTALS = (
    "new_tokens",
    "target_forwards",
    "draft_forwards",
    "drafted_tokens",
    "verified_tokens",
    "accepted_tokens",
    "draft_time_s",
    "target_time_s",
    "verify_time_s",
    "wall_time_s",
)
"""The counts and times of a sample's ``stats`` that a cell's speed metrics add up."""


def share_time(stats: dict) -> float:
    """A sample's share of its batch's time (tokens over shares is a batch's throughput): its wall time when it ran
    alone, and in results written before batches, which have no shares."""
    return stats.get("share_time_s") or stats["wall_time_s"]


def speed_summary(stats: list[dict]) -> dict:
    """Pooled speed metrics of one cell's samples (their ``stats`` dicts), with the engines' counters
    (:func:`~specdec_cli.results.stats.engine_counters`) derived from the counts every record has."""
    total = {key: sum(s[key] for s in stats) for key in STAT_TOTALS}
    total["share_time_s"] = sum(share_time(s) for s in stats)
    drafted = position_totals([s["drafted_per_position"] for s in stats])
    accepted = position_totals([s["accepted_per_position"] for s in stats])
    # Over the positions some draft proposed; the accepted counts may run on to L (vLLM's shape) with zeros.
    per_position = [_ratio(a, d) for d, a in zip(drafted, itertools.chain(accepted, itertools.repeat(0)))]
    forward = [s.get("forward_time_s") for s in stats]  # absent from results written before it was measured
    overhead = {} if None in forward else {"engine_overhead": 1 - _ratio(sum(forward), total["wall_time_s"])}
    drafts = drafted[0] if drafted else 0  # every draft proposes its first position
    return {
        **total,
        **overhead,
        "samples": len(stats),
        "block_efficiency": _ratio(total["new_tokens"], total["target_forwards"]),
        "acceptance_rate": _ratio(total["accepted_tokens"], total["drafted_tokens"]),
        "token_acceptance": _ratio(total["accepted_tokens"], total["verified_tokens"]),
        "acceptance_per_position": per_position,
        **engine_counters(drafts, total["drafted_tokens"], total["accepted_tokens"], accepted),
        "tokens_per_second": _ratio(total["new_tokens"], total["share_time_s"]),
        "draft_s_per_forward": _ratio(total["draft_time_s"], total["draft_forwards"]),
        "target_s_per_forward": _ratio(total["target_time_s"], total["target_forwards"]),
    }


def speedup_interval_fields(pairs: list[tuple[dict, dict]]) -> dict:
    """The interval of a speedup over the baseline measured on ``pairs`` ((sample's stats, the baseline's stats
    on the same example and seed)): ``speedup_low`` and ``speedup_high`` (see
    :func:`~specdec_cli.results.stats.speedup_interval`; absent for one pair) and ``speedup_samples``, the pairs
    it rests on. Each run's rate is its tokens over its :func:`share_time`, as the pooled speedup's."""
    interval = speedup_interval([(_run_rate(mine), _run_rate(theirs)) for mine, theirs in pairs])
    bounds = {} if interval is None else {"speedup_low": interval[0], "speedup_high": interval[1]}
    return bounds | {"speedup_samples": len(pairs)}


def mean_and_std(values: list[float]) -> dict:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    if not finite:
        return {"mean": None, "std": None, "n": 0}
    return {
        "mean": statistics.fmean(finite),
        "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
        "n": len(finite),
    }


def spread(values: list[float]) -> dict | None:
    """Median, quartiles and range of ``values`` (per-example speedups): how far one example's figure
    strays from the pooled one. None without values."""
    if not values:
        return None
    # statistics.quantiles needs two values; one value is its own median and quartiles.
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": median, "q1": q1, "q3": q3, "min": min(values), "max": max(values), "n": len(values)}


def _run_rate(stats: dict) -> RunRate:
    return RunRate(tokens=stats["new_tokens"], seconds=share_time(stats))


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
