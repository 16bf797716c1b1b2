"""Values and callbacks that stop the background worker: a tensor with no data, a user callback
that hangs. Training goes on with bounded memory, the process exits cleanly, and someone is told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers.events import run_events

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


META_AT_EXIT = """
import sys, torch
import otel_train as ot
ot.init(output_dir=sys.argv[1], run_name="meta", prometheus_port=0, verbosity=0, hardware=False, log_interval=1)
for step in range(3):
    with ot.step(step):
        if step < 2:
            ot.record("loss", 1.0)
        else:
            ot.record("loss", torch.empty(1, device="meta"))
            ot.record("other", torch.empty((), device="meta"))
            ot.record("odd", torch.tensor([1.0]).to_sparse())  # cannot be stacked with the others
            ot.record("loss", torch.tensor(2.0))  # ... which are still read
ot.shutdown()
"""


def test_meta_tensor_before_shutdown_is_dropped_and_the_process_exits_cleanly(tmp_path: Path) -> None:
    proc = _python(META_AT_EXIT, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]  # it was -6 (SIGABRT at exit)
    rows = [json.loads(line) for line in (tmp_path / "meta" / "metrics.rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/steps" in r] == [0, 1, 2]  # the last flush is written
    assert max(r.get("otel_train/dropped/no_data_tensor", 0) for r in rows) == 2
    assert proc.stderr.count("no data (a meta or fake tensor)") == 2  # once per name: loss, other
    assert [r["train/loss"] for r in rows if "train/loss" in r][-1] == 2.0


def test_hung_gauge_callback_bounds_memory_and_warns_naming_it(tmp_path: Path) -> None:
    import otel_train as ot
    from otel_train.testing import current_session

    fifo = tmp_path / "dead-nfs-file"
    os.mkfifo(fifo)  # opening it for reading blocks until a writer comes: a read that never returns

    def read_dead_file(options: object) -> list:
        from opentelemetry.metrics import Observation

        with open(fifo) as f:
            return [Observation(float(f.read() or 0))]

    ot.init(
        run_name="hung-cb", prometheus_port=0, verbosity=0, hardware=False, log_interval=10,
        stall_timeout_s=0.5, max_values_per_interval=500,
    )  # fmt: skip
    session = current_session()
    ot.get_meter().create_observable_gauge("custom.nfs_value", callbacks=[read_dead_file])
    try:
        step, deadline = 0, time.monotonic() + 60
        while time.monotonic() < deadline:
            with ot.step(step):
                pass
            step += 1
            if step % 1000 == 0:
                if step > 2000 and any(e["event"] == "worker_stuck" for e in run_events(session.run_dir)):
                    break
                time.sleep(0.05)  # a training step takes time: let the watchdog see the worker's age
        stuck = run_events(session.run_dir, event="worker_stuck")
        assert len(stuck) == 1, stuck  # once per stuck flush
        assert "observable-instrument callbacks" in stuck[0]["message"]
        # The training thread's interval stays within the cap while every flush is deferred.
        assert step > 2000 and len(session.step_events) <= 500
        assert session.buffer.dropped.get("too_many_values", 0) > 0
    finally:
        with open(fifo, "w") as f:  # the "file system" comes back: the callback returns
            f.write("1")
        ot.shutdown()


def test_messages_beyond_the_queue_of_a_stuck_worker_are_counted_and_warned_once(
    tmp_path: Path, caplog
) -> None:
    import threading

    import otel_train as ot
    from otel_train.testing import current_session

    release = threading.Event()

    def hanging(options: object) -> list:
        release.wait(60)  # a callback that hangs until the test lets it go
        return []

    ot.init(
        run_name="full-queue", output_dir=str(tmp_path), prometheus_port=0, verbosity=0, hardware=False,
        log_interval=1,
    )  # fmt: skip
    session = current_session()
    assert session is not None
    ot.get_meter().create_observable_gauge("custom.hanging", callbacks=[hanging])
    try:
        with ot.step(0):
            ot.record("loss", 1.0)  # its flush runs the callback: the worker hangs there
        deadline = time.monotonic() + 30
        while session.worker.doing == "idle" and time.monotonic() < deadline:
            time.sleep(0.01)
        limit = session.worker.max_messages
        with caplog.at_level("WARNING", logger="otel_train"):
            for i in range(limit + 25):
                ot.log_text("note", f"entry {i}")
        assert session.buffer.dropped.get("message_queue_full") == 25
        assert sum("message_queue_full" in r.getMessage() for r in caplog.records) == 1
    finally:
        release.set()
        ot.shutdown()
    rows = [
        json.loads(line)
        for line in (tmp_path / "full-queue" / "metrics.rank0.jsonl").read_text().splitlines()
    ]
    assert max(r.get("otel_train/dropped/message_queue_full", 0) for r in rows) == 25
