"""What the worker writes a flush into: the SDK instruments (user gauges created lazily, bounded by
max_metric_names), the step reader that collects them for the sinks
(docs/design/core.md#step-reader), and the sampled steps' spans."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Container, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.metrics import Counter, Histogram, ObservableCounter, _Gauge
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    MetricReader,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_train import semconv
from otel_train.core.buffer import SCALER_FOUND_INF, FlushBatch, Interval, SpanRecord, SpanRole
from otel_train.core.resolve import record_many, tensors_to_host
from otel_train.crossrank import FINGERPRINT


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
        self._phase_names: set[str] = set()  # train.phase values so far (see admit_phases)
        # Zero-valued series from the start, so increase() in alert rules sees the first event.
        self.dropped.add(0, {semconv.REASON: "nonfinite"})
        self.nonfinite_loss.add(0)
        for event in ("nonfinite", "nonfinite_grad", "loss_spike", "straggler", "stall"):
            self.health_events.add(0, {semconv.EVENT: event})

    def admit_phases(self, batch: FlushBatch, interval: Interval) -> None:
        """At most as many distinct timer and span names (`train.phase` values, one series set and
        row keys each) as record names (max_metric_names) in the process's life: a name invented
        per step must not grow the series and rows without bound. The values of a name past them
        are dropped and counted (`too_many_names`), as a record name's are."""
        known = self._phase_names
        if interval.phases.keys() <= known and all(name in known for name, _ in batch.phase_errors):
            return
        seen = [
            *batch.phases,
            *(event[0] for event in batch.timer_events),
            *(n for n, _ in batch.phase_errors),
        ]
        for name in [name for name in dict.fromkeys(seen) if name not in known]:  # first seen first
            if len(known) < self._max_user_gauges:
                known.add(name)
                continue
            values = interval.phases.pop(name, [])
            interval.arrivals.pop(name, None)
            errors = [key for key in batch.phase_errors if key[0] == name]
            count = len(values) + sum(len(batch.phase_errors.pop(key)) for key in errors)
            batch.dropped["too_many_names"] = batch.dropped.get("too_many_names", 0) + count
            batch.problems["too_many_names", name] = None

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
    """Durations with an exemplar context (sampled spans) one by one, the rest in one step."""
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


def scaler_skipped_steps(batch: FlushBatch, interval: Interval) -> set[int]:
    """The watched steps whose fused optimizer step the GradScaler skipped (found inf/NaN): their
    gradient statistics are NaN by design and no sign of divergence, so they are taken out of the
    interval's non-finite grad_norm and counted as dropped `scaler_skipped` instead."""
    marks = [r for r in batch.layer_stats if r.instrument == SCALER_FOUND_INF]
    if not marks:
        return set()
    found = tensors_to_host([r.values for r in marks])
    skipped = {r.step for r, f in zip(marks, found, strict=True) if f is not None and f[0] > 0}
    steps = interval.nonfinite_steps.get(semconv.GRAD_NORM.name)
    if skipped and steps is not None:
        kept = [step for step in steps if step not in skipped]
        forgiven = len(steps) - len(kept)
        dropped = batch.dropped
        dropped["nonfinite"] -= forgiven
        dropped["scaler_skipped"] = dropped.get("scaler_skipped", 0) + forgiven
        if not dropped["nonfinite"]:
            del dropped["nonfinite"]
        if kept:
            interval.nonfinite_steps[semconv.GRAD_NORM.name] = kept
            interval.nonfinite[semconv.GRAD_NORM.name] = len(kept)
        else:
            del interval.nonfinite_steps[semconv.GRAD_NORM.name], interval.nonfinite[semconv.GRAD_NORM.name]
            batch.problems.pop(("nonfinite", semconv.GRAD_NORM.name), None)
    return skipped


def feed_layer_stats(
    instruments: Instruments, batch: FlushBatch, interval: Interval, scaler_skipped: Container[int] = ()
) -> None:
    """ot.watch statistics: one gauge point per layer; non-finite values are dropped, counted
    and, for gradients, named in the interval (health reports them once a spell). A step the
    scaler skipped (`scaler_skipped_steps`) has no gradient statistics."""
    records = batch.layer_stats
    for record, values in zip(records, tensors_to_host([r.values for r in records]), strict=True):
        if values is None or record.instrument == SCALER_FOUND_INF:  # unconvertible, or no metric
            continue
        if record.instrument == semconv.LAYER_GRAD_NORM.name and record.step in scaler_skipped:
            batch.dropped["scaler_skipped"] = batch.dropped.get("scaler_skipped", 0) + len(record.labels)
            continue
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
    instruments are case-folded, so the row has the folded key. `spelling` (kept across flushes)
    maps a folded key to the spelling whose value the gauge holds (the last one set). Names
    differing only in case each get their own value; one the SDK did not export gets no key."""
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


def leave_out(scalars: dict[str, float], instruments: Collection[str]) -> None:
    """Take `instruments` (values with rows of their own, `log_metrics(step=N)`) out of a flush's
    row, with their interval statistics, as a framework's built-in logger would."""
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
    scalars.update({key: value for key, value in stat_keys.items() if key not in scalars})
    return taken


def set_interval_stats(
    instruments: Instruments, stat_keys: dict[str, float], instrument: str, values: Sequence[float]
) -> None:
    """The interval's min, max and last value beside the mean: gauges of their own where semconv
    has them (the loss), else bridge keys (into `stat_keys`: series budget)."""
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


# --- the step reader: a delta-temporality MetricReader collected at each flush, flattened into one
# key per value for the sinks (docs/design/core.md#step-reader) ---
# Attributes that never become key segments: the SDK's overflow marker, and the MFU's peak, its
# source and dtype (they describe the value; as segments they would rename the key).
_IGNORED_ATTRIBUTES = frozenset(
    {"otel.metric.overflow", semconv.PEAK_SOURCE, semconv.COMPUTE_DTYPE, semconv.PEAK_FLOPS}
)


# Counters a sampler thread reads off the device on its own clock (`hardware_interval_s`), not at
# flushes: a flush interval holds the increase of zero, one or several samples, so a rate over it is
# no rate (0 at most flushes, several times the truth at the next; `hw.power` and
# `energy/avg_power_w` are the rates), and the first reading counts from driver load, not from this
# run. Rows carry their increase from the second reading on, and no `_per_s`.
SAMPLED_COUNTERS = frozenset({semconv.GPU_ENERGY.name, semconv.GPU_ERRORS.name, semconv.GPU_IO.name})


class StepReader(MetricReader):
    def __init__(self) -> None:
        # Gauges too: a row carries a gauge only from the interval it was set in (an eval loss at its
        # eval, ot.watch's layer norms at watched steps), as a framework's logger writes it at its step.
        kinds = (Counter, Histogram, ObservableCounter, _Gauge)
        super().__init__(preferred_temporality=dict.fromkeys(kinds, AggregationTemporality.DELTA))

        self._latest: MetricsData | None = None
        self._baselines: set[str] = set()  # keys of SAMPLED_COUNTERS whose first reading was taken
        self._carried: dict[str, float] = {}  # key -> what a counter began at, left out of its first row

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        self._latest = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._latest = None

    def carry(self, instrument_name: str, attributes: Mapping[str, Any], amount: float) -> None:
        """A counter began at `amount` carried over from a previous process of the run (goodput's
        totals): the rows take its deltas from there, so the first one does not repeat it."""
        key = key_for(instrument_name, attributes)
        self._carried[key] = self._carried.get(key, 0.0) + amount

    def collect_scalars(self, interval_s: float) -> dict[str, float]:
        """Collect now (in this thread) and flatten to `{key: value}`."""
        self._latest = None
        self.collect()
        data, self._latest = self._latest, None
        if data is None:
            return {}
        return flatten(data, interval_s, self._baselines, self._carried)


def key_for(instrument_name: str, attributes: Mapping[str, Any]) -> str:
    spec = semconv.BY_NAME.get(instrument_name)
    template = spec.key if spec is not None else semconv.default_key(instrument_name)
    used: set[str] = set()
    for attr, value in attributes.items():
        placeholder = "{" + attr + "}"
        if placeholder in template:
            template = template.replace(placeholder, _segment(value))
            used.add(attr)
    extra = [
        _segment(v) for k, v in sorted(attributes.items()) if k not in used and k not in _IGNORED_ATTRIBUTES
    ]
    # A placeholder whose attribute is absent is dropped with its separator.
    parts = [p for p in template.split("/") if p and not (p.startswith("{") and p.endswith("}"))]
    return "/".join(parts + extra)


def _segment(value: Any) -> str:
    text = str(value).strip().replace("/", "_").replace(" ", "_")
    return text or "_"


def flatten(
    data: MetricsData, interval_s: float, baselines: set[str], carried: dict[str, float]
) -> dict[str, float]:
    """`{key: value}` of one collection; `baselines` holds the SAMPLED_COUNTERS keys already read
    once, `carried` the amounts counters began at (`StepReader.carry`) not yet left out (both
    updated here)."""
    out: dict[str, float] = {}
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                _flatten_metric(metric.name, metric.data, interval_s, baselines, carried, out)
    return out


def _flatten_metric(
    name: str,
    data: Any,
    interval_s: float,
    baselines: set[str],
    carried: dict[str, float],
    out: dict[str, float],
) -> None:
    if isinstance(data, Gauge):
        for point in data.data_points:
            out[key_for(name, point.attributes or {})] = float(point.value)
    elif isinstance(data, Sum):
        sampled = name in SAMPLED_COUNTERS
        for point in data.data_points:
            key = key_for(name, point.attributes or {})
            if sampled and key not in baselines:
                baselines.add(key)
                continue
            value = float(point.value) - carried.pop(key, 0.0) if carried else float(point.value)
            out[key] = value
            delta = data.aggregation_temporality == AggregationTemporality.DELTA
            if data.is_monotonic and delta and interval_s > 0 and not sampled:
                out[key + semconv.RATE_SUFFIX] = value / interval_s
    elif isinstance(data, HistogramData):
        for hpoint in data.data_points:
            if hpoint.count == 0:
                continue
            key = key_for(name, hpoint.attributes or {})
            out[semconv.stat_key(key, "mean")] = hpoint.sum / hpoint.count
            out[semconv.stat_key(key, "count")] = float(hpoint.count)
            out[semconv.stat_key(key, "total")] = float(hpoint.sum)
            for stat, bound in (("min", hpoint.min), ("max", hpoint.max)):
                if bound is not None and math.isfinite(bound):
                    out[semconv.stat_key(key, stat)] = float(bound)
            for q, suffix in ((0.5, "p50"), (0.95, "p95")):
                estimate = bucket_quantile(
                    q, hpoint.explicit_bounds, hpoint.bucket_counts, hpoint.min, hpoint.max
                )
                if estimate is not None:
                    out[semconv.stat_key(key, suffix)] = estimate


def exact_quantiles(scalars: dict[str, float], interval: Interval) -> None:
    """The rows' p50/p95 of the step and phase times from the interval's own durations (the
    buckets could only bound them: 0.1 ms steps all fall in the first, 0-5 ms, bucket)."""
    series = [(key_for(semconv.STEP_DURATION.name, {}), interval.step_durations)]
    series += [
        (key_for(semconv.PHASE_DURATION.name, {semconv.PHASE: n}), v) for n, v in interval.phases.items()
    ]
    for key, values in series:
        if not values:
            continue
        ordered = sorted(values)
        for q, suffix in ((0.5, "p50"), (0.95, "p95")):
            at = q * (len(ordered) - 1)  # linear interpolation between the closest ranks
            low = int(at)
            high = min(low + 1, len(ordered) - 1)
            scalars[semconv.stat_key(key, suffix)] = ordered[low] + (ordered[high] - ordered[low]) * (
                at - low
            )


def bucket_quantile(
    q: float, bounds: Any, counts: Any, observed_min: float | None, observed_max: float | None
) -> float | None:
    """Quantile estimate from explicit buckets, or None unless the bucket holding it has finite
    bounds on both sides once clamped to the observed min/max."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    cumulative = 0.0
    for i, count in enumerate(counts):
        if count == 0:
            continue
        if cumulative + count >= rank:
            lower = bounds[i - 1] if i > 0 else observed_min
            upper = bounds[i] if i < len(bounds) else observed_max
            if observed_min is not None and lower is not None:
                lower = max(lower, observed_min)
            if observed_max is not None and upper is not None:
                upper = min(upper, observed_max)
            if lower is None or upper is None or not (math.isfinite(lower) and math.isfinite(upper)):
                return None
            fraction = (rank - cumulative) / count
            return float(lower + (upper - lower) * fraction)
        cumulative += count
    return None


# --- tracing: sampled steps' span records as OTel spans, each step's spans on every rank in one trace
# whose id comes from (run id, step) alone ---
def step_trace_ids(run_id: str, step: int) -> tuple[int, int]:
    """(trace id, virtual root span id) derived from (run id, step): every rank's span for step N
    lands in one trace with no communication."""
    digest = hashlib.sha256(f"otel_train/{run_id}/{step}".encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


# (phase name or None for the step, duration in seconds) -> context holding that span. The
# duration is computed exactly as the training thread computes the histogram value, so the
# sampled step's (or phase's) own measurement finds its span: recorded in that context, the
# histogram point gets the span's trace id as an exemplar (the SDK's trace_based filter).
ExemplarContexts = dict[tuple[str | None, float], Any]


def _seconds(record: SpanRecord) -> float:
    return (record.end_ns - record.start_ns) * 1e-9


class SpanWriter:
    """Turns SpanRecords (perf-counter timestamps) into OTel spans with explicit times."""

    def __init__(self, tracer: Any, run_id: str, rank: int) -> None:
        self._tracer = tracer
        self._run_id = run_id
        self._rank = rank

    def write(self, records: Sequence[SpanRecord], perf_to_epoch_ns: int) -> ExemplarContexts:
        """Export the spans; return each one's context, keyed as `ExemplarContexts`."""
        contexts: ExemplarContexts = {}
        steps = {r.step: r for r in records if r.kind is SpanRole.STEP}
        parents: dict[int, Any] = {}
        for step, record in sorted(steps.items()):
            parents[step] = self._span(
                f"train.step {step}", record, perf_to_epoch_ns, self._virtual_root(step)
            )
            contexts[(None, _seconds(record))] = parents[step]
        for record in records:
            if record.kind is SpanRole.STEP:
                continue
            parent = parents.get(record.step) if record.kind is SpanRole.PHASE else None
            context = parent if parent is not None else self._virtual_root(record.step)
            contexts[(record.name, _seconds(record))] = self._span(
                record.name, record, perf_to_epoch_ns, context
            )
        return contexts

    def _virtual_root(self, step: int) -> Any:
        trace_id, root_id = step_trace_ids(self._run_id, step)
        root = SpanContext(trace_id, root_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        return trace.set_span_in_context(NonRecordingSpan(root))

    def _span(self, name: str, record: SpanRecord, perf_to_epoch_ns: int, context: Any) -> Any:
        """The span of `record`, ended; returns the context holding it."""
        span = self._tracer.start_span(
            name, context=context, kind=SpanKind.INTERNAL, start_time=record.start_ns + perf_to_epoch_ns
        )
        span.set_attribute(semconv.RANK, self._rank)
        if record.error:
            span.set_status(Status(StatusCode.ERROR, record.error))
            span.set_attribute(semconv.ERROR_TYPE, record.error)
        if record.kind is not SpanRole.STEP:
            span.set_attribute(semconv.PHASE, record.name)
        span.set_attribute("train.step", record.step)
        span.set_attributes(record.attributes or {})  # e.g. train.profiled, an ot.span's own
        span.end(end_time=record.end_ns + perf_to_epoch_ns)
        return trace.set_span_in_context(span)
