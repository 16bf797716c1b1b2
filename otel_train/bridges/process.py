"""BridgeProcess: the training process's end of the bridge process (`bridges.host`).

TensorBoard, W&B and MLflow writes are Python work (protobuf encoding, SQLite, W&B's record
serialisation) that, in the training process, would compete with the training thread for the GIL.
They run in ONE child process instead, fed once per flush through a pipe:

* The child is `python -m otel_train.bridges.host`, started with `subprocess` (not multiprocessing's
  spawn, which re-imports the user's `__main__`, nor fork, unsafe after torch/CUDA/threads), with
  `CUDA_VISIBLE_DEVICES` empty. It is started from the feeder thread, which lives as long as the
  bridges, because Linux's parent-death signal follows the thread that created the child.
* Setup is checked before `init()` returns: the child builds the bridges and answers; a missing
  package or an unwritable directory raises here, with the bridge's own message.
* Every call is encoded (plain Python, `bridges.framing`) and put on a bounded queue without
  blocking; a full queue drops the call and counts it (`otel_train.dropped{reason=bridge_queue}`).
  One feeder thread writes the queue to the pipe in order, so every bridge sees scalars, text,
  samples, histograms and hyperparameters in the order they were logged.
* `close(final_scalars, timeout)` queues the close and waits at most `timeout` for the child's
  answer (with the bridges' drop and error counts). All bridges close at once in the child, each
  within its own grace period; a hung one cannot hold the training process past `timeout`: the
  child then finishes (or gives up) on its own, and exits.
* SIGKILL of the training process: the child sees stdin EOF (or its death signal), closes the
  bridges, which writes what they received, and exits: at most the flush in flight is lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train.bridges.base import Sink
from otel_train.bridges.errors import BridgeSetupFailed
from otel_train.bridges.framing import encode, plain, read_frame, write_frame
from otel_train.bridges.table import BridgeSpec

log = logging.getLogger("otel_train")

SETUP_TIMEOUT_S = 120.0  # importing torch.utils.tensorboard, wandb and mlflow on a busy machine
LIFT_EVERY_S = 5.0  # a starved bridge process is lifted to normal scheduling at most this often
CHILD_GRACE_S = 30.0  # per bridge, in parallel, in the child: then a hung bridge is abandoned


class BridgeProcess(Sink):
    name = "bridges"

    def __init__(
        self,
        specs: Sequence[BridgeSpec],
        queue_size: int,
        count_drop: Callable[[str, int], None] | None = None,
        setup_timeout_s: float = SETUP_TIMEOUT_S,
    ) -> None:
        self.specs = [(m, c, dict(kw)) for m, c, kw in specs]
        self._queue_size = queue_size
        self._count_drop = count_drop
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=queue_size)
        self.proc: subprocess.Popen[bytes] | None = None
        self.dropped = 0
        self.bridge_stats: dict[str, dict[str, Any]] = {}
        self.closed_cleanly = False
        self._dead = False
        self._closing = False
        self._warned_drop = False
        self._next_lift = 0.0  # monotonic time before which _catch_up does nothing
        self._setup_done = threading.Event()
        self._setup_error: BaseException | None = None
        self._closed_reply = threading.Event()
        self._close_frame: bytes | None = None
        self._thread = threading.Thread(target=self._run, name="otel_train-bridges", daemon=True)
        self._thread.start()
        if not self._setup_done.wait(setup_timeout_s):
            self._dead = True
            self._kill()
            raise BridgeSetupFailed(f"the bridge process did not start within {setup_timeout_s:.0f} s")
        if self._setup_error is not None:
            raise self._setup_error

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def queued(self) -> int:
        """Calls handed over and not yet written into the pipe (lost if this process is killed;
        what is in the pipe is still read and written by the bridge process)."""
        return self._queue.qsize()

    # -- Sink API (never blocks) ------------------------------------------------------------------

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self._submit(
            "write_scalars", (int(step), float(wall_time), {str(k): float(v) for k, v in scalars.items()})
        )

    def write_text(self, key: str, text: str, step: int) -> None:
        self._submit("write_text", (str(key), str(text), int(step)))

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        self._submit("write_samples", (str(key), [(str(p), str(o)) for p, o in rows], int(step)))

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        self._submit("write_histogram", (str(key), [float(v) for v in values], int(step)))

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        self._submit("write_hparams", (plain(dict(params)),))

    def close(self, final_scalars: Mapping[str, float], timeout: float | None = None) -> None:
        """Hand over the close and wait at most `timeout` seconds for the bridges to finish."""
        if self._closing:
            return
        self._closing = True
        deadline = time.monotonic() + (CHILD_GRACE_S if timeout is None else max(0.0, timeout))
        if not self._dead:
            self._lift()
            grace = max(CHILD_GRACE_S, deadline - time.monotonic())
            frame = encode(("close", {str(k): float(v) for k, v in final_scalars.items()}, grace))
            self._close_frame = frame
            while not self._dead:
                try:
                    self._queue.put(frame, timeout=max(0.01, min(0.05, deadline - time.monotonic())))
                    break
                except queue.Full:
                    if time.monotonic() >= deadline:
                        break
            self._closed_reply.wait(max(0.0, deadline - time.monotonic()))
        if self._closed_reply.is_set():
            self.closed_cleanly = all(s.get("clean") for s in self.bridge_stats.values())
            for name, stat in self.bridge_stats.items():
                if stat.get("dropped"):
                    self._drop(f"bridge_{name}", int(stat["dropped"]))
        else:
            log.warning(
                "otel_train: the bridges did not finish within %.1f s; the bridge process (pid %s) "
                "finishes on its own (at most %.0f s more) and exits.",
                timeout or CHILD_GRACE_S,
                self.pid,
                CHILD_GRACE_S,
            )

    def wait(self, timeout: float) -> bool:
        """After close: wait until the bridge process has written everything and exited."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def forget_in_child(self) -> None:
        """After fork: the forked child must not hold the pipe (the bridge process waits for EOF)."""
        self._dead = True
        self._release()  # closes the file objects (never a bare fd number a later open() may reuse)

    # -- internals --------------------------------------------------------------------------------

    def _submit(self, method: str, args: tuple[Any, ...]) -> None:
        if self._dead or self._closing:
            self._on_drop()
            return
        try:
            frame = encode(("call", method, args))
        except Exception as exc:
            log.warning("otel_train: a %s call could not be encoded for the bridges: %r", method, exc)
            self._on_drop()
            return
        try:
            self._queue.put_nowait(frame)
        except queue.Full:
            self._on_drop()
        if self._queue.qsize() * 2 >= self._queue_size:
            self._catch_up()

    def _catch_up(self) -> None:
        """The bridge process is not reading (starved under SCHED_IDLE while every core is busy, so
        it cannot see its own queues fill): lift it to normal scheduling, at most every LIFT_EVERY_S;
        it returns to SCHED_IDLE by itself once its queues are nearly empty (host.CpuPolicy)."""
        now = time.monotonic()
        if now >= self._next_lift:
            self._next_lift = now + LIFT_EVERY_S
            self._lift()

    def _lift(self) -> None:
        """The bridge process's main thread to normal scheduling (at its nice 10): one system call;
        it lifts its other threads and W&B's service itself when it notices (host.CpuPolicy)."""
        if self.proc is None or not hasattr(os, "sched_setscheduler") or self.proc.poll() is not None:
            return  # not Linux, or exited (poll reaps it: its pid is never another process's here)
        with contextlib.suppress(OSError):  # another user's process: left as it is
            os.sched_setscheduler(self.proc.pid, os.SCHED_OTHER, os.sched_param(0))

    def _on_drop(self) -> None:
        self.dropped += 1
        self._drop("bridge_queue", 1)
        if not self._warned_drop and not self._closing:
            self._warned_drop = True
            log.warning(
                "otel_train: the bridges are falling behind (queue of %d full) or gone; dropping their "
                "updates (counted in otel_train.dropped). Training is not slowed down. Shown once.",
                self._queue_size,
            )

    def _drop(self, reason: str, count: int) -> None:
        if self._count_drop is not None and count:
            with contextlib.suppress(Exception):
                self._count_drop(reason, count)

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the bridge process never touches a GPU
        package_root = str(Path(__file__).resolve().parents[2])  # otel_train importable as the parent has it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        return subprocess.Popen(
            [sys.executable, "-m", "otel_train.bridges.host", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
            start_new_session=False,
        )

    def _run(self) -> None:
        try:
            self.proc = self._start()
            assert self.proc.stdin is not None and self.proc.stdout is not None
            out_fd, in_fd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
            write_frame(out_fd, encode(("setup", self.specs, self._queue_size)))
            reply = read_frame(in_fd, time.monotonic() + SETUP_TIMEOUT_S)
            if reply[0] == "error":
                _, kind, message = reply
                known = kind in ("BridgeImportError", "BridgeSetupError")
                self._setup_error = BridgeSetupFailed(message if known else f"{kind}: {message}")
                self._dead = True
                return
        except BaseException as exc:
            self._setup_error = BridgeSetupFailed(f"the bridge process could not start: {exc!r}")
            self._dead = True
            return
        finally:
            self._setup_done.set()
        try:
            while True:
                frame = self._queue.get()
                write_frame(out_fd, frame)
                if frame is self._close_frame:
                    break
            reply = read_frame(in_fd, time.monotonic() + 2 * CHILD_GRACE_S + 5.0)
            if reply[0] == "closed":
                self.bridge_stats = reply[1]
                self._closed_reply.set()
            self.proc.wait(5.0)  # reap it (it exits right after answering)
        except (OSError, EOFError, TimeoutError, subprocess.TimeoutExpired) as exc:
            if not self._closing:
                log.warning("otel_train: the bridge process is gone (%r); bridge updates are dropped.", exc)
            self._dead = True
        finally:
            self._release()

    def _release(self) -> None:
        proc = self.proc
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
