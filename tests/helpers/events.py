"""A recording double for health events, for tests of what emits them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Events:
    """A recording `otel_train.health.EventChannel` (what the session's HealthEvents offers)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, dict[str, Any]]] = []

    def emit(
        self,
        event: str,
        message: str,
        attributes: Mapping[str, str | int | float | bool] | None = None,
        severity: str = "WARNING",
    ) -> None:
        self.items.append((event, message, dict(attributes or {})))

    def named(self, event: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [e for e in self.items if e[0] == event]
