"""A hostile control.json: typos, huge or special files, rewrites and edits. Nothing reaches the
training step as an exception, every refusal is a `control_rejected` event, every accepted change
is applied on every rank at the same step, and the file can never stop stall detection."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.events import run_events
from helpers.multirank import run_ranks
from helpers.waiting import wait_for

import otel_train as ot
from otel_train.control import MAX_FILE_BYTES
from otel_train.testing import current_session

BAD_FILES = [
    '{"profile": {"active": 0}}',
    '{"profile": {"active": "x"}}',
    '{"profile": {"wait": -1}}',
    '{"profile": {"repeat": 0}}',
    '{"profile": {"ranks": [5]}}',  # world size 2
    '{"profile": {"active": 1000000000}}',
    '{"trace_every": Infinity}',
    '{"timing_log_level": true}',
]
# Stamp fields a person copied or invented are not rank 0's stamp: the settings are a new change.
BAD_STAMP = '{"timing_log_level": 2, "version": "x", "apply_at_step": -3}'


def _count(run_dir: Path, event: str) -> int:
    return sum(e["event"] == event for e in run_events(run_dir))


def _stamped_version(path: Path) -> int:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    return document.get("version", 0) if "digest" in document else 0


def _driver(control: Path, run_dir: Path) -> Callable[[], bool]:
    """Rank 0's script, advanced once per step; returns True once every file was written."""
    script: list[tuple[Callable[[], None], Callable[[], bool]]] = []
    for number, text in enumerate(BAD_FILES, start=1):
        script.append(
            (lambda t=text: control.write_text(t), lambda n=number: _count(run_dir, "control_rejected") >= n)
        )
    script.append((lambda: control.write_text(BAD_STAMP), lambda: _stamped_version(control) == 1))
    # Overwritten as soon as rank 0 stamped it: the other rank may never have read version 1.
    script.append((lambda: control.write_text('{"trace_every": 3}'), lambda: _stamped_version(control) == 2))

    def edit_stamped() -> None:  # a person edits the stamped file, keeping its stamp fields
        document = json.loads(control.read_text())
        control.write_text(json.dumps({**document, "trace_every": 5}))

    script.append((edit_stamped, lambda: _stamped_version(control) == 3))
    state = {"index": 0, "written": False}

    def advance() -> bool:
        if state["index"] >= len(script):
            return True
        write, done = script[state["index"]]
        if not state["written"]:
            write()
            state["written"] = True
        elif done():
            state["index"] += 1
            state["written"] = False
        return False

    return advance


def _rank_with_hostile_control(rank: int, world_size: int, out: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ot.init(run_name="hostile", output_dir=out, prometheus_port=0, verbosity=0, hardware=False,
                      log_interval=5)  # fmt: skip
    session = current_session()
    run_dir = session.run_dir
    advance = _driver(run_dir / "control.json", run_dir) if rank == 0 else (lambda: True)
    seen: list[tuple[int, int, int]] = []  # (step, timing level, trace_every) at each change
    flag = torch.zeros(1)
    step = 0
    finished_at: int | None = None
    while step < 20_000:
        with ot.step(step):
            state = (session.timing_level, session.config.trace_every)
            if not seen or seen[-1][1:] != state:
                seen.append((step, *state))
            time.sleep(0.004)
            flag[0] = 1.0 if advance() and state == (2, 5) else 0.0
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        step += 1
        if flag.item() > 0 and finished_at is None:
            finished_at = step
        if finished_at is not None and step >= finished_at + 10:
            break
    events = run_events(run_dir, rank)
    ot.shutdown()
    return {
        "seen": seen,
        "versions": [e["version"] for e in events if e["event"] == "control"],
        "rejected": [e["message"] for e in events if e["event"] == "control_rejected"],
    }


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_hostile_control_files_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(2, _rank_with_hostile_control, (str(tmp_path),), timeout=240)
    rank0, rank1 = results
    # Every typo is refused, by name, before anything is announced; no rank raised.
    assert len(rank0["rejected"]) == len(BAD_FILES), rank0["rejected"]
    for fragment in ("active >= 1", "'x'", ">= 0", "repeat >= 1", "ranks=[5]", "at most 50", "Infinity"):
        assert any(fragment in message for message in rank0["rejected"]), (fragment, rank0["rejected"])
    # Every accepted change is announced and applied on both ranks, at the same steps.
    assert rank0["versions"] == rank1["versions"] == [1, 2, 3]
    assert rank0["seen"] == rank1["seen"], (rank0["seen"], rank1["seen"])
    assert [state for _, *state in rank0["seen"]] == [[1, 100], [2, 100], [2, 3], [2, 5]]


def _rejections(run_dir: Path) -> list[str]:
    return [e["message"] for e in run_events(run_dir) if e["event"] == "control_rejected"]


def test_special_and_huge_control_files_are_refused_unread(tmp_path: Path) -> None:
    ot.init(run_name="special", prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    control = session.run_dir / "control.json"
    with ot.step(0):
        pass
    os.mkfifo(control)  # opening it for reading would block until a writer comes
    wait_for(lambda: any("FIFO" in m for m in _rejections(session.run_dir)), 10, "the FIFO refused")
    control.unlink()
    control.symlink_to("/dev/zero")  # reading it would never end
    wait_for(lambda: len(_rejections(session.run_dir)) >= 2, 10, "the symlink refused")
    control.unlink()
    with control.open("w") as f:  # valid JSON, far over the cap
        f.write('{"trace_every": 1, "pad": "' + "x" * (4 * MAX_FILE_BYTES) + '"}')
    wait_for(
        lambda: any(f"larger than {MAX_FILE_BYTES}" in m for m in _rejections(session.run_dir)), 10, "big"
    )
    assert len(_rejections(session.run_dir)) == 3  # each refused once, not at every poll
    # The runtime control thread is alive: a good file after all that is applied.
    control.unlink()
    control.write_text('{"timing_log_level": 2}')
    step = 1
    deadline = time.monotonic() + 30
    while session.timing_level != 2 and time.monotonic() < deadline:
        with ot.step(step):
            time.sleep(0.01)
        step += 1
    assert session.timing_level == 2


def test_a_blocked_control_read_does_not_stop_stack_dumps(tmp_path: Path) -> None:
    """A read that blocks (a dead network file system) holds only the control thread."""
    ot.init(run_name="blocked", stall_timeout_s=0.5, prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    assert session.control is not None
    release = threading.Event()
    reading = threading.Event()
    real_poll = session.control.poll

    def poll_on_a_dead_mount(last_step: int, per_step: float | None) -> list:
        reading.set()
        release.wait(30)
        return real_poll(last_step, per_step)

    session.control.poll = poll_on_a_dead_mount  # type: ignore[method-assign]
    try:
        with ot.step(0):
            pass
        wait_for(reading.is_set, 10, "the control thread to block")
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: run_events(session.run_dir, event="stack_dump"), 10, "SIGUSR1 dump")
        wait_for(lambda: run_events(session.run_dir, event="stall"), 10, "stall dump")
    finally:
        release.set()


def test_a_change_that_cannot_be_applied_is_an_event_not_an_exception(tmp_path: Path) -> None:
    ot.init(run_name="busy-profiler", prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    control = session.run_dir / "control.json"
    control.write_text('{"profile": {"wait": 3000, "active": 1}}')  # a long window: still running ...
    step = 0
    deadline = time.monotonic() + 60
    second_written = False
    while time.monotonic() < deadline and not _rejections(session.run_dir):
        with ot.step(step):  # never raises
            time.sleep(0.005)
        step += 1
        if not second_written and _stamped_version(control) == 1:
            control.write_text('{"profile": {"active": 2}, "timing_log_level": 2}')  # ... when this applies
            second_written = True
    (rejected,) = _rejections(session.run_dir)
    assert "v2 at step" in rejected and "profile was not applied: a window is still running" in rejected
    assert session.timing_level == 2  # the rest of the change is applied, on every rank alike
    assert session.profiler is not None and session.profiler.window.wait == 3000
