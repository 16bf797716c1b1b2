"""ThreadedSink: a slow, hung or failing backend never delays or breaks the caller."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from otel_train.bridges.base import Sink
from otel_train.bridges.threaded import ThreadedSink


class Recording(Sink):
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.closed = threading.Event()

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self.calls.append(("scalars", (step, dict(scalars))))

    def write_text(self, key: str, text: str, step: int) -> None:
        self.calls.append(("text", (key, text, step)))

    def write_histogram(self, key: str, values: Any, step: int) -> None:
        self.calls.append(("histogram", (key, list(values), step)))

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        self.calls.append(("hparams", dict(params)))

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        self.calls.append(("close", dict(final_scalars)))
        self.closed.set()


class Slow(Recording):
    """Every write blocks for 5 s, like a hung wandb.log or a remote-FS TensorBoard writer."""

    name = "slow"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = threading.Event()

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self.started.set()
        self.release.wait(5.0)
        super().write_scalars(step, wall_time, scalars)


class Raising(Recording):
    name = "broken-backend"

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        raise RuntimeError("backend exploded")


def test_calls_are_forwarded_in_order_and_close_drains() -> None:
    inner = Recording()
    sink = ThreadedSink(inner, queue_size=16, name="rec")
    scalars = {"train/loss": 1.0}
    sink.write_hparams({"lr": 0.1})
    sink.write_scalars(1, 0.0, scalars)
    scalars["train/loss"] = 99.0  # the caller may reuse its dict: the sink copied it
    sink.write_text("k", "t", 1)
    sink.write_samples("s", [("p", "o")], 1)  # base default: rendered as text by the inner sink
    sink.write_histogram("h", (1.0, 2.0), 1)
    sink.close({"train/loss": 1.0}, timeout=5)
    assert sink.closed_cleanly and sink.dropped == 0 and sink.errors == 0
    assert [c[0] for c in inner.calls] == ["hparams", "scalars", "text", "text", "histogram", "close"]
    assert inner.calls[1] == ("scalars", (1, {"train/loss": 1.0}))
    sink.write_scalars(2, 0.0, {})  # after close: dropped, not queued, no error
    assert sink.dropped == 1


def test_slow_backend_never_blocks_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    inner = Slow()
    sink = ThreadedSink(inner, queue_size=4, name="slow")
    sink.write_scalars(0, 0.0, {"x": 0.0})
    assert inner.started.wait(2.0)  # the worker is now stuck inside the 5 s write
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in range(1, 101):
            sink.write_scalars(step, 0.0, {"x": float(step)})
    # All 100 calls returned while the backend was stuck in its first 5 s write: had any call waited
    # for the backend, it could not have finished before `release` below. Exactly queue_size were
    # queued, the rest dropped and counted.
    assert not inner.release.is_set() and len(inner.calls) == 0
    assert sink.fill == 1.0  # all 4 queued
    assert sink.dropped == 96
    drops = [r for r in caplog.records if "falling behind" in r.getMessage()]
    assert len(drops) == 1 and "slow" in drops[0].getMessage()  # warned once, naming the backend
    inner.release.set()
    sink.close({}, timeout=10)
    assert sink.closed_cleanly
    assert [c[1][0] for c in inner.calls if c[0] == "scalars"] == [0, 1, 2, 3, 4]


def test_close_is_bounded_when_the_backend_hangs(caplog: pytest.LogCaptureFixture) -> None:
    inner = Slow()
    sink = ThreadedSink(inner, queue_size=2, name="hung")
    sink.write_scalars(0, 0.0, {"x": 0.0})
    assert inner.started.wait(2.0)
    sink.write_scalars(1, 0.0, {"x": 1.0})
    sink.write_scalars(2, 0.0, {"x": 2.0})  # the queue is full: close's own call cannot be queued
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        sink.close({}, timeout=0.3)
    assert time.monotonic() - t0 < 2.0  # far below the backend's 5 s stall
    assert not sink.closed_cleanly and not inner.closed.is_set()
    assert any("did not finish within" in r.getMessage() and "hung" in r.getMessage() for r in caplog.records)
    # the call it hangs in and the two queued behind it are not written: counted as dropped
    assert sink.dropped == 3
    assert any("3 call(s) not written, counted in dropped" in r.getMessage() for r in caplog.records)
    inner.release.set()
    assert inner.closed.wait(10.0)  # a backend that comes back is still closed ...
    assert [c[1][0] for c in inner.calls if c[0] == "scalars"] == [0]  # ... without the dropped calls


def test_raising_backend_warns_once_then_is_disabled(caplog: pytest.LogCaptureFixture) -> None:
    inner = Raising()
    sink = ThreadedSink(
        inner, queue_size=64, name="broken-backend", max_consecutive_failures=3, retry_after_s=3600.0
    )
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in range(10):
            sink.write_scalars(step, 0.0, {"x": 1.0})  # never raises into the caller
        sink.write_text("k", "t", 1)
        sink.close({"x": 1.0}, timeout=5)
    messages = [r.getMessage() for r in caplog.records]
    failures = [m for m in messages if "failed in write_scalars" in m]
    assert len(failures) == 1 and "broken-backend" in failures[0] and "backend exploded" in failures[0]
    assert sum("3 times in a row and is disabled" in m and "retried" in m for m in messages) == 1
    assert sink.disabled and sink.errors == 3
    assert sink.dropped == 11  # the 3 that raised, then 7 scalars + 1 text after disabling
    assert inner.calls == [("close", {"x": 1.0})]  # close still reaches the backend to release it
    assert sink.closed_cleanly


def test_intermittent_failures_do_not_disable() -> None:
    class Flaky(Recording):
        def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
            if step % 2:
                raise OSError("transient")
            super().write_scalars(step, wall_time, scalars)

    inner = Flaky()
    sink = ThreadedSink(inner, queue_size=64, max_consecutive_failures=2)
    for step in range(10):
        sink.write_scalars(step, 0.0, {"x": 1.0})
    sink.close({}, timeout=5)
    assert not sink.disabled and sink.errors == 5 and sink.dropped == 5  # each that raised: unwritten
    assert [c[1][0] for c in inner.calls if c[0] == "scalars"] == [0, 2, 4, 6, 8]


def test_a_disabled_backend_is_retried_with_a_fresh_writer_until_it_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend that failed for a while (a full disk) writes again once the cause is gone: each
    retry first asks it for a fresh writer; while it still fails the back-off doubles."""

    class FullDisk(Recording):
        name = "disk"

        def __init__(self) -> None:
            super().__init__()
            self.full = True
            self.reopened = 0

        def reopen(self) -> None:
            self.reopened += 1

        def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
            if self.full:
                raise OSError(28, "No space left on device")
            super().write_scalars(step, wall_time, scalars)

    inner = FullDisk()
    # retry_after_s=0: every call while disabled is a retry (no clock in this test)
    sink = ThreadedSink(inner, queue_size=64, max_consecutive_failures=2, retry_after_s=0.0)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in range(5):  # 2 failures disable it, 3 retries fail
            sink.write_scalars(step, 0.0, {"x": 1.0})
        wait = time.monotonic() + 30  # a guard only: the five calls are handled in order
        while sink.errors < 5 and time.monotonic() < wait:
            time.sleep(0.01)
        assert sink.disabled and inner.reopened == 3 and sink.retries == 3
        inner.full = False
        for step in range(5, 8):
            sink.write_scalars(step, 0.0, {"x": 1.0})
        sink.close({}, timeout=10)
    assert not sink.disabled and sink.reenabled == 1 and inner.reopened == 4
    assert [c[1][0] for c in inner.calls if c[0] == "scalars"] == [5, 6, 7]
    assert sink.errors == 5 and sink.dropped == 5  # 2 failed calls, then 3 failed retries
    messages = [r.getMessage() for r in caplog.records]
    assert any("the disk bridge works again" in m and "3 update(s) were dropped" in m for m in messages), (
        messages
    )


def test_a_backend_stuck_in_one_call_is_named_as_the_cause_with_its_server(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue that fills behind one call that does not return (an unreachable server, retried by
    its client) is no slow backend: the warning says which call, for how long, and where to."""
    from otel_train.bridges import threaded

    monkeypatch.setattr(threaded, "STUCK_CALL_S", 0.2)
    inner = Slow()
    inner.destination = "tracking URI http://localhost:1, from MLFLOW_TRACKING_URI"
    sink = ThreadedSink(inner, queue_size=2, name="mlflow")
    sink.write_scalars(0, 0.0, {"x": 0.0})
    assert inner.started.wait(2.0)
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in range(1, 5):
            sink.write_scalars(step, 0.0, {"x": float(step)})
    [warning] = [r.getMessage() for r in caplog.records if "falling behind" in r.getMessage()]
    assert re.search(
        r"its backend has been in write_scalars\(\) for \d+ s \(tracking URI http://localhost:1, from "
        r"MLFLOW_TRACKING_URI\): a server that does not answer\?",
        warning,
    ), warning
    inner.release.set()
    sink.close({}, timeout=10)


def test_the_mlflow_bridge_names_its_server_and_the_setting_that_chose_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_train.bridges.mlflow import MlflowSink

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:secret@localhost:1")
    assert MlflowSink(tmp_path, None, "e", "r").destination == (
        "tracking URI http://***@localhost:1, from MLFLOW_TRACKING_URI"
    )
    assert "from mlflow_tracking_uri" in MlflowSink(tmp_path, "http://h:5000", "e", "r").destination
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert MlflowSink(tmp_path, None, "e", "r").destination == ""  # the run directory's own store
