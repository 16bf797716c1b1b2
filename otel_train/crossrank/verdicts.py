"""Straggler detection that holds under synchronization: who is the rank everyone waits for?

Ranks are compared by their arrivals at phase ends, not by wall-clock phase times; scores keep
NVRx semantics, and the model abstains when the data cannot tell (`abstain_reason`).
Design: docs/design/crossrank.md#verdicts.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Literal

from otel_train.config import Config
from otel_train.crossrank.spread import Spread
from otel_train.crossrank.up_row import TimerStats

Category = Literal["data", "compute", "communication", "other"]
Pattern = Literal["chronic", "one_off"]

STEP_END = "step"  # the step's end as a phase end (its arrival is the step time)
UNTIMED = "untimed"  # lateness that arose outside every timer

_COMM = {"allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "reducescatter", "comm"}
_COMM |= {"communication", "collective", "collectives", "nccl", "p2p", "send", "recv", "barrier", "sync"}
_COMM |= {"grad_sync", "gradsync", "broadcast", "alltoall", "all2all"}
_DATA = {"data", "dataloader", "data_wait", "datawait", "data_loading", "batch", "get_batch", "input"}
_DATA |= {"inputs", "load", "loading", "loader", "fetch", "prefetch", "io"}
_COMPUTE = {"forward", "fwd", "backward", "bwd", "compute", "optimizer", "optim", "opt", "loss", "model"}
_COMPUTE |= {"forward_backward", "fwd_bwd", "train_step", "zero_grad", "clip", "clip_grad", "update"}
_HOLDS_GRAD_SYNC = {"backward", "bwd", "forward_backward", "fwd_bwd", "train_step"}


def _pieces(name: str) -> set[str]:
    lower = name.lower()
    pieces = {lower, *[p for p in re.split(r"[^a-z0-9]+", lower) if p]}
    return pieces | {lower.replace("-", "_").replace(".", "_").replace("/", "_")}


@functools.lru_cache(maxsize=1024)  # called per rank and phase at every flush; names are few
def phase_category(name: str) -> Category:
    """Matched on the name and its word pieces (`_COMM`, `_DATA`, `_COMPUTE`), else other."""
    pieces = _pieces(name)
    if pieces & _COMM:
        return "communication"
    if pieces & _DATA:
        return "data"
    if pieces & _COMPUTE:
        return "compute"
    return "other"


@functools.lru_cache(maxsize=1024)  # asked per rank and phase at every flush (`_early_at_collective`)
def holds_collective(name: str, timed_communication: bool = False) -> bool:
    """Whether a phase (probably) holds the job's synchronizing collective: a communication timer,
    or, when the job times no communication phase, backward (DDP's gradient all-reduce and FSDP's
    reduce-scatter run inside it)."""
    if phase_category(name) == "communication":
        return True
    return not timed_communication and bool(_pieces(name) & _HOLDS_GRAD_SYNC)


@dataclass(frozen=True)
class Settings:
    """Typed straggler settings (from `Config`: straggler_threshold, straggler_ewma)."""

    threshold: float = 0.9  # relative score below this (EWMA) = chronic straggler
    ewma: float = 0.5  # weight of the newest interval in the smoothed scores
    one_off_steps: float = 1.0  # a one-off: one step's lateness >= this many (median) step times
    noise_mads: float = 3.0  # lateness counts only above this many MADs of the ranks' own noise
    min_lateness_s: float = 0.0005  # ... and above this floor

    @classmethod
    def from_config(cls, config: Config) -> Settings:
        return cls(threshold=config.straggler_threshold, ewma=config.straggler_ewma)


@dataclass(frozen=True)
class RankView:
    """One rank's interval as the model sees it."""

    rank: int
    host: str
    local_rank: int
    step: Spread  # step durations
    arrivals: Mapping[str, Spread]  # timer name -> arrival statistics (timers inside steps only)
    # How many ranks it stands for: 1, or a summary row of the tree (`merge`: rank < 0, never named)
    weight: float = 1.0
    # timer name -> its (runs, seconds) per step, read only where a timer repeats in a step
    timers: Mapping[str, TimerStats] = field(default_factory=dict)


@dataclass(frozen=True)
class Lateness:
    """How late one rank is in one interval, and what it costs (0 s = on time)."""

    seconds: float = 0.0  # per step, at the phase end where it is latest
    late_in: str = ""  # the phase where the lateness arose (UNTIMED: outside every timer)
    sync_phase: str | None = None  # where the others waited for it (None: nobody waits)
    mirrored: bool = False  # found as the earliest rank at a collective (it started its steps late)
    collective: str = ""  # the collective where the others wait for it (collective_lateness)


@dataclass
class RankAssessment:
    """The model's view of one rank for one interval."""

    index: int
    rank: int
    host: str
    local_rank: int
    step_s: float | None  # lower-median step time
    chronic: Lateness = field(default_factory=Lateness)  # on lower medians
    one_off: Lateness = field(default_factory=Lateness)  # on maxima (one step)
    wait_s: float = 0.0  # time per step this rank waits for the latest rank
    waiting_ranks: tuple[int, ...] = ()  # ranks that wait for this one (set on the culprit)
    waited_s: float = 0.0  # median wait of those ranks per step (set on the culprit)

    @property
    def relative(self) -> float:
        """This interval's relative score: 1 - lateness / step time (1 = on time)."""
        if not self.step_s or self.step_s <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.chronic.seconds / self.step_s))

    @property
    def own_s(self) -> float | None:
        """Step time without the time spent waiting for others."""
        return None if self.step_s is None else max(self.step_s - self.wait_s, 0.0)


_Point = tuple[float, float, int]  # (value, weight, rank index)


def _median_without(ordered: Sequence[_Point], skip: int, half: float) -> float:
    """The median of the sorted points but rank index `skip`'s, each value standing for `weight`
    ranks (all 1: the plain median, the middle two averaged); `half`: half the others' weight."""
    tie: float | None = None
    acc, last = 0.0, math.nan
    for value, weight, index in ordered:
        if index == skip:
            continue
        if tie is not None:
            return (tie + value) / 2.0
        acc += weight
        if acc > half:
            return value
        if acc == half:
            tie = value
        last = value
    return last


def _medians_without(ordered: Sequence[_Point], weights: Sequence[float], total: float) -> dict[int, float]:
    """Every rank index's `_median_without`, at once. With every weight 1 (no summaries) the
    median of the others is read at its place in the sorted points, O(1) a rank; the verdicts
    take one for every rank at every phase, so rank 0's flush grows with ranks x phases."""
    n = len(ordered)
    if n < 2 or any(weight != 1.0 for _, weight, _ in ordered):
        return {i: _median_without(ordered, i, (total - weights[i]) / 2.0) for _, _, i in ordered}
    values = [value for value, _, _ in ordered]
    mid = (n - 1) // 2  # of the n - 1 others: the middle place (n - 1 odd) or the upper middle one
    odd = (n - 1) % 2 == 1
    out: dict[int, float] = {}
    for place, (_, _, index) in enumerate(ordered):
        # the others' k-th value: values[k] below the left-out place, values[k + 1] from it on
        upper = values[mid if mid < place else mid + 1]
        out[index] = upper if odd else (values[mid - 1 if mid - 1 < place else mid] + upper) / 2.0
    return out


class _Table:
    """Arrival statistics by phase end (ordered) and rank index, with leave-one-out lateness."""

    def __init__(self, views: Sequence[RankView], settings: Settings) -> None:
        self.settings = settings
        self.weights = [v.weight for v in views]
        by_phase: dict[str, dict[int, Spread]] = {}
        for index, view in enumerate(views):
            for name, spread in view.arrivals.items():
                if spread.count and name != STEP_END:
                    by_phase.setdefault(name, {})[index] = spread
        self.phases = {p: by for p, by in by_phase.items() if len(by) >= 2}
        self.timers = [v.timers for v in views]
        # Timers only one rank ran (a rank-0-only eval) have nobody to compare with, but they say
        # where that rank was when its lateness arose after every phase the ranks share.
        self.solo: dict[int, dict[str, Spread]] = {}
        for name, by in by_phase.items():
            if len(by) == 1:
                ((index, spread),) = by.items()
                self.solo.setdefault(index, {})[name] = spread
        steps = {i: v.step for i, v in enumerate(views) if v.step.count}
        self.order = sorted(self.phases, key=lambda p: median([s.median for s in self.phases[p].values()]))
        if len(steps) >= 2:
            self.phases[STEP_END] = steps
            self.order.append(STEP_END)
        self.timed_communication = any(phase_category(p) == "communication" for p in self.order)
        self._orders: dict[str, tuple[dict[int, float], dict[int, float], dict[int, float]]] = {}
        self._per_step_medians: dict[str, dict[int, float]] = {}

    def holds_collective(self, phase: str) -> bool:
        return holds_collective(phase, self.timed_communication)

    def solo_phase(self, index: int, use_max: bool, after: str | None) -> str | None:
        """The timer only rank `index` ran that ends latest after its phase end `after` (None: its
        step start): where it was when lateness arose past the phases the ranks share."""
        own = self.solo.get(index, {})
        start = self.phases[after].get(index) if after is not None else None
        since = 0.0 if start is None else (start.max if use_max else start.median)
        ends = {name: (spread.max if use_max else spread.median) for name, spread in own.items()}
        later = [name for name, end in ends.items() if end > since]
        return max(later, key=lambda name: ends[name]) if later else None

    def lateness(self, index: int, use_max: bool) -> dict[str, float]:
        """Leave-one-out lateness of rank `index` at every phase end it has (noise clamped to 0)."""
        out: dict[str, float] = {}
        noise_mads, least = self.settings.noise_mads, self.settings.min_lateness_s
        for phase in self.order:
            own = self.phases[phase].get(index)
            if own is None:
                continue
            medians, maxima, mads = self._others(phase)
            value = own.max - maxima[index] if use_max else own.median - medians[index]
            floor = max(noise_mads * max(own.mad, mads[index]), least)
            out[phase] = value if abs(value) > floor else 0.0
        return out

    def repeated_phase(
        self, index: int, series: Mapping[str, float], peak_at: str, late_in: str, use_max: bool
    ) -> str:
        """Where the lateness first seen at `late_in` arose when this rank runs that timer several
        times a step (micro-batches): named by time per step instead of arrivals (design page)."""
        mine = self.timers[index]
        if late_in not in mine or mine[late_in].per_step[0] <= 1.0:
            return late_in
        phases = [p for p in self.order if p in series]
        upto = phases.index(peak_at)
        steps = self.phases[late_in][index].count if use_max else 1
        excess: dict[str, float] = {}
        for at, phase in enumerate(phases):
            others = self._per_step_others(phase) if phase in mine and phase != STEP_END else {}
            if index not in others:
                continue
            own = mine[phase].per_step[1] - others[index]
            if not self.holds_collective(phase):
                if at <= upto:
                    excess[phase] = own
            elif mine[phase].per_step[0] > 1.0 and at > 0:
                # The others wait in the synchronizing micro-batch for the lateness this rank brings
                # to it, which hides as much of its own excess there: added back. A rank that
                # spends clearly longer there than the others did its own waiting there (a stall
                # elsewhere early in the interval), so it hides nothing.
                brought = series[phases[at - 1]] / steps
                if own <= 0.5 * brought:
                    excess[phase] = own + brought
        best = max(excess.values(), default=0.0)
        if best * steps < 0.5 * series[peak_at]:
            return late_in
        return next(p for p, e in excess.items() if e >= 0.5 * best)

    def _per_step_others(self, phase: str) -> dict[int, float]:
        """The median of the other ranks' seconds per step in `phase`, for every rank index."""
        got = self._per_step_medians.get(phase)
        if got is None:
            weights = self.weights
            by = {i: self.timers[i][phase].per_step[1] for i in self.phases[phase] if phase in self.timers[i]}
            ordered = sorted((own, weights[i], i) for i, own in by.items())
            total = sum(weights[i] for i in by)
            got = self._per_step_medians[phase] = (
                _medians_without(ordered, weights, total) if len(by) > 1 else {}
            )
        return got

    def _others(self, phase: str) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """The phase's median of the others' medians, of their maxima and of their MADs, for every
        rank index: once per phase (`_medians_without`), read by each rank's `lateness`."""
        got = self._orders.get(phase)
        if got is None:
            by, weights = self.phases[phase], self.weights
            total = sum(weights[i] for i in by)

            def others(key: str) -> dict[int, float]:
                ordered = sorted((getattr(s, key), weights[i], i) for i, s in by.items())
                return _medians_without(ordered, weights, total)

            got = self._orders[phase] = (others("median"), others("max"), others("mad"))
        return got

    def gap(self, culprit: int, other: int, phase: str, use_max: bool) -> float | None:
        by = self.phases.get(phase, {})
        a, b = by.get(culprit), by.get(other)
        if a is None or b is None:
            return None
        return (a.max - b.max) if use_max else (a.median - b.median)


def _late(series: Mapping[str, float], table: _Table, index: int, use_max: bool) -> Lateness | None:
    """A rank that arrives late: where, since which phase, and whether the lateness collapses."""
    phases = [p for p in table.order if p in series]
    if not phases:
        return None
    peak_at = max(phases, key=lambda p: series[p])
    peak = series[peak_at]
    if peak <= 0:
        return None
    late_in = next(p for p in phases if series[p] >= 0.5 * peak)
    if table.holds_collective(late_in):
        return None  # lateness that arises inside the collective is waiting: a victim, not a culprit
    if late_in != STEP_END:
        late_in = table.repeated_phase(index, series, peak_at, late_in, use_max)
    sync: str | None = None
    after = phases[phases.index(peak_at) + 1 :]
    if after:
        previous, best_drop = peak, 0.0
        for phase in after:
            drop = previous - series[phase]
            if drop > best_drop:
                sync, best_drop = phase, drop
            previous = series[phase]
        end = series.get(STEP_END, series[after[-1]])
        if end > 0.5 * peak:
            sync = None  # still late at the end: nobody waited for it (independent ranks)
    if late_in == STEP_END:  # past every shared phase: in a timer of its own, if it ran one there
        before = phases[phases.index(late_in) - 1] if len(phases) > 1 else None
        late_in = table.solo_phase(index, use_max, before) or UNTIMED
    return Lateness(peak, late_in, sync)


def _early_at_collective(series: Mapping[str, float], table: _Table) -> Lateness | None:
    """A rank that reaches the end of a collective-holding phase EARLIEST and is caught up with
    afterwards: it started its step late and the others waited for it there (design page)."""
    phases = [p for p in table.order if p in series]
    candidates = [p for p in phases if table.holds_collective(p) and series[p] < 0]
    if not candidates:
        return None
    trough_at = min(candidates, key=lambda p: series[p])
    trough = -series[trough_at]
    after = phases[phases.index(trough_at) + 1 :]
    recovered = next((p for p in after if series[p] > -0.5 * trough), None)
    if recovered is None or table.holds_collective(recovered):
        # Caught up inside a collective: it waited there for a rank outside its earlier
        # collective's group (design page). A waiter, never a culprit.
        return None
    return Lateness(trough, recovered if recovered != STEP_END else UNTIMED, trough_at, mirrored=True)


def _culprit_lateness(table: _Table, index: int, use_max: bool) -> Lateness:
    series = table.lateness(index, use_max)
    late = _late(series, table, index, use_max)
    early = _early_at_collective(series, table)
    if late is not None and (early is None or late.seconds >= early.seconds):
        return late
    return early if early is not None else Lateness()


def assess(views: Sequence[RankView], settings: Settings) -> list[RankAssessment]:
    """One interval of every rank -> per-rank lateness (chronic and one-off), waits and costs."""
    table = _Table(views, settings)
    out = [
        RankAssessment(i, v.rank, v.host, v.local_rank, v.step.median if v.step.count else None)
        for i, v in enumerate(views)
    ]
    if len(views) < 2 or not table.order:
        return out
    for a in out:
        if a.rank < 0:
            continue  # a summary of many ranks (`merge`): a reference, never a culprit
        a.chronic = _culprit_lateness(table, a.index, use_max=False)
        a.one_off = _culprit_lateness(table, a.index, use_max=True)
    worst = max(out, key=lambda a: a.chronic.seconds)
    if worst.chronic.seconds > 0 and worst.chronic.sync_phase is not None:
        waits = _waits(table, worst, out)
        for a in out:
            a.wait_s = waits.get(a.index, 0.0)
        waiting = [a for a in out if a.index != worst.index and a.wait_s >= 0.5 * worst.chronic.seconds]
        worst.waiting_ranks = tuple(sorted({a.rank for a in waiting}))  # a summary: rank < 0, once
        worst.waited_s = median([a.wait_s for a in waiting]) if waiting else 0.0
    return out


def _waits(table: _Table, culprit: RankAssessment, ranks: Sequence[RankAssessment]) -> dict[int, float]:
    """Per rank, how long it waits per step for `culprit` at the sync phase: its lead over the
    culprit where the culprit is latest, minus what is left of that lead at the step end."""
    lateness = culprit.chronic
    sign = -1.0 if lateness.mirrored else 1.0
    at = lateness.sync_phase if lateness.mirrored else None
    if at is None:
        series = table.lateness(culprit.index, use_max=False)
        at = max((p for p in table.order if p in series), key=lambda p: series[p])
    waits: dict[int, float] = {}
    for a in ranks:
        if a.index == culprit.index:
            continue
        lead = table.gap(culprit.index, a.index, at, use_max=False)
        if lead is None:
            continue
        left = table.gap(culprit.index, a.index, STEP_END, use_max=False) or 0.0
        waits[a.index] = max(0.0, sign * lead - max(0.0, sign * left))
    return waits


def abstain_reason(
    views: Sequence[RankView], timer_names: Sequence[str], sharded: bool = False
) -> str | None:
    """Why the model cannot find the rank others wait for (or sees only part of its cost), or None."""
    if any(view.arrivals for view in views):
        if sharded:
            return (
                "FSDP runs all-gathers inside forward (and reduce-scatters inside backward): ranks "
                "synchronize at every layer, so only the compute after a phase's last collective shows as "
                "lateness; a rank slower in every layer is seen at a fraction of its cost and may stay "
                "below straggler_threshold. Waiting ranks are still never blamed. To see it whole, time "
                "the per-layer compute on the device (ot.timer(..., cuda=True)) or compare NCCL collective "
                "times (TORCH_NCCL_ENABLE_TIMING=1)."
            )
        return None
    if timer_names:
        return (
            "the timers (" + ", ".join(sorted(timer_names)[:6]) + ") do not run inside ot.step (nor between "
            "ot.begin_step() and ot.end_step()) or are CUDA timers, so no rank's arrival in its step is known; only differences in step time are "
            "visible, and in a synchronized job every rank's step time is equal. Time the phases "
            "inside `with ot.step(...)` with CPU timers: ot.timer('data'), ot.timer('forward'), "
            "ot.timer('backward'), ot.timer('optimizer')."
        )
    return (
        "only ot.step is timed: in a synchronized job (DDP, FSDP, ...) every rank's step time is "
        "equal, so the rank the others wait for cannot be seen (only ranks that are slower without "
        "synchronizing are found). Add timers inside the step, before the collective: "
        "ot.timer('data'), ot.timer('forward'), ot.timer('backward'), ot.timer('optimizer')."
    )
