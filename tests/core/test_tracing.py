"""otel_train/tracing.py: `SpanWriter` on a real SDK tracer. A step span is the child of the step's
virtual root (trace id from run id and step, the same on every rank), its timers are its children,
an `ot.span` mark hangs off the root; each span's context is returned keyed by what its duration
histogram records. The end-to-end path through OTLP is tests/exporters/test_otlp.py."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, get_current_span

from otel_train import semconv
from otel_train.core.buffer import Buffer, SpanRecord, SpanRole, span_records, step_record
from otel_train.core.instruments import SpanWriter, step_trace_ids

EPOCH_NS = 1_700_000_000_000_000_000  # perf_counter_ns 0 as epoch nanoseconds


def test_spans_form_one_trace_per_step_by_role() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    writer = SpanWriter(provider.get_tracer("test"), "run-1", rank=3)
    records = [
        SpanRecord("forward", 1_000, 3_000, 7),  # a timer: SpanRole.PHASE by default
        SpanRecord("step", 0, 10_000, 7, None, SpanRole.STEP, {"train.profiled": True}),
        SpanRecord("eval", 20_000, 25_000, 7, "ValueError", SpanRole.MARK, {"split": "val"}),
    ]
    contexts = writer.write(records, EPOCH_NS)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"train.step 7", "forward", "eval"}
    step, forward, mark = spans["train.step 7"], spans["forward"], spans["eval"]
    trace_id, root_id = step_trace_ids("run-1", 7)
    assert {s.context.trace_id for s in spans.values()} == {trace_id}
    assert step.parent is not None and step.parent.span_id == root_id
    assert forward.parent is not None and forward.parent.span_id == step.context.span_id
    assert mark.parent is not None and mark.parent.span_id == root_id  # a mark is not inside the step
    assert (step.start_time, step.end_time) == (EPOCH_NS, EPOCH_NS + 10_000)
    assert step.attributes is not None and step.attributes["train.profiled"] is True
    assert mark.status.status_code is StatusCode.ERROR
    assert mark.attributes is not None and mark.attributes[semconv.ERROR_TYPE] == "ValueError"
    assert mark.attributes["split"] == "val" and mark.attributes[semconv.RANK] == 3
    # the histogram's value for each span finds that span's context (its exemplar)
    by_key = {key: get_current_span(context).get_span_context().span_id for key, context in contexts.items()}
    assert by_key == {
        (None, 10_000 * 1e-9): step.context.span_id,
        ("forward", 2_000 * 1e-9): forward.context.span_id,
        ("eval", 5_000 * 1e-9): mark.context.span_id,
    }


def test_trace_ids_depend_on_run_and_step_only() -> None:
    assert step_trace_ids("run-1", 7) == step_trace_ids("run-1", 7)
    assert step_trace_ids("run-1", 7) != step_trace_ids("run-1", 8)
    assert step_trace_ids("run-1", 7) != step_trace_ids("run-2", 7)


def test_only_the_traced_steps_timers_become_span_records_within_the_limit() -> None:
    """The training thread appends every timer as one tuple; the worker makes span records of those
    whose step is traced (found by the step's start), as children of that step, up to the limit."""
    buffer = Buffer(max_names=10, max_values=10)
    buffer.spans.append(step_record(100, 190, 0, False, False))
    buffer.spans.append(step_record(300, 390, 2, True, False))
    buffer.timer_events.extend([
        ("data", 101, 110, 100), ("forward", 111, 150, 100),  # step 0: traced
        ("forward", 211, 250, 200),  # step 1: not traced
        ("forward", 311, 350, 300),  # step 2: traced (it failed)
        ("eval_load", 400, 450, 0),  # outside any step
    ])  # fmt: skip
    batch = buffer.take(0, 2, 1.0, 0)
    records = span_records(batch, 100)
    timers = [(r.name, r.start_ns, r.step, r.kind) for r in records if r.kind is not SpanRole.STEP]
    assert timers == [
        ("data", 101, 0, SpanRole.PHASE), ("forward", 111, 0, SpanRole.PHASE), ("forward", 311, 2, SpanRole.PHASE)
    ]  # fmt: skip
    assert len(span_records(batch, 3)) == 3  # the two steps' records first, then timers to the limit
    assert span_records(buffer.take(1, 2, 1.0, 0), 100) == []  # no traced step: nothing
