"""otel_train/instruments.py on a real SDK meter: the zero-valued series alert rules need from the
start, catalogue gauges made from their spec, user gauges capped, and durations recorded in bulk
except those with an exemplar context."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, Metric

from otel_train import semconv
from otel_train.core.instruments import Instruments, record_durations


def _metrics(reader: InMemoryMetricReader) -> dict[str, Metric]:
    data = reader.get_metrics_data()
    assert data is not None
    return {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def _points(metrics: dict[str, Metric], name: str) -> list[Any]:
    return list(metrics[name].data.data_points)


def _instruments(max_user_gauges: int = 2) -> tuple[Instruments, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    return Instruments(MeterProvider(metric_readers=[reader]).get_meter("t"), max_user_gauges), reader


def test_alerting_series_exist_at_zero_from_the_start() -> None:
    _, reader = _instruments()
    metrics = _metrics(reader)
    events = {p.attributes[semconv.EVENT]: p.value for p in _points(metrics, semconv.HEALTH_EVENTS.name)}
    assert events == dict.fromkeys(("nonfinite", "nonfinite_grad", "loss_spike", "straggler", "stall"), 0)
    (dropped,) = _points(metrics, semconv.DROPPED.name)
    assert dropped.attributes == {semconv.REASON: "nonfinite"} and dropped.value == 0
    assert [p.value for p in _points(metrics, semconv.NONFINITE_LOSS.name)] == [0]


def test_gauges_come_from_the_catalogue_and_user_names_are_capped() -> None:
    instruments, reader = _instruments(max_user_gauges=1)
    loss = instruments.gauge(semconv.LOSS.name)
    assert loss is not None
    loss.set(2.0)
    assert instruments.gauge(semconv.LOSS.name) is loss  # made once
    mine = instruments.gauge("my.value")
    assert mine is not None
    mine.set(1.0)
    for name in (f"other.{i}" for i in range(len(semconv.CATALOGUE))):  # the cap counts the catalogue too
        extra = instruments.gauge(name)
        if extra is None:
            break
    else:
        raise AssertionError("user gauges were not capped")
    metrics = _metrics(reader)
    assert metrics[semconv.LOSS.name].unit == semconv.LOSS.unit
    assert metrics["my.value"].description == "Recorded with otel_train.record()."


def test_durations_with_an_exemplar_context_are_recorded_one_by_one() -> None:
    calls: list[tuple[float, Any]] = []

    class Histogram:
        def record(self, value: float, attributes: Any = None, context: Any = None) -> None:
            calls.append((value, context))

    exemplars: dict[tuple[str | None, float], Any] = {("forward", 0.5): "ctx"}
    record_durations(Histogram(), [0.25, 0.5, 0.75], "forward", {}, exemplars)
    assert (0.5, "ctx") in calls and not exemplars  # used once, then gone
    assert sorted(v for v, _ in calls) == [0.25, 0.5, 0.75]
