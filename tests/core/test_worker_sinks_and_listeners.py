"""Worker.add_sink / add_listener / remove_listener: the next flush sees the new lists, and a list a
flush may be iterating is never changed in place (copy-on-write)."""

from __future__ import annotations

import time

import pytest

import otel_train as ot
from otel_train.core.buffer import Interval
from otel_train.core.session import Session
from otel_train.testing import Capture


class CountingListener:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_flush(self, interval: Interval) -> None:
        self.steps.append(interval.step)


def _wait_for_call(listener: CountingListener) -> None:
    deadline = time.monotonic() + 30  # liveness bound, not a timing assertion
    while not listener.steps and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.fixture
def session(quiet_session: Session) -> Session:
    return quiet_session


def test_add_sink_replaces_the_list_a_flush_iterates(session: Session) -> None:
    before = session.worker.sinks
    capture = Capture()
    session.worker.add_sink(capture)
    assert capture not in before  # the old list, which a flush may be iterating, is untouched
    assert session.worker.sinks[-1] is capture
    with ot.step(0):
        ot.record("loss", 2.0)
    ot.shutdown()
    assert capture.last("train/loss") == 2.0


def test_listeners_come_and_go_between_flushes(session: Session) -> None:
    listener = CountingListener()
    before = session.worker.listeners
    session.worker.add_listener(listener)
    assert listener not in before and session.worker.listeners[-1] is listener
    with ot.step(0):
        pass
    _wait_for_call(listener)  # step 0's flush is processed with the listener in place
    session.worker.remove_listener(listener)
    session.worker.remove_listener(listener)  # idempotent
    assert listener not in session.worker.listeners
    with ot.step(1):
        pass
    ot.shutdown()
    assert listener.steps == [0]  # nothing after the removal, not even the final flush
