"""OpenTelemetry pipelines: one MeterProvider, TracerProvider and LoggerProvider per process
(`providers`, `pull_endpoint`, `guards`). Design: docs/design/core.md#exporters."""

from otel_train.exporters.guards import export_failure_cause, quiet_sdk_exporter_logs
from otel_train.exporters.job_provider import build_job_provider
from otel_train.exporters.providers import Telemetry, build_telemetry, otlp_probe, otlp_probes
from otel_train.exporters.tiers import essential_names, resolve_rank_series

__all__ = [
    "Telemetry",
    "build_job_provider",
    "build_telemetry",
    "essential_names",
    "export_failure_cause",
    "otlp_probe",
    "otlp_probes",
    "quiet_sdk_exporter_logs",
    "resolve_rank_series",
]
