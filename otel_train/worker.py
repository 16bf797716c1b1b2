"""The background worker: everything a flush does off the training thread.

For each `FlushBatch` it (1) resolves device values in one batched transfer, drops and counts bad
ones, (2) feeds the OTel SDK: the sampled steps' spans first (the step-time exemplars link to them),
then the instruments, (3) hands the interval's `ot.log_histogram` values to the sinks, (4) runs the
flush listeners (health, hardware, cross-rank reduction, goodput), (5) collects the StepReader and
(6) hands the flattened scalars to the sinks. Text, samples, histograms and hyperparameters travel
through the same queue so they keep their order with the scalars.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_train import semconv
from otel_train.bridges.base import Sink
from otel_train.buffer import FlushBatch, LayerStats, SpanRecord
from otel_train.config import redact_text
from otel_train.crossrank import FINGERPRINT
from otel_train.histogram_feed import record_many
from otel_train.interval import FlushListener, Interval
from otel_train.step_reader import StepReader, key_for

log = logging.getLogger("otel_train")


@dataclass
class Message:
    """A non-scalar item from the explicit logger API (text, samples, histogram, hparams)."""

    kind: str  # "text" | "samples" | "histogram" | "hparams"
    key: str
    payload: Any
    step: int


class Instruments:
    """The SDK instruments otel_train records into (created once; user gauges created lazily)."""

    def __init__(self, meter: Any, max_user_gauges: int) -> None:
        self.meter = meter
        self.steps = meter.create_counter(semconv.STEPS.name, semconv.STEPS.unit, semconv.STEPS.description)
        self.tokens = meter.create_counter(
            semconv.TOKENS.name, semconv.TOKENS.unit, semconv.TOKENS.description
        )
        self.samples = meter.create_counter(
            semconv.SAMPLES.name, semconv.SAMPLES.unit, semconv.SAMPLES.description
        )
        self.step_duration = _histogram(meter, semconv.STEP_DURATION)
        self.phase_duration = _histogram(meter, semconv.PHASE_DURATION)
        self.current_step = _gauge(meter, semconv.CURRENT_STEP)
        self.last_step_time = _gauge(meter, semconv.LAST_STEP_TIME)
        self.total_steps = _gauge(meter, semconv.TOTAL_STEPS)
        self.eta = _gauge(meter, semconv.ETA)
        self.nonfinite_loss = meter.create_counter(
            semconv.NONFINITE_LOSS.name, semconv.NONFINITE_LOSS.unit, semconv.NONFINITE_LOSS.description
        )
        self.health_events = meter.create_counter(
            semconv.HEALTH_EVENTS.name, semconv.HEALTH_EVENTS.unit, semconv.HEALTH_EVENTS.description
        )
        self.dropped = meter.create_counter(
            semconv.DROPPED.name, semconv.DROPPED.unit, semconv.DROPPED.description
        )
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
                gauge = _gauge(self.meter, spec)
            else:
                gauge = self.meter.create_gauge(instrument, "", "Recorded with otel_train.record().")
            self._gauges[instrument] = gauge
        return gauge


def _histogram(meter: Any, spec: semconv.MetricSpec) -> Any:
    return meter.create_histogram(
        spec.name, spec.unit, spec.description, explicit_bucket_boundaries_advisory=list(spec.buckets or ())
    )


def _gauge(meter: Any, spec: semconv.MetricSpec) -> Any:
    return meter.create_gauge(spec.name, spec.unit, spec.description)


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
        """Export the spans; return the context of each one, keyed by what its duration histogram
        records (so that those points carry the span's trace id as an exemplar)."""
        contexts: ExemplarContexts = {}
        steps = {r.step: r for r in records if r.kind == "step"}
        parents: dict[int, Any] = {}
        for step, record in sorted(steps.items()):
            span = self._start(f"train.step {step}", record, perf_to_epoch_ns, self._virtual_root(step))
            span.set_attribute("train.step", step)
            for key, value in (record.attributes or {}).items():  # e.g. train.profiled
                span.set_attribute(key, value)
            parents[step] = trace.set_span_in_context(span)
            span.end(end_time=record.end_ns + perf_to_epoch_ns)
            contexts[(None, _seconds(record))] = parents[step]
        for record in records:
            if record.kind == "step":
                continue
            parent = parents.get(record.step) if record.kind == "phase" else None
            context = parent if parent is not None else self._virtual_root(record.step)
            span = self._start(record.name, record, perf_to_epoch_ns, context)
            span.set_attribute(semconv.PHASE, record.name)
            span.set_attribute("train.step", record.step)
            for key, value in (record.attributes or {}).items():
                span.set_attribute(key, value)
            span.end(end_time=record.end_ns + perf_to_epoch_ns)
            contexts[(record.name, _seconds(record))] = trace.set_span_in_context(span)
        return contexts

    def _virtual_root(self, step: int) -> Any:
        trace_id, root_id = step_trace_ids(self._run_id, step)
        root = SpanContext(trace_id, root_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        return trace.set_span_in_context(NonRecordingSpan(root))

    def _start(self, name: str, record: SpanRecord, perf_to_epoch_ns: int, context: Any) -> Any:
        span = self._tracer.start_span(
            name, context=context, kind=SpanKind.INTERNAL, start_time=record.start_ns + perf_to_epoch_ns
        )
        span.set_attribute(semconv.RANK, self._rank)
        if record.error:
            span.set_status(Status(StatusCode.ERROR, record.error))
            span.set_attribute(semconv.ERROR_TYPE, record.error)
        return span


_NO_DATA_WARNING = (
    "otel_train: record() got a tensor with no data (a meta or fake tensor); such values are "
    "dropped and counted as otel_train.dropped{reason=no_data_tensor}."
)


def has_data(tensor: Any) -> bool:
    """False for a tensor that has no values to copy (a `meta` tensor, a FakeTensor of
    torch.compile's tracing): copying one raises from deep in C++, slowly (its C++ stack is
    symbolised), and a worker still inside that at interpreter exit aborts the process (SIGABRT),
    losing the last flushes. Such values are dropped (`otel_train.dropped{reason=no_data_tensor}`)."""
    if getattr(tensor, "is_meta", False):
        return False
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is None or not isinstance(tensor, fake.FakeTensor)


def histogram_values(values: Any) -> list[float]:
    """A distribution (tensor, array or sequence) as finite floats; runs on the worker."""
    if hasattr(values, "detach") and not has_data(values):
        return []
    if hasattr(values, "detach"):
        values = values.detach().reshape(-1).double().cpu().tolist()
    elif hasattr(values, "tolist"):
        values = values.reshape(-1).tolist() if hasattr(values, "reshape") else values.tolist()
    out: list[float] = []
    for value in values if isinstance(values, (list, tuple)) else list(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out.append(number)
    return out


def resolve_values(values: Sequence[Any]) -> tuple[list[float | None], dict[str, int]]:
    """Turn recorded values (numbers, 0-dim or 1-element tensors) into finite floats, position by
    position (None where a value was dropped: bad type, non-scalar tensor, NaN/Inf).

    Device tensors are stacked and copied in ONE transfer. Returns (values, drop counts).
    """
    dropped: dict[str, int] = {}
    stacked = _stacked_scalars(values)
    if stacked is not None:
        return _finite_only(stacked, dropped), dropped
    out: list[float | None] = [None] * len(values)
    tensors: list[tuple[int, Any]] = []
    for i, value in enumerate(values):
        # One value at a time: whatever a value does (10**400, a __float__ that raises anything),
        # only that value is dropped and counted, never the flush.
        try:
            cls = value.__class__
            if cls is float:
                out[i] = value
            elif cls is int:
                out[i] = float(value)
            elif cls is bool or value is None or isinstance(value, (str, bytes)):
                dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
            elif hasattr(value, "numel") and hasattr(value, "detach"):
                if not has_data(value):
                    dropped["no_data_tensor"] = dropped.get("no_data_tensor", 0) + 1
                elif value.is_complex():
                    dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
                elif value.numel() == 1:
                    tensors.append((i, value))
                else:
                    dropped["non_scalar_tensor"] = dropped.get("non_scalar_tensor", 0) + 1
            else:
                out[i] = float(value)  # numpy scalars, Decimal, ...
        except OverflowError:
            dropped["overflow"] = dropped.get("overflow", 0) + 1
        except Exception:
            dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
    if tensors:
        for (i, _), resolved in zip(tensors, tensors_to_host([t for _, t in tensors]), strict=True):
            if resolved is None:  # a dtype that cannot convert (complex, ...)
                dropped["invalid_type"] = dropped.get("invalid_type", 0) + 1
            else:
                out[i] = resolved[0]
    return _finite_only(out, dropped), dropped


def _finite_only(values: list[float | None], dropped: dict[str, int]) -> list[float | None]:
    """`values` with NaN/Inf replaced by None, counted as dropped `nonfinite`."""
    for i, value in enumerate(values):
        if value is not None and not math.isfinite(value):
            values[i] = None
            dropped["nonfinite"] = dropped.get("nonfinite", 0) + 1
    return values


def _stacked_scalars(values: Sequence[Any]) -> list[float | None] | None:
    """The common interval (one loss tensor per step): every value a plain, real, one-element
    `torch.Tensor` of one shape on one device, read with one stack and one copy, without the
    per-value checks of `resolve_values` (~3x cheaper per value on the worker). None for anything
    else (a number, a subclass such as FakeTensor, a meta or complex tensor, mixed shapes or
    devices), which takes the careful path: the result is the same either way."""
    torch = sys.modules.get("torch")
    if torch is None or not values:
        return None
    plain = torch.Tensor
    if any(value.__class__ is not plain or value.is_meta for value in values):
        return None
    try:
        with torch.no_grad():
            joined = torch.stack(list(values))  # raises on mixed shapes or devices
            if joined.numel() != len(values) or joined.is_complex():
                return None
            if joined.device.type == "mps":  # Metal has no float64: convert on the host
                joined = joined.cpu()
            resolved: list[float | None] = joined.reshape(-1).to(torch.float64).cpu().tolist()
            return resolved
    except Exception:
        return None


def tensors_to_host(tensors: Sequence[Any]) -> list[list[float] | None]:
    """Each tensor's values as floats, copied to the host in ONE transfer per device (None for a
    tensor whose device group could not be converted)."""
    import torch

    by_device: dict[Any, list[int]] = {}
    for i, tensor in enumerate(tensors):
        try:
            if has_data(tensor):
                by_device.setdefault(tensor.device, []).append(i)
        except Exception:  # a tensor-like object without a usable device: left as None
            continue
    out: list[list[float] | None] = [None] * len(tensors)
    for positions in by_device.values():
        try:
            with torch.no_grad():  # one stack/cat and one cast per device, not one per tensor
                group = [tensors[i] for i in positions]
                shape = group[0].shape
                if all(t.shape == shape for t in group):  # e.g. one 0-dim loss per step: 4x cheaper
                    joined = torch.stack(group)
                else:
                    joined = torch.cat([t.reshape(-1) for t in group])
                if joined.device.type == "mps":  # Metal has no float64: convert on the host
                    joined = joined.cpu()
                flat = joined.reshape(-1).to(torch.float64).cpu().tolist()
        except Exception:  # one odd tensor (sparse, quantized, nested, ...): each on its own, so
            for i in positions:  # only the odd ones are dropped, not the whole device's values
                out[i] = _one_to_host(tensors[i])
            continue
        offset = 0
        for i in positions:
            size = tensors[i].numel()
            out[i] = flat[offset : offset + size]
            offset += size
    return out


def _one_to_host(tensor: Any) -> list[float] | None:
    import torch

    try:
        with torch.no_grad():
            return [float(x) for x in tensor.reshape(-1).to(torch.float64).cpu().tolist()]
    except Exception:
        return None


def resolve_layer_stats(records: Sequence[LayerStats]) -> list[tuple[LayerStats, list[float]]]:
    """Per-layer values of watched steps, copied to the host with one transfer per device."""
    resolved = tensors_to_host([r.values for r in records])
    return [(r, values) for r, values in zip(records, resolved, strict=True) if values is not None]


def _record_durations(
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


def _value_steps(
    resolved: Sequence[float | None], step_indices: Sequence[int], merged: bool
) -> list[int] | None:
    """The step of each kept value, when the values were recorded k times in every step of the
    interval (the usual once-per-step loss); None when that cannot be told (values recorded outside
    steps, in some steps only, or under two names merged into one instrument)."""
    if merged or not step_indices or len(resolved) % len(step_indices):
        return None
    per_step = len(resolved) // len(step_indices)
    if per_step == 1 and None not in resolved:  # once a step, nothing dropped: the usual loss
        return list(step_indices)
    return [step_indices[i // per_step] for i, v in enumerate(resolved) if v is not None]


def timer_phases(batch: FlushBatch) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(phase durations, arrivals) in seconds: `ot.phase` values, then each timer's raw clock
    readings (durations computed exactly as `_seconds` does for its span, so exemplars match;
    the arrival, from its step's start to the timer's end, only for timers inside a step)."""
    phases = {name: list(values) for name, values in batch.phases.items()}
    arrivals: dict[str, list[float]] = {}
    for name, timings in batch.timings.items():
        durations = [(end - start) * 1e-9 for start, end, _ in timings]
        phases[name] = phases[name] + durations if name in phases else durations
        arrived = [(end - began) * 1e-9 for _, end, began in timings if began]
        if arrived:
            arrivals[name] = arrived
    return phases, arrivals


def resolve_interval(batch: FlushBatch) -> Interval:
    """The batch as host floats (waiting on its CUDA event, here on the worker); bad values are
    dropped and counted in `batch.dropped`, non-finite ones also per instrument in the interval."""
    if batch.cuda_event is not None:
        batch.cuda_event.synchronize()  # waits here, on the worker, never on the training thread
    scalars: dict[str, list[float]] = {}
    scalar_steps: dict[str, list[int]] = {}
    nonfinite: dict[str, int] = {}
    for instrument, raw in batch.scalars.items():
        resolved, dropped = resolve_values(raw)
        for reason, count in dropped.items():
            batch.dropped[reason] = batch.dropped.get(reason, 0) + count
        if dropped.get("nonfinite", 0):
            nonfinite[instrument] = dropped["nonfinite"]
        values = [v for v in resolved if v is not None]
        if values:
            scalars[instrument] = values
            steps = _value_steps(resolved, batch.step_indices, instrument in batch.merged)
            if steps is not None:
                scalar_steps[instrument] = steps
    phases, arrivals = timer_phases(batch)
    for name, start, end in batch.cuda_timers:
        try:
            end.synchronize()
            phases.setdefault(name, []).append(start.elapsed_time(end) / 1000.0)
        except Exception:
            batch.dropped["cuda_timer"] = batch.dropped.get("cuda_timer", 0) + 1
    return Interval(
        seq=batch.seq,
        step=batch.step,
        wall_time=batch.wall_time,
        elapsed_s=batch.elapsed_s,
        steps=batch.steps,
        tokens=batch.tokens,
        samples=batch.samples,
        step_durations=batch.step_durations,
        phases=phases,
        arrivals=arrivals,
        scalars=scalars,
        scalar_steps=scalar_steps,
        nonfinite=nonfinite,
        final=batch.final,
        flush_interval=batch.flush_interval,
        flush_anchor=batch.flush_anchor,
        autocast_dtype=batch.autocast_dtype,
    )


class Worker:
    """The one background thread that turns flushes into telemetry."""

    def __init__(
        self,
        instruments: Instruments,
        step_reader: StepReader,
        sinks: list[Sink],
        listeners: list[FlushListener],
        span_writer: SpanWriter | None,
        queue_size: int,
        total_steps: int | None,
        otel_logger: Any | None = None,
    ) -> None:
        self.instruments = instruments
        self.step_reader = step_reader
        self.sinks = sinks
        self.listeners = listeners
        self.span_writer = span_writer
        self.total_steps = total_steps
        self.otel_logger = otel_logger
        # Unbounded as a queue; flush batches are bounded by `max_batches` (the session defers a
        # flush when the worker has that many pending) and messages by `max_messages`, so a burst
        # of messages from another thread can never make a flush batch fail to enqueue.
        self.queue: queue.Queue[FlushBatch | Message | None] = queue.Queue()
        self.max_batches = queue_size
        self.max_messages = max(64, queue_size * 8)
        # Single-writer counters: *_put by the session (under its lock), *_done by this thread.
        self.batches_put = 0
        self.batches_done = 0
        self.steps_put = 0
        self.steps_done = 0
        self.failed_flushes = 0
        self._room = threading.Condition()
        self._abandoned = False
        self.dropped_messages = 0
        self.final_scalars: dict[str, float] = {}
        self._stat_keys: dict[str, float] = {}  # this flush's interval statistics of users' names
        self.flushes = 0
        self.busy_s = 0.0  # worker time spent processing, for benchmarks
        self.cpu_s = 0.0  # the worker thread's own CPU time spent processing (time.thread_time)
        self._errors_warned: set[str] = set()
        self.sink_errors: dict[str, int] = {}
        self._started_at = time.time()
        self._steps_done = 0
        self.busy_since: float | None = None  # perf_counter when its item began (`stuck_message`)
        self.doing = "idle"
        self.stuck_reported: float | None = None  # the busy_since of the item already reported
        self._thread = threading.Thread(target=self._run, name="otel_train-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit_message(self, message: Message) -> None:
        if self.queue.qsize() >= self.max_messages:
            self.dropped_messages += 1
        else:
            self.queue.put(message)

    def pending_batches(self) -> int:
        return self.batches_put - self.batches_done

    def submit_batch(self, batch: FlushBatch, wait_s: float) -> bool:
        """Enqueue a flush batch (the caller serialises these calls). With `wait_s` > 0, wait up
        to that long for room below `max_batches`; False (nothing enqueued) if there was none."""
        if wait_s > 0 and self.pending_batches() >= self.max_batches:
            with self._room:
                if not self._room.wait_for(lambda: self.pending_batches() < self.max_batches, wait_s):
                    return False
        self.batches_put += 1
        self.steps_put += batch.steps
        self.queue.put(batch)
        return True

    def stop(self, timeout_s: float) -> bool:
        """Ask the worker to finish what is queued and stop; False if it did not within timeout_s
        (then it is told to abandon what is left: see `unwritten`)."""
        self.queue.put(None)
        self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            self._abandoned = True
            return False
        return True

    def unwritten(self) -> tuple[int, int]:
        """(flush batches, steps) handed to the worker that it has not written (yet)."""
        return self.batches_put - self.batches_done, self.steps_put - self.steps_done

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None or self._abandoned:
                return
            started, cpu_started = time.perf_counter(), time.thread_time()
            self.doing, self.busy_since = "processing a flush", started
            try:
                if isinstance(item, Message):
                    self._deliver_message(item)
                else:
                    self._process(item)
            except Exception as exc:  # never let one bad flush kill telemetry
                self.failed_flushes += 1
                self.instruments.dropped.add(1, {semconv.REASON: "flush_failed"})
                log.warning(
                    "otel_train: flush %d (step %d) failed and was skipped (%d so far): %r",
                    getattr(item, "seq", -1),
                    getattr(item, "step", -1),
                    self.failed_flushes,
                    exc,
                )
            finally:
                self.busy_since, self.doing = None, "idle"
                self.busy_s += time.perf_counter() - started
                self.cpu_s += time.thread_time() - cpu_started
                if isinstance(item, FlushBatch) and not self._abandoned:
                    with self._room:
                        self.steps_done += item.steps
                        self.batches_done += 1
                        self._room.notify_all()

    # --- one flush ------------------------------------------------------------------------------
    def _process(self, batch: FlushBatch) -> None:
        """One flush: resolve -> feed the SDK -> histograms to the sinks -> listeners -> collect ->
        scalars to the sinks."""
        interval = resolve_interval(batch)
        if batch.dropped.get("no_data_tensor"):
            self._warn_once("no_data_tensor", _NO_DATA_WARNING)
        self._feed_sdk(batch, interval)
        for key, step, values in batch.histograms:
            self._deliver_message(Message("histogram", key, values, step))
        for listener in self.listeners:
            self.doing = f"the flush listener {type(listener).__name__}"
            try:
                listener.on_flush(interval)
            except Exception as exc:
                self._warn_once(
                    type(listener).__name__, f"otel_train: {type(listener).__name__} failed: {exc!r}"
                )
        self.doing = "collecting metrics (observable-instrument callbacks, e.g. ones made on ot.get_meter())"
        scalars = self.step_reader.collect_scalars(interval.elapsed_s)
        for key, value in self._stat_keys.items():
            scalars.setdefault(key, value)  # a user's own name of that key keeps its value
        self._stat_keys.clear()
        self.final_scalars.update(scalars)
        self.flushes += 1
        if not (interval.steps or batch.scalars or batch.dropped or interval.phases or batch.phase_errors):
            # Nothing new since the last row (the final flush after the last step): the gauges
            # would write that row again under the same step.
            return
        for sink in self.sinks:
            self.doing = f"writing to the sink {type(sink).__name__}"
            try:
                sink.write_scalars(interval.step, interval.wall_time, scalars)
            except Exception as exc:
                self._sink_failed(sink, exc)

    def _feed_sdk(self, batch: FlushBatch, interval: Interval) -> None:
        """Layer statistics, sampled steps' spans, then the instruments (with exemplars)."""
        if batch.layer_stats:
            feed_layer_stats(self.instruments, batch, interval)
        exemplars: ExemplarContexts = {}
        if self.span_writer is not None and batch.spans:
            exemplars = self.span_writer.write(batch.spans, batch.perf_to_epoch_ns)
        self._feed(batch, interval, exemplars)

    def _feed(self, batch: FlushBatch, interval: Interval, exemplars: ExemplarContexts) -> None:
        ins = self.instruments
        if interval.steps:
            ins.steps.add(interval.steps)
            ins.current_step.set(interval.step)
            ins.last_step_time.set(interval.wall_time)
        if interval.tokens:
            ins.tokens.add(interval.tokens)
        if interval.samples:
            ins.samples.add(interval.samples)
        # Sampled steps' durations go one by one with their span's context (trace-based exemplars);
        # the rest reach the SDK as one aggregation step per series and flush (histogram_feed).
        _record_durations(ins.step_duration, interval.step_durations, None, {}, exemplars)
        for name, values in interval.phases.items():
            _record_durations(ins.phase_duration, values, name, {semconv.PHASE: name}, exemplars)
        for (name, error), values in batch.phase_errors.items():
            attributes = {semconv.PHASE: name, semconv.ERROR_TYPE: error}
            _record_durations(ins.phase_duration, values, name, attributes, exemplars)
        for instrument, values in interval.scalars.items():
            gauge = ins.gauge(instrument)
            if gauge is None:
                batch.dropped["too_many_names"] = batch.dropped.get("too_many_names", 0) + 1
                continue
            gauge.set(math.fsum(values) / len(values))  # the interval's mean (see semconv.INTERVAL_STATS)
            self._set_interval_stats(instrument, values)
        for reason, count in batch.dropped.items():
            ins.dropped.add(count, {semconv.REASON: reason})
        self._steps_done += interval.steps
        if self.total_steps:
            ins.total_steps.set(self.total_steps)
            remaining = self.total_steps - (interval.step + 1)
            elapsed = interval.wall_time - self._started_at
            if self._steps_done and remaining >= 0:
                ins.eta.set(remaining * elapsed / self._steps_done)

    def _set_interval_stats(self, instrument: str, values: Sequence[float]) -> None:
        """The interval's min, max and last value beside the mean: gauges of their own for the
        instruments semconv gives them (the loss), bridge keys for the others (series budget)."""
        stats = {"min": min(values), "max": max(values), "last": values[-1]}
        specs = semconv.INTERVAL_STAT_SPECS.get(instrument)
        if specs is None:
            key = key_for(instrument, {})
            for stat, value in stats.items():
                self._stat_keys[semconv.interval_key(key, stat)] = value
            return
        for stat, spec in specs.items():
            gauge = self.instruments.gauge(spec.name)
            if gauge is not None:
                gauge.set(stats[stat])

    def _deliver_message(self, message: Message) -> None:
        if message.kind == "histogram":
            message = Message(message.kind, message.key, histogram_values(message.payload), message.step)
        elif message.kind == "text":
            message = Message(message.kind, message.key, redact_text(message.payload), message.step)
        elif message.kind == "samples":
            rows = [(redact_text(p), redact_text(o)) for p, o in message.payload]
            message = Message(message.kind, message.key, rows, message.step)
        self._log_record(message)
        for sink in self.sinks:
            try:
                if message.kind == "text":
                    sink.write_text(message.key, message.payload, message.step)
                elif message.kind == "samples":
                    sink.write_samples(message.key, message.payload, message.step)
                elif message.kind == "histogram":
                    sink.write_histogram(message.key, message.payload, message.step)
                elif message.kind == "hparams":
                    sink.write_hparams(message.payload)
            except Exception as exc:
                self._sink_failed(sink, exc)

    def _sink_failed(self, sink: Sink, exc: Exception) -> None:
        """A write a sink could not do (full disk, ...): counted, and warned once per sink with
        the error's text, which names the file for OSErrors."""
        self.sink_errors[sink.name] = self.sink_errors.get(sink.name, 0) + 1
        self.instruments.dropped.add(1, {semconv.REASON: "sink_error"})
        self._warn_once(
            f"{sink.name}:{getattr(exc, 'filename', None)}",  # once per sink and file
            f"otel_train: sink {sink.name} failed: {type(exc).__name__}: {exc}. "
            "Further failures of this sink are counted in otel_train.dropped{reason=sink_error}.",
        )

    def _log_record(self, message: Message) -> None:
        """Text, samples, histograms and hyperparameters also leave as OTel log records, so the
        collector (and whatever sits behind it) sees them, not only the bridges."""
        if self.otel_logger is None:
            return
        body: Any
        if message.kind == "text":
            body = message.payload
        elif message.kind == "samples":
            body = json.dumps([{"prompt": p, "output": o} for p, o in message.payload])
        elif message.kind == "histogram":
            values = message.payload
            body = {"count": len(values)}
            if values:
                body.update(min=min(values), max=max(values), mean=sum(values) / len(values))
        else:
            body = json.dumps(message.payload, default=str, sort_keys=True)
        try:
            self.otel_logger.emit(
                severity_number=SeverityNumber.INFO,
                severity_text="INFO",
                body=body,
                attributes={"otel_train.key": message.key, "train.step": message.step},
                event_name=f"otel_train.{message.kind}",
            )
        except Exception as exc:
            self._warn_once("log_record", f"otel_train: could not emit a log record: {exc!r}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._errors_warned:
            self._errors_warned.add(key)
            log.warning(message)


def stuck_message(worker: Worker, limit_s: float) -> str | None:
    """Once per item: what `worker` has been doing when it is longer than `limit_s` on one
    (watchdog thread; a user callback that hangs, a dead file system), else None."""
    since, doing = worker.busy_since, worker.doing
    if since is None or since == worker.stuck_reported:
        return None
    busy_s = time.perf_counter() - since
    if busy_s < limit_s:
        return None
    worker.stuck_reported = since
    return (
        f"the otel_train background worker has been {doing} for {busy_s:.0f}s; no telemetry is "
        "written until it returns (flushes wait; values beyond max_values_per_interval are dropped)"
    )


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
