"""`ot.on_event` / `ot.on_straggler` callbacks never disable the safety net (issue #48): they run on
a thread of their own, so a callback that blocks holds neither the worker nor the watchdog, one
that calls `ot.shutdown()` closes everything, and one that forwards events with `ot.event` does
not feed itself."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.events import run_events
from helpers.ports import free_port

import otel_train as ot
from otel_train import adapters, semconv
from otel_train.testing import current_session

HANG_GUARD_S = 60.0  # only a bound on a test that went wrong: nothing here waits this long when it works


def _wait_for(predicate: Any, timeout_s: float = HANG_GUARD_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def test_a_blocking_callback_holds_neither_the_worker_nor_the_watchdog(tmp_path) -> None:
    release = threading.Event()
    entered: list[str] = []

    def webhook_that_hangs(event: str, message: str, attrs: dict[str, Any]) -> None:
        entered.append(event)
        release.wait(10 * HANG_GUARD_S)  # released when the test ends; outlasts every wait below

    try:
        ot.init(
            output_dir=str(tmp_path), run_name="hook", prometheus_port=0, verbosity=0, hardware=False,
            log_interval=1, stall_timeout_s=1.0,
        )  # fmt: skip
        session = current_session()
        assert session is not None and session.run_dir is not None
        run_dir = session.run_dir
        ot.on_event(webhook_that_hangs)
        # Training goes on for several stall timeouts after the callback blocked (a worker held that
        # long is reported as worker_stuck, whose call then held the watchdog), then stalls for real.
        started = time.monotonic()
        steps = 0
        while steps < 300 or time.monotonic() - started < 4.0:
            with ot.step(steps):
                # a non-finite loss at step 1: its event is raised on the worker thread
                ot.record("loss", float("nan") if steps == 1 else 1.0)
            steps += 1
            time.sleep(0.002)
        assert _wait_for(lambda: entered), "the callback was never called"
        # a real stall of the training thread, after the callback blocked: the watchdog must see it
        stalled = _wait_for(lambda: any(e["event"] == "stall" for e in run_events(run_dir)), HANG_GUARD_S / 2)
        assert stalled, [e["event"] for e in run_events(run_dir)]
        with ot.step(steps):
            ot.record("loss", 1.0)
        ot.shutdown()
    finally:
        release.set()
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(row.get("timers/step/count", 0) for row in rows) == steps + 1  # every step written
    assert rows[-1]["step"] == steps
    events = run_events(run_dir)
    (stall,) = [e for e in events if e["event"] == "stall"]
    assert stall["step"] == steps - 1
    dump = Path(stall["file"])
    assert dump.is_file() and "otel_train stack dump" in dump.read_text()
    assert "worker_stuck" not in {e["event"] for e in events}  # the worker never waited for the callback
    assert entered == ["nonfinite"]  # the stall's call waited behind the blocked one, in order


def test_shutdown_from_a_callback_closes_sinks_bridges_and_exporters(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    done = threading.Event()
    errors: list[BaseException] = []
    threads: list[str] = []

    def stop_the_run(event: str, message: str, attrs: dict[str, Any]) -> None:
        if event != "nonfinite":
            return
        threads.append(threading.current_thread().name)
        try:
            ot.shutdown()  # the README's "stop a run on a hang"
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    ot.init(
        output_dir=str(tmp_path), run_name="stop", prometheus_port=free_port(), verbosity=0,
        hardware=False, log_interval=1, tensorboard=True,
    )  # fmt: skip
    session = current_session()
    assert session is not None and session.run_dir is not None and session.bridges is not None
    url = session.prometheus_url
    assert url is not None
    urllib.request.urlopen(url, timeout=5).read()  # the pull endpoint serves while the run lives
    ot.on_event(stop_the_run)
    for i in range(5):
        with ot.step(i):
            ot.record("loss", float("nan") if i == 3 else 1.0)  # raised on the worker thread
    assert done.wait(HANG_GUARD_S), "the callback never ran"
    assert errors == [] and threads == ["otel_train-hooks"]
    assert current_session() is None and session.shutdown_done.is_set()
    assert "callback" not in caplog.text and "cannot join" not in caplog.text, caplog.text
    # sinks: the run dir's files were closed with the end-of-process line
    progress = [p for p in session.run_dir.iterdir() if p.name.startswith("progress")]
    assert progress and "end of process" in progress[0].read_text()
    # bridges: the bridge process closed cleanly and exited, its TensorBoard file written
    assert session.bridges.closed_cleanly and session.bridges.wait(10.0)
    assert list(session.run_dir.rglob("*tfevents*"))
    # exporters: the pull endpoint is gone
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5).read()
    hooks = session.events.hooks
    assert hooks is not None and _wait_for(lambda: not hooks._thread.is_alive())  # ended with the session
    ot.shutdown()  # again, from the training thread: a no-op


def test_a_callback_forwarding_with_ot_event_gives_one_event(tmp_path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="fwd", prometheus_port=0, verbosity=0, hardware=False,
            log_interval=1)  # fmt: skip
    session = current_session()
    assert session is not None and session.run_dir is not None
    forwarded: list[str] = []

    def forward_everything(event: str, message: str, attrs: dict[str, Any]) -> None:
        forwarded.append(event)
        ot.event("escalated", f"{event}: {message}")  # e.g. to a pager, through otel_train's own events

    ot.on_event(forward_everything)
    deadline = time.monotonic() + HANG_GUARD_S
    i = 0
    # steps go on until the hook has seen the spike (a hook running once ot.shutdown() began finds
    # no session for its ot.event)
    while (i < 12 or not forwarded) and time.monotonic() < deadline:
        with ot.step(i):
            ot.record("loss", 50.0 if i == 9 else 1.0)  # one loss spike
        time.sleep(0.01)
        i += 1
    ot.shutdown()
    events = [e["event"] for e in run_events(session.run_dir)]
    assert events.count("loss_spike") == 1, events
    assert events.count("escalated") == 1, events  # one forward; not one per forward of a forward
    assert forwarded == ["loss_spike"]


def test_on_straggler_runs_on_the_hook_thread(tmp_path) -> None:
    ot.init(output_dir=str(tmp_path), prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    assert session is not None
    seen: list[tuple[str, list[int]]] = []
    adapters.on_straggler(lambda reports: seen.append((threading.current_thread().name, reports)))
    session.reducer.on_straggler([3])  # as the reducer calls it, on the worker thread
    ot.shutdown()  # runs what is queued first
    assert seen == [("otel_train-hooks", [3])]


class _Dropped:
    def __init__(self) -> None:
        self.added: list[tuple[int, dict[str, Any]]] = []

    def add(self, amount: int, attributes: dict[str, Any]) -> None:
        self.added.append((amount, dict(attributes)))


def test_a_full_hook_queue_drops_counted_and_warned_once(caplog) -> None:
    from otel_train.health import HookThread

    caplog.set_level(logging.WARNING, logger="otel_train")
    dropped = _Dropped()
    hooks = HookThread(dropped, maxsize=3)
    release, started = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow(i: int) -> None:
        started.set()
        release.wait(HANG_GUARD_S)
        calls.append(i)

    hooks.submit(slow, 0)
    assert started.wait(HANG_GUARD_S)
    for i in range(1, 9):  # 3 wait in the queue, 5 are dropped; the caller never blocks
        hooks.submit(slow, i)
    assert hooks.drops == 5
    assert dropped.added == [(1, {semconv.REASON: "callback_backlog"})] * 5
    assert caplog.text.count("callback_backlog") == 1
    release.set()
    hooks.close(HANG_GUARD_S)
    assert calls == [0, 1, 2, 3]
    hooks.submit(slow, 99)  # after close: nothing
    assert calls == [0, 1, 2, 3]
