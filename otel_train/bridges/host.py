"""The bridge process (`python -m otel_train.bridges.host <parent pid>`): TensorBoard, W&B and
MLflow run here, off the training process's GIL. Design: docs/design/bridges.md#host."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from otel_train.bridges.framing import BadFrame, encode, read_frame, write_frame
from otel_train.bridges.threaded import ThreadedSink

log = logging.getLogger("otel_train")

DEFAULT_GRACE_S = 10.0
REPORT_EVERY_S = 1.0  # the bridges' drop counts go to the training process at most this often
DRAIN_S = 5.0  # after the parent's death: how long the calls still in the pipe are read
FRAME_S = 5.0  # a frame whose first byte arrived is whole within this (the parent writes it at once)
_PR_SET_PDEATHSIG = 1


class ParentGone(Exception):
    """SIGTERM: the parent died (death signal) or someone asks this process to finish."""


def _die_with_parent(parent_pid: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: stdin EOF still ends this process
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise ParentGone


class CpuPolicy:
    """Below the training (nice 10, SCHED_IDLE or SCHED_BATCH) except while the bridges fall
    behind; why and how: docs/design/bridges.md#cpu-policy."""

    CATCH_UP_AT = 0.5  # a bridge queue this full: normal scheduling
    IDLE_AT = 0.1  # every queue at most this full again: back to the idle policy

    def __init__(self) -> None:
        self.idle_policy: int | None = None  # chosen by start(), at nice 10
        self.idle = False

    def start(self) -> None:
        """Nice 10, at normal scheduling while the bridges are set up (`set_up`)."""
        with contextlib.suppress(OSError):
            os.nice(10)
        if hasattr(os, "SCHED_IDLE"):
            self.idle_policy = os.SCHED_IDLE if _may_leave_idle() else os.SCHED_BATCH

    def set_up(self) -> None:
        self._set(idle=True)

    def follow_lift(self) -> None:
        """The training process lifted this (main) thread (BridgeProcess._lift): lift the others
        and W&B's service too, before the frame just read reaches them."""
        if self.idle and self.idle_policy is not None and os.sched_getscheduler(0) != self.idle_policy:
            self._set(idle=False)

    def update(self, fullest: float, unread: bool = False) -> None:
        """`fullest`: the fullest bridge queue's fill; `unread`: frames wait in the pipe."""
        if self.idle and fullest >= self.CATCH_UP_AT:
            self._set(idle=False)
        elif not self.idle and fullest <= self.IDLE_AT and not unread:
            self._set(idle=True)

    def _set(self, idle: bool) -> None:
        if self.idle_policy is None:
            return
        policy = self.idle_policy if idle else os.SCHED_OTHER
        changed = False
        for tid in _task_ids():
            with contextlib.suppress(OSError):  # a thread that just ended
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                changed = True
        if changed:
            self.idle = idle


def _may_leave_idle() -> bool:
    """May this process's threads go from SCHED_IDLE back to SCHED_OTHER? Tried on a thread of
    its own: the policy is per thread."""
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    thread = threading.Thread(target=probe, name="otel_train-sched-probe", daemon=True)
    thread.start()
    thread.join()
    return allowed == [True]


def unread(fd: int) -> bool:
    """Are there bytes waiting in pipe `fd` (FIONREAD; False where it cannot be told)?"""
    try:
        import fcntl
        import termios

        waiting = bytearray(4)
        fcntl.ioctl(fd, termios.FIONREAD, waiting)
        return int.from_bytes(waiting, sys.byteorder) > 0
    except (ImportError, OSError):  # not POSIX, or not a pipe
        return False


def _task_ids() -> list[int]:
    """Every thread of this process and of its descendants (W&B's service)."""
    import psutil

    pids = [os.getpid()]
    with contextlib.suppress(psutil.Error):
        pids += [child.pid for child in psutil.Process().children(recursive=True)]
    tids: list[int] = []
    for pid in pids:
        with contextlib.suppress(OSError):
            tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return tids or [0]


def build(specs: list[tuple[str, str, dict[str, Any]]], queue_size: int) -> list[ThreadedSink]:
    sinks: list[ThreadedSink] = []
    try:
        for module, cls, kwargs in specs:
            inner = getattr(importlib.import_module(module), cls)(**kwargs)
            sinks.append(ThreadedSink(inner, queue_size, inner.name))
    except BaseException:
        close_all(sinks, {}, 2.0)
        raise
    return sinks


def close_all(
    sinks: list[ThreadedSink], final_scalars: Mapping[str, float], grace_s: float, failed: bool = False
) -> None:
    """Close every bridge at once (a hung one costs `grace_s` once, not once per bridge)."""
    threads = [
        threading.Thread(target=sink.close, args=(dict(final_scalars), failed, grace_s), daemon=True)
        for sink in sinks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(grace_s + 1.0)


def _call_all(sinks: list[ThreadedSink], message: tuple[str, str, tuple[Any, ...]]) -> None:
    _, method, args = message
    for sink in sinks:
        getattr(sink, method)(*args)


class Reports:
    """The bridges' drop counts and the frames skipped here, sent to the training process as they
    grow (at most every REPORT_EVERY_S): the close's answer may come after it stopped waiting."""

    def __init__(self, reply_fd: int, sinks: list[ThreadedSink]) -> None:
        self.reply_fd = reply_fd
        self.sinks = sinks
        self.skipped = 0  # frames that arrived whole but could not be read (`framing.BadFrame`)
        self._sent = self._counts()
        self._next = 0.0  # monotonic time before which no report is sent

    def _counts(self) -> tuple[int, ...]:
        return (self.skipped, *(s.dropped for s in self.sinks))

    def skip(self, exc: BadFrame) -> None:
        if not self.skipped:
            log.warning(
                "otel_train: the bridge process skipped %s; the bridges miss that update (counted as "
                "otel_train.dropped{reason=bridge_bad_frame}). Shown once.",
                exc,
            )
        self.skipped += 1

    def send(self, answer: str = "stats") -> None:
        stats = {
            s.name: {"dropped": s.dropped, "errors": s.errors, "clean": s.closed_cleanly} for s in self.sinks
        }
        write_frame(self.reply_fd, encode((answer, stats, self.skipped)))

    def send_if_grown(self) -> None:
        now, counts = time.monotonic(), self._counts()
        if counts != self._sent and now >= self._next:
            self.send()
            self._sent, self._next = counts, now + REPORT_EVERY_S


def serve(parent_pid: int, in_fd: int, reply_fd: int, cpu: CpuPolicy) -> None:
    closing = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        if not closing.is_set():
            raise ParentGone

    signal.signal(signal.SIGTERM, on_sigterm)
    sinks: list[ThreadedSink] = []
    reports: Reports | None = None
    final: Mapping[str, float] = {}
    grace_s = DEFAULT_GRACE_S
    failed = True  # until the parent says how the run ended
    try:
        _die_with_parent(parent_pid)
        kind, specs, queue_size = read_frame(in_fd)
        assert kind == "setup"
        try:
            sinks = build(specs, queue_size)
        except Exception as exc:  # the backends' own set-up (TensorBoard, W&B, MLflow): told to the parent
            write_frame(reply_fd, encode(("error", type(exc).__name__, str(exc))))
            return
        cpu.set_up()  # W&B's service included: it started in build()
        reports = Reports(reply_fd, sinks)
        write_frame(reply_fd, encode(("ready", [s.name for s in sinks])))
        while True:
            reports.send_if_grown()
            try:
                message = _read_whole(in_fd, REPORT_EVERY_S)
            except BadFrame as exc:  # skipped, never the end of this process (or of its successor)
                reports.skip(exc)
                continue
            if message is None:
                continue
            cpu.follow_lift()
            if message[0] == "call":
                _call_all(sinks, message)
                cpu.update(max((s.fill for s in sinks), default=0.0), unread(in_fd))
            elif message[0] == "close":
                _, final, grace_s, failed = message
                break
    except (EOFError, ParentGone, OSError):  # OSError: TimeoutError too (a frame cut by a death)
        reports = None  # the parent is gone: still close the bridges, so what they got is on disk
    closing.set()
    cpu.update(1.0)  # closing: finish the backlog at normal priority, within the grace period
    if reports is None:
        _drain(in_fd, sinks)
    close_all(sinks, final, grace_s, failed)
    if reports is not None:
        with contextlib.suppress(OSError):
            reports.send("closed")


def _read_whole(in_fd: int, wait_s: float | None = None) -> Any:
    """The next frame, or None when none began within `wait_s`: waiting for it may be cut short by
    SIGTERM (ParentGone), reading it may not (a frame cut in half would leave `_drain` garbage)."""
    if not select.select([in_fd], [], [], wait_s)[0]:  # interruptible: nothing read yet
        return None
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return read_frame(in_fd, time.monotonic() + FRAME_S)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a held SIGTERM is raised after this


def _drain(in_fd: int, sinks: list[ThreadedSink]) -> None:
    """The parent died with calls in the pipe this process had not read: hand them on too. Never
    blocks past DRAIN_S: a forked grandchild may hold the pipe open, or a frame was cut in half."""
    deadline = time.monotonic() + DRAIN_S
    with contextlib.suppress(Exception):  # EOF, a cut frame, the deadline: what was read is kept
        while True:
            try:
                message = read_frame(in_fd, deadline)
            except BadFrame:
                continue
            if message[0] != "call":
                return
            _call_all(sinks, message)


def main() -> None:
    parent_pid = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    # Frames come from a private copy of stdin (os.dup's copies are not inherited), and fd 0
    # becomes /dev/null: see docs/design/bridges.md#host.
    in_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # Replies go to the original stdout; anything a backend prints goes to stderr instead.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cpu = CpuPolicy()
    cpu.start()
    code = 0
    try:
        serve(parent_pid, in_fd, reply_fd, cpu)
    except BaseException:  # a bug: said, and an exit code the parent's warning shows
        log.exception("otel_train: the bridge process failed")
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Backends may leave non-daemon threads (W&B's service); what they had to write is written.
        os._exit(code)


if __name__ == "__main__":
    main()
