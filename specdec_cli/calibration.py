"""Does the draft pay on this machine? One short measurement of a decoder's forward costs, cached.

Speculation is faster than the target alone only when a draft forward is cheap next to a target
forward. On a CPU without native bfloat16, for example, a bfloat16 draft can cost more than a
float32 target many times its size. :func:`draft_cost` measures both forwards with the engine's
own timers (two short generations, the first untimed), and caches the result beside the
converted weights. :func:`draft_cost_note` turns it into one honest line when the draft does not pay.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from .engine import SpeculativeDecoder
from .inputs import cache_dir, write_cache_file
from .provenance import cpu_model
from .recipe import AUTOREGRESSIVE
from .stats import SampleStats

_CALIBRATION_TOKENS = 16


@dataclass(frozen=True)
class DraftCost:
    """Seconds per forward of the target alone (one token), of the target scoring a block, and of a
    draft step; and the per-token acceptance seen while measuring them."""

    target_token_s: float
    target_block_s: float
    draft_s: float
    acceptance: float
    machine: str

    def speedup(self, acceptance: float, draft_length: int) -> float:
        """Expected token rate over the target alone's: tokens a block commits, (1 − α^(L+1)) / (1 − α),
        times the target's time per token, over a block's time (L draft steps and one scoring forward)."""
        tokens = draft_length + 1 if acceptance >= 1 else (1 - acceptance ** (draft_length + 1)) / (1 - acceptance)
        block = draft_length * self.draft_s + self.target_block_s
        return tokens * self.target_token_s / block if block else 0.0


def draft_cost(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> DraftCost:
    """The decoder's forward costs on this machine: from the cache, or measured now (a few seconds)."""
    machine = _machine(decoder)
    path = cache_dir() / "calibration" / f"{_key(decoder, machine)}.json"
    if path.is_file():
        try:
            return DraftCost(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # a damaged or older cache entry is measured again
    speculative, alone = (_steady_stats(decoder.with_config(**changes), prompt_ids)
                          for changes in ({}, {"verifier": AUTOREGRESSIVE}))  # fmt: skip
    cost = DraftCost(
        target_token_s=alone.target_time_s / max(alone.target_forwards, 1),
        target_block_s=speculative.target_time_s / max(speculative.target_forwards, 1),
        draft_s=speculative.draft_time_s / max(speculative.draft_forwards, 1),
        acceptance=speculative.token_acceptance,
        machine=machine,
    )
    write_cache_file(path, json.dumps(asdict(cost)))
    return cost


def _steady_stats(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> SampleStats:
    """Statistics of a short generation after an untimed one (lazy initialisation is not the steady cost)."""
    probe = decoder.with_config(max_new_tokens=_CALIBRATION_TOKENS)
    probe.generate_ids(prompt_ids, seed=-1)
    return probe.generate_ids(prompt_ids, seed=-2)[2]


def draft_cost_note(cost: DraftCost, draft_length: int, bfloat16_draft: bool) -> str | None:
    """One line when speculation cannot pay here: the measured costs, and what would make it pay."""
    best, likely = cost.speedup(1.0, draft_length), cost.speedup(cost.acceptance, draft_length)
    if likely >= 1:
        return None
    figures = (f"on this machine ({cost.machine}) a draft step takes {cost.draft_s * 1e3:.0f} ms and the target "
               f"{cost.target_token_s * 1e3:.0f} ms per token alone, {cost.target_block_s * 1e3:.0f} ms to score a "
               f"block")  # fmt: skip
    if best < 1:
        verdict = (f"so with L={draft_length} speculation is slower than the target alone even if every draft token "
                   f"is accepted (at most {best:.2f}×)")  # fmt: skip
    else:
        verdict = (f"so at the acceptance measured ({cost.acceptance:.0%}) speculation runs at about {likely:.2f}× "
                   "the target alone")  # fmt: skip
    remedy = "a GPU"
    if bfloat16_draft and "no native bfloat16" in cost.machine:
        remedy += ", or a CPU with native bfloat16 (avx512_bf16 or AMX) for this bfloat16 draft,"
    return f"note: {figures}, {verdict}; {remedy} would make it pay (measured once, cached)"


def note_for(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> str | None:
    """:func:`draft_cost_note` for a speculative decoder (None for the target alone, or when the draft pays)."""
    if decoder.verifier is None:
        return None
    bfloat16_draft = any(d.model.model.dtype == torch.bfloat16 for d in decoder.drafts)
    return draft_cost_note(draft_cost(decoder, prompt_ids), decoder.draft_length, bfloat16_draft)


def _machine(decoder: SpeculativeDecoder) -> str:
    device = decoder.device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def _key(decoder: SpeculativeDecoder, machine: str) -> str:
    config = decoder.config
    models = [decoder.target.name, *(d.model.name for d in decoder.drafts)]
    dtypes = [str(decoder.target.model.dtype), *(str(d.model.model.dtype) for d in decoder.drafts)]
    parts = [machine, torch.__version__, *models, *dtypes, config.speculation.draft_length, config.speculation.num_drafts]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
