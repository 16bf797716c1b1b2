"""Rank 0's job-level series (`semconv.JOB_SPECS`) from the merged job blocks (`job_block`), on a
meter of their own (no rank label), merged and fed to the SDK as bucket counts when an exporter
collects. Design: docs/design/crossrank.md#job-series; what each counts: docs/scale.md#job-level-series.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from otel_train import semconv
from otel_train.core.resolve import add_bucket_counts
from otel_train.crossrank.job_block import STEP_ID, JobTotals, TimerTotals, combine, decode
from otel_train.crossrank.timer_stats import STEP_PHASE

logger = logging.getLogger("otel_train")

MAX_WAITING = 64  # collections a timer without a name is kept for; beyond, its counts are dropped
MAX_KEPT = 64  # flushes kept between two collections; beyond, they are merged into one


class JobSeries:
    """Rank 0: the job-level series of the blocks `publish` gets, on `meter` (None: nothing)."""

    def __init__(self, meter: Any | None) -> None:
        self.meter = meter
        self.unexported = False  # the SDK's histogram internals were not as expected (module doc)
        self._kept: list[Any] = []  # the blocks of the flushes since the last collection
        self._latest: tuple[Any, float] | None = None  # the latest flush's blocks and seconds
        self._names: Mapping[int, str] = {}
        self._waiting: dict[float, list[TimerTotals]] = {}
        self._totals = {"samples": 0.0, "tokens": 0.0}
        self._gauges: dict[str, list[tuple[float, dict[str, str]]]] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        if meter is None:
            return
        self.step = semconv.JOB_STEP_DURATION.create(meter)
        self.phase = semconv.JOB_PHASE_DURATION.create(meter)
        semconv.JOB_SAMPLES.create(meter, self._observe("samples"))
        semconv.JOB_TOKENS.create(meter, self._observe("tokens"))
        for spec in (
            semconv.JOB_SAMPLES_RATE, semconv.JOB_TOKENS_RATE, semconv.JOB_LOSS, semconv.JOB_LOSS_MIN,
            semconv.JOB_LOSS_MAX, semconv.JOB_PHASE_CROSS_RANK, semconv.JOB_RANKS,
        ):  # fmt: skip
            spec.create(meter, self._observe(spec.name))

    def publish(self, blocks: Any, names: Mapping[int, str], elapsed_s: float) -> None:
        """One flush's blocks ([JOB_LEN] or [n, JOB_LEN]: the sum of them is the flush's);
        `names`: timer id -> name (read when collected); `elapsed_s`: rank 0's seconds since its
        previous flush (the rates' denominator)."""
        if self.meter is None:
            return
        with self._lock:
            self._names = names
            self._kept.append(blocks)
            self._latest = (blocks, elapsed_s)
            if len(self._kept) > MAX_KEPT:  # nothing collects: keep them bounded
                self._kept = [combine(self._kept_blocks())]

    def _observe(self, name: str) -> Any:
        def callback(options: Any) -> Iterator[Any]:
            from opentelemetry.metrics import Observation

            self._collect()
            if name in self._totals:
                if self._totals[name]:
                    yield Observation(self._totals[name])
                return
            for value, attributes in self._gauges.get(name, ()):
                yield Observation(value, attributes)

        return callback

    def _kept_blocks(self) -> Any:
        import torch

        return torch.cat([b.reshape(-1, b.shape[-1]) for b in self._kept])

    def _collect(self) -> None:
        """Merge what the flushes since the last collection brought and feed it (module doc)."""
        with self._lock:
            if not self._kept or self._latest is None:
                return
            everything, (latest, elapsed_s) = combine(self._kept_blocks()), self._latest
            self._kept = []
        totals = decode(everything)
        if totals.overflow:
            self._warn(
                "overflow",
                f"otel_train: the job runs more than {len(totals.timers) - 1} timers; the job-level "
                "series leave out those with the fewest durations (per-rank series keep them)",
            )
        self._totals["samples"] += totals.samples
        self._totals["tokens"] += totals.tokens
        for ident, timer in totals.timers.items():
            name = STEP_PHASE if ident == STEP_ID else self._names.get(int(ident))
            if name is None:
                waiting = self._waiting.setdefault(ident, [])
                if len(waiting) < MAX_WAITING:
                    waiting.append(timer)
                continue
            for earlier in self._waiting.pop(ident, []):
                self._histogram(ident, name, earlier)
            self._histogram(ident, name, timer)
        self._gauges = _gauges(decode(combine(latest)), self._names, elapsed_s)

    def _histogram(self, ident: float, name: str, timer: TimerTotals) -> None:
        if ident == STEP_ID:
            done = add_counts(self.step, timer, semconv.STEP_BUCKETS, {})
        else:
            done = add_counts(self.phase, timer, semconv.PHASE_BUCKETS, {semconv.PHASE: name})
        if not done:
            self.unexported = True
            self._warn(
                "sdk",
                "otel_train: the job-level histograms are left out: this OpenTelemetry SDK's histogram "
                "aggregation is not the one otel_train merges bucket counts into (it needs opentelemetry-sdk >= 1.45.2)",
            )

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def _gauges(
    totals: JobTotals, names: Mapping[int, str], elapsed_s: float
) -> dict[str, list[tuple[float, dict[str, str]]]]:
    """The gauges' points (name -> [(value, attributes)]) of one flush's merged block."""
    out: dict[str, list[tuple[float, dict[str, str]]]] = {semconv.JOB_RANKS.name: [(float(totals.rows), {})]}
    if elapsed_s > 0:
        out[semconv.JOB_SAMPLES_RATE.name] = [(totals.samples / elapsed_s, {})]
        out[semconv.JOB_TOKENS_RATE.name] = [(totals.tokens / elapsed_s, {})]
    if totals.loss_count:
        out[semconv.JOB_LOSS.name] = [(totals.loss_sum / totals.loss_count, {})]
        out[semconv.JOB_LOSS_MIN.name] = [(totals.loss_min, {})]
        out[semconv.JOB_LOSS_MAX.name] = [(totals.loss_max, {})]
    stats = out.setdefault(semconv.JOB_PHASE_CROSS_RANK.name, [])
    for ident, timer in totals.timers.items():
        name = STEP_PHASE if ident == STEP_ID else names.get(int(ident))
        if name is None:
            continue
        for stat, value in (
            ("min", timer.mean_min), ("max", timer.mean_max), ("mean", timer.mean_of_means),
            ("argmin_rank", float(timer.mean_min_rank)), ("argmax_rank", float(timer.mean_max_rank)),
        ):  # fmt: skip
            if math.isfinite(value):
                stats.append((value, {semconv.PHASE: name, semconv.STAT: stat}))
    return out


def add_counts(
    histogram: Any, timer: TimerTotals, bounds: Sequence[float], attributes: dict[str, Any]
) -> bool:
    """Add one record's bucket counts, sum, min and max to `histogram`'s series of `attributes` in
    every reader, as the SDK's own `record()` would have for those values; False (nothing added)
    when the SDK's internals are not the expected ones or its buckets are not `bounds`."""
    if not timer.count:
        return True

    def counts_for(reader_bounds: Sequence[float]) -> tuple[int, ...] | None:
        return timer.buckets if tuple(reader_bounds) == tuple(bounds) else None

    return add_bucket_counts(histogram, attributes, counts_for, timer.total, timer.low, timer.high)
