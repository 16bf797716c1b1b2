"""Shared test helpers: real-component lookup (fail under CI, skip locally), free ports."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import pytest


def require_binary(name: str) -> str:
    """Path of a real component (prometheus, promtool, amtool, ...).

    Under CI (the CI variable set) a missing component is a failure, never a silent skip.
    """
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found on PATH (Debian: apt-get install prometheus prometheus-alertmanager)"
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
