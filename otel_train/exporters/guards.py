"""What wraps every exporter: a fork guard, one warning per collector outage instead of the SDK's
line per retry, and silenced OTLP exporter logs (no header echo). Design: docs/design/core.md#exporters."""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Sequence
from typing import Any, TypeVar
from urllib.parse import urlparse

from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_train.redaction import redact_url

log = logging.getLogger("otel_train")
_Result = TypeVar("_Result")


class ExportStatus:
    """Reports a collector outage once and its recovery once (the SDK logs every retry), with what
    one TCP connect tells of the cause (its log lines, muted, may quote a secret)."""

    def __init__(self, endpoint: str, protocol: str = "http/protobuf") -> None:
        self._url = endpoint
        self.endpoint = redact_url(endpoint)  # never log userinfo
        self._protocol = protocol
        self.failing = False

    def report(self, ok: bool, signal: str) -> None:
        if ok and self.failing:
            self.failing = False
            log.warning("otel_train: OTLP export to %s works again.", self.endpoint)
        elif not ok and not self.failing:
            self.failing = True
            log.warning(
                "otel_train: OTLP %s export to %s failed: %s. Training continues; exports retry every "
                "interval and cumulative totals stay right when it returns (`otel-train doctor` checks "
                "the endpoint).",
                signal,
                self.endpoint,
                export_failure_cause(self._url, self._protocol, signal=signal),
            )


PROBE_S = 2.0  # the TCP connect that tells a collector that is down from one that refuses


def export_failure_cause(url: str, protocol: str, probe_s: float = PROBE_S, signal: str = "metrics") -> str:
    """Why an export of `signal` failed, as far as one TCP connect (of at most `probe_s`) tells:
    nothing listens, nothing answers at all (SYNs dropped), or something accepts connections and
    refused or ignored the export."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    default_port = 443 if parsed.scheme == "https" or protocol == "grpc" else 80
    try:
        address = (parsed.hostname or "localhost", parsed.port or default_port)
        with socket.create_connection(address, timeout=probe_s) as connection:
            if parsed.scheme == "https":
                problem = _tls_problem(connection, address[0], protocol, signal)
                if problem is not None:
                    return problem
    except TimeoutError:
        return (
            f"no answer to a TCP connect within {probe_s:g} s (packets dropped: a firewall or a wrong host?)"
        )
    except (OSError, ValueError) as exc:  # ValueError: a port out of range
        return (
            f"the collector is down or unreachable (cannot connect: {getattr(exc, 'strerror', None) or exc})"
        )
    return (
        f"something accepts TCP connections there but refused or did not take the OTLP/{protocol} "
        "export (another service or protocol on that port, a wrong path, refused headers, or a "
        "collector too slow for otlp_timeout_s)"
    )


def _otlp_file(signal: str, what: str) -> tuple[str, str | None]:
    """The OTel variable naming `signal`'s `what` file (the signal's own, else the general one, as
    the SDK's exporters read them) and its value."""
    own = f"OTEL_EXPORTER_OTLP_{signal.upper()}_{what}"
    name = own if os.environ.get(own) else f"OTEL_EXPORTER_OTLP_{what}"
    return name, os.environ.get(name) or None


def _tls_problem(connection: socket.socket, host: str, protocol: str, signal: str) -> str | None:
    """What a TLS handshake, with the CA and client certificate the OTel variables name for
    `signal`, says against an `https://` collector; None when it completes."""
    ca_name, ca = _otlp_file(signal, "CERTIFICATE")
    overridden = [n for n in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE") if os.environ.get(n)]
    trap = (
        f" ({' and '.join(overridden)} set: for http/protobuf they win over {ca_name})"
        if ca and overridden and protocol != "grpc"
        else ""
    )
    try:
        context = ssl.create_default_context(cafile=ca)
        (cert_name, cert), (_, key) = (
            _otlp_file(signal, "CLIENT_CERTIFICATE"),
            _otlp_file(signal, "CLIENT_KEY"),
        )
        if cert:
            context.load_cert_chain(cert, key)
        with context.wrap_socket(connection, server_hostname=host) as tls:
            refused = _alert_after_handshake(tls)
            if refused is not None:
                return (
                    f"the collector ended the TLS session ({refused}): it wants a client certificate "
                    f"it trusts (mTLS): set {cert_name} and its _CLIENT_KEY"
                )
            if not trap:
                return None
        one = len(overridden) == 1
        return (
            f"the TLS handshake with {ca_name}'s CA succeeds, but {' and '.join(overridden)} "
            f"{'is' if one else 'are'} set, which the http/protobuf exporter's requests library uses "
            f"instead: unset {'it' if one else 'them'}, or add the collector's CA there"
        )
    except ssl.SSLCertVerificationError as exc:
        return (
            f"its TLS certificate is not trusted ({exc.verify_message}): set {ca_name} to the collector's "
            f"CA file{trap}"
        )
    except (ssl.SSLError, OSError) as exc:  # a CA or client file unreadable, another TLS failure
        return (
            f"the TLS handshake failed ({exc}): check {ca_name}, and for mTLS "
            f"{_otlp_file(signal, 'CLIENT_CERTIFICATE')[0]} / _CLIENT_KEY{trap}"
        )


def _alert_after_handshake(tls: ssl.SSLSocket) -> str | None:
    """Under TLS 1.3 a server checks the client's certificate after the client's side of the
    handshake is done: its refusal, an alert, arrives with the first read. Its reason, or None (no
    alert within a moment, data, or the connection closed)."""
    tls.settimeout(0.5)
    try:
        tls.recv(1)
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, TimeoutError):
        return None
    except ssl.SSLError as exc:
        return str(exc.reason or exc)
    except OSError:
        return None
    return None


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
