"""What wraps every exporter: a fork guard, one warning per collector outage instead of the SDK's
line per retry, and silenced OTLP exporter logs (no header echo). Design: docs/design/core.md#exporters."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, TypeVar

from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_train.redaction import redact_url

log = logging.getLogger("otel_train")
_Result = TypeVar("_Result")


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


class _ForkGuard:
    """A forked child never exports: there exports succeed and shutdowns do nothing."""

    def __init__(self, inner: Any, status: ExportStatus | None = None) -> None:
        self._inner = inner
        self._pid = os.getpid()
        self._status = status

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _export(self, success: _Result, signal: str, *args: Any, **kwargs: Any) -> _Result:
        if self._forked():
            return success
        result = self._inner.export(*args, **kwargs)
        if self._status is not None:
            self._status.report(result == success, signal)
        return result

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        if not self._forked():
            self._inner.shutdown(*args, **kwargs)


class ForkGuardMetricExporter(_ForkGuard, MetricExporter):
    def __init__(self, inner: MetricExporter, status: ExportStatus | None = None) -> None:
        MetricExporter.__init__(
            self,
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        _ForkGuard.__init__(self, inner, status)

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        success = MetricExportResult.SUCCESS
        return self._export(success, "metrics", metrics_data, timeout_millis=timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._forked() or self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        super().shutdown(timeout_millis=timeout_millis, **kwargs)


class ForkGuardSpanExporter(_ForkGuard, SpanExporter):
    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        return self._export(SpanExportResult.SUCCESS, "span", spans)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._forked() or self._inner.force_flush(timeout_millis)


class ForkGuardLogExporter(_ForkGuard, LogRecordExporter):
    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        return self._export(LogRecordExportResult.SUCCESS, "log", batch)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
