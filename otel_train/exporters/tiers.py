"""Series tiers (`Config.rank_series`): which of a rank's series reach the metrics store.

"essential" keeps per rank the catalogue's `essential` specs (per-rank histograms as sum and count
only) and the job-level specs. Only the store-facing paths filter (the OTLP metric exporter and the
pull endpoint's reader); the local outputs get every metric (docs/scale.md, "Series tiers").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from opentelemetry.sdk.metrics.export import (
    Histogram,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)

from otel_train import semconv
from otel_train.config import RANK_SERIES_ESSENTIAL_FROM

Tier = Literal["full", "essential"]


def resolve_rank_series(setting: str, world_size: int) -> Tier:
    """The tier `setting` means for a job of `world_size` ranks: "auto" is "essential" from
    `RANK_SERIES_ESSENTIAL_FROM` ranks on, else "full". Every rank passes rank 0's setting
    and the job's world size (assemble's agreement), so all ranks of a job resolve the same."""
    auto_essential = setting == "auto" and world_size >= RANK_SERIES_ESSENTIAL_FROM
    return "essential" if setting == "essential" or auto_essential else "full"


_ESSENTIAL_NAMES: frozenset[str] = frozenset(
    semconv.otel_name(spec.name) for spec in semconv.CATALOGUE if spec.essential or spec.scope == "job"
)
# Per-rank histograms among them: sent as sum and count only in the essential tier.
_WITHOUT_BUCKETS: frozenset[str] = frozenset(
    semconv.otel_name(spec.name)
    for spec in semconv.CATALOGUE
    if spec.essential and spec.kind is semconv.Kind.HISTOGRAM and spec.scope != "job"
)


def essential_names() -> frozenset[str]:
    """The instrument names the essential tier sends (per-rank essential and job-level)."""
    return _ESSENTIAL_NAMES


def _essential_metric(metric: Metric) -> Metric:
    if metric.name not in _WITHOUT_BUCKETS or not isinstance(metric.data, Histogram):
        return metric
    points = [replace(p, bucket_counts=(p.count,), explicit_bounds=()) for p in metric.data.data_points]
    return replace(metric, data=replace(metric.data, data_points=points))


def essential_only(data: MetricsData) -> MetricsData:
    """`data` with only what the essential tier sends (see the module doc). Resources stay, also
    without a metric left, so the pull endpoint's `target_info` keeps naming the rank."""
    resources = []
    for resource_metrics in data.resource_metrics:
        scopes = []
        for scope_metrics in resource_metrics.scope_metrics:
            kept = [_essential_metric(m) for m in scope_metrics.metrics if m.name in _ESSENTIAL_NAMES]
            if kept:
                scopes.append(replace(scope_metrics, metrics=kept))
        resources.append(replace(resource_metrics, scope_metrics=scopes))
    return replace(data, resource_metrics=resources)


class EssentialMetricExporter(MetricExporter):
    """Sends `essential_only` of each export to `inner` (the OTLP exporter)."""

    def __init__(self, inner: MetricExporter) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        return self._inner.export(essential_only(metrics_data), timeout_millis=timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)
