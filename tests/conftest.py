"""Shared test helpers: real components at their pinned versions (fail under CI, skip locally),
free ports."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import pinned
import pytest


def require_binary(name: str) -> str:
    """Path of a real component (prometheus, promtool, prometheus-alertmanager, amtool,
    docker-compose) at the version deploy/versions.env pins: from `.tools/bin` (filled by
    `make tools`), else from PATH when that one reports the pinned version.

    Under CI (the CI variable set) a missing or wrong-version component is a failure, never a
    silent skip.
    """
    path, message = pinned.find(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI requires real components: {message}")
        pytest.skip(message)
    return path


class Events:
    """A recording health-event sink (the `emit` protocol the session's HealthEvents offers)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, dict[str, Any]]] = []

    def emit(
        self, event: str, message: str, attributes: Mapping[str, str | int | float] | None = None
    ) -> None:
        self.items.append((event, message, dict(attributes or {})))

    def named(self, event: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [e for e in self.items if e[0] == event]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def _isolated_session(tmp_path, monkeypatch) -> Iterator[None]:
    """Every test starts with no otel_train session and writes run dirs under its tmp dir."""
    for key in list(os.environ):
        if key.startswith(("OTEL_", "WANDB_")):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    try:
        from otel_train import testing
    except ImportError:
        return
    testing.reset()
