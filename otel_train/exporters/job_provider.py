"""Rank 0's second MeterProvider: the job-level series (`semconv.JOB_SPECS`, published by
`crossrank.job_outputs`), once per job, in both tiers. Its Resource is the run identity alone, so
no store gives them a rank label; it exports where rank 0's own provider does, the pull endpoint
included (docs/scale.md, "Job-level series").
"""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from otel_train import semconv
from otel_train.config import Config
from otel_train.distributed import Identity
from otel_train.exporters.guards import ForkGuardMetricExporter
from otel_train.exporters.providers import Telemetry, otlp_metric_exporter

JOB_LABEL_KEYS: tuple[str, ...] = (semconv.RUN_ID, semconv.ROLE)  # the pull endpoint's labels


def job_resource(config: Config, identity: Identity) -> Resource:
    """The run's identity, nothing of any one rank (module doc)."""
    attributes: dict[str, str] = {"service.name": config.service_name, semconv.RUN_ID: identity.run_id}
    if identity.role:
        attributes[semconv.ROLE] = identity.role
    return Resource(attributes)


def build_job_provider(config: Config, identity: Identity, telemetry: Telemetry) -> MeterProvider | None:
    """Rank 0 of a job whose ranks exchange (cross_rank), or a single process: the job-level
    series' provider, shut down with `telemetry`. None elsewhere: other ranks export none."""
    if identity.rank != 0 or (identity.distributed and not config.cross_rank):
        return None
    readers: list[MetricReader] = []
    if config.otlp_endpoint or config.otlp_metrics_endpoint:
        readers.append(
            PeriodicExportingMetricReader(
                ForkGuardMetricExporter(otlp_metric_exporter(config)),  # rank 0's own reports outages
                export_interval_millis=config.metric_export_interval_s * 1000,
                export_timeout_millis=config.otlp_timeout_s * 1000,
            )
        )
    if telemetry.pull_endpoint is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        # rank 0's own reader already serves target_info on this registry: one per endpoint
        readers.append(
            PrometheusMetricReader(
                disable_target_info=True,
                registry=telemetry.pull_endpoint.registry,
                resource_attribute_filter=frozenset(JOB_LABEL_KEYS).__contains__,
            )
        )
    if not readers:
        return None
    provider = MeterProvider(
        metric_readers=readers, resource=job_resource(config, identity), shutdown_on_exit=False
    )
    telemetry.others.append(provider)
    return provider
