"""Rank 0's job-level series (`semconv.JOB_SPECS`) from the merged job block (`job_block`).

They go to a meter of their own (`exporters.job_provider`: a MeterProvider whose Resource holds
the run identity only), so no store sees a rank label on them. What they mean:

- `train.job.step.duration`, `train.job.phase.duration` (histograms) and `train.job.samples`,
  `train.job.tokens` (counters): cumulative sums over every row rank 0 took, each row once, at the
  flush that took it. A late row counts at the flush that takes it; a row that could not go up goes
  with the rank's next one; the rows of a rank that is gone, and every rank's shutdown flush (never
  exchanged), are missing. So the buckets are exactly the sum of the ranks' own buckets over the
  flushes exchanged.
- the gauges (`train.job.loss`, its min and max, the rates, `train.job.phase.cross_rank`,
  `train.job.ranks`) are over the rows taken at rank 0's latest flush.

The histograms are fed their bucket counts, never values, through the SDK's aggregation (the
internals `flush.histogram_feed` also uses, opentelemetry-sdk 1.45). Where those are not what is
expected, the job histograms are left out (warned once): they are exact or absent.
A timer whose name rank 0 has not learned yet (a timer only other ranks run: names travel in the
rows' announcements) waits, counted, until it has.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from otel_train import semconv
from otel_train.crossrank.job_block import STEP_ID, JobTotals, TimerTotals, decode
from otel_train.crossrank.timer_stats import STEP_PHASE

logger = logging.getLogger("otel_train")

MAX_WAITING = 64  # flushes a timer without a name is kept for; beyond, its counts are dropped (warned)


class JobSeries:
    """Rank 0: publishes each flush's merged job block on `meter` (None: nothing is published)."""

    def __init__(self, meter: Any | None) -> None:
        self.meter = meter
        self.published = 0  # blocks published (tests)
        self.unexported = False  # the SDK's histogram internals were not as expected (module doc)
        self._waiting: dict[float, list[TimerTotals]] = {}
        self._warned: set[str] = set()
        if meter is None:
            return
        self.step = semconv.JOB_STEP_DURATION.create(meter)
        self.phase = semconv.JOB_PHASE_DURATION.create(meter)
        self.samples = semconv.JOB_SAMPLES.create(meter)
        self.tokens = semconv.JOB_TOKENS.create(meter)
        self.samples_rate = semconv.JOB_SAMPLES_RATE.create(meter)
        self.tokens_rate = semconv.JOB_TOKENS_RATE.create(meter)
        self.loss = semconv.JOB_LOSS.create(meter)
        self.loss_min = semconv.JOB_LOSS_MIN.create(meter)
        self.loss_max = semconv.JOB_LOSS_MAX.create(meter)
        self.cross_rank = semconv.JOB_PHASE_CROSS_RANK.create(meter)
        self.ranks = semconv.JOB_RANKS.create(meter)

    def publish(self, block: Any, names: Mapping[int, str], elapsed_s: float) -> None:
        """One flush's merged block; `names`: timer id -> name; `elapsed_s`: rank 0's seconds since
        its previous flush (the rates' denominator)."""
        if self.meter is None:
            return
        totals = decode(block)
        if totals.rows <= 0:
            return
        self.published += 1
        if totals.overflow:
            self._warn(
                "overflow",
                f"otel_train: the job runs more than {len(totals.timers) - 1} timers; the job-level "
                "series leave out those with the fewest durations (per-rank series keep them)",
            )
        self._throughput(totals, elapsed_s)
        for ident, timer in totals.timers.items():
            name = STEP_PHASE if ident == STEP_ID else names.get(int(ident))
            if name is None:
                waiting = self._waiting.setdefault(ident, [])
                if len(waiting) < MAX_WAITING:
                    waiting.append(timer)
                continue
            for earlier in self._waiting.pop(ident, []):
                self._histogram(ident, name, earlier)
            self._histogram(ident, name, timer)
            self._timer_stats(name, timer)

    def _throughput(self, totals: JobTotals, elapsed_s: float) -> None:
        self.ranks.set(totals.rows)
        if totals.samples:
            self.samples.add(totals.samples)
        if totals.tokens:
            self.tokens.add(totals.tokens)
        if elapsed_s > 0:
            self.samples_rate.set(totals.samples / elapsed_s)
            self.tokens_rate.set(totals.tokens / elapsed_s)
        if totals.loss_count:
            self.loss.set(totals.loss_sum / totals.loss_count)
            self.loss_min.set(totals.loss_min)
            self.loss_max.set(totals.loss_max)

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
                "aggregation is not the one otel_train merges bucket counts into (opentelemetry-sdk 1.45)",
            )

    def _timer_stats(self, name: str, timer: TimerTotals) -> None:
        stats = (
            ("min", timer.mean_min),
            ("max", timer.mean_max),
            ("mean", timer.mean_of_means),
            ("argmin_rank", float(timer.mean_min_rank)),
            ("argmax_rank", float(timer.mean_max_rank)),
        )
        for stat, value in stats:
            if math.isfinite(value):
                self.cross_rank.set(value, {semconv.PHASE: name, semconv.STAT: stat})

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def add_counts(
    histogram: Any, timer: TimerTotals, bounds: Sequence[float], attributes: dict[str, Any]
) -> bool:
    """Add one record's bucket counts, sum, min and max to `histogram`'s series of `attributes` in
    every reader, as the SDK's own `record()` would have for those values; False (nothing added)
    when the SDK's internals are not the expected ones or its buckets are not `bounds`."""
    if not timer.count:
        return True
    try:
        from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
        from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation

        aggregations = []
        for storage in histogram._measurement_consumer._reader_storages.values():
            for match in storage._get_or_init_view_instrument_match(histogram):
                keys = match._view._attribute_keys
                attrs = attributes if keys is None else {k: v for k, v in attributes.items() if k in keys}
                with match._lock:
                    aggregation = match._get_or_create_aggregation(_hash_attributes(attrs), attrs)
                if type(aggregation) is not _ExplicitBucketHistogramAggregation:
                    return False
                if tuple(aggregation._boundaries) != tuple(bounds):
                    return False
                aggregations.append((match, _hash_attributes(attrs), attrs))
    except (AttributeError, ImportError, TypeError):
        return False
    for match, key, attrs in aggregations:
        # Held like record() holds it when collect() swaps aggregations (delta readers).
        with match._lock:
            aggregation = match._get_or_create_aggregation(key, attrs)
            with aggregation._lock:
                if aggregation._value is None:
                    aggregation._value = aggregation._get_empty_bucket_counts()
                aggregation._sum += timer.total
                if aggregation._record_min_max:
                    aggregation._min = min(aggregation._min, timer.low)
                    aggregation._max = max(aggregation._max, timer.high)
                for index, count in enumerate(timer.buckets):
                    aggregation._value[index] += count
    return True
