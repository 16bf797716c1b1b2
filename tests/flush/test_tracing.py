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
from otel_train.buffer import SpanRecord, SpanRole
from otel_train.flush.tracing import SpanWriter, step_trace_ids

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
