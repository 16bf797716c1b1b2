"""StepReader: a delta-temporality MetricReader collected at each flush on the worker, flattened
into one key per value for the sinks. The flattening rules: docs/design/core.md#step-reader.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.metrics import Counter, Histogram, ObservableCounter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    MetricReader,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData

from otel_train import semconv

# Attributes that never become key segments: the SDK's overflow marker, and the MFU's peak, its
# source and dtype (they describe the value; as segments they would rename the key).
_IGNORED_ATTRIBUTES = frozenset(
    {"otel.metric.overflow", semconv.PEAK_SOURCE, semconv.COMPUTE_DTYPE, semconv.PEAK_FLOPS}
)


class StepReader(MetricReader):
    def __init__(self) -> None:
        super().__init__(
            preferred_temporality={
                Counter: AggregationTemporality.DELTA,
                Histogram: AggregationTemporality.DELTA,
                ObservableCounter: AggregationTemporality.DELTA,
            }
        )
        self._latest: MetricsData | None = None

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        self._latest = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._latest = None

    def collect_scalars(self, interval_s: float) -> dict[str, float]:
        """Collect now (in this thread) and flatten to `{key: value}`."""
        self._latest = None
        self.collect()
        data, self._latest = self._latest, None
        return flatten(data, interval_s) if data is not None else {}


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


def flatten(data: MetricsData, interval_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                _flatten_metric(metric.name, metric.data, interval_s, out)
    return out


def _flatten_metric(name: str, data: Any, interval_s: float, out: dict[str, float]) -> None:
    if isinstance(data, Gauge):
        for point in data.data_points:
            out[key_for(name, point.attributes or {})] = float(point.value)
    elif isinstance(data, Sum):
        for point in data.data_points:
            key = key_for(name, point.attributes or {})
            if data.is_monotonic and data.aggregation_temporality == AggregationTemporality.DELTA:
                out[key] = float(point.value)
                if interval_s > 0:
                    out[key + semconv.RATE_SUFFIX] = float(point.value) / interval_s
            else:
                out[key] = float(point.value)
    elif isinstance(data, HistogramData):
        for hpoint in data.data_points:
            if hpoint.count == 0:
                continue
            key = key_for(name, hpoint.attributes or {})
            out[semconv.stat_key(key, "mean")] = hpoint.sum / hpoint.count
            out[semconv.stat_key(key, "count")] = float(hpoint.count)
            out[semconv.stat_key(key, "total")] = float(hpoint.sum)
            if hpoint.min is not None and math.isfinite(hpoint.min):
                out[semconv.stat_key(key, "min")] = float(hpoint.min)
            if hpoint.max is not None and math.isfinite(hpoint.max):
                out[semconv.stat_key(key, "max")] = float(hpoint.max)
            for q, suffix in ((0.5, "p50"), (0.95, "p95")):
                estimate = bucket_quantile(
                    q, hpoint.explicit_bounds, hpoint.bucket_counts, hpoint.min, hpoint.max
                )
                if estimate is not None:
                    out[semconv.stat_key(key, suffix)] = estimate


def bucket_quantile(
    q: float,
    bounds: Any,
    counts: Any,
    observed_min: float | None = None,
    observed_max: float | None = None,
) -> float | None:
    """Quantile estimate from explicit buckets, or None when no honest estimate exists.

    The bucket holding the q-th observation must have finite bounds on both sides after clamping
    to the observed min/max (the first bucket is bounded below by min, the last above by max).
    """
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
