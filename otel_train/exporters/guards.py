"""What wraps every exporter: a fork guard, and one warning per collector outage instead of the
SDK's line per retry (docs/design/core.md#exporters). The OTLP exporters' own log lines are
silenced, so they never echo a header value.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_train.redaction import redact_url

log = logging.getLogger("otel_train")


# --- export status: one warning per outage instead of the SDK's line per retry -------------------
class ExportStatus:
    """Reports a collector outage once and its recovery once (the SDK logs every retry)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = redact_url(endpoint)  # never log userinfo
        self.failing = False

    def report(self, ok: bool, signal: str) -> None:
        if ok and self.failing:
            self.failing = False
            log.warning("otel_train: OTLP export to %s works again.", self.endpoint)
        elif not ok and not self.failing:
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
    logger = logging.getLogger("opentelemetry.exporter.otlp")
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
