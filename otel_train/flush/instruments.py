"""The SDK instruments the worker records a flush into (created once at init(), user gauges
created lazily, bounded by max_metric_names), and the recording that is more than one call:
durations with their spans' exemplars, ot.watch's per-layer statistics."""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Mapping, Sequence
from typing import Any

from otel_train import semconv
from otel_train.buffer import FlushBatch
from otel_train.crossrank import FINGERPRINT
from otel_train.flush.histogram_feed import record_many
from otel_train.flush.resolve import resolve_layer_stats
from otel_train.flush.step_reader import key_for
from otel_train.flush.tracing import ExemplarContexts
from otel_train.interval import Interval


class Instruments:
    """The SDK instruments otel_train records into (created once; user gauges created lazily)."""

    def __init__(self, meter: Any, max_user_gauges: int) -> None:
        self.meter = meter
        self.steps = semconv.STEPS.create(meter)
        self.tokens = semconv.TOKENS.create(meter)
        self.samples = semconv.SAMPLES.create(meter)
        self.step_duration = semconv.STEP_DURATION.create(meter)
        self.phase_duration = semconv.PHASE_DURATION.create(meter)
        self.current_step = semconv.CURRENT_STEP.create(meter)
        self.last_step_time = semconv.LAST_STEP_TIME.create(meter)
        self.total_steps = semconv.TOTAL_STEPS.create(meter)
        self.eta = semconv.ETA.create(meter)
        self.nonfinite_loss = semconv.NONFINITE_LOSS.create(meter)
        self.health_events = semconv.HEALTH_EVENTS.create(meter)
        self.dropped = semconv.DROPPED.create(meter)
        self._gauges: dict[str, Any] = {}
        self._max_user_gauges = max_user_gauges
        # Zero-valued series from the start, so increase() in alert rules sees the first event.
        self.dropped.add(0, {semconv.REASON: "nonfinite"})
        self.nonfinite_loss.add(0)
        for event in ("nonfinite", "nonfinite_grad", "loss_spike", "straggler", "stall"):
            self.health_events.add(0, {semconv.EVENT: event})

    def gauge(self, instrument: str) -> Any | None:
        gauge = self._gauges.get(instrument)
        if gauge is None:
            spec = semconv.BY_NAME.get(instrument)
            if spec is None and len(self._gauges) >= self._max_user_gauges + len(semconv.CATALOGUE):
                return None
            if spec is not None:
                gauge = spec.create(self.meter)
            else:  # names differing only in case share the SDK's one instrument
                folded = semconv.otel_name(instrument)
                gauge = self._gauges.get(folded) or self.meter.create_gauge(
                    folded, "", "Recorded with otel_train.record()."
                )
            self._gauges[instrument] = gauge
        return gauge


def record_durations(
    histogram: Any,
    values: Sequence[float],
    phase: str | None,
    attributes: dict[str, str],
    exemplars: ExemplarContexts,
) -> None:
    """Durations with an exemplar context (sampled spans) one by one, the rest in bulk."""
    if not exemplars:
        record_many(histogram, values, attributes)
        return
    bulk: list[float] = []
    for seconds in values:
        context = exemplars.pop((phase, seconds), None)
        if context is None:
            bulk.append(seconds)
        else:
            histogram.record(seconds, attributes, context)
    record_many(histogram, bulk, attributes)


def feed_layer_stats(instruments: Instruments, batch: FlushBatch, interval: Interval) -> None:
    """ot.watch statistics: one gauge point per layer; non-finite values are dropped, counted
    and, for gradients, named in the interval (health reports them as one event per step)."""
    for record, values in resolve_layer_stats(batch.layer_stats):
        if record.instrument == FINGERPRINT:  # not a metric: compared across ranks (replicas.py)
            interval.batch_fingerprints.append((record.step, values))
            continue
        if record.instrument == semconv.LAYER_PARAM_NORM.name:
            interval.layer_param_norms.append((record.step, record.labels, values))
        gauge = instruments.gauge(record.instrument)
        if gauge is None:
            continue
        if record.instrument == semconv.LAYER_GRAD_NORM.name:
            interval.layer_grad_norms.append((record.step, record.labels, values))
        bad = []
        for label, value in zip(record.labels, values, strict=True):
            if math.isfinite(value):
                gauge.set(value, {semconv.LAYER: label})
            else:
                bad.append(label)
        if bad:
            batch.dropped["nonfinite"] = batch.dropped.get("nonfinite", 0) + len(bad)
            if record.instrument == semconv.LAYER_GRAD_NORM.name:
                interval.nonfinite_grads.append((record.step, bad))


def keep_case(
    scalars: dict[str, float],
    recorded: Mapping[str, Sequence[float]],
    spelling: dict[str, str],
    stepped: Container[str] = frozenset(),
) -> None:
    """Give the user's own names their keys in the case they were recorded (`eval/F1`): the SDK's
    instruments are case-folded (OTel names are case-insensitive) and a gauge goes on reporting its
    last value in later flushes, under the folded key. `spelling` (the worker's, kept across
    flushes) maps a folded key to the spelling whose value the SDK's gauge holds: the last one set.
    Names differing only in case each get their own interval mean (the latest value for `stepped`
    instruments, as the worker set the gauge). A name the SDK did not export
    (over max_metric_names) gets no key."""
    fresh: dict[str, float] = {}
    for instrument, values in recorded.items():  # the order the worker set the gauges in
        if instrument in semconv.BY_NAME or not values:
            continue
        folded_key = semconv.default_key(semconv.otel_name(instrument))
        if folded_key in scalars:
            spelling[folded_key] = key = semconv.default_key(instrument)
            fresh[key] = values[-1] if instrument in stepped else math.fsum(values) / len(values)
    for folded_key, key in spelling.items():
        if key != folded_key and folded_key in scalars:
            scalars[key] = scalars.pop(folded_key)
    scalars.update(fresh)


def leave_out_own_rows(scalars: dict[str, float], instruments: Collection[str]) -> None:
    """Take out of a flush's row the keys of instruments whose values have rows of their own
    (`log_metrics(step=N)`): their value, its interval statistics and, for the loss, its min/max/last
    gauges; a bridge then shows each at its own step only, as a framework's built-in logger does."""
    for instrument in instruments:
        key = key_for(instrument, {})
        scalars.pop(key, None)
        for stat in ("min", "max", "last"):
            scalars.pop(semconv.interval_key(key, stat), None)
        for spec in semconv.INTERVAL_STAT_SPECS.get(instrument, {}).values():
            scalars.pop(spec.key, None)


STAT_KEY_TAKEN = (
    "otel_train: a recorded name writes {key!r}, which is also the key of another recorded name's "
    "interval statistic (<key>_min, _max, _last); the recorded value is kept and the statistic is "
    "not written: rename one of them."
)


def add_stat_keys(scalars: dict[str, float], stat_keys: Mapping[str, float]) -> list[str]:
    """Add the interval statistics' keys to a flush's scalars; return those a user's own record
    name already wrote (it keeps its value)."""
    taken = [key for key in stat_keys if key in scalars]
    for key, value in stat_keys.items():
        scalars.setdefault(key, value)
    return taken


def set_interval_stats(
    instruments: Instruments, stat_keys: dict[str, float], instrument: str, values: Sequence[float]
) -> None:
    """The interval's min, max and last value beside the mean: gauges of their own for the
    instruments semconv gives them (the loss), bridge keys (into `stat_keys`) for the others
    (series budget)."""
    stats = {"min": min(values), "max": max(values), "last": values[-1]}
    specs = semconv.INTERVAL_STAT_SPECS.get(instrument)
    if specs is None:
        key = key_for(instrument, {})
        for stat, value in stats.items():
            stat_keys[semconv.interval_key(key, stat)] = value
        return
    for stat, spec in specs.items():
        gauge = instruments.gauge(spec.name)
        if gauge is not None:
            gauge.set(stats[stat])
