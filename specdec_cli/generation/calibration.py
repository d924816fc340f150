"""Does the draft pay on this machine? A short measurement of a decoder's forward costs, cached.

Speculation is faster than the target alone only when a draft forward is cheap next to a target
forward. On a CPU without native bfloat16, for example, a bfloat16 draft can cost more than a
float32 target many times its size. :func:`draft_cost` measures both forwards with the engine's
own timers (a few short generations of each, the first untimed; the least time of each quantity,
since a busy machine only ever adds time) and caches the result beside the converted weights, with
its date. A cached figure is measured again when asked, when it is a month old, and when it cannot
be right (a damaged entry, or a smaller draft of the same dtype slower than the target scoring a whole block).
:func:`draft_cost_note` turns it into one honest line when the draft does not pay.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch

from ..base.inputs import cache_dir, write_cache_file
from ..base.recipe import AUTOREGRESSIVE
from ..engine.decoder import SpeculativeDecoder
from ..results.provenance import cpu_model
from ..results.stats import SampleStats

_CALIBRATION_TOKENS = 8
_REPEATS = 3
_MAX_AGE = timedelta(days=30)


@dataclass(frozen=True)
class DraftCost:
    """Seconds per forward of the target alone (one token), of the target scoring a block, and of a
    draft step; and the per-token acceptance seen while measuring them."""

    target_token_s: float
    target_block_s: float
    draft_s: float
    acceptance: float
    machine: str
    measured_at: str = ""
    """When (ISO 8601, UTC); "" for a figure not measured here."""

    def speedup(self, acceptance: float, draft_length: int) -> float:
        """Expected token rate over the target alone's: tokens a block commits, (1 − α^(L+1)) / (1 − α),
        times the target's time per token, over a block's time (L draft steps and one scoring forward)."""
        tokens = draft_length + 1 if acceptance >= 1 else (1 - acceptance ** (draft_length + 1)) / (1 - acceptance)
        block = draft_length * self.draft_s + self.target_block_s
        return tokens * self.target_token_s / block if block else 0.0


def draft_cost(decoder: SpeculativeDecoder, prompt_ids: list[int], recalibrate: bool = False) -> DraftCost | None:
    """The decoder's forward costs on this machine: the cached figure if it can be trusted (and
    ``recalibrate`` is off), else measured now (a few seconds) and cached. None when even a fresh
    measurement cannot be right (a machine too busy to measure): no figure says less than a wrong one."""
    machine = _machine(decoder)
    path = cache_dir() / "calibration" / f"{_key(decoder, machine)}.json"
    cached = None if recalibrate else _read_cached(path)
    if cached is not None and _plausible(cached, decoder):
        return cached
    cost = _measure(decoder, prompt_ids, machine)
    if not _plausible(cost, decoder):
        return None
    write_cache_file(path, json.dumps(asdict(cost)))  # one that cannot be written only costs measuring again
    return cost


def _measure(decoder: SpeculativeDecoder, prompt_ids: list[int], machine: str) -> DraftCost:
    """The least time per forward of each kind over a few short generations with the draft and without."""
    speculative = _timed_runs(decoder, prompt_ids)
    alone = _timed_runs(decoder.with_config(verifier=AUTOREGRESSIVE), prompt_ids)
    return DraftCost(
        target_token_s=min(s.target_time_s / max(s.target_forwards, 1) for s in alone),
        target_block_s=min(s.target_time_s / max(s.target_forwards, 1) for s in speculative),
        draft_s=min(s.draft_time_s / max(s.draft_forwards, 1) for s in speculative),
        acceptance=sum(s.token_acceptance for s in speculative) / len(speculative),
        machine=machine,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _timed_runs(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> list[SampleStats]:
    """Statistics of :data:`_REPEATS` short generations after an untimed one (lazy initialisation is
    not the steady cost)."""
    probe = decoder.with_config(max_new_tokens=_CALIBRATION_TOKENS)
    probe.generate_ids(prompt_ids, key=-1)
    return [probe.generate_ids(prompt_ids, key=-2 - repeat)[2] for repeat in range(_REPEATS)]


def _read_cached(path: Path) -> DraftCost | None:
    """The cached figure, or None when there is none or it is not one (damaged, another shape, an older
    format): it is then measured again, never trusted."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    names = {f.name: f.type for f in fields(DraftCost)}
    if not isinstance(entry, dict) or entry.keys() != names.keys():
        return None
    if not all(
        isinstance(entry[name], str if kind == "str" else (int, float)) and not isinstance(entry[name], bool)
        for name, kind in names.items()
    ):
        return None
    return DraftCost(**entry)


def _plausible(cost: DraftCost, decoder: SpeculativeDecoder) -> bool:
    """Whether ``cost`` can be this machine's: positive finite times, an acceptance in [0, 1], measured
    less than :data:`_MAX_AGE` ago, and no draft step slower than the target's forward over a whole block
    when every draft is smaller than the target and of its dtype (a busy machine measured, not the model)."""
    times = (cost.target_token_s, cost.target_block_s, cost.draft_s)
    if not all(math.isfinite(t) and t > 0 for t in times) or not 0 <= cost.acceptance <= 1:
        return False
    try:
        age = datetime.now(timezone.utc) - datetime.fromisoformat(cost.measured_at)
    except (ValueError, TypeError):  # not a date, or one without its time zone
        return False
    if not timedelta(0) <= age <= _MAX_AGE:
        return False
    target = decoder.target.model
    like_the_target = all(
        model.model.dtype == target.dtype and _size(model.model) < _size(target) for model in _draft_models(decoder)
    )
    return not (like_the_target and cost.draft_s > cost.target_block_s)


def _size(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def draft_cost_note(cost: DraftCost, draft_length: int, bfloat16_draft: bool) -> str | None:
    """One line when speculation cannot pay here: the measured costs, and what would make it pay."""
    best, likely = cost.speedup(1.0, draft_length), cost.speedup(cost.acceptance, draft_length)
    if likely >= 1:
        return None
    figures = (
        f"on this machine ({cost.machine}) a draft step takes {cost.draft_s * 1e3:.0f} ms and the target "
        f"{cost.target_token_s * 1e3:.0f} ms per token alone, {cost.target_block_s * 1e3:.0f} ms to score a "
        f"block"
    )
    if best < 1:
        verdict = (
            f"so with L={draft_length} speculation is slower than the target alone even if every draft token "
            f"is accepted (at most {best:.2f}×)"
        )
    else:
        verdict = (
            f"so at the acceptance measured ({cost.acceptance:.0%}) speculation runs at about {likely:.2f}× "
            "the target alone"
        )
    remedy = "a GPU"
    if bfloat16_draft and "no native bfloat16" in cost.machine:
        remedy += ", or a CPU with native bfloat16 (avx512_bf16 or AMX) for this bfloat16 draft,"
    measured = f"measured {cost.measured_at[:10]}" if cost.measured_at else "measured"
    return f"note: {figures}, {verdict}; {remedy} would make it pay ({measured}, cached; --recalibrate measures again)"


def note_for(decoder: SpeculativeDecoder, prompt_ids: list[int], recalibrate: bool = False) -> str | None:
    """:func:`draft_cost_note` for a speculative decoder (None for the target alone, when the draft pays,
    or when no trustworthy figure could be measured). ``recalibrate``: measure again, whatever is cached."""
    if decoder.verifier is None or not _draft_models(decoder):  # a drafter without a model costs no forward
        return None
    cost = draft_cost(decoder, prompt_ids, recalibrate)
    if cost is None:
        return None
    bfloat16_draft = any(model.model.dtype == torch.bfloat16 for model in _draft_models(decoder))
    return draft_cost_note(cost, decoder.draft_length, bfloat16_draft)


def _draft_models(decoder: SpeculativeDecoder) -> list:
    """The loaded models the decoder's drafters draft with."""
    return [draft.model for draft in decoder.drafts if draft.model is not None]


def _machine(decoder: SpeculativeDecoder) -> str:
    device = decoder.device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def _key(decoder: SpeculativeDecoder, machine: str) -> str:
    config = decoder.config
    models = [decoder.target.name, *(model.name for model in _draft_models(decoder))]
    dtypes = [str(decoder.target.model.dtype), *(str(model.model.dtype) for model in _draft_models(decoder))]
    drafters = [(draft.drafter, draft.params) for draft in decoder.drafts]  # prompt lookup changes the acceptance
    parts = [
        machine,
        torch.__version__,
        *models,
        *dtypes,
        config.speculation.draft_length,
        config.speculation.num_drafts,
    ]
    parts += drafters if any(draft.model is None for draft in decoder.drafts) else []  # old keys stay valid
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
