"""The Prometheus pull endpoint under idle connections: a bounded number of threads in the training
process, idle connections closed, scrapes served again once the flood is gone."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from pathlib import Path

from helpers.ports import free_port

import otel_train as ot
from otel_train.exporters import pull_endpoint
from otel_train.testing import current_session


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:  # reset
        return True


def test_300_idle_connections_do_not_make_300_threads(tmp_path: Path, monkeypatch, capfd) -> None:
    monkeypatch.setattr(pull_endpoint, "PULL_READ_TIMEOUT_S", 1.0)  # (10 s by default)
    port = free_port()
    ot.init(run_name="pull", prometheus_port=port, verbosity=0, hardware=False)
    session = current_session()
    assert session.prometheus_url is not None
    baseline = threading.active_count()
    clients: list[socket.socket] = []
    most = baseline
    try:
        for _ in range(300):  # connect and send nothing (a port scanner, a stuck proxy, ...)
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.setblocking(False)
            clients.append(sock)
            most = max(most, threading.active_count())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_closed_by_server(s) for s in clients):
            most = max(most, threading.active_count())
            time.sleep(0.05)
        assert all(_closed_by_server(s) for s in clients)  # refused at once, or closed when idle
        assert most <= baseline + pull_endpoint.MAX_PULL_CONNECTIONS
    finally:
        for sock in clients:
            sock.close()
    with urllib.request.urlopen(session.prometheus_url, timeout=10) as response:  # scrapes work again
        assert response.status == 200
    stderr = capfd.readouterr().err  # the idle ones timed out quietly: the training's log stays its own
    assert "Traceback" not in stderr and "Exception occurred" not in stderr, stderr[:2000]
