"""Helpers for tests (ours and users'): capture what a run would send to the bridges, and the
running session's internals (`current_session()`) for tests and debugging: not a stable API."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from otel_train.bridges.base import Sink
from otel_train.core import current

if TYPE_CHECKING:
    from otel_train.core import Session


@dataclass
class Capture(Sink):
    """A sink that keeps every flush: `flushes` is a list of (step, {key: value})."""

    name: str = "capture"
    flushes: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    texts: list[tuple[str, str, int]] = field(default_factory=list)
    samples: list[tuple[str, list[tuple[str, str]], int]] = field(default_factory=list)
    histograms: list[tuple[str, list[float], int]] = field(default_factory=list)
    hparams: list[dict[str, Any]] = field(default_factory=list)

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self.flushes.append((step, dict(scalars)))

    def write_text(self, key: str, text: str, step: int) -> None:
        self.texts.append((key, text, step))

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        self.samples.append((key, list(rows), step))

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        self.histograms.append((key, list(values), step))

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        self.hparams.append(dict(params))

    def last(self, key: str) -> float | None:
        return next((scalars[key] for _, scalars in reversed(self.flushes) if key in scalars), None)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, scalars[key]) for step, scalars in self.flushes if key in scalars]


@contextmanager
def capture_metrics(**settings: Any) -> Iterator[Capture]:
    """Run a session (no pull endpoint, quiet) and capture every flush it hands to the bridges."""
    import otel_train

    settings.setdefault("prometheus_port", 0)
    settings.setdefault("verbosity", 0)
    otel_train.init(**settings)
    capture = Capture()
    session = current()
    assert session is not None  # init() just returned it
    session.worker.add_sink(capture)
    try:
        yield capture
    finally:
        otel_train.shutdown()


def current_session() -> Session | None:
    """The running session's internals (tests, debugging): not a stable API. A script's stable
    view is `ot.init()`'s `Run` and `ot.run_info()`; an adapter's, `otel_train.adapters`."""
    return current()


def reset() -> None:
    """Shut down any running session (tests call this between cases)."""
    import otel_train

    otel_train.shutdown()
