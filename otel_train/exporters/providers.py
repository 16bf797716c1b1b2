"""The providers and what they export to (OTLP, the console, the pull endpoint, the StepReader),
every exporter behind a fork guard. Design: docs/design/core.md#exporters."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from otel_train import semconv
from otel_train.config import Config, ConfigError
from otel_train.exporters.guards import (
    ExportStatus,
    ForkGuardLogExporter,
    ForkGuardMetricExporter,
    ForkGuardSpanExporter,
    quiet_sdk_exporter_logs,
)
from otel_train.exporters.pull_endpoint import PullEndpoint, start_pull_endpoint
from otel_train.exporters.tiers import EssentialMetricExporter

log = logging.getLogger("otel_train")


# --- builders --------------------------------------------------------------------------------------
def _own_otlp_url(config: Config, signal: str) -> str | None:
    """The URL the user gave for `signal` alone; it is used as-is (the OTel spec's rule)."""
    return {
        "metrics": config.otlp_metrics_endpoint,
        "traces": config.otlp_traces_endpoint,
        "logs": config.otlp_logs_endpoint,
    }[signal]


def _otlp_url(config: Config, signal: str) -> str | None:
    """Where `signal` is pushed: its own URL, else the base URL with the signal's path; None: nowhere."""
    own = _own_otlp_url(config, signal)
    if own or not config.otlp_endpoint:
        return own
    base = config.otlp_endpoint.rstrip("/")
    if config.otlp_protocol == "grpc":
        return base
    return f"{base}/v1/{signal}"


# per signal: (module under opentelemetry.exporter.otlp.proto.<http or grpc>, exporter class)
_OTLP_EXPORTERS = {
    "metrics": ("metric_exporter", "OTLPMetricExporter"),
    "traces": ("trace_exporter", "OTLPSpanExporter"),
    "logs": ("_log_exporter", "OTLPLogExporter"),
}


def _otlp_exporter(config: Config, signal: str) -> Any:
    """The OTLP exporter of `signal` over `config.otlp_protocol`, with a bounded timeout (seconds:
    the Python SDK's unit)."""
    grpc = config.otlp_protocol == "grpc"
    module, name = _OTLP_EXPORTERS[signal]
    package = "opentelemetry.exporter.otlp.proto." + ("grpc" if grpc else "http")
    exporter_class = getattr(importlib.import_module(f"{package}.{module}"), name)
    endpoint = _otlp_url(config, signal)
    assert endpoint is not None
    # gRPC refuses a metadata key with a capital letter (every export would fail); HTTP header
    # names are case-insensitive, so lower case serves both.
    headers = {name.lower(): value for name, value in config.otlp_headers.items()}
    options: dict[str, Any] = {"endpoint": endpoint, "headers": headers}
    if grpc:
        options["insecure"] = config.otlp_insecure and not endpoint.startswith("https")
        options["compression"] = _grpc_compression(signal)
    return exporter_class(**options, timeout=config.otlp_timeout_s)


def _grpc_compression(signal: str) -> Any:
    """The gRPC exporter's compression from the OTel variables (the signal's, else the global one),
    read here: the SDK's gRPC exporter lacks the spec's "none", and init() raised on it."""
    import grpc

    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION"):
        value = os.environ.get(name, "").strip().lower()
        if value == "gzip":
            return grpc.Compression.Gzip
        if value == "none":
            return grpc.Compression.NoCompression
        if value:
            raise ConfigError(f"{name}={value!r}: OTLP over gRPC takes gzip or none; set one, or unset it")
    return None


def otlp_probes(config: Config) -> list[tuple[str, str]]:
    """What `otel-train doctor` probes, as (signal, the URL the user set for it): metrics, and each
    other signal init() pushes to a URL of its own (one at the base URL reaches the same collector)."""
    pushed = [s for s in _OTLP_EXPORTERS if _otlp_url(config, s) and (s != "traces" or config.traces)]
    probes = [s for s in pushed if s == "metrics" or _own_otlp_url(config, s)] or pushed[:1]
    return [(s, _own_otlp_url(config, s) or config.otlp_endpoint or "") for s in probes]


def otlp_probe(config: Config, signal: str) -> bool:
    """Whether `signal`'s endpoint accepts one empty OTLP export, sent with the exporter init()
    builds (protocol, TLS, headers, `otlp_timeout_s`). ConfigError: a setting it cannot take."""
    from opentelemetry.sdk.metrics.export import MetricsData

    exporter: Any = otlp_metric_exporter(config) if signal == "metrics" else _otlp_exporter(config, signal)
    try:
        result = exporter.export(MetricsData(resource_metrics=[]) if signal == "metrics" else [])
    finally:
        exporter.shutdown()
    return bool(result.name == "SUCCESS")


def otlp_metric_exporter(config: Config) -> MetricExporter:
    """The OTLP metric exporter; in the essential tier it sends that tier's series only."""
    exporter: MetricExporter = _otlp_exporter(config, "metrics")
    return EssentialMetricExporter(exporter) if config.rank_series == "essential" else exporter


@dataclass
class Telemetry:
    resource: Resource
    meter_provider: MeterProvider
    tracer_provider: TracerProvider | None
    logger_provider: LoggerProvider | None
    pull_endpoint: PullEndpoint | None
    remote: bool = False  # exports over OTLP (a slow shutdown then points at the collector)
    rank_series: str = "full"  # the series tier sent to the store (`tiers`)
    others: list[MeterProvider] = field(default_factory=list)  # shut down with it (`job_provider`)

    def shutdown(self, timeout_s: float) -> bool:
        """Shut every provider down, each on a helper thread of its own and all at once, so a slow
        collector's span export does not eat the metrics' time; False when one gave up after
        `timeout_s` (the OTLP exporters do not honour the SDK's own timeouts: seconds vs millis,
        retries)."""
        millis = max(1, int(timeout_s * 1000))
        events = (self.tracer_provider, self.logger_provider)
        steps: list[Callable[[], Any]] = [provider.shutdown for provider in events if provider is not None]
        steps += [
            functools.partial(p.shutdown, timeout_millis=millis) for p in (self.meter_provider, *self.others)
        ]
        if self.pull_endpoint is not None:
            steps.append(self.pull_endpoint.close)
        threads = [
            threading.Thread(target=_shut_down, args=(step,), name="otel_train-shutdown", daemon=True)
            for step in steps
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            log.warning(
                "otel_train: exporters did not finish within %.1fs%s; abandoning the last export. "
                "Local run-dir files are complete (more time: shutdown_timeout_s).",
                timeout_s,
                " (collector down or slow?)" if self.remote else "",
            )
            return False
        return True


def _shut_down(step: Callable[[], Any]) -> None:
    try:
        step()
    except Exception as exc:  # shutdown must not raise into the training's exit path
        log.debug("otel_train: shutdown step failed: %s", exc)


def build_telemetry(
    config: Config,
    resource: Resource,
    event_attributes: Mapping[str, str | int],
    step_reader: MetricReader,
    local_rank: int,
) -> Telemetry:
    """`resource` identifies metric series (no per-launch attribute); spans and logs carry
    `event_attributes` (process.pid, run name) on top. `config.rank_series` is the resolved tier
    (`build_session` resolves "auto"; "auto" here sends every series): "essential" filters the
    OTLP metrics and the pull endpoint (`tiers`)."""
    readers: list[MetricReader] = [step_reader]
    span_exporters: list[SpanExporter] = []
    log_exporters: list[LogRecordExporter] = []
    interval_ms = config.metric_export_interval_s * 1000
    timeout_ms = config.otlp_timeout_s * 1000
    remote = any(_otlp_url(config, signal) for signal in _OTLP_EXPORTERS)
    if remote:
        quiet_sdk_exporter_logs()
    statuses: dict[str, ExportStatus] = {}  # one outage warning per endpoint the user set

    def status(signal: str) -> ExportStatus:
        name = _own_otlp_url(config, signal) or config.otlp_endpoint or ""
        if name not in statuses:
            statuses[name] = ExportStatus(name, config.otlp_protocol)
        return statuses[name]

    if _otlp_url(config, "metrics"):
        metrics = ForkGuardMetricExporter(otlp_metric_exporter(config), status("metrics"))
        readers.append(
            PeriodicExportingMetricReader(
                metrics, export_interval_millis=interval_ms, export_timeout_millis=timeout_ms
            )
        )
    if _otlp_url(config, "traces"):
        span_exporters.append(ForkGuardSpanExporter(_otlp_exporter(config, "traces"), status("traces")))
    if _otlp_url(config, "logs"):
        log_exporters.append(ForkGuardLogExporter(_otlp_exporter(config, "logs"), status("logs")))
    if config.console_exporter:
        from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        console = ForkGuardMetricExporter(ConsoleMetricExporter())
        readers.append(PeriodicExportingMetricReader(console, export_interval_millis=interval_ms))
        span_exporters.append(ForkGuardSpanExporter(ConsoleSpanExporter()))
        log_exporters.append(ForkGuardLogExporter(ConsoleLogRecordExporter()))

    pull_reader, pull_endpoint = start_pull_endpoint(config, local_rank, semconv.LABEL_RESOURCE_KEYS)
    if pull_reader is not None:
        readers.append(pull_reader)

    meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    # Spans and logs are events, not series: they name the process (to find it on the host).
    event_resource = resource.merge(Resource(dict(event_attributes)))
    tracer_provider, logger_provider = _event_providers(config, event_resource, span_exporters, log_exporters)
    tier = "essential" if config.rank_series == "essential" else "full"
    return Telemetry(resource, meter_provider, tracer_provider, logger_provider, pull_endpoint, remote, tier)


def _event_providers(
    config: Config,
    resource: Resource,
    span_exporters: list[SpanExporter],
    log_exporters: list[LogRecordExporter],
) -> tuple[TracerProvider | None, LoggerProvider | None]:
    """The tracer and logger providers that batch spans and log records to their exporters."""
    tracer_provider = logger_provider = None
    if span_exporters and config.traces:
        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        timeout_ms = config.otlp_timeout_s * 1000
        for span_exporter in span_exporters:
            batch = BatchSpanProcessor(
                span_exporter, schedule_delay_millis=2000, export_timeout_millis=timeout_ms
            )
            tracer_provider.add_span_processor(batch)
    if log_exporters:
        logger_provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
        for log_exporter in log_exporters:
            logger_provider.add_log_record_processor(
                BatchLogRecordProcessor(log_exporter, schedule_delay_millis=2000)
            )
    return tracer_provider, logger_provider
