"""The session's shape: one class in one module, read top to bottom (docs/design/core.md#session);
and its flush hand-off when the loop idles."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import otel_train as ot
from otel_train import adapters
from otel_train.core.buffer import Interval
from otel_train.core.session import Session
from otel_train.testing import current_session


def test_the_session_is_one_class_without_a_base_holding_part_of_it() -> None:
    """Its parts, steps, flush hand-off and close are in `Session` itself: no base class (a size
    split by inheritance) holds fields or methods of it."""
    assert Session.__mro__ == (Session, object)
    fields = {f.name for f in dataclasses.fields(Session)}
    assert {"config", "worker", "cadence", "watches"} <= fields  # the parts it opens with
    assert {"begin_step", "end_step", "flush", "shutdown"} <= set(vars(Session))  # its life, here


class _Intervals:
    """A flush listener that keeps (step, steps) of each interval; `hold` blocks the worker in its
    first flush until released, so that the session's queue fills."""

    def __init__(self, hold: bool = False) -> None:
        self.seen: list[tuple[int, int]] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def on_flush(self, interval: Interval) -> None:
        self.release.wait(30)
        self.seen.append((interval.step, interval.steps))

    def close(self) -> None:
        self.release.set()

    def wait_for(self, step: int) -> None:
        deadline = time.monotonic() + 30  # liveness bound, not a timing assertion
        while step not in [s for s, _ in self.seen] and time.monotonic() < deadline:
            time.sleep(0.005)

    def wait_for_count(self, flushes: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.seen) < flushes and time.monotonic() < deadline:
            time.sleep(0.005)


def test_idle_flushes_the_steps_since_the_last_flush() -> None:
    """No step end comes while the loop idles (a fit done, the test not yet begun): `idle()` hands
    the steps it holds to the worker, so the outputs show them during the pause."""
    ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, hardware=False, log_interval=100)
    session = current_session()
    assert session is not None
    intervals = _Intervals()
    session.worker.add_listener(intervals)
    for i in range(5):
        with ot.step(i):
            ot.record("loss", 1.0)
    adapters.idle()
    intervals.wait_for(4)
    assert intervals.seen == [(4, 5)]
    adapters.idle()  # nothing new: no empty flush
    with ot.timer("evaluate"):  # after the last step (a framework's eval): flushed by the pause too
        pass
    adapters.idle()
    intervals.wait_for_count(2)
    assert intervals.seen == [(4, 5), (4, 0)]
    for i in range(5, 8):
        with ot.step(i):
            pass
    ot.shutdown()
    assert intervals.seen == [(4, 5), (4, 0), (7, 3)]


def test_idle_takes_a_flush_a_full_queue_deferred(caplog: pytest.LogCaptureFixture) -> None:
    """A worker busy with one flush (queue_size=1) defers the next ones, their steps kept, and says
    so once (the asked-for log_interval is not kept); the pause that follows still hands them over
    rather than leaving them until the next step."""
    ot.init(
        prometheus_port=0, verbosity=0, run_dir_enabled=False, hardware=False, log_interval=1, queue_size=1
    )  # fmt: skip
    session = current_session()
    assert session is not None
    intervals = _Intervals(hold=True)
    session.worker.add_listener(intervals)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for i in range(3):
            with ot.step(i):
                pass
    assert session.deferred_flushes == 2  # steps 1 and 2: the worker still holds step 0's flush
    warned = [r.getMessage() for r in caplog.records if "faster than the worker" in r.getMessage()]
    assert len(warned) == 1 and "log_interval=1" in warned[0], warned
    adapters.idle()
    intervals.release.set()
    intervals.wait_for(2)
    assert intervals.seen == [(0, 1), (2, 2)]
    ot.shutdown()


def test_a_log_metrics_row_every_step_reaches_the_run_dir_while_the_worker_is_behind(tmp_path) -> None:
    """`wandb.log(..., step=i)` ported as `ot.log_metrics(..., step=i)` after every step: the rows
    ride the flushes (bounded like every per-interval list), so a worker that is a few flushes
    behind loses none of them (a queue of their own would overflow)."""
    ot.init(output_dir=str(tmp_path), run_name="rows", prometheus_port=0, verbosity=0,
            hardware=False, queue_size=1)  # fmt: skip
    session = current_session()
    assert session is not None and session.run_dir is not None
    intervals = _Intervals(hold=True)
    session.worker.add_listener(intervals)
    steps = session.worker.max_messages * 2
    for i in range(steps):
        with ot.step(i):
            pass
        ot.log_metrics({"loss": float(i), "lr": 0.1}, step=i)
    intervals.release.set()
    ot.shutdown()
    lines = (session.run_dir / "metrics.rank0.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    own = {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert own == {i: float(i) for i in range(steps)}
    assert not any(row.get("otel_train/dropped/message_queue_full") for row in rows)
    filed = [row["step"] for row in rows]
    assert filed == sorted(filed)  # in step order: W&B refuses a step that goes back


FORGOT_STEP = "marked no step"


def _shutdown_warnings(caplog: Any, loop: Callable[[], None]) -> list[str]:
    ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, hardware=False, log_interval=4)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        loop()
        ot.shutdown()
    return [r.getMessage() for r in caplog.records if FORGOT_STEP in r.getMessage()]


def test_a_run_that_times_phases_but_marks_no_step_is_told_at_shutdown(caplog: Any) -> None:
    def loop() -> None:
        for _ in range(3):
            with ot.timer("forward"):
                pass
            ot.record("loss", 1.0)

    (told,) = _shutdown_warnings(caplog, loop)
    assert "`with ot.step(step):`" in told


def test_steps_or_values_alone_are_no_forgotten_step(caplog: Any) -> None:
    def steps() -> None:
        for i in range(3):
            with ot.step(i), ot.timer("forward"):
                pass

    def evaluation_only() -> None:  # a framework's evaluate(): values at a step, no training step
        ot.log_metrics({"eval/loss": 1.0}, step=0)

    assert _shutdown_warnings(caplog, steps) == []
    assert _shutdown_warnings(caplog, evaluation_only) == []


def test_a_ctrl_c_as_a_step_ends_leaves_no_step_open(tmp_path) -> None:
    """Jupyter's interrupt is a KeyboardInterrupt wherever the interpreter next checks for signals:
    at the entry to end_step it left the step open, so every later step counted as nested in it
    and nothing flushed until shutdown."""
    run = ot.init(output_dir=str(tmp_path), verbosity=0, prometheus_port=0, log_interval=5, hardware=False)
    for _ in range(3):
        with ot.step():
            ot.record("loss", 1.0)

    def interrupt(frame: Any, event: str, arg: Any) -> None:  # a signal checked at end_step's entry
        if event == "call" and frame.f_code is Session.end_step.__code__:
            sys.settrace(None)
            raise KeyboardInterrupt

    sys.settrace(interrupt)
    with pytest.raises(KeyboardInterrupt), ot.step():
        ot.record("loss", 1.0)
    sys.settrace(None)
    assert ot.run_info().open_step is None
    for _ in range(20):  # the notebook's next cell trains on
        with ot.step():
            ot.record("loss", 2.0)
    ot.shutdown()
    rows = [json.loads(line) for line in (run.run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert len([row for row in rows if "train/steps" in row]) >= 4  # a row every 5 steps, not one at the end


@pytest.fixture
def python_sigint() -> Any:
    """Python's own SIGINT handler for the test (another test's framework, Ray's TorchTrainer,
    leaves its own installed in this process), the earlier one back after it."""
    import signal

    earlier = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, earlier)


def test_a_ctrl_c_during_shutdown_is_delivered_after_the_close(tmp_path, monkeypatch, python_sigint) -> None:
    """Cut in the middle, the close left the run's rows unwritten, its worker thread and pull port
    held, and a second shutdown() could not finish it: the interrupt now waits for the (bounded)
    close, then raises."""
    import os
    import signal

    from helpers.ports import free_port

    from otel_train.core import session as session_module

    port = free_port()
    run = ot.init(
        output_dir=str(tmp_path), verbosity=0, prometheus_port=port, log_interval=1000, hardware=False
    )
    worker = current_session().worker._thread
    for _ in range(5):
        with ot.step():
            ot.record("loss", 1.0)
    drain = session_module._drain_worker

    def interrupted_drain(*args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)  # Jupyter's interrupt, as the worker drains
        return drain(*args)

    monkeypatch.setattr(session_module, "_drain_worker", interrupted_drain)
    with pytest.raises(KeyboardInterrupt):
        ot.shutdown()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    rows = [json.loads(line) for line in (run.run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(row.get("train/steps", 0) for row in rows) == 5
    assert not worker.is_alive()  # this run's (another test's stuck worker may still be about)
    monkeypatch.setattr(session_module, "_drain_worker", drain)
    second = ot.init(output_dir=str(tmp_path), verbosity=0, prometheus_port=port, hardware=False)
    assert second.prometheus_url is not None  # the first run let its port go
    ot.shutdown()


def test_a_second_ctrl_c_during_shutdown_cuts_it_short(tmp_path, monkeypatch, python_sigint) -> None:
    """The first Ctrl-C waits for the close; an impatient second one raises at once."""
    import os
    import signal

    from otel_train.core import session as session_module

    ot.init(output_dir=str(tmp_path), verbosity=0, prometheus_port=0, hardware=False)
    drain = session_module._drain_worker
    reached: list[str] = []

    def twice_interrupted_drain(*args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        reached.append("first held")
        os.kill(os.getpid(), signal.SIGINT)
        reached.append("never")  # the second raised inside the close
        return drain(*args)

    monkeypatch.setattr(session_module, "_drain_worker", twice_interrupted_drain)
    with pytest.raises(KeyboardInterrupt):
        ot.shutdown()
    assert reached == ["first held"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
