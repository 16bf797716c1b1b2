"""A run directory's events as a test reads them while the run still writes them; a recording
double for health events, for tests of what emits them; the log messages a spawned rank writes
(pytest's caplog sees only the test's own process); the stretches a test slows."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def jsonl_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file so far ([] before it exists). A file still being written may
    end mid-line (a reader can see part of one os.write): only lines with their newline count."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def run_events(run_dir: Path, rank: int = 0, event: str | None = None) -> list[dict[str, Any]]:
    """Rank `rank`'s events in `run_dir` so far (only those named `event`, if given)."""
    rows = jsonl_rows(run_dir / f"events.rank{rank}.jsonl")
    return rows if event is None else [row for row in rows if row["event"] == event]


def every_rank_events(run_dir: Path, event: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Each rank's events so far, by file name."""
    return {
        path.name: [row for row in jsonl_rows(path) if event is None or row["event"] == event]
        for path in sorted(run_dir.glob("events.rank*.jsonl"))
    }


class Events:
    """A recording `otel_train.health.EventChannel` (what the session's HealthEvents offers)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, dict[str, Any]]] = []
        self.severities: dict[str, list[str]] = {}  # event name -> the severities it was emitted at

    def emit(
        self,
        event: str,
        message: str,
        attributes: Mapping[str, str | int | float | bool] | None = None,
        severity: str = "WARNING",
    ) -> None:
        self.items.append((event, message, dict(attributes or {})))
        self.severities.setdefault(event, []).append(severity)

    def named(self, event: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [e for e in self.items if e[0] == event]


def log_messages(logger: str = "otel_train", level: int = logging.WARNING) -> list[str]:
    """The messages `logger` logs at `level` or above from now on in this process."""
    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(logger).addHandler(handler)
    return messages


class SlowStretches:
    """The wall-clock stretches a test made slow on purpose (a long evaluation, a long save), and
    the `stall` events of a run directory that fell inside one. On a loaded machine a training
    step may itself outlast a short stall timeout, a true stall: only the stretches are judged."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def sleep(self, seconds: float) -> None:
        """Sleep `seconds`: one stretch (a stall that the watchdog should not see comes while the
        loop sleeps, not while it computes)."""
        start = time.time()
        time.sleep(seconds)
        self.spans.append((start, time.time()))

    def stalls_inside(self, run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
        return [
            e for e in run_events(run_dir, rank, "stall") if any(a <= e["time"] <= b for a, b in self.spans)
        ]
