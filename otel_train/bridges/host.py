"""The bridge process: TensorBoard, W&B and MLflow run here, off the training process's GIL.

Started by `bridges.process.BridgeProcess` as `python -m otel_train.bridges.host <parent pid>` (never
through multiprocessing's spawn, which would re-import the user's `__main__`). It reads frames
(`bridges.framing`) from stdin and answers on its original stdout (its own prints go to stderr):

    -> ("setup", [(module, class, kwargs), ...])   <- ("ready", [names]) | ("error", message)
    -> ("call", method, args)                        (in order, to every bridge)
    -> ("close", final_scalars, grace_s)           <- ("closed", {name: {dropped, errors, clean}})

Each bridge sits behind its own `ThreadedSink` here, so one hung backend never holds the others.
It never touches CUDA (CUDA_VISIBLE_DEVICES is empty) and never outlives its parent for long: stdin
EOF (the parent exited or was killed) or SIGTERM (PR_SET_PDEATHSIG on Linux, for when a forked
grandchild still holds the pipe) closes the bridges, which flushes what they have, within `grace_s`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from otel_train.bridges.framing import encode, read_frame, write_frame
from otel_train.bridges.threaded import ThreadedSink

log = logging.getLogger("otel_train")

DEFAULT_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


class ParentGone(Exception):
    """SIGTERM: the parent died (death signal) or someone asks this process to finish."""


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:  # not Linux: stdin EOF still ends this process
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise ParentGone


def yield_cpu() -> None:
    """Run below the training: nice 10, and SCHED_IDLE where the OS has it (Linux).

    Measured on a launch-bound loop (bench/bench_launch.py, 2 cores): at nice 10 the bridge process
    still took the training thread's core now and then (2-3 % of its wall time off-CPU while
    flushing, +2 to +4 % step time with all three bridges); under SCHED_IDLE a normal thread always
    preempts it and it never preempts one, which removed that. It still runs whenever a core is
    idle, which is nearly always on a GPU node; on a node whose every core is saturated the bridges
    fall behind, their bounded queues fill and the drops are counted (otel_train.dropped) and warned
    once. W&B's service process inherits the policy.
    """
    with contextlib.suppress(OSError):
        os.nice(10)
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is not None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, policy, os.sched_param(0))


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


def close_all(sinks: list[ThreadedSink], final_scalars: Mapping[str, float], grace_s: float) -> None:
    """Close every bridge at once (a hung one costs `grace_s` once, not once per bridge)."""
    threads = [
        threading.Thread(target=sink.close, args=(dict(final_scalars), grace_s), daemon=True)
        for sink in sinks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(grace_s + 1.0)


def stats(sinks: list[ThreadedSink]) -> dict[str, dict[str, Any]]:
    return {s.name: {"dropped": s.dropped, "errors": s.errors, "clean": s.closed_cleanly} for s in sinks}


def serve(parent_pid: int, reply_fd: int) -> None:
    in_fd = sys.stdin.fileno()
    closing = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        if not closing.is_set():
            raise ParentGone

    signal.signal(signal.SIGTERM, on_sigterm)
    sinks: list[ThreadedSink] = []
    final: Mapping[str, float] = {}
    grace_s = DEFAULT_GRACE_S
    reply = True
    try:
        _die_with_parent(parent_pid)
        kind, specs, queue_size = read_frame(in_fd)
        assert kind == "setup"
        try:
            sinks = build(specs, queue_size)
        except Exception as exc:
            write_frame(reply_fd, encode(("error", type(exc).__name__, str(exc))))
            return
        write_frame(reply_fd, encode(("ready", [s.name for s in sinks])))
        while True:
            message = read_frame(in_fd)
            if message[0] == "call":
                _, method, args = message
                for sink in sinks:
                    getattr(sink, method)(*args)
            elif message[0] == "close":
                _, final, grace_s = message
                break
    except (EOFError, ParentGone, OSError):
        reply = False  # the parent is gone: still close the bridges, so what they got is on disk
    closing.set()
    close_all(sinks, final, grace_s)
    if reply:
        with contextlib.suppress(OSError):
            write_frame(reply_fd, encode(("closed", stats(sinks))))


def main() -> None:
    parent_pid = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    # Replies go to the original stdout; anything a backend prints goes to stderr instead.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    yield_cpu()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        serve(parent_pid, reply_fd)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Backends may leave non-daemon threads (W&B's service); what they had to write is written.
        os._exit(0)


if __name__ == "__main__":
    main()
