"""Clean shutdown under thread contention: the JSONL holds every completed step, or the shortfall
is counted and warned with its size."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Mapping

import otel_train as ot
from otel_train.bridges.base import Sink
from otel_train.testing import current_session


def _written_steps(session: ot.Session) -> int:
    path = session.run_dir / f"metrics.rank{session.identity.rank}.jsonl"
    return int(sum(json.loads(line).get("train/steps", 0) for line in path.read_text().splitlines()))


def _warned_shortfall(caplog) -> int:
    """Steps the shutdown warnings say were not written (0 when none)."""
    total = 0
    for record in caplog.records:
        match = re.search(r"holding (\d+) step", record.getMessage())
        if match:
            total += int(match.group(1))
    return total


def test_tiny_switch_interval_every_step_arrives_or_is_counted(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    steps = 3000
    ot.init(output_dir=str(tmp_path), run_name="race", prometheus_port=0, verbosity=0, log_interval=1,
                      hardware=False)  # fmt: skip
    session = current_session()
    stop = threading.Event()

    def recorder(k: int) -> None:
        i = 0
        while not stop.is_set():
            ot.record(f"thread{k}", float(i))
            i += 1
            if i % 50 == 0:  # asks for a flush from a thread that is not running the steps
                ot.log_metrics({f"eval{k}": 1.0}, step=i)

    threads = [threading.Thread(target=recorder, args=(k,)) for k in range(3)]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for step in range(steps):
            with ot.step(step, tokens=1):
                ot.record("loss", 1.0)
        stop.set()
        for thread in threads:
            thread.join()
        ot.shutdown()
    finally:
        stop.set()
        sys.setswitchinterval(previous)
    written = _written_steps(session)
    lost = getattr(session, "lost_steps", 0)
    assert written <= steps
    assert written + lost >= steps, (written, lost)
    if written < steps:
        assert _warned_shortfall(caplog) >= steps - written


class _SlowSink(Sink):
    name = "slow"

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        time.sleep(0.3)


def test_shutdown_with_a_busy_worker_counts_and_warns(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    ot.init(output_dir=str(tmp_path), run_name="busy", prometheus_port=0, verbosity=0, log_interval=1,
                      hardware=False, shutdown_timeout_s=0.5)  # fmt: skip
    session = current_session()
    session.worker.add_sink(_SlowSink())
    for step in range(20):
        with ot.step(step):
            ot.record("loss", 1.0)
        time.sleep(0.01)
    ot.shutdown()
    time.sleep(0.7)  # let the abandoned worker finish what it was doing (it must not write more)
    written = _written_steps(session)
    assert written < 20  # the worker could not have written everything: the case under test
    shortfall = _warned_shortfall(caplog)
    assert shortfall >= 20 - written, ([r.getMessage() for r in caplog.records], written)
    assert written + session.lost_steps >= 20


class _TextCounter(Sink):
    name = "texts"

    def __init__(self) -> None:
        self.texts = 0

    def write_text(self, key: str, text: str, step: int) -> None:
        self.texts += 1


def test_shutdown_with_a_busy_worker_counts_the_log_entries_it_never_wrote(tmp_path, caplog) -> None:
    """`log_text` entries queued behind flushes the worker could not finish: each is written or in
    the warning's count, none silently lost."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    ot.init(output_dir=str(tmp_path), run_name="texts", prometheus_port=0, verbosity=0, log_interval=1,
            hardware=False, shutdown_timeout_s=0.5)  # fmt: skip
    session = current_session()
    counter = _TextCounter()
    session.worker.add_sink(_SlowSink())
    session.worker.add_sink(counter)
    for step in range(10):
        with ot.step(step):
            ot.record("loss", 1.0)
        ot.log_text("note", f"step {step}")
    ot.shutdown()
    time.sleep(0.7)  # let the abandoned worker finish what it was doing (it must not write more)
    warned = 0
    for record in caplog.records:
        match = re.search(r"and (\d+) log_text", record.getMessage())
        if match:
            warned += int(match.group(1))
    assert warned > 0, [r.getMessage() for r in caplog.records]  # the case under test
    assert counter.texts + warned == 10, (counter.texts, warned)
