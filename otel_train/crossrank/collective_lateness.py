"""Arrival lateness at collectives: the rank the others wait for, found without user timers.

Arrivals at the same collectives, read from each rank's Flight Recorder, are compared on rank 0
with each rank's clock offset bounded NTP-style (`ClockEstimator`).
Design: docs/design/crossrank.md#collective-lateness.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

from otel_train.core.buffer import Interval
from otel_train.crossrank.arrival_block import (
    BLOCK_LEN,
    Arrival,
    Key,
    Row,
    decode,
    encode,
    sample,
    span,
    window,
)
from otel_train.crossrank.down_row import Down
from otel_train.crossrank.up_row import RankRecord, floats
from otel_train.crossrank.verdicts import UNTIMED, Lateness, RankAssessment, RankView
from otel_train.crossrank.wire import ARRIVALS
from otel_train.diagnostics import CollectiveMonitor

FLOOR_S = 0.0005  # lateness below this is noise (as verdicts.Settings.min_lateness_s)
MIN_RESOLVED = 3  # collectives with a late rank needed before anyone is named
CONSISTENT = 0.5  # share of those where the culprit must arrive last
PENDING_FLUSHES = 8  # flushes that new reports wait for a verdict that names a culprit
PENDING_S = 30.0  # or seconds from the first exchange, if later: short flushes outpace the reads
CLIP = 2.0  # a collective's lateness counts at most this many times its typical one (`_clipped_sum`)
EXPLAINS = 0.25  # share of a culprit's lateness a timer's excess must reach to be where it arose
DRIFT = 20e-6  # s/s: how fast an older offset measurement loses accuracy (unsynchronized quartz)

logger = logging.getLogger("otel_train")


class ClockEstimator:
    """A leaf's clock offset to rank 0 (rank 0's clock - this rank's) and its error bound."""

    def __init__(self) -> None:
        self._best: tuple[float, float, float] | None = None  # (offset, half width, measured at)

    def add(self, t1: float, t2: float, t3: float, t4: float) -> None:
        """One exchange's stamps (t1, t4 on this rank's clock; t2, t3 on rank 0's)."""
        low, high = t3 - t4, t2 - t1
        if not (math.isfinite(low) and math.isfinite(high)) or high < low:
            return
        sample = ((low + high) / 2.0, (high - low) / 2.0, t4)
        best = self._best
        if best is None or sample[1] <= self._aged(best, t4):
            self._best = sample
        elif abs(sample[0] - best[0]) > sample[1] + self._aged(best, t4):
            self._best = sample  # disjoint: one of the two clocks stepped since the best was measured

    @staticmethod
    def _aged(best: tuple[float, float, float], now: float) -> float:
        return best[1] + DRIFT * max(0.0, now - best[2])

    def estimate(self, now: float) -> tuple[float, float]:
        """(offset, bound): the true offset lies within offset +- bound; (0, inf) before any."""
        if self._best is None:
            return 0.0, math.inf
        return self._best[0], self._aged(self._best, now)


@dataclass(frozen=True)
class Verdict:
    """Rank 0's reading of one read flush's arrivals."""

    read_seq: int
    matched: int  # collectives every rank reported
    resolved: int  # ... where one rank was late beyond noise and clock error
    unclear: int  # ... where the lateness did not exceed the clock error bound
    culprit: int = -1  # rank (-1: none)
    seconds: float = 0.0  # its lateness per step
    key: Key | None = None  # the collective where it was latest
    waits: Mapping[int, float] | None = None  # rank -> its wait for the culprit per step
    waiting: tuple[int, ...] = ()  # the ranks that wait for it
    abstain: str | None = None


STEP_MARGIN = 3.0  # a culprit's lateness per step above this many of rank 0's mean steps: the clocks


def judge(rows: Sequence[Row], world: int, step_s: float | None = None) -> Verdict | None:
    """Every rank's row of one read -> the verdict (None: not every rank reported that read);
    `step_s`, rank 0's mean step time in the read's window, bounds any rank's lateness."""
    if len(rows) < max(world, 2) or len({r.read_seq for r in rows}) != 1:
        return None
    common = set(rows[0].arrivals).intersection(*(r.arrivals for r in rows[1:]))
    found: dict[int, list[tuple[float, Key]]] = {}  # rank -> (lateness, collective) where it was last
    unclear, bounds = 0, list[float]()
    bound = {r.rank: r.bound for r in rows}
    floors = _floors(rows, common)
    for key in sorted(common):
        arrivals = {r.rank: r.arrivals[key] + r.offset for r in rows}
        last = max(arrivals, key=lambda rank: arrivals[rank])
        others = {r: max(t, floors[key]) for r, t in arrivals.items() if r != last}
        late = arrivals[last] - median(others.values())
        if late <= FLOOR_S:
            continue
        # The least it can be with every clock off by its bound against it (the median is monotone).
        least = arrivals[last] - bound[last] - median([t + bound[r] for r, t in others.items()])
        if least <= FLOOR_S:
            unclear, bounds = unclear + 1, [*bounds, late - least]
            continue
        found.setdefault(last, []).append((late, key))
    resolved = sum(map(len, found.values()))
    verdict = Verdict(rows[0].read_seq, len(common), resolved, unclear)
    # Consistently last; unclear collectives neither name nor clear anyone (design page).
    late_sum = {r: _clipped_sum([late for late, _ in v]) for r, v in found.items()}
    culprits = [r for r, v in found.items() if len(v) >= max(MIN_RESOLVED, CONSISTENT * resolved)]
    if not culprits and unclear > resolved:
        return replace(verdict, abstain=(
            f"the clocks of the ranks' hosts are known only to within {median(bounds) * 1e3:.2f} ms (the "
            f"offset bound from the telemetry exchange), more than the lateness at {unclear} of "
            f"{len(common)} collectives: no rank is named from collective arrivals"
        ))  # fmt: skip
    if not culprits:
        return verdict
    culprit = max(culprits, key=lambda r: late_sum[r])
    # The sample stands for the whole window (window / matched collectives each), over its steps
    # (the same window on every rank: the first row's).
    scale = (rows[0].window / max(len(common), 1)) / max(rows[0].steps, 1)
    seconds = late_sum[culprit] * scale
    if step_s and seconds > STEP_MARGIN * step_s:
        return replace(verdict, abstain=(
            f"rank {culprit} would be {seconds * 1e3:.1f} ms late per step, far longer than a step "
            f"({step_s * 1e3:.1f} ms on rank 0): its host's clock stepped or is off by more than the "
            "telemetry exchange measured; no rank is named from collective arrivals until it is "
            "measured again"
        ))  # fmt: skip
    waits, waiting = _waits(rows, culprit, [key for _, key in found[culprit]], late_sum[culprit], floors)
    worst = max(found[culprit], key=lambda late_key: late_key[0])[1]  # the first of the latest
    scaled = {r: w * scale for r, w in waits.items()}
    return replace(verdict, culprit=culprit, seconds=seconds, key=worst, waits=scaled, waiting=waiting)


def _clipped_sum(lateness: Sequence[float]) -> float:
    """The sum of a rank's lateness at its collectives, each at most CLIP times the median of their
    larger half: one long stall weighs about as one collective, and one where it was barely last
    weighs what it lost there, however many there are (a median over them all does neither)."""
    ordered = sorted(lateness)
    cap = CLIP * median(ordered[len(ordered) // 2 :])
    return sum(min(late, cap) for late in ordered)


def _floors(rows: Sequence[Row], keys: set[Key]) -> dict[Key, float]:
    """Per collective, the latest arrival at the one before it (in time): the earliest the previous
    one completes. A rank that waits there arrives at the next one after it anyway; one that enqueued
    both without waiting (DDP's asynchronous gradient buckets, a small all_reduce right after them)
    still carries the wait it has not served, which would be counted again at the next."""
    order = sorted(keys, key=lambda k: median([r.arrivals[k] + r.offset for r in rows]))
    floors, latest = {}, -math.inf
    for key in order:
        floors[key] = latest
        latest = max(r.arrivals[key] + r.offset for r in rows)
    return floors


def _waits(
    rows: Sequence[Row], culprit: int, keys: Sequence[Key], lateness: float, floors: Mapping[Key, float]
) -> tuple[dict[int, float], tuple[int, ...]]:
    """Each other rank's summed wait for `culprit` at `keys` (from its arrival, or the earliest the
    collective before could complete: `_floors`), and the ranks that wait for it: those that could
    have waited at least half its lateness, their clocks' bound given (every rank but the last waits
    in a collective; one that is slow too waits less)."""
    waits, waiting = {}, []
    late = next(r for r in rows if r.rank == culprit)
    for row in rows:
        if row.rank != culprit:
            gaps = [
                late.arrivals[k] + late.offset - max(row.arrivals[k] + row.offset, floors[k]) for k in keys
            ]
            waits[row.rank] = sum(max(0.0, g) for g in gaps)
            if sum(max(0.0, g + row.bound + late.bound) for g in gaps) >= 0.5 * lateness:
                waiting.append(row.rank)
    return waits, tuple(sorted(waiting))


def apply(
    assessments: Sequence[RankAssessment], verdict: Verdict, collective: str, phase: str | None
) -> None:
    """Join the collective verdict to the timer-based assessments (module doc), in place."""
    if verdict.culprit < 0 or not verdict.waits:
        return
    by_rank = {a.rank: a for a in assessments}
    culprit = by_rank.get(verdict.culprit)
    if culprit is None:
        return
    waiting = verdict.waiting
    for rank in waiting:
        if rank in by_rank:  # it waits inside the collective: never a culprit
            by_rank[rank].chronic = Lateness()
            by_rank[rank].wait_s = verdict.waits[rank]
    timers_saw = culprit.chronic.seconds
    if timers_saw > 0 and timers_saw >= 0.5 * verdict.seconds:  # most of it: their phase says where it arose
        seconds = max(culprit.chronic.seconds, verdict.seconds)
        culprit.chronic = replace(culprit.chronic, seconds=seconds, collective=collective)
    else:
        culprit.chronic = Lateness(verdict.seconds, phase or UNTIMED, collective, collective=collective)
    culprit.waiting_ranks = tuple(waiting)
    culprit.waited_s = median([verdict.waits[r] for r in waiting]) if waiting else 0.0


def lost_in(views: Sequence[RankView], culprit: int, seconds: float) -> str | None:
    """The culprit's timer whose time per step exceeds the other ranks' median the most, if by at
    least EXPLAINS of its lateness at the collectives (None: no timer explains it). The others may
    wait for it in a later phase than the one it lost time in: Lightning's broadcast at every
    batch's start sits in `data` and holds the wait for a rank slower in each micro-batch's
    backward. Only a part of its lateness shows as excess: what the others wait for inside the
    same timer (the last micro-batch's all-reduce) is in their time there too."""
    mine = next((v for v in views if v.rank == culprit), None)
    if mine is None:
        return None
    excess: dict[str, float] = {}
    for name, stats in mine.timers.items():
        others = [v.timers[name].per_step[1] for v in views if v.rank != culprit and name in v.timers]
        if others:
            excess[name] = stats.per_step[1] - median(others)
    most = max(excess, key=lambda n: excess[n], default=None)
    return most if most is not None and excess[most] >= EXPLAINS * seconds > 0 else None


class LatenessTracker:
    """One rank's side (module doc): reads the recorder at the flushes rank 0 picks, keeps the
    next block and the clock estimate; on rank 0 also judges every rank's block and names the
    collective. Lives in `reducer.CrossRankReducer`, on the flush worker only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.monitor: CollectiveMonitor | None = None  # set when the Flight Recorder is on
        self.skew_s = 0.0  # tests: this rank's clock reads off by this much (recorder and exchange)
        self.estimator = ClockEstimator()
        self.verdict: Verdict | None = None  # rank 0: the latest read's
        self._block = [0.0] * BLOCK_LEN  # version 0: nothing read yet
        self._after = 0.0  # the previous read's cutoff (epoch seconds, this rank's clock)
        self._steps = 0  # steps since then
        # rank 0: its own windows by read flush (this read's and the one its verdict is about), each
        # with its steps, the start of its last step and where that step's timers ended in it (the
        # collective is placed among the timers of its own step: a forward a little shorter than
        # usual would otherwise put the all-reduce just after it into the forward)
        self._own: dict[int, tuple[list[Arrival], int, float, dict[str, float]]] = {}
        self._step_s: dict[int, float] = {}  # rank 0: its mean step time in those windows
        self._exchanges = 0
        self._first_exchange: float | None = None  # time.monotonic() of the first
        # rank 0: why the exchange's rows do not let it judge arrivals (a tree's, `reducer.unjudged`)
        self.unjudged: str | None = None
        self._told = False

    @classmethod
    def attach(cls, rank: int, exchange: Any) -> LatenessTracker:
        """A tracker whose clock stamps `exchange` (exchange.StarExchange) takes."""
        tracker = cls(rank)
        exchange.stamp(tracker.clock)
        return tracker

    def clock(self) -> float:
        return time.time() + self.skew_s

    def wants_read(self) -> bool:
        """Rank 0: whether every rank reads its recorder at this flush (not at the first answer,
        which only starts the window)."""
        return self.monitor is not None and bool(self._after) and self.monitor.may_read()

    def block(self) -> Any:
        """This rank's block for the up row: the latest read's sample and the clock estimate."""
        offset, bound = (0.0, 0.0) if self.rank == 0 else self.estimator.estimate(self.clock())
        ARRIVALS.put(self._block, offset=offset, bound=bound)  # each flush: it improves between reads
        return floats(self._block)

    def after_exchange(self, interval: Interval, down: Down | None, stamps: tuple[float, float]) -> None:
        """The exchange's answer (None: none came at this flush), its stamps on a leaf (t1 of the
        row it answers, t4 when it was taken) and, when rank 0 asked in it, this flush's read."""
        self._exchanges += 1
        if self._first_exchange is None:
            self._first_exchange = time.monotonic()
        self._steps += interval.steps
        if down is None:
            return
        if self.rank != 0:
            self.estimator.add(stamps[0], down.root_times[0], down.root_times[1], stamps[1])
        until = interval.wall_time + self.skew_s
        if not self._after:  # the first answer only starts the window: before it, setup and warm-up
            self._after, self._steps = until, 0
            return
        monitor = self.monitor if down.read_recorder else None
        dump = monitor.read(interval.seq, force=True) if monitor is not None else None
        if monitor is None or dump is None:
            return
        arrivals = window(dump["entries"], monitor.excluded, self._after, until, self.skew_s)
        latest = span(arrivals)
        steps = float(self._steps)
        if latest and len(latest) < len(arrivals):  # the span covers part of the window's time
            steps *= (until - latest[0].at) / max(until - self._after, 1e-9)
        picked = sample(latest, interval.seq)
        self._block = encode(interval.seq, 0.0, math.inf, len(latest), steps, picked)
        if self.rank == 0:
            # a timer that ran once in each of the interval's steps: its last arrival is the last step's
            ends = {n: a[-1] for n, a in interval.arrivals.items() if a and len(a) == interval.steps}
            self._own = {s: v for s, v in self._own.items() if s == max(self._own, default=-1)}
            self._own[interval.seq] = (arrivals, self._steps, interval.last_step_start + self.skew_s, ends)
            self._step_s = {s: v for s, v in self._step_s.items() if s in self._own}
            if self._steps:
                self._step_s[interval.seq] = (until - self._after) / self._steps
        self._after, self._steps = until, 0

    def judgeable(self, unjudged: str | None) -> bool:
        """Rank 0: whether this flush's rows let it judge arrivals (`unjudged`: why not); the
        first time they do not while the recorder is on, it says so (also where timers name
        culprits: those named at collectives are then missed)."""
        if unjudged is not None and not self._told and self.monitor is not None:
            self._told = True
            logger.warning("otel_train: %s", unjudged)
        self.unjudged = unjudged
        return unjudged is None

    def judge(self, blocks: Any, records: Sequence[RankRecord], host: str) -> None:
        """Rank 0: every rank's block ([world, BLOCK_LEN], row i from `records[i]`); a new read
        gives a new verdict. Rows from rank 0's `host` read its clock: offset 0, exact."""
        rows = [decode(r.rank, values) for r, values in zip(records, blocks.tolist(), strict=True)]
        if any(r is None for r in rows) or not rows:
            return
        same = [r.host == host for r in records]
        got = [replace(r, offset=0.0, bound=0.0) if s else r for r, s in zip(rows, same, strict=True) if r]
        if self.verdict is not None and got[0].read_seq == self.verdict.read_seq:
            return
        self.verdict = judge(got, len(records), self._step_s.get(got[0].read_seq)) or self.verdict

    def join(self, assessments: Sequence[RankAssessment], views: Sequence[RankView]) -> None:
        """Rank 0: the current verdict into the timer-based assessments (its own timers' ends
        place the collective in a phase)."""
        own = next((v for v in views if v.rank == 0), None)
        phase_ends = {n: s.median for n, s in own.arrivals.items()} if own else {}
        verdict = self.verdict
        if verdict is not None and verdict.key is not None:
            collective, phase = self.name(verdict.read_seq, verdict.key, phase_ends)
            apply(assessments, verdict, collective, lost_in(views, verdict.culprit, verdict.seconds) or phase)

    def pending(self) -> bool:
        """Rank 0: the recorder is on and the latest verdict neither names a culprit, nor abstains, nor
        found no collective (a read travels one flush, and one read's window may hold too few
        collectives where a rank is late): new chronic straggler reports wait, so that their event
        names the collective. Bounded: after PENDING_FLUSHES exchanges and PENDING_S seconds from
        the first, the timers' reports go out without it (reads are spaced out by their budget, so
        a job flushing every step may pass 8 flushes before its second read)."""
        verdict = self.verdict
        # A read with no collective common to every rank (independent ranks) has nobody to name.
        decided = verdict is not None and (
            verdict.culprit >= 0 or verdict.abstain is not None or verdict.matched == 0
        )
        waiting = not decided and self.unjudged is None
        since = 0.0 if self._first_exchange is None else time.monotonic() - self._first_exchange
        young = self._exchanges <= PENDING_FLUSHES or since < PENDING_S
        return self.monitor is not None and waiting and young

    def abstain(self, timer_reason: str | None) -> str | None:
        """Rank 0: why culprits cannot be found, the collectives considered."""
        if self.monitor is None:
            return timer_reason
        if self.unjudged is not None:  # no verdict will come: say why, with the timers' reason
            return f"{timer_reason}; {self.unjudged}" if timer_reason else None
        if self.verdict is None:
            return None  # the first read is still on its way: no reason to give yet
        if self.verdict.abstain is not None:
            return self.verdict.abstain
        return None if self.verdict.matched else timer_reason

    def name(self, read_seq: int, key: Key, phase_ends: Mapping[str, float]) -> tuple[str, str | None]:
        """('all_gather #3 in 'forward' (default_pg)', 'forward'): the collective's op, its place
        among the same op in the last step of rank 0's window of that read, and the timer it sits
        in (by that step's own timer ends, else by `phase_ends`, typical ones); without whole steps
        in the window, its sequence id and group."""
        own, steps, last_start, last_ends = self._own.get(read_seq, ([], 0, math.nan, {}))
        phase_ends = {**phase_ends, **last_ends}
        mine = next((i for i, a in enumerate(own) if a.key == key), None)
        if mine is None:
            return "a collective", None
        per_step = len(own) // steps if steps else 0
        if not per_step or per_step * steps != len(own):
            return f"{own[mine].op} (seq {own[mine].seq}, {own[mine].label})", None
        start = (steps - 1) * per_step
        position = mine % per_step
        at = own[start + position]
        nth = 1 + sum(1 for a in own[start : start + position] if a.op == at.op)
        into = at.at - last_start
        phase = next((p for p, end in sorted(phase_ends.items(), key=lambda kv: kv[1]) if end >= into), None)
        where = f" in {phase!r}" if phase else " of the step"
        return f"{at.op} #{nth}{where} ({at.label})", phase
