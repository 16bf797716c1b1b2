"""Straggler scores over flushes, from each flush's assessments (`verdicts.assess`): smoothed
per-rank scores, chronic and one-off `StragglerReport`s, the straggler gauges and, on rank 0, the
`straggler` events. Design: docs/design/crossrank.md#verdicts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from otel_train import semconv
from otel_train.crossrank.spread import Spread
from otel_train.crossrank.timer_stats import Reduction, stats_for_option
from otel_train.crossrank.verdicts import (
    STEP_END,
    UNTIMED,
    Category,
    Lateness,
    Pattern,
    RankAssessment,
    Settings,
    phase_category,
)
from otel_train.health import EventChannel

logger = logging.getLogger("otel_train")

OVERALL_PHASE = "all"  # train.phase of the overall straggler scores
KIND_RELATIVE = "relative"
KIND_INDIVIDUAL = "individual"
MAX_REPORTS_PER_FLUSH = 5  # rank 0 logs and emits at most this many new stragglers per flush (slowest first)


@dataclass(frozen=True)
class StragglerReport:
    """A rank the others wait for: chronic (its smoothed relative score is below the threshold) or
    one-off (one step of the interval was late by at least `Settings.one_off_steps` step times)."""

    rank: int
    host: str
    local_rank: int
    pattern: Pattern
    phase: str  # the phase where its lateness arose
    category: Category
    lateness_s: float  # per step (chronic) or in the one step (one-off)
    score: float  # smoothed relative score (chronic) / that step's score (one-off)
    raw_score: float  # this interval's relative score
    sync_phase: str | None  # where the others wait for it (None: nobody waits)
    waiting_ranks: tuple[int, ...] = ()
    wait_s: float = 0.0  # per waiting rank and step (median)
    kind: str = "relative"
    collective: str = ""  # the collective where the others wait for it, when the Flight Recorder saw it

    @property
    def chronic(self) -> bool:
        return self.pattern == "chronic"


@dataclass
class RankScores:
    rank: int
    relative: float | None = None  # EWMA of the relative score (None: not distributed)
    individual: float | None = None  # EWMA of own best / own time
    raw_relative: float | None = None
    raw_individual: float | None = None
    lateness_s: float = 0.0
    wait_s: float = 0.0


class StragglerScorer:
    """Smoothed scores and verdicts for every rank from every rank's data (on rank 0, which sends
    each rank its scores and every rank the chronic list). EWMA with prior 1.0."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self._relative: dict[int, float] = {}
        self._individual: dict[int, float] = {}
        self._best_own: dict[int, float] = {}
        self._chronic: set[int] = set()  # ranks reported chronic at the last update

    def _smooth(self, state: dict[int, float], rank: int, raw: float) -> float:
        alpha = self.settings.ewma
        value = alpha * raw + (1.0 - alpha) * state.get(rank, 1.0)
        state[rank] = value
        return value

    def _individual_score(self, rank: int, own: float | None) -> tuple[float | None, float | None]:
        if own is None or own <= 0:
            return None, None
        best = min(self._best_own.get(rank, own), own)
        self._best_own[rank] = best
        raw = best / own
        return raw, self._smooth(self._individual, rank, raw)

    def update(
        self, assessments: Sequence[RankAssessment], one_offs: bool = True
    ) -> tuple[list[RankScores], list[StragglerReport]]:
        """Scores of every rank and this interval's reports (chronic first, then one-offs)."""
        scores: list[RankScores] = []
        chronic: list[StragglerReport] = []
        one_off: list[StragglerReport] = []
        threshold = self.settings.threshold
        for a in assessments:
            raw = a.relative
            smoothed = self._smooth(self._relative, a.rank, raw)
            raw_ind, ind = self._individual_score(a.rank, a.own_s)
            scores.append(RankScores(a.rank, smoothed, ind, raw, raw_ind, a.chronic.seconds, a.wait_s))
            # Hysteresis: a chronic straggler stays one until its score is half way back to 1, so a
            # score hovering at the threshold is not reported again at every other flush.
            limit = threshold + 0.5 * (1.0 - threshold) if a.rank in self._chronic else threshold
            if smoothed < limit and a.chronic.seconds > 0:
                chronic.append(self._report(a, "chronic", a.chronic, smoothed, raw))
            elif one_offs and a.step_s and a.one_off.seconds >= self.settings.one_off_steps * a.step_s:
                step_score = a.step_s / (a.step_s + a.one_off.seconds)
                one_off.append(self._report(a, "one_off", a.one_off, step_score, raw))
        self._chronic = {r.rank for r in chronic}
        return scores, chronic + one_off

    @staticmethod
    def _report(
        a: RankAssessment, pattern: Pattern, late: Lateness, score: float, raw: float
    ) -> StragglerReport:
        chronic = pattern == "chronic"
        category = "other" if late.late_in in (UNTIMED, STEP_END) else phase_category(late.late_in)
        return StragglerReport(
            a.rank, a.host, a.local_rank, pattern, late.late_in, category, late.seconds, score, raw,
            late.sync_phase, a.waiting_ranks if chronic else (), a.waited_s if chronic else 0.0,
            collective=late.collective,
        )  # fmt: skip

    def update_local(self, rank: int, step: Spread) -> RankScores:
        """Not distributed: only the individual score (own time = step time; nobody to wait for)."""
        raw_ind, ind = self._individual_score(rank, step.median if step.count else None)
        return RankScores(rank, None, ind, None, raw_ind)


def describe(report: StragglerReport, step: int, threshold: float) -> str:
    """One line for the log and the health event."""
    where = f"in {report.phase!r} ({report.category})"
    if report.phase == UNTIMED:
        where = "outside every timer (other)"
    ms = report.lateness_s * 1000.0
    if report.chronic:
        head = (
            f"straggler: rank {report.rank} ({report.host}, local rank {report.local_rank}) is chronically "
            f"{ms:.1f} ms late per step, {where}"
        )
    else:
        head = (
            f"straggler (one-off): rank {report.rank} ({report.host}, local rank {report.local_rank}) was "
            f"{ms:.1f} ms late in one step, {where}"
        )
    if report.waiting_ranks:
        ranks = ", ".join(str(r) for r in report.waiting_ranks)
        cost = (
            f"; ranks {ranks} wait {report.wait_s * 1000.0:.1f} ms per step for rank {report.rank}"
            f" in {report.sync_phase!r}"
        )
    elif report.sync_phase is not None:
        # its lateness collapses there, but no rank's wait is measured (a one-off's waits are not
        # computed): claim no waiting that `waiting_ranks` and `wait_ms` do not show
        cost = f"; it rejoins the others in {report.sync_phase!r}"
    else:
        cost = "; nobody waits for it (no synchronization after it in the step)"
    if report.collective and report.collective != report.sync_phase:
        cost += f", at {report.collective}"
    score = (
        f" (score {report.score:.2f}, this interval {report.raw_score:.2f}, threshold {threshold})"
        if report.chronic
        else f" (that step's score {report.score:.2f})"
    )
    return f"{head}{cost}{score} at step {step}"


class StragglerGauges:
    """This rank's straggler gauges (scores, lateness, wait) and, on rank 0, the cross-rank phase
    statistics (`train.phase.cross_rank`)."""

    def __init__(self, meter: Any | None, root: bool) -> None:
        self.score = semconv.STRAGGLER_SCORE.create(meter) if meter is not None else None
        self.lateness = semconv.STRAGGLER_LATENESS.create(meter) if meter is not None else None
        self.wait = semconv.STRAGGLER_WAIT.create(meter) if meter is not None else None
        self.cross = semconv.PHASE_CROSS_RANK.create(meter) if meter is not None and root else None

    def set_scores(self, scores: RankScores) -> None:
        if self.score is not None:
            for kind, value in ((KIND_RELATIVE, scores.relative), (KIND_INDIVIDUAL, scores.individual)):
                if value is not None:
                    self.score.set(value, {semconv.STRAGGLER_KIND: kind, semconv.PHASE: OVERALL_PHASE})
        if scores.relative is None:
            return  # lateness and wait exist only across ranks
        if self.lateness is not None:
            self.lateness.set(scores.lateness_s)
        if self.wait is not None:
            self.wait.set(scores.wait_s)

    def set_cross_rank(self, option: str, reductions: Mapping[str, Reduction]) -> None:
        """Rank 0: the cross-rank timer gauges."""
        if self.cross is None:
            return
        for name, red in reductions.items():
            for stat in stats_for_option(option):
                value = getattr(red, {"argmax_rank": "argmax", "argmin_rank": "argmin"}.get(stat, stat))
                self.cross.set(float(value), {semconv.PHASE: name, semconv.STAT: stat})


class StragglerReporter:
    """Rank 0: logs and emits each NEW straggler once (a chronic one until it recovers); the
    `on_straggler` callback runs from the next answer instead."""

    def __init__(self, events: EventChannel | None) -> None:
        self.events = events
        self._flagged: set[int] = set()

    def report(
        self, reports: Sequence[StragglerReport], step: int, threshold: float, hold_new_chronic: bool = False
    ) -> None:
        """`hold_new_chronic`: a new chronic straggler waits for a later flush (its event then names
        the collective); one-offs never wait, they are this interval's only."""
        now = {r.rank for r in reports if r.chronic}
        new = [r for r in reports if not r.chronic or r.rank not in self._flagged]
        if hold_new_chronic:
            new = [r for r in new if not r.chronic]
            now &= self._flagged
        new.sort(key=lambda r: (not r.chronic, r.score, r.rank))
        shown = new[:MAX_REPORTS_PER_FLUSH]
        if len(new) > MAX_REPORTS_PER_FLUSH:
            slowest = ", ".join(f"rank {r.rank} {r.pattern} {r.score:.2f}" for r in shown)
            message = "otel_train: %d new stragglers at step %d; reporting the %d slowest (%s)"
            logger.warning(message, len(new), step, MAX_REPORTS_PER_FLUSH, slowest)
        for report in shown:
            message = describe(report, step, threshold)
            if self.events is None:
                logger.warning("otel_train: %s", message)
            else:  # echoed on the console by the events (as `verbosity` says)
                self.events.emit("straggler", message, event_attributes(report, step))
        for rank in sorted(self._flagged - now):
            logger.info("otel_train: rank %d is no longer a straggler", rank)
        self._flagged = now


def event_attributes(report: StragglerReport, step: int) -> dict[str, str | int | float]:
    """The `straggler` health event's attributes (documented in docs/multi-gpu.md)."""
    return {
        "rank": report.rank,
        "host.name": report.host,
        "gpu": report.local_rank,
        semconv.PHASE: report.phase,
        "category": report.category,
        "pattern": report.pattern,
        semconv.STRAGGLER_KIND: report.kind,
        "lateness_ms": round(report.lateness_s * 1000.0, 3),
        "sync_phase": report.sync_phase or "",
        "waiting_ranks": ",".join(str(r) for r in report.waiting_ranks),
        "wait_ms": round(report.wait_s * 1000.0, 3),
        "score": round(report.score, 4),
        "collective": report.collective,
        "step": step,
    }
