"""What a generation returns: per-sample statistics and results."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    """'eos' or 'max_new_tokens'."""

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
        return data


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
