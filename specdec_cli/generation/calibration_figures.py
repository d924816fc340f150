"""What a calibration measured and what it tells the user: the figures (:class:`DraftCost`, taken at a
:class:`CpuLoad`) and :func:`draft_cost_note`, the one line they give when the draft does not pay or the CPU is busy.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_SPREAD = 3.0
"""Repeats of a short generation whose middle time is this many times their least: another job had the cores
(on a quiet machine they agree within a few per cent; a shared 2-core machine at load 3 to 5 gave 0.4 to 6.6
tokens/s from one run to the next)."""


@dataclass(frozen=True)
class CpuLoad:
    """The 1-minute load average (runnable tasks, system-wide) and the machine's core count."""

    average: float
    cores: int

    @property
    def busy(self) -> bool:
        """More runnable tasks than cores: every thread waits for its turn, and a run's threads for each other."""
        return self.average > self.cores

    def __str__(self) -> str:
        return f"load {self.average:.1f} on {self.cores} cores"

    def changed_since(self, average: float) -> bool:
        """Whether the load moved by a core's worth or more since ``average`` (a quarter of the cores on more than
        four): enough to change how many of a run's threads find a free core, so which thread count is faster."""
        return abs(self.average - average) >= max(1.0, self.cores / 4)


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
    threads: int = 0
    """torch's intra-op threads while measuring (0: not recorded)."""
    slower_threads: int = 0
    """The other thread count the choice set aside (0: none; the user fixed the count, or it is one)."""
    slower_block_s: float = 0.0
    """A block's time (:meth:`block_s`) at ``slower_threads``; 0: not measured (a busy CPU took one thread at
    once)."""
    load: float | None = None
    """The 1-minute load average when measured (None: not known)."""
    cores: int = 0
    """The machine's cores when measured (0: not known)."""
    spread: float = 1.0
    """The widest ratio, over the three times, of the middle timed run's to the least."""

    def block_s(self, draft_length: int) -> float:
        """A block's time: ``draft_length`` draft steps and the target's scoring forward."""
        return draft_length * self.draft_s + self.target_block_s

    def speedup(self, acceptance: float, draft_length: int) -> float:
        """Expected token rate over the target alone's: tokens a block commits, (1 − α^(L+1)) / (1 − α),
        times the target's time per token, over a block's time (L draft steps and one scoring forward)."""
        tokens = draft_length + 1 if acceptance >= 1 else (1 - acceptance ** (draft_length + 1)) / (1 - acceptance)
        block = self.block_s(draft_length)
        return tokens * self.target_token_s / block if block else 0.0

    @property
    def busy_load(self) -> bool:
        """The load average was above the core count."""
        return self.load is not None and CpuLoad(self.load, self.cores).busy

    @property
    def busy(self) -> bool:
        """Measured while the CPU was busy: slower than this machine can do, so not its figure."""
        return self.busy_load or self.spread > _MAX_SPREAD


def draft_cost_note(cost: DraftCost, draft_length: int, bfloat16_draft: bool) -> str | None:
    """One line when the CPU was busy (:func:`_busy_note`) or speculation cannot pay here: the measured costs, and
    what would make it pay."""
    if cost.busy:
        return _busy_note(cost, draft_length)
    best, likely = cost.speedup(1.0, draft_length), cost.speedup(cost.acceptance, draft_length)
    if likely >= 1:
        return None
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
    return (
        f"note: on this machine ({cost.machine}) {_figures(cost)}, {verdict}; {remedy} would make it pay ({measured}, "
        "cached; --recalibrate measures again)"
    )


def _busy_note(cost: DraftCost, draft_length: int) -> str:
    """The CPU was busy: the figures are of this moment, not of the machine, so no verdict on the draft; what the
    run did about it (the thread count it chose) or what the user can do."""
    if cost.busy_load:
        busy = f"the CPU is busy ({CpuLoad(cost.load, cost.cores)})"
    else:
        busy = f"the CPU was busy while measuring (repeats {cost.spread:.1f}× apart)"
    quieter = "a quieter moment gives this machine's own speed"
    chosen, other = thread_count(cost.threads), thread_count(cost.slower_threads)
    if cost.slower_threads and cost.slower_block_s:
        faster = cost.slower_block_s / cost.block_s(draft_length)
        remedy = f"this run uses {chosen}, {faster:.1f}× as fast here now as {other} ({_CHOOSE}); {quieter}"
    elif cost.slower_threads:
        remedy = f"this run uses {chosen}, not {other}, the steady count on a busy CPU ({_CHOOSE}); {quieter}"
    elif cost.threads > 1:
        remedy = f"--threads 1 may run faster while it lasts, and {quieter}"
    else:
        remedy = quieter
    return f"note: {busy}: {_figures(cost)}, slower than this machine can do (measured now, not cached); {remedy}"


_CHOOSE = "--threads N sets the count and skips this choice"
"""How a user takes the thread count into their own hands: the run then times no other count."""


def _figures(cost: DraftCost) -> str:
    return (
        f"a draft step takes {cost.draft_s * 1e3:.0f} ms and the target {cost.target_token_s * 1e3:.0f} ms per token "
        f"alone, {cost.target_block_s * 1e3:.0f} ms to score a block"
    )


def thread_count(count: int) -> str:
    return f"{count} thread" if count == 1 else f"{count} threads"
