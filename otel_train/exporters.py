"""OpenTelemetry pipelines: one MeterProvider, TracerProvider and LoggerProvider per process.

- OTLP (HTTP/protobuf by default, or gRPC) for metrics, spans and logs, with bounded timeouts;
- the Prometheus pull endpoint on `prometheus_host:prometheus_port + local_rank`;
- console exporters for debugging;
- the StepReader (step_reader) is passed in and registered on the same MeterProvider.

Every exporter is wrapped in a fork guard: a forked child (a DataLoader worker) inherits the SDK's
threads, which the SDK restarts after fork; without the guard the child would re-export the
parent's frozen values under the same identity.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_train import semconv
from otel_train.config import Config, redact_url

log = logging.getLogger("otel_train")


# --- export status: one warning per outage instead of the SDK's line per retry -------------------
class ExportStatus:
    """Reports a collector outage once and its recovery once (the SDK logs every retry)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = redact_url(endpoint)  # never log userinfo
        self.failing = False
        self.failures = 0

    def report(self, ok: bool, signal: str) -> None:
        if ok and self.failing:
            self.failing = False
            log.warning("otel_train: OTLP export to %s works again.", self.endpoint)
        elif not ok:
            self.failures += 1
            if not self.failing:
                self.failing = True
                log.warning(
                    "otel_train: OTLP %s export to %s failed (collector down or unreachable?). Training continues; "
                    "exports retry every interval and cumulative totals stay right when it returns.",
                    signal,
                    self.endpoint,
                )


def _not_a_header_echo(record: logging.LogRecord) -> bool:
    # The SDK re-parses OTEL_EXPORTER_OTLP_HEADERS in every exporter and logs an entry it rejects
    # verbatim, secret included; otel_train has parsed and checked that variable at init().
    return not str(record.msg).startswith("Header format invalid")


def quiet_sdk_exporter_logs() -> None:
    """Silence the OTLP exporters' per-retry log lines unless the user configured those loggers,
    and never let the SDK echo a header value."""
    for name in ("opentelemetry.exporter.otlp",):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.CRITICAL)
    header_logger = logging.getLogger("opentelemetry.util.re")
    if _not_a_header_echo not in header_logger.filters:
        header_logger.addFilter(_not_a_header_echo)


# --- fork guards -----------------------------------------------------------------------------------
class ForkGuardMetricExporter(MetricExporter):
    def __init__(self, inner: MetricExporter, status: ExportStatus | None = None) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self._pid = os.getpid()
        self._status = status

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if os.getpid() != self._pid:
            return MetricExportResult.SUCCESS  # a forked child never exports
        result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        if self._status is not None:
            self._status.report(result == MetricExportResult.SUCCESS, "metrics")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return os.getpid() != self._pid or self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if os.getpid() == self._pid:
            self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class ForkGuardSpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, status: ExportStatus | None = None) -> None:
        self._inner = inner
        self._pid = os.getpid()
        self._status = status

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if os.getpid() != self._pid:
            return SpanExportResult.SUCCESS
        result = self._inner.export(spans)
        if self._status is not None:
            self._status.report(result == SpanExportResult.SUCCESS, "span")
        return result

    def shutdown(self) -> None:
        if os.getpid() == self._pid:
            self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return os.getpid() != self._pid or self._inner.force_flush(timeout_millis)


class ForkGuardLogExporter(LogRecordExporter):
    def __init__(self, inner: LogRecordExporter) -> None:
        self._inner = inner
        self._pid = os.getpid()

    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        if os.getpid() != self._pid:
            return LogRecordExportResult.SUCCESS
        return self._inner.export(batch)

    def shutdown(self) -> None:
        if os.getpid() == self._pid:
            self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


# --- builders --------------------------------------------------------------------------------------
def _otlp_url(config: Config, signal: str) -> str:
    if signal == "metrics" and config.otlp_metrics_endpoint:
        return config.otlp_metrics_endpoint  # used as-is, as the OTel spec says
    assert config.otlp_endpoint is not None
    base = config.otlp_endpoint.rstrip("/")
    if config.otlp_protocol == "grpc":
        return base
    return f"{base}/v1/{signal}"


def _otlp_metric_exporter(config: Config) -> MetricExporter:
    headers = dict(config.otlp_headers)
    endpoint = _otlp_url(config, "metrics")
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

        insecure = config.otlp_insecure and not endpoint.startswith("https")
        return GrpcMetrics(
            endpoint=endpoint, insecure=insecure, headers=headers, timeout=config.otlp_timeout_s
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=endpoint, headers=headers, timeout=config.otlp_timeout_s)


def _otlp_event_exporters(config: Config) -> tuple[SpanExporter, LogRecordExporter]:
    headers = dict(config.otlp_headers)
    timeout = config.otlp_timeout_s  # seconds: the Python SDK's unit
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogs
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

        insecure = config.otlp_insecure and not config.otlp_endpoint.startswith("https")  # type: ignore[union-attr]
        endpoint = _otlp_url(config, "traces")
        return (
            GrpcSpans(endpoint=endpoint, insecure=insecure, headers=headers, timeout=timeout),
            GrpcLogs(endpoint=endpoint, insecure=insecure, headers=headers, timeout=timeout),
        )
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return (
        OTLPSpanExporter(endpoint=_otlp_url(config, "traces"), headers=headers, timeout=timeout),
        OTLPLogExporter(endpoint=_otlp_url(config, "logs"), headers=headers, timeout=timeout),
    )


# The pull endpoint serves each connection on a thread of its own, in the training process: at most
# this many at once (more are closed at once; Prometheus needs one per scrape), and a connection
# that sends nothing for PULL_READ_TIMEOUT_S is closed. Collecting for a scrape is not bounded by it.
MAX_PULL_CONNECTIONS = 8
PULL_READ_TIMEOUT_S = 10.0


def _pull_server_class() -> Any:
    """A threading WSGI server with a cap on connections (built on first use: wsgiref at init())."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIServer

    class PullServer(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        request_queue_size = 64

        def server_activate(self) -> None:
            super().server_activate()
            self.slots = threading.BoundedSemaphore(MAX_PULL_CONNECTIONS)
            self.refused = 0

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):
                self.refused += 1  # all slots busy (idle clients, hung scrapes): no new thread
                self.shutdown_request(request)
                return
            threading.Thread(
                target=self._serve,
                args=(request, client_address),
                name="otel_train-metrics-http",
                daemon=True,
            ).start()

        def _serve(self, request: Any, client_address: Any) -> None:
            try:
                self.process_request_thread(request, client_address)
            finally:
                self.slots.release()

    return PullServer


def _serve_pull(host: str, port: int, registry: Any) -> tuple[Any, threading.Thread]:
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app

    class QuietHandler(WSGIRequestHandler):
        timeout = PULL_READ_TIMEOUT_S  # socket timeout on every read and write of the connection

        def log_message(self, format: str, *args: Any) -> None:
            """No line per request on stderr."""

    server_class = _pull_server_class()
    # IPv6 hosts need an AF_INET6 socket (as prometheus_client's own server picks it).
    server_class.address_family = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0][0]
    server: Any = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="otel_train-metrics-server", daemon=True)
    thread.start()
    return server, thread


@dataclass
class PullEndpoint:
    url: str
    server: Any
    thread: threading.Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_pull_endpoint(
    config: Config, local_rank: int, label_keys: Sequence[str]
) -> tuple[MetricReader | None, PullEndpoint | None]:
    """Prometheus pull endpoint; a busy port warns once (naming port and setting) and is skipped."""
    if config.prometheus_port == 0:
        return None, None
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    port = config.prometheus_port + local_rank
    registry = CollectorRegistry()
    keys = frozenset(label_keys)
    reader = PrometheusMetricReader(registry=registry, resource_attribute_filter=keys.__contains__)
    try:
        server, thread = _serve_pull(config.prometheus_host, port, registry)
    except OSError as exc:
        log.warning(
            "otel_train: Prometheus pull endpoint %s:%d is unavailable (%s); continuing without it. "
            "Set OTEL_TRAIN_PROMETHEUS_PORT to a free base port (the endpoint uses port + local_rank), "
            "or 0 to disable.",
            config.prometheus_host,
            port,
            exc.strerror or exc,
        )
        return None, None
    return reader, PullEndpoint(f"http://{config.prometheus_host}:{port}/metrics", server, thread)


@dataclass
class Telemetry:
    resource: Resource
    meter_provider: MeterProvider
    tracer_provider: TracerProvider | None
    logger_provider: LoggerProvider | None
    pull_endpoint: PullEndpoint | None
    remote: bool = False  # exports over OTLP (a slow shutdown then points at the collector)
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def shutdown(self, timeout_s: float) -> bool:
        """Shut every provider down on a helper thread; give up after `timeout_s`.

        The SDK's own timeouts are not honoured by the OTLP exporters (seconds vs millis, retries),
        so the bound is enforced here. Returns False when something was abandoned.
        """
        steps: list[Callable[[], Any]] = []
        if self.tracer_provider is not None:
            steps.append(self.tracer_provider.shutdown)
        if self.logger_provider is not None:
            steps.append(self.logger_provider.shutdown)
        millis = max(1, int(timeout_s * 1000))
        steps.append(lambda: self.meter_provider.shutdown(timeout_millis=millis))
        if self.pull_endpoint is not None:
            steps.append(self.pull_endpoint.close)

        def run() -> None:
            for step in steps:
                try:
                    step()
                except Exception as exc:  # shutdown must not raise into the training's exit path
                    log.debug("otel_train: shutdown step failed: %s", exc)

        thread = threading.Thread(target=run, name="otel_train-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning(
                "otel_train: exporters did not finish within %.1fs%s; abandoning the last export. "
                "Local run-dir files are complete (more time: shutdown_timeout_s).",
                timeout_s,
                " (collector down or slow?)" if self.remote else "",
            )
            return False
        return True


def build_telemetry(
    config: Config,
    resource: Resource,
    event_attributes: Mapping[str, str | int],
    step_reader: MetricReader,
    local_rank: int,
) -> Telemetry:
    """`resource` identifies metric series (no per-launch attribute); spans and logs carry
    `event_attributes` (process.pid, run name) on top."""
    readers: list[MetricReader] = [step_reader]
    span_exporters: list[SpanExporter] = []
    log_exporters: list[LogRecordExporter] = []
    interval_ms = config.metric_export_interval_s * 1000

    if config.otlp_endpoint or config.otlp_metrics_endpoint:
        quiet_sdk_exporter_logs()
        # Named by the endpoint the user set: the base URL for all signals, or the metrics URL.
        metrics_status = ExportStatus(config.otlp_metrics_endpoint or config.otlp_endpoint or "")
        readers.append(
            PeriodicExportingMetricReader(
                ForkGuardMetricExporter(_otlp_metric_exporter(config), metrics_status),
                export_interval_millis=interval_ms,
                export_timeout_millis=config.otlp_timeout_s * 1000,
            )
        )
    if config.otlp_endpoint:
        spans, logs = _otlp_event_exporters(config)
        same = not config.otlp_metrics_endpoint  # one endpoint: one outage warning for all signals
        span_exporters.append(
            ForkGuardSpanExporter(spans, metrics_status if same else ExportStatus(config.otlp_endpoint))
        )
        log_exporters.append(ForkGuardLogExporter(logs))
    if config.console_exporter:
        from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        readers.append(
            PeriodicExportingMetricReader(
                ForkGuardMetricExporter(ConsoleMetricExporter()), export_interval_millis=interval_ms
            )
        )
        span_exporters.append(ForkGuardSpanExporter(ConsoleSpanExporter()))
        log_exporters.append(ForkGuardLogExporter(ConsoleLogRecordExporter()))

    pull_reader, pull_endpoint = start_pull_endpoint(config, local_rank, semconv.LABEL_RESOURCE_KEYS)
    if pull_reader is not None:
        readers.append(pull_reader)

    meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    # Spans and logs are events, not series: they name the process (to find it on the host).
    event_resource = resource.merge(Resource(dict(event_attributes)))
    tracer_provider, logger_provider = _event_providers(config, event_resource, span_exporters, log_exporters)
    remote = bool(config.otlp_endpoint or config.otlp_metrics_endpoint)
    return Telemetry(resource, meter_provider, tracer_provider, logger_provider, pull_endpoint, remote)


def _event_providers(
    config: Config,
    event_resource: Resource,
    span_exporters: list[SpanExporter],
    log_exporters: list[LogRecordExporter],
) -> tuple[TracerProvider | None, LoggerProvider | None]:
    """The tracer and logger providers that batch spans and log records to their exporters."""
    tracer_provider: TracerProvider | None = None
    logger_provider: LoggerProvider | None = None
    if span_exporters and config.traces:
        tracer_provider = TracerProvider(resource=event_resource, shutdown_on_exit=False)
        for exporter in span_exporters:
            tracer_provider.add_span_processor(
                BatchSpanProcessor(
                    exporter, schedule_delay_millis=2000, export_timeout_millis=config.otlp_timeout_s * 1000
                )
            )
    if log_exporters:
        logger_provider = LoggerProvider(resource=event_resource, shutdown_on_exit=False)
        for log_exporter in log_exporters:
            logger_provider.add_log_record_processor(
                BatchLogRecordProcessor(log_exporter, schedule_delay_millis=2000)
            )
    return tracer_provider, logger_provider
