"""OpenTelemetry pipelines: one MeterProvider, TracerProvider and LoggerProvider per process.

`assemble` calls `build_telemetry` once at init(); the session holds the `Telemetry` it returns and
`closing` shuts it down within a bounded time. The parts, each with one job:

* ``providers``: the providers and what they export to: OTLP (HTTP/protobuf by default, or gRPC)
  for metrics, spans and logs, with bounded timeouts; console exporters for debugging; the
  per-flush StepReader (passed in) on the same MeterProvider.
* ``pull_endpoint``: the Prometheus pull endpoint on `prometheus_host:prometheus_port +
  local_rank`, served in the training process with a cap on connections and idle time.
* ``guards``: what wraps every exporter: a fork guard (a forked child, such as a DataLoader
  worker, inherits the SDK's threads and must never re-export the parent's frozen values under
  the same identity), and one warning per collector outage instead of the SDK's line per retry.

Importing this package imports the OTel SDK: it is imported at init(), never by `import otel_train`.
"""

from otel_train.exporters.providers import Telemetry, build_telemetry

__all__ = ["Telemetry", "build_telemetry"]
