"""record_many: one aggregation step per flush gives exactly what one record() per value gives."""

from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

from otel_train.core.resolve import record_many

BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0]


def _points(feed: str, temporality: AggregationTemporality) -> list[list[tuple]]:
    from opentelemetry.sdk.metrics import Histogram

    readers = [
        InMemoryMetricReader(preferred_temporality={Histogram: temporality}),
        InMemoryMetricReader(),  # a second reader (cumulative), like the pull endpoint beside the bridges
    ]
    provider = MeterProvider(metric_readers=readers)
    histogram = provider.get_meter("t").create_histogram(
        "d", "s", explicit_bucket_boundaries_advisory=BUCKETS
    )
    if feed == "many":

        def no_per_value_record(*args: object, **kwargs: object) -> None:
            raise AssertionError("record_many fell back to one record() per value")

        histogram.record = no_per_value_record  # type: ignore[method-assign]
    rng = random.Random(7)
    collected: list[list[tuple]] = []
    for _ in range(3):  # three flushes, collected after each
        for phase in ("forward", "backward"):
            values = [rng.lognormvariate(-4, 1.5) for _ in range(rng.randrange(1, 200))]
            values += [float("nan"), 0.0, 5.0, *BUCKETS, 0.01]  # non-finite skipped; values on bounds
            if feed == "record":
                for value in values:
                    if value == value:
                        histogram.record(value, {"train.phase": phase})
            else:
                record_many(histogram, values, {"train.phase": phase})
        for reader in readers:
            data = reader.get_metrics_data()
            points = [
                (tuple(p.attributes.items()), p.count, round(p.sum, 12), p.min, p.max, tuple(p.bucket_counts))
                for rm in data.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
                for p in m.data.data_points
            ]
            collected.append(sorted(points))
    provider.shutdown()
    return collected


@pytest.mark.parametrize("temporality", [AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE])
def test_record_many_equals_one_record_per_value(temporality: AggregationTemporality) -> None:
    assert _points("many", temporality) == _points("record", temporality)


def test_falls_back_to_record_when_the_sdk_internals_differ() -> None:
    class Plain:
        def __init__(self) -> None:
            self.recorded: list[tuple[float, object]] = []

        def record(self, value: float, attributes: object = None) -> None:
            self.recorded.append((value, attributes))

    histogram = Plain()
    record_many(histogram, [0.5, float("inf"), 0.25], {"a": "b"})
    assert histogram.recorded == [(0.5, {"a": "b"}), (0.25, {"a": "b"})]
