"""otel_train/semconv.py: `MetricSpec.create`, the one way an instrument is made from the catalogue,
on a real SDK meter: every spec's instrument carries its spec's name, unit, description, kind and
(histograms) buckets."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    InMemoryMetricReader,
    Metric,
    Sum,
)

from otel_train import semconv as sc


def _collect(spec: sc.MetricSpec) -> Metric:
    """Make `spec`'s instrument on a fresh meter, give it one value, and read it back."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")

    def observe(options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(3.0)

    instrument: Any = spec.create(meter, observe)
    if spec.kind is sc.Kind.COUNTER:
        instrument.add(3)
    elif spec.kind is sc.Kind.HISTOGRAM:
        instrument.record(3.0)
    elif spec.kind is sc.Kind.GAUGE:
        instrument.set(3.0)
    data = reader.get_metrics_data()
    assert data is not None
    (metric,) = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    return metric


@pytest.mark.parametrize("spec", sc.CATALOGUE, ids=lambda spec: spec.name)
def test_create_makes_the_instrument_the_spec_describes(spec: sc.MetricSpec) -> None:
    metric = _collect(spec)
    assert (metric.name, metric.unit, metric.description) == (spec.name, spec.unit, spec.description)
    expected = {
        sc.Kind.COUNTER: (Sum, True),
        sc.Kind.OBSERVABLE_COUNTER: (Sum, True),
        sc.Kind.OBSERVABLE_UP_DOWN_COUNTER: (Sum, False),
        sc.Kind.HISTOGRAM: (Histogram, None),
        sc.Kind.GAUGE: (Gauge, None),
        sc.Kind.OBSERVABLE_GAUGE: (Gauge, None),
    }[spec.kind]
    assert type(metric.data) is expected[0]
    if isinstance(metric.data, Sum):
        assert metric.data.is_monotonic is expected[1]
    (point,) = list[Any](metric.data.data_points)
    if isinstance(metric.data, Histogram):
        assert tuple(point.explicit_bounds) == spec.buckets  # seconds-scaled, not the SDK's ms default
        assert point.sum == 3.0
    else:
        assert point.value == 3


def test_every_kind_is_in_the_catalogue() -> None:
    """So the parametrised test above covers every branch of `create`."""
    assert {spec.kind for spec in sc.CATALOGUE} == set(sc.Kind)
