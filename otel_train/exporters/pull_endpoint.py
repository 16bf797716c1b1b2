"""The Prometheus pull endpoint: `http://prometheus_host:prometheus_port + local_rank/metrics`,
served by a threading WSGI server in the training process with a cap on connections.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics.export import MetricReader

from otel_train.config import Config
from otel_train.exporters.tiers import essential_only

log = logging.getLogger("otel_train")

# The pull endpoint serves each connection on a thread of its own, in the training process: at most
# this many at once (more are closed at once; Prometheus needs one per scrape), and a connection
# that sends nothing for PULL_READ_TIMEOUT_S is closed. Collecting for a scrape is not bounded by it.
MAX_PULL_CONNECTIONS = 8
PULL_READ_TIMEOUT_S = 10.0


def _serve_pull(host: str, port: int, registry: Any) -> Any:
    """A threading WSGI server with a cap on connections, serving `registry` (built here, on first
    use: wsgiref is imported at init() only where a pull endpoint is asked for)."""
    import socket
    import sys
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    class PullServer(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        request_queue_size = 64

        def server_activate(self) -> None:
            super().server_activate()
            self.slots = threading.BoundedSemaphore(MAX_PULL_CONNECTIONS)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):  # all busy (idle clients, hung scrapes): no thread
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

        def handle_error(self, request: Any, client_address: Any) -> None:
            """A client that went quiet (closed at the read timeout) or away is no error of the
            training's: no traceback on its stderr, where socketserver prints one."""
            if isinstance(sys.exc_info()[1], OSError):
                log.debug(
                    "otel_train: pull endpoint: connection from %s ended: %s",
                    client_address,
                    sys.exc_info()[1],
                )
                return
            super().handle_error(request, client_address)

    class QuietHandler(WSGIRequestHandler):
        timeout = PULL_READ_TIMEOUT_S  # socket timeout on every read and write of the connection

        def log_message(self, format: str, *args: Any) -> None:
            """No line per request on stderr."""

    # IPv6 hosts need an AF_INET6 socket (as prometheus_client's own server picks it).
    PullServer.address_family = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0][0]
    server: Any = make_server(host, port, make_wsgi_app(registry), PullServer, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, name="otel_train-metrics-server", daemon=True).start()
    return server


@dataclass
class PullEndpoint:
    url: str
    server: Any
    registry: Any  # what it serves: a second provider's reader may join it (`job_provider`)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _essential_reader_class() -> Any:
    """The SDK's Prometheus reader, serving only what the essential tier sends (`tiers`)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    class EssentialPrometheusReader(PrometheusMetricReader):
        def _receive_metrics(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> None:
            if metrics_data is not None:
                metrics_data = essential_only(metrics_data)
            super()._receive_metrics(metrics_data, timeout_millis, **kwargs)

    return EssentialPrometheusReader


def start_pull_endpoint(
    config: Config, local_rank: int, label_keys: Sequence[str]
) -> tuple[MetricReader | None, PullEndpoint | None]:
    """Prometheus pull endpoint; a busy port warns once (naming port and setting) and is skipped.
    In the essential tier (`config.rank_series`) it serves that tier's series only."""
    if config.prometheus_port == 0:
        return None, None
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    port = config.prometheus_port + local_rank
    registry = CollectorRegistry()
    keys = frozenset(label_keys)
    reader_class = _essential_reader_class() if config.rank_series == "essential" else PrometheusMetricReader
    reader = reader_class(registry=registry, resource_attribute_filter=keys.__contains__)
    try:
        if port > 65535:  # bind() raises OverflowError, not OSError
            raise OSError(
                errno.EINVAL, f"port {config.prometheus_port} + local rank {local_rank} is past 65535"
            )
        server = _serve_pull(config.prometheus_host, port, registry)
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
    return reader, PullEndpoint(f"http://{config.prometheus_host}:{port}/metrics", server, registry)
