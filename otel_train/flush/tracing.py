"""Tracing: sampled steps' span records become OTel spans, each step's spans on every rank in one
trace whose id comes from (run id, step) alone."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_train import semconv
from otel_train.buffer import SpanRecord, SpanRole


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
        steps = {r.step: r for r in records if r.kind is SpanRole.STEP}
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
            if record.kind is SpanRole.STEP:
                continue
            parent = parents.get(record.step) if record.kind is SpanRole.PHASE else None
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
