"""What a generation returns: per-sample statistics and results; the engines' names for its counts, and the
interval of a speedup measured on paired samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

INTERVAL_LEVEL = 0.95
"""The confidence level of a speedup's interval."""
BOOTSTRAP_RESAMPLES = 2000
"""Draws of the speedup's bootstrap: enough that each 2.5 % tail holds 50 of them."""
NO_INTERVAL = "1 sample: no interval"
"""What a speedup measured on one sample says in place of its interval."""


@dataclass
class SampleStats:
    prompt_tokens: int
    new_tokens: int = 0
    """Tokens committed after the prompt (EOS included when generated)."""
    target_forwards: int = 0
    draft_forwards: int = 0
    """Forward calls of draft models (one call scores all K drafts of one model)."""
    blocks: int = 0
    drafted_tokens: int = 0
    """Draft positions proposed (L per block, fewer near max_new_tokens)."""
    accepted_tokens: int = 0
    """Draft positions whose token the verifier output (the block went on along a draft)."""
    verified_tokens: int = 0
    """Draft positions the verifier decided on (a block stops verifying at its first rejection)."""
    accepted_per_position: list[int] = field(default_factory=list)
    """[t]: blocks in which draft position t+1 was accepted."""
    drafted_per_position: list[int] = field(default_factory=list)
    """[t]: blocks that proposed a draft position t+1."""
    draft_time_s: float = 0.0
    """Drafting: draft forwards, their sampling laws and draws."""
    target_time_s: float = 0.0
    """Scoring: the target forward and its sampling laws."""
    verify_time_s: float = 0.0
    """The verifier's decision, the block's one device read and the cache rollback."""
    forward_time_s: float = 0.0
    """Inside the models' forward calls (target and drafts): the part that is not the engine's own."""
    wall_time_s: float = 0.0
    share_time_s: float = 0.0
    """Its share of the time it ran in: in a batch, each step's time split evenly among the samples in it (so the
    shares of a batch's samples add up to the batch's time, and tokens over shares is the batch's throughput);
    alone, its wall time."""
    stop_reason: str = ""
    """'eos', 'max_new_tokens' or 'stop_string' (its text completed one of ``generation.stop``)."""

    @property
    def block_efficiency(self) -> float:
        """Tokens committed per target forward, bonus included (tau)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def target_forwards_saved(self) -> int:
        """Target forwards an autoregressive run would have needed beyond this one's."""
        return self.new_tokens - self.target_forwards

    @property
    def engine_overhead(self) -> float:
        """Share of wall time spent outside the models' forward calls: sampling, verification, bookkeeping."""
        return 1 - self.forward_time_s / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def num_drafts(self) -> int:
        """Blocks that proposed at least one draft position: vLLM's drafts (a target alone has none)."""
        return self.drafted_per_position[0] if self.drafted_per_position else 0

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.accepted_tokens, self.num_drafts)

    @property
    def mean_draft_length(self) -> float:
        return mean_draft_length(self.drafted_tokens, self.num_drafts)

    @property
    def token_acceptance(self) -> float:
        """Accepted / verified positions: the per-token acceptance α of Leviathan et al."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    def record_block(self, drafted: int, verified: int, accepted: int) -> None:
        self.blocks += 1
        self.drafted_tokens += drafted
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        for counts, upto in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for t in range(upto):
                counts[t] += 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in (
            "block_efficiency",
            "acceptance_rate",
            "token_acceptance",
            "tokens_per_second",
            "target_forwards_saved",
            "engine_overhead",
        ):
            data[name] = getattr(self, name)
        return data | engine_counters(
            self.num_drafts, self.drafted_tokens, self.accepted_tokens, self.accepted_per_position
        )


def mean_acceptance_length(accepted_tokens: int, drafts: int) -> float:
    """Tokens one draft's block commits, its bonus (or correction) token counted: 1 + accepted tokens per draft,
    as vLLM reports it; 1 without drafts (each target forward commits one token)."""
    return 1 + accepted_tokens / drafts if drafts else 1.0


def mean_draft_length(draft_tokens: int, drafts: int) -> float:
    """Draft positions proposed per draft: the draft length used, below L where a block neared max_new_tokens
    or an adaptive schedule shortened it; 0 without drafts."""
    return draft_tokens / drafts if drafts else 0.0


def engine_counters(drafts: int, draft_tokens: int, accepted_tokens: int, accepted_per_position: list[int]) -> dict:
    """The counts of a sample (or of pooled samples) under vLLM's per-request names (docs/metrics.md maps them),
    with the mean draft length: ``num_draft_tokens`` counts draft positions, one per position whatever the number
    of drafts K, and ``num_accepted_tokens_per_pos[t]`` the drafts whose position t+1 was accepted."""
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted_tokens,
        "num_accepted_tokens_per_pos": list(accepted_per_position),
        "mean_acceptance_length": mean_acceptance_length(accepted_tokens, drafts),
        "mean_draft_length": mean_draft_length(draft_tokens, drafts),
    }


def position_totals(counts: Sequence[list[int]]) -> list[int]:
    """[t]: per-position counts (``drafted_per_position``, ``accepted_per_position``) of several samples, summed
    at draft position t+1."""
    positions = max((len(c) for c in counts), default=0)
    return [sum(c[t] for c in counts if t < len(c)) for t in range(positions)]


@dataclass(frozen=True)
class RunRate:
    """What a sample's token rate is made of: tokens over seconds."""

    tokens: int
    seconds: float


def speedup_interval(
    pairs: Sequence[tuple[RunRate, RunRate]], level: float = INTERVAL_LEVEL, seed: int = 0
) -> tuple[float, float] | None:
    """The ``level`` confidence interval of a pooled speedup (the runs' tokens over their seconds, divided by the
    same ratio of the baseline's runs) measured on paired samples: (run, baseline's run on the same prompt and
    seed).

    A percentile bootstrap over the pairs: they are drawn with replacement, as many as there are, in each of
    :data:`BOOTSTRAP_RESAMPLES` draws, and the interval holds the middle ``level`` of the draws' pooled speedups.
    Whole pairs are drawn, so what a prompt does to both runs (a long output, an early EOS, a slow moment of the
    machine) stays together and the interval shows how the speedup varies from prompt to prompt. The draws come
    from a generator seeded with ``seed``: the same samples give the same interval. With few pairs the percentile
    interval is too narrow rather than too wide; with one it is a point, so one pair gives None.
    """
    if len(pairs) < 2:
        return None
    counts = np.array([[a.tokens, a.seconds, b.tokens, b.seconds] for a, b in pairs], dtype=np.float64)  # [n, 4]
    generator = np.random.default_rng(seed)
    draws = np.stack(
        [counts[generator.integers(0, len(pairs), len(pairs))].sum(axis=0) for _ in range(BOOTSTRAP_RESAMPLES)]
    )  # [R, 4]: each draw's summed tokens and seconds, the run's then the baseline's
    tokens, seconds, base_tokens, base_seconds = draws.T  # [R] each
    timed = (seconds > 0) & (base_seconds > 0) & (base_tokens > 0)  # a draw without time or tokens has no ratio
    if not timed.any():
        return None
    speedups = tokens[timed] / seconds[timed] * base_seconds[timed] / base_tokens[timed]  # [R']
    low, high = np.quantile(speedups, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def describe_speedup(speedup: float, interval: tuple[float, float] | None, samples: int, unit: str = "") -> str:
    """'1.23× [1.10–1.37]' (``unit`` ×): the speedup and its interval; one sample says it has none; several
    without an interval (their baseline had no time) give the speedup alone."""
    if interval is not None:
        low, high = interval
        return f"{speedup:.2f}{unit} [{low:.2f}–{high:.2f}]"
    return f"{speedup:.2f}{unit}" + (f" ({NO_INTERVAL})" if samples == 1 else "")


def token_count(tokens: float) -> str:
    """'(40 tokens)': what a token rate counts, written beside it so rates of different lengths are not compared
    unawares."""
    return f"({tokens:.0f} token{'' if round(tokens) == 1 else 's'})"


@dataclass
class GenerationResult:
    prompt: str
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    """Generated tokens only (the prompt excluded)."""
    text: str
    stats: SampleStats
    accepted_mask: list[bool] = field(default_factory=list)
    """[i]: token_ids[i] was a draft token the verifier accepted (False: the target produced it)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "text": self.text,
            "token_ids": self.token_ids,
            "accepted_mask": self.accepted_mask,
            "stats": self.stats.to_dict(),
        }
