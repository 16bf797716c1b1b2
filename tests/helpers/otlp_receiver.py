"""A real OTLP receiver for tests: HTTP/protobuf and gRPC, decoded with opentelemetry-proto."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Received:
    metrics: list[Any] = field(default_factory=list)  # ExportMetricsServiceRequest
    traces: list[Any] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)  # every request body, for secret scans
    headers: list[dict[str, str]] = field(default_factory=list)
    # http_receiver(record_senders=True): per request, every process holding its client socket
    # (a fork child inherits its parent's keep-alive connection, so more than one can)
    sender_pids: list[frozenset[int]] = field(default_factory=list)

    # --- views ----------------------------------------------------------------------------------
    def metric_points(self) -> dict[str, list[tuple[dict[str, Any], Any, str]]]:
        """name -> [(resource attributes, metric, unit)]"""
        out: dict[str, list[tuple[dict[str, Any], Any, str]]] = {}
        for request in self.metrics:
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        out.setdefault(metric.name, []).append((resource, metric, metric.unit))
        return out

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        out = []
        for request in self.traces:
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        out.append((resource, span))
        return out

    def log_records(self) -> list[tuple[dict[str, Any], Any]]:
        out = []
        for request in self.logs:
            for rl in request.resource_logs:
                resource = attributes(rl.resource.attributes)
                for sl in rl.scope_logs:
                    for record in sl.log_records:
                        out.append((resource, record))
        return out


def any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def attributes(items: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in items}


def sender_pids(client: tuple[str, int], server: tuple[str, int]) -> frozenset[int]:
    """Every process that holds the client end of a TCP connection to `server` in its fd table
    (empty: none found, or processes of another user), read from /proc: the socket's inode from
    /proc/net/tcp, then each process's fds. Not psutil.net_connections: it names one holder per
    inet socket (the last process of its /proc walk), so a forked DataLoader worker that inherited
    a keep-alive connection would hide the parent that is sending on it."""
    inode = _tcp_inode(client, server)
    if inode is None:
        return frozenset()
    target = f"socket:[{inode}]"
    holders: set[int] = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and target in _fd_links(proc):
            holders.add(int(proc.name))
    return frozenset(holders)


def _fd_links(proc: Path) -> set[str]:
    """What each open fd of a process points to (an fd closed while being read is skipped)."""
    links: set[str] = set()
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:  # the process ended, or is another user's
        return links
    for fd in fds:
        try:
            links.add(os.readlink(fd))
        except OSError:
            continue
    return links


def _tcp_inode(local: tuple[str, int], remote: tuple[str, int]) -> str | None:
    """The inode of the IPv4 TCP socket from `local` to `remote` (/proc/net/tcp writes each address
    as the host-order hex of its 32 bits, a colon and the port in hex)."""

    def hex_address(address: tuple[str, int]) -> str:
        packed = int.from_bytes(socket.inet_aton(address[0]), sys.byteorder)
        return f"{packed:08X}:{address[1]:04X}"

    want = (hex_address(local), hex_address(remote))
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (fields[1], fields[2]) == want:
            return fields[9]
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def http_receiver(
    port: int | None = None, record_senders: bool = False, delay_s: float = 0.0, status: int = 200
) -> Iterator[tuple[str, Received]]:
    """`record_senders`: note the pid of the process that sent each request (received.sender_pids);
    `delay_s`: a slow collector, which answers each request that much later; `status`: what it
    answers (400: a collector refusing the payload)."""
    received = Received()
    lock = threading.Lock()
    kinds = {
        "/v1/metrics": (metrics_service_pb2.ExportMetricsServiceRequest, received.metrics,
                        metrics_service_pb2.ExportMetricsServiceResponse),
        "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest, received.traces,
                       trace_service_pb2.ExportTraceServiceResponse),
        "/v1/logs": (logs_service_pb2.ExportLogsServiceRequest, received.logs, logs_service_pb2.ExportLogsServiceResponse),
    }  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            kind = kinds.get(self.path)
            if kind is None:
                self.send_response(404)
                self.end_headers()
                return
            request_type, sink, response_type = kind
            message = request_type()
            message.ParseFromString(body)
            # while this request is open, its client socket is in the sender's fd table
            holders = (
                sender_pids(self.client_address[:2], self.server.server_address[:2])
                if record_senders
                else frozenset()
            )
            with lock:
                if record_senders:
                    received.sender_pids.append(holders)
                sink.append(message)
                received.raw.append(body)
                received.headers.append(dict(self.headers.items()))
            time.sleep(delay_s)
            payload = response_type().SerializeToString()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("127.0.0.1", port or _free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    import grpc

    received = Received()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.metrics.append(request)
            received.raw.append(request.SerializeToString())
            received.headers.append(dict(context.invocation_metadata()))
            return metrics_service_pb2.ExportMetricsServiceResponse()

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.traces.append(request)
            received.raw.append(request.SerializeToString())
            return trace_service_pb2.ExportTraceServiceResponse()

    class Logs(logs_service_pb2_grpc.LogsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.logs.append(request)
            received.raw.append(request.SerializeToString())
            return logs_service_pb2.ExportLogsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Logs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


@contextmanager
def tarpit() -> Iterator[str]:
    """Accepts connections and never answers (a hung collector)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(1)
        for conn in held:
            conn.close()
        listener.close()


def refused_endpoint() -> str:
    """A loopback port with nothing listening."""
    return f"http://127.0.0.1:{_free_port()}"
