"""What the straggler verdicts become on each rank: its straggler gauges (scores, lateness, wait;
on rank 0 the cross-rank phase statistics) and, on rank 0, the `straggler` events, each new
straggler once (a chronic one until it recovers), with their documented attributes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from otel_train import semconv
from otel_train.crossrank.scores import RankScores, StragglerReport, describe
from otel_train.crossrank.timer_stats import Reduction, stats_for_option
from otel_train.health import EventChannel

logger = logging.getLogger("otel_train")

OVERALL_PHASE = "all"  # train.phase of the overall straggler scores
KIND_RELATIVE = "relative"
KIND_INDIVIDUAL = "individual"
MAX_REPORTS_PER_FLUSH = 5  # rank 0 logs and emits at most this many new stragglers per flush (slowest first)


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

    def report(self, reports: Sequence[StragglerReport], step: int, threshold: float) -> None:
        now = {r.rank for r in reports if r.chronic}
        new = [r for r in reports if not r.chronic or r.rank not in self._flagged]
        new.sort(key=lambda r: (not r.chronic, r.score, r.rank))
        if len(new) > MAX_REPORTS_PER_FLUSH:
            logger.warning(
                "otel_train: %d new stragglers at step %d; reporting the %d slowest (%s)",
                len(new),
                step,
                MAX_REPORTS_PER_FLUSH,
                ", ".join(f"rank {r.rank} {r.pattern} {r.score:.2f}" for r in new[:MAX_REPORTS_PER_FLUSH]),
            )
        for report in new[:MAX_REPORTS_PER_FLUSH]:
            message = describe(report, step, threshold)
            logger.warning("otel_train: %s", message)
            if self.events is not None:
                self.events.emit("straggler", message, event_attributes(report, step))
        for rank in sorted(self._flagged - now):
            logger.info("otel_train: rank %d is no longer a straggler", rank)
        self._flagged = now


def event_attributes(report: StragglerReport, step: int) -> dict[str, str | int | float]:
    """The `crossrank/reducer` health event's attributes (documented in the README)."""
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
