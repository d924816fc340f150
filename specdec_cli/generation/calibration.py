"""Does the draft pay on this machine, and at how many threads? A short measurement of a decoder's forward
costs, cached.

Speculation is faster than the target alone only when a draft forward is cheap next to a target
forward. On a CPU without native bfloat16, for example, a bfloat16 draft can cost more than a
float32 target many times its size. :func:`draft_cost` measures both forwards with the engine's
own timers (a few short generations of each, the first untimed; the least time of each quantity,
since a busy machine only ever adds time) and caches the result beside the converted weights, with
its date, the thread count and the CPU's load.

A busy CPU (other jobs on a shared machine) slows every figure, and a second intra-op thread can then cost
more than it gives. When the user fixed no thread count (no ``--threads``, no OMP_NUM_THREADS), the count is
chosen: on a busy CPU (a load average above the core count), one thread at once, measured there only (timing the
default count too cost a busy 2-core machine 90 s a run, and one thread is the steady choice there:
benchmarks/results/busy_cpu_threads.md), taken before the models load where the command asks
(:func:`take_one_thread_when_busy`: the warm-up alone took 28 s at two threads there, 3 s at one); on a quiet
one, the faster of torch's default and one thread, measured both ways and cached. A figure measured while the CPU
was busy (that load, or repeats :data:`~.calibration_figures._MAX_SPREAD` times apart) serves this run's note,
which says so, but is never cached as the machine's. A cached figure is measured again when asked, when it is a
month old, when the load has moved by a core's worth since (:meth:`CpuLoad.changed_since`), and when it cannot
be right (a damaged entry, a forward slower than :func:`slowest_plausible_s`, or a smaller draft of the same dtype
slower than the target scoring a whole block).
:func:`draft_cost_note` (in :mod:`.calibration_figures`) turns it into one honest line when the draft does not
pay or the CPU is busy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from dataclasses import MISSING, asdict, dataclass, fields, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch

from ..base.inputs import cache_dir, write_cache_file
from ..base.recipe import AUTOREGRESSIVE
from ..base.waits import waiting
from ..engine.decoder import SpeculativeDecoder
from ..results.provenance import cpu_model
from ..results.stats import SampleStats
from .calibration_figures import CpuLoad, DraftCost, draft_cost_note, thread_count

_CALIBRATION_TOKENS = 8
_REPEATS = 3
_MAX_AGE = timedelta(days=30)
# The slowest a forward can be on any CPU of the last decade, one thread, nothing else running: every weight
# read once at 1 GB/s, or two FLOPs per weight and position at 1 GFLOP/s, whichever is slower, plus 0.1 s of
# Python and framework work per forward. One thread of a 2-core AMD EPYC shared with other jobs multiplied a
# 4096 x 4096 matrix by a vector at 5.6-12 GB/s and 6-47 GFLOP/s (float32 and bfloat16): five times the floors
# or more, on a machine as loaded as the one these floors must not mistake for a slow one.
_BYTES_PER_S_FLOOR = 1e9
_FLOPS_FLOOR = 1e9
_FORWARD_OVERHEAD_S = 0.1


_SET_ASIDE: list[int] = []
"""torch's thread count before :func:`take_one_thread_when_busy` took one thread (empty: it took none). Process-wide,
as the thread count itself is."""


def take_one_thread_when_busy() -> None:
    """For a run that chooses its own thread count (no ``--threads``, no OMP_NUM_THREADS), before its models load: one
    thread on a CPU busy now, so that loading and the warm-up do not run at the slower count; the count set aside is
    what :func:`draft_cost` then reports as not taken. On a quiet CPU nothing: the calibration times both counts."""
    load = cpu_load()
    if "OMP_NUM_THREADS" in os.environ or load is None or not load.busy or torch.get_num_threads() == 1:
        return
    _SET_ASIDE.append(torch.get_num_threads())
    torch.set_num_threads(1)


def cpu_load() -> CpuLoad | None:
    """The CPU's load now; None where the platform keeps no load average (Windows)."""
    try:
        average = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return CpuLoad(average, os.cpu_count() or 1)


def draft_cost(
    decoder: SpeculativeDecoder, prompt_ids: list[int], recalibrate: bool = False, choose_threads: bool = False
) -> DraftCost | None:
    """The decoder's forward costs on this machine: the cached figure if it can be trusted (and
    ``recalibrate`` is off), else measured now (a few seconds) and cached unless the CPU was busy. None when a
    fresh measurement cannot be right and no busy CPU explains it: no figure says less than a wrong one.

    ``choose_threads`` (the user gave no ``--threads``): unless OMP_NUM_THREADS fixes the count, the figure is of
    the thread count chosen on a CPU (:func:`_chosen`), its ``threads``, which the caller applies; torch is left at
    the count it had, whatever the measurement set meanwhile."""
    entry = torch.get_num_threads()
    try:
        return _draft_cost(decoder, prompt_ids, recalibrate, choose_threads)
    finally:  # a measurement stopped half-way (Ctrl-C, out of memory) leaves the run at its own count too
        torch.set_num_threads(entry)


def _draft_cost(
    decoder: SpeculativeDecoder, prompt_ids: list[int], recalibrate: bool, choose_threads: bool
) -> DraftCost | None:
    """:func:`draft_cost`, which restores torch's thread count around it."""
    on_cpu = decoder.device.type == "cpu"
    default = _SET_ASIDE[-1] if _SET_ASIDE else torch.get_num_threads()
    choosing = choose_threads and on_cpu and "OMP_NUM_THREADS" not in os.environ and default > 1
    machine = _machine(decoder)
    path = cache_dir() / "calibration" / f"{_key(decoder, machine, choosing)}.json"
    cached = None if recalibrate else _read_cached(path)
    if cached is not None and _trusted(cached, decoder, choosing):
        return cached
    load = cpu_load()
    with waiting(_measuring(decoder, choosing, load)):
        cost = _chosen(decoder, prompt_ids, load, default) if choosing else _measure(decoder, prompt_ids, machine)
    if cost.busy:
        return cost  # this run's figure, which its note calls a busy CPU's; never the machine's
    if not _plausible(cost, decoder):
        return None
    write_cache_file(path, json.dumps(asdict(cost)))  # one that cannot be written only costs measuring again
    return cost


def _trusted(cached: DraftCost, decoder: SpeculativeDecoder, choosing: bool) -> bool:
    """A cached figure can stand for now: plausible, of a thread count when one is to be chosen, and measured at
    about today's load (a figure with no load recorded is kept until it is a month old)."""
    now = cpu_load()
    load_moved = cached.load is not None and now is not None and now.changed_since(cached.load)
    return _plausible(cached, decoder) and (cached.threads >= 1 or not choosing) and not load_moved


def _measuring(decoder: SpeculativeDecoder, choosing: bool, load: CpuLoad | None) -> str:
    """What the measurement is doing, said while it lasts (a few seconds quiet, a minute or more busy)."""
    if load is not None and load.busy:
        return f"measuring what the draft and the target cost here for this run only (the CPU is busy: {load})"
    counts = f" at {thread_count(torch.get_num_threads())} and at 1 thread, to take the faster" if choosing else ""
    return f"measuring what the draft and the target cost on this machine{counts} (once: cached for later runs)"


def _chosen(decoder: SpeculativeDecoder, prompt_ids: list[int], load: CpuLoad | None, default: int) -> DraftCost:
    """The figure at the thread count chosen for ``load``: on a busy CPU one thread, taken at once (or before the
    models loaded) and measured there only (``default``, torch's count, is the slower one recorded, with no time:
    not measured; the figure keeps the load that chose, so it is never cached as a quiet CPU's choice); else the
    faster of the default and one thread (:func:`_fastest`)."""
    if load is None or not load.busy:
        torch.set_num_threads(default)  # a CPU that has gone quiet since one thread was taken: both are timed
        return _fastest(decoder, prompt_ids)
    torch.set_num_threads(1)
    cost = _measure(decoder, prompt_ids, _machine(decoder))
    return replace(cost, slower_threads=default, load=load.average, cores=load.cores)


def _fastest(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> DraftCost:
    """Measured at torch's current thread count and at one thread: the one whose block (draft steps and the
    target's scoring) is faster, with the other's block time."""
    costs = []
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        costs.append(_measure(decoder, prompt_ids, _machine(decoder)))
    faster, slower = sorted(costs, key=lambda cost: cost.block_s(decoder.draft_length))  # a tie keeps the default
    return replace(faster, slower_threads=slower.threads, slower_block_s=slower.block_s(decoder.draft_length))


def _measure(decoder: SpeculativeDecoder, prompt_ids: list[int], machine: str) -> DraftCost:
    """The least time per forward of each kind over a few short generations with the draft and without, with the
    load the CPU had and how far apart the repeats were."""
    load = cpu_load()
    speculative = _timed_runs(decoder, prompt_ids)
    alone = _timed_runs(decoder.with_config(verifier=AUTOREGRESSIVE), prompt_ids)
    per_forward = {
        "target_token_s": [s.target_time_s / max(s.target_forwards, 1) for s in alone],
        "target_block_s": [s.target_time_s / max(s.target_forwards, 1) for s in speculative],
        "draft_s": [s.draft_time_s / max(s.draft_forwards, 1) for s in speculative],
    }
    return DraftCost(
        **{name: min(times) for name, times in per_forward.items()},
        acceptance=sum(s.token_acceptance for s in speculative) / len(speculative),
        machine=machine,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        threads=torch.get_num_threads(),
        load=None if load is None else load.average,
        cores=0 if load is None else load.cores,
        spread=max(_spread(times) for times in per_forward.values()),
    )


def _spread(times: list[float]) -> float:
    """The middle time over the least (1 for a zero least: no forward takes no time, and :func:`_plausible`
    turns such a figure down)."""
    least = min(times)
    return statistics.median(times) / least if least > 0 else 1.0


def _timed_runs(decoder: SpeculativeDecoder, prompt_ids: list[int]) -> list[SampleStats]:
    """Statistics of :data:`_REPEATS` short generations after an untimed one (lazy initialisation is
    not the steady cost)."""
    probe = decoder.with_config(max_new_tokens=_CALIBRATION_TOKENS)
    probe.generate_ids(prompt_ids, key=-1)
    return [probe.generate_ids(prompt_ids, key=-2 - repeat)[2] for repeat in range(_REPEATS)]


def _read_cached(path: Path) -> DraftCost | None:
    """The cached figure, or None when there is none or it is not one (damaged, another shape, an older
    format without a date): it is then measured again, never trusted. An entry from before the thread count
    and load were recorded takes their defaults."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    kinds = {f.name: f.type for f in fields(DraftCost)}
    required = {f.name for f in fields(DraftCost) if f.default is MISSING}
    if not isinstance(entry, dict) or not required <= entry.keys() <= kinds.keys():
        return None
    if not all(
        isinstance(value, _JSON_TYPES[kinds[name]]) and not isinstance(value, bool) for name, value in entry.items()
    ):
        return None
    return DraftCost(**entry)


_JSON_TYPES = {"float": (int, float), "int": (int,), "str": (str,), "float | None": (int, float, type(None))}
"""What JSON gives for each annotation of :class:`DraftCost`."""


def _plausible(cost: DraftCost, decoder: SpeculativeDecoder) -> bool:
    """Whether ``cost`` can be this machine's: positive finite times, an acceptance in [0, 1], measured
    less than :data:`_MAX_AGE` ago, no forward slower than :func:`slowest_plausible_s`, and no draft step slower
    than the target's forward over a whole block when every draft is smaller than the target and of its dtype (a
    busy machine measured, not the model)."""
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
    return not (like_the_target and cost.draft_s > cost.target_block_s) and _within_floors(cost, decoder)


def slowest_plausible_s(parameters: int, weight_bytes: int, positions: int) -> float:
    """The longest one forward over ``positions`` positions of a model of ``parameters`` weights (``weight_bytes``
    in all) can take on one core of any CPU of the last decade: reading every weight once at
    :data:`_BYTES_PER_S_FLOOR` or two FLOPs per weight and position at :data:`_FLOPS_FLOOR`, whichever is
    slower, plus :data:`_FORWARD_OVERHEAD_S`."""
    reading = weight_bytes / _BYTES_PER_S_FLOOR
    computing = 2 * parameters * positions / _FLOPS_FLOOR
    return _FORWARD_OVERHEAD_S + max(reading, computing)


def _within_floors(cost: DraftCost, decoder: SpeculativeDecoder) -> bool:
    """No forward of ``cost`` slower than :func:`slowest_plausible_s` allows for its models: the target's over one
    position and over a block of each draft's L + 1, a draft step's over one position of each draft."""
    speculation = decoder.config.speculation
    target, drafts = [decoder.target.model], [model.model for model in _draft_models(decoder)]
    forwards = [  # (seconds, models, positions)
        (cost.target_token_s, target, 1),
        (cost.target_block_s, target, speculation.num_drafts * (speculation.draft_length + 1)),
        (cost.draft_s, drafts, speculation.num_drafts),
    ]
    return all(seconds <= _slowest_s(models, positions, cost.machine) for seconds, models, positions in forwards)


def _slowest_s(models: list[torch.nn.Module], positions: int, machine: str) -> float:
    """:func:`slowest_plausible_s` summed over ``models``; no bound for half precision that a CPU does in software
    (float16, or bfloat16 without native instructions): how slow that is has no floor to vouch for."""
    if any(_emulated(model, machine) for model in models):
        return math.inf
    return sum(slowest_plausible_s(_size(model), _weight_bytes(model), positions) for model in models)


def _emulated(model: torch.nn.Module, machine: str) -> bool:
    if model.device.type != "cpu":
        return False
    return model.dtype == torch.float16 or (model.dtype == torch.bfloat16 and "no native bfloat16" in machine)


def _size(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


def busy_cpu_note(threads: int) -> str | None:
    """For a run that times models on the CPU at ``threads`` threads (``bench``): one line when other jobs keep the
    CPU busy now, since its speed figures are then the moment's, not the machine's; None on a quiet CPU."""
    load = cpu_load()
    if load is None or not load.busy:
        return None
    advice = "a quieter moment gives this machine's own figures"
    if threads > 1:
        advice = f"--threads 1 often gives steadier ones (compare runs only at the same setting), and {advice}"
    return f"the CPU is busy ({load}): speed figures are slower and noisier than this machine's; {advice}"


@dataclass(frozen=True)
class Calibration:
    """What calibrating a decoder on this machine found: the note to show before decoding, and the thread count
    chosen for the run, which the caller applies (None: keep torch's)."""

    note: str | None
    threads: int | None = None


def calibrate(
    decoder: SpeculativeDecoder, prompt_ids: list[int], recalibrate: bool = False, choose_threads: bool = False
) -> Calibration:
    """:func:`draft_cost_note` for a speculative decoder (None for the target alone, when the draft pays on a quiet
    CPU, or when no trustworthy figure could be measured), and the thread count to run at. ``recalibrate``: measure
    again, whatever is cached. ``choose_threads`` (the user gave no ``--threads``): the faster of torch's default
    thread count and one thread (:func:`draft_cost`)."""
    if decoder.verifier is None or not _draft_models(decoder):  # a drafter without a model costs no forward
        return Calibration(None)
    cost = draft_cost(decoder, prompt_ids, recalibrate, choose_threads)
    if cost is None:
        return Calibration(None)
    bfloat16_draft = any(model.model.dtype == torch.bfloat16 for model in _draft_models(decoder))
    threads = cost.threads if choose_threads and cost.threads >= 1 else None
    return Calibration(draft_cost_note(cost, decoder.draft_length, bfloat16_draft), threads)


def note_for(
    decoder: SpeculativeDecoder, prompt_ids: list[int], recalibrate: bool = False, choose_threads: bool = False
) -> str | None:
    """:func:`calibrate`'s note alone (its thread count is the caller's to apply)."""
    return calibrate(decoder, prompt_ids, recalibrate, choose_threads).note


def _draft_models(decoder: SpeculativeDecoder) -> list:
    """The loaded models the decoder's drafters draft with."""
    return [draft.model for draft in decoder.drafts if draft.model is not None]


def _machine(decoder: SpeculativeDecoder) -> str:
    device = decoder.device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def _key(decoder: SpeculativeDecoder, machine: str, choosing: bool) -> str:
    """The cache entry's name: the machine (with torch's thread count before any choice), the versions, the models
    and the speculation; a figure whose thread count was chosen has its own entry."""
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
    parts += ["the faster of these threads and one"] if choosing else []
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
