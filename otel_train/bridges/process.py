"""BridgeProcess: the training process's end of the bridge process (`bridges.host`), the one child
that runs TensorBoard, W&B and MLflow off the training thread's GIL. Design: docs/design/bridges.md#process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from otel_train.bridges.base import Sink, merge_params
from otel_train.bridges.errors import BridgeSetupFailed
from otel_train.bridges.framing import (
    BadFrame,
    FrameCut,
    FrameTooLarge,
    encode,
    plain,
    read_frame,
    write_frame,
)
from otel_train.bridges.table import BridgeSpec

log = logging.getLogger("otel_train")

SETUP_TIMEOUT_S = 120.0  # importing torch.utils.tensorboard, wandb and mlflow on a busy machine
LIFT_EVERY_S = 5.0  # a starved bridge process is lifted to normal scheduling at most this often
CHILD_GRACE_S = 30.0  # per bridge, in parallel, in the child: then a hung bridge is abandoned
MAX_RESTARTS = 5  # a child that keeps dying (a bridge that crashes it at every set-up) is let go
RESTART_AFTER_S = 1.0  # the first restart's back-off; doubles with each restart
MAX_RESTART_AFTER_S = 30.0
# what a close that must see it all written (this process is PID 1) waits on top of the grace: the
# child joins its bridges' threads, and W&B's service writes its offline log until the child exits
AFTER_GRACE_S = 15.0
_RESTARTING = (
    "otel_train: the bridge process (pid %s) died (%s); restarting it in %.0f s (restart %d of at most "
    "%d). What it had received but not yet written is lost, and not counted (only the restart is, "
    "as otel_train.dropped{reason=bridge_restart}); updates meanwhile wait for the new process."
)
_FALLING_BEHIND = (
    "otel_train: the bridges are falling behind (queue of %d full) or gone; dropping their updates "
    "(counted in otel_train.dropped). Training is not slowed down. Shown once."
)
_AFTER_CLOSE = (
    "otel_train: updates handed to the bridges after their close (the background worker was still "
    "busy past the shutdown deadline) are dropped (counted as otel_train.dropped{reason=bridge_closed}). "
    "Shown once."
)
_TOO_LARGE = (
    "otel_train: a %s call for the bridges is %s; it is dropped (counted as "
    "otel_train.dropped{reason=bridge_frame_too_large}). Shown once."
)
_GONE_FOR_GOOD = (
    "otel_train: the bridge process died again (%s) after %d restarts; it is not restarted and bridge "
    "updates are dropped for the rest of the run (the run directory's JSONL has every value)."
)


class BridgeProcess(Sink):
    name = "bridges"

    def __init__(
        self,
        specs: Sequence[BridgeSpec],
        queue_size: int,
        count_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self.specs = [(m, c, dict(kw)) for m, c, kw in specs]
        self.names = [
            module.rsplit(".", 1)[-1] for module, _, _ in specs
        ]  # "otel_train.bridges.wandb": wandb
        self._queue_size = queue_size
        self._count_drop = count_drop
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=queue_size)
        self.proc: subprocess.Popen[bytes] | None = None
        self.dropped = 0
        self.bridge_stats: dict[str, dict[str, Any]] = {}
        self.closed_cleanly = False
        self._dead = False
        self._warned: set[str] = set()  # the drop reasons warned about (once each)
        self._listener: threading.Thread | None = None  # reads the child's answers (`_listen`)
        self._next_lift = 0.0  # monotonic time before which _submit lifts no more
        self._setup_done = threading.Event()
        self._setup_error: BaseException | None = None
        self._closed_reply = threading.Event()
        self._ended = threading.Event()  # the feeder thread is done (closed, or the child gone for good)
        self._closing = threading.Event()
        self._close_frame: bytes | None = None
        self._unsent: bytes | None = None  # the frame whose write found the child dead
        self.restarts = 0
        # every hyperparameter so far, merged as the bridges merge them: a restarted bridge process
        # gets them at its set-up (its W&B run directory and MLflow run would otherwise lack them)
        self._hparams: dict[str, Any] = {}
        modules = {module for module, _, _ in self.specs}
        if "otel_train.bridges.wandb" in modules:
            from otel_train.bridges import wandb as wandb_bridge

            wandb_bridge.warn_if_user_run_active()
        if "otel_train.bridges.mlflow" in modules:
            from otel_train.bridges import mlflow as mlflow_bridge

            mlflow_bridge.warn_if_user_run_active()
        self._thread = threading.Thread(target=self._run, name="otel_train-bridges", daemon=True)
        self._thread.start()
        if not self._setup_done.wait(SETUP_TIMEOUT_S):
            self._dead = True
            self._kill()
            raise BridgeSetupFailed(f"the bridge process did not start within {SETUP_TIMEOUT_S:.0f} s")
        if self._setup_error is not None:
            raise self._setup_error

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def queued(self) -> int:
        """Calls handed over and not yet written into the pipe (lost if this process is killed)."""
        return self._queue.qsize()

    # Sink API, never blocking: the worker hands plain data (`core.worker`), hyperparameters `plain`.

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self._submit("write_scalars", (step, wall_time, dict(scalars)))

    def write_text(self, key: str, text: str, step: int) -> None:
        self._submit("write_text", (key, text, step))

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        self._submit("write_samples", (key, list(rows), step))

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        self._submit("write_histogram", (key, list(values), step))

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        params = plain(dict(params))
        self._hparams = merge_params(self._hparams, params)  # a new dict: the feeder reads it whole
        self._submit("write_hparams", (params,))

    def close(
        self, final_scalars: Mapping[str, float], failed: bool = False, timeout: float | None = None
    ) -> None:
        """Hand over the close and wait at most `timeout` seconds for the bridges to finish."""
        if self._closing.is_set():
            return
        self._closing.set()
        wait_s = CHILD_GRACE_S if timeout is None else max(0.0, timeout)
        deadline = time.monotonic() + wait_s
        if not self._dead:
            self._lift()
            grace = max(CHILD_GRACE_S, deadline - time.monotonic())
            frame = encode(("close", dict(final_scalars), grace, failed))
            self._close_frame = frame
            while not self._dead:
                try:
                    self._queue.put(frame, timeout=max(0.01, min(0.05, deadline - time.monotonic())))
                    break
                except queue.Full:
                    if time.monotonic() >= deadline:
                        break
            self._wait_for_reply(deadline)
            if os.getpid() == 1:  # PID 1 of its PID namespace (a container without an init)
                _finish_as_namespace_init(self, grace)
        if self._closed_reply.is_set():  # its drop counts were counted as it came (`_listen`)
            self.closed_cleanly = all(s.get("clean") for s in self.bridge_stats.values())
        else:
            _warn_unfinished(self, wait_s)

    def _wait_for_reply(self, deadline: float) -> None:
        while not self._closed_reply.is_set() and not self._ended.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._closed_reply.wait(min(left, 0.1))

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
        self._release(replies_too=True)  # the file objects (never a bare fd a later open() may reuse)

    def _submit(self, method: str, args: tuple[Any, ...]) -> None:
        if self._closing.is_set():  # the worker, busy past the shutdown deadline, hands on its backlog
            self._on_drop("bridge_closed", _AFTER_CLOSE)
            return
        if self._dead:
            self._on_drop()
            return
        try:
            frame = encode(("call", method, args))
        except FrameTooLarge as exc:  # never sent: the bridge process could not read it
            self._on_drop("bridge_frame_too_large", _TOO_LARGE % (method, exc))
            return
        except (pickle.PicklingError, TypeError, AttributeError, ValueError, RecursionError) as exc:
            log.warning("otel_train: a %s call could not be encoded for the bridges: %r", method, exc)
            self._on_drop()
            return
        try:
            self._queue.put_nowait(frame)
        except queue.Full:
            self._on_drop()
        # a half-full queue: the bridge process is not reading (starved under SCHED_IDLE, it cannot
        # see its own queues fill): lift it, at most every LIFT_EVERY_S (docs/design/bridges.md#cpu-policy)
        if self._queue.qsize() * 2 >= self._queue_size and time.monotonic() >= self._next_lift:
            self._next_lift = time.monotonic() + LIFT_EVERY_S
            self._lift()

    def _lift(self) -> None:
        """The bridge process's main thread to normal scheduling; it lifts the rest (host.CpuPolicy)."""
        if self.proc is None or not hasattr(os, "sched_setscheduler") or self.proc.poll() is not None:
            return  # not Linux, or exited (poll reaps it: its pid is never another process's here)
        with contextlib.suppress(OSError):  # another user's process: left as it is
            os.sched_setscheduler(self.proc.pid, os.SCHED_OTHER, os.sched_param(0))

    def _on_drop(self, reason: str = "bridge_queue", warning: str | None = None) -> None:
        """One call dropped: counted under `reason`, warned about once per reason."""
        self.dropped += 1
        self._drop(reason, 1)
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(warning or _FALLING_BEHIND % self._queue_size)

    def _drop(self, reason: str, count: int) -> None:
        if self._count_drop is not None and count:
            self._count_drop(reason, count)

    def _run(self) -> None:
        try:
            self._set_up_child()
        except BaseException as exc:
            if self._setup_error is None:
                self._setup_error = BridgeSetupFailed(f"the bridge process could not start: {exc!r}")
            self._dead = True
            self._kill()
            self._release()
            self._ended.set()
            return
        finally:
            self._setup_done.set()
        try:
            while True:
                try:
                    self._feed()
                    return
                except (OSError, EOFError, TimeoutError, subprocess.TimeoutExpired) as exc:
                    if self._closing.is_set() or not self._restart():
                        if not self._closing.is_set():
                            log.warning(
                                "otel_train: the bridge process is gone (%r); bridge updates are dropped.",
                                exc,
                            )
                        self._dead = True
                        return
        finally:
            self._release()
            self._ended.set()

    def _set_up_child(self) -> None:
        """Start the child and have it build the bridges; BridgeSetupFailed when it refuses. A
        restarted child gets the hyperparameters so far first."""
        self._listener = None
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the bridge process never touches a GPU
        package_root = str(Path(__file__).resolve().parents[2])  # otel_train importable as the parent has it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel_train.bridges.host", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        relay = threading.Thread(target=_relay, args=(self.proc.stderr,), name="otel_train-bridges-stderr")
        relay.daemon = True
        relay.start()
        write_frame(self.proc.stdin.fileno(), encode(("setup", self.specs, self._queue_size)))
        reply = read_frame(self.proc.stdout.fileno(), time.monotonic() + SETUP_TIMEOUT_S)
        if reply[0] == "error":
            _, kind, message = reply
            known = kind in ("BridgeImportError", "BridgeSetupError")
            self._setup_error = BridgeSetupFailed(message if known else f"{kind}: {message}")
            raise self._setup_error
        self._listener = threading.Thread(
            target=_listen, args=(self, self.proc.stdout), name="otel_train-bridges-replies", daemon=True
        )
        self._listener.start()
        hparams = self._hparams
        if hparams:
            write_frame(self.proc.stdin.fileno(), encode(("call", "write_hparams", (hparams,))))

    def _feed(self) -> None:
        """Write the queue into the pipe until the close, then wait for the child's answer."""
        assert self.proc is not None and self.proc.stdin is not None and self._listener is not None
        out_fd = self.proc.stdin.fileno()
        while True:
            frame = self._unsent if self._unsent is not None else self._queue.get()
            self._unsent = None
            try:
                write_frame(out_fd, frame)
            except FrameCut:  # the child may have died of this frame: its successor never gets it
                self._drop("bridge_cut_frame", 1)
                raise
            except OSError:
                self._unsent = frame  # it never reached the child: the next child gets it
                raise
            if frame is self._close_frame:
                break
        self._listener.join(2 * CHILD_GRACE_S + 5.0)  # it ends when the child exits, after answering
        if self._listener.is_alive():
            raise TimeoutError
        if not self._closed_reply.is_set():
            raise EOFError
        self.proc.wait(5.0)  # reap it

    def _restart(self) -> bool:
        """The child died (or its pipe broke): True when a new one, after the back-off, runs the bridges."""
        self._kill()  # a pipe broken under a live child: that child is of no more use
        with contextlib.suppress(subprocess.TimeoutExpired):
            if self.proc is not None:
                self.proc.wait(5.0)
        how = _exit_text(self.proc)
        self._release()
        if self.restarts >= MAX_RESTARTS:
            log.warning(_GONE_FOR_GOOD, how, self.restarts)
            return False
        delay = min(RESTART_AFTER_S * 2**self.restarts, MAX_RESTART_AFTER_S)
        self.restarts += 1
        log.warning(_RESTARTING, self.pid, how, delay, self.restarts, MAX_RESTARTS)
        self._drop("bridge_restart", 1)
        if self._closing.wait(delay):
            return False  # the run ends: nothing left that a new child would write
        try:
            self._set_up_child()
        except BaseException as retry:
            log.warning(
                "otel_train: the bridge process could not be restarted (%s); bridge updates are dropped.",
                retry,
            )
            self._kill()
            return False
        return True

    def _release(self, replies_too: bool = False) -> None:
        """Close the pipes to the child; the reply pipe only where no `_listen` closes it, or with
        `replies_too` (after fork: that thread is not here)."""
        proc = self.proc
        if proc is None:
            return
        listening = self._listener is not None and not replies_too
        # stderr: the relay thread closes it at EOF
        for stream in (proc.stdin, None if listening else proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def _listen(bridges: BridgeProcess, replies: IO[bytes]) -> None:
    """The child's answers, on a thread of their own (the feeder may block in a write meanwhile):
    drop counts, counted as they grow, and the close's answer. It closes the pipe at its end."""
    counted: dict[str, int] = {}  # this child's drops counted so far, by reason
    with contextlib.suppress(OSError, ValueError, EOFError), replies:  # EOF: the child exited
        while True:
            try:
                answer, stats, skipped = read_frame(replies.fileno())
            except BadFrame:
                continue
            bridges.bridge_stats = stats
            grown = {f"bridge_{name}": int(s.get("dropped", 0)) for name, s in stats.items()}
            for reason, total in {**grown, "bridge_bad_frame": int(skipped)}.items():
                bridges._drop(reason, max(0, total - counted.get(reason, 0)))
                counted[reason] = total
            if answer == "closed":
                bridges._closed_reply.set()


def _warn_unfinished(bridges: BridgeProcess, waited_s: float) -> None:
    """The close's answer did not come: what became of the bridge process, in one warning."""
    proc = bridges.proc
    if proc is None or proc.poll() is not None or bridges._dead:
        log.warning(
            "otel_train: the bridge process is gone (pid %s, %s); what it had not written is lost "
            "(the run directory's JSONL has every value).",
            bridges.pid,
            _exit_text(proc),
        )
    elif os.getpid() != 1:  # (PID 1: _finish_as_namespace_init said what is lost)
        stats = bridges.bridge_stats  # empty until the child first answered: then every bridge
        backends = sorted(n for n, s in stats.items() if not s.get("clean")) if stats else bridges.names
        log.warning(
            "otel_train: the bridges (%s) did not finish within %.1f s; the bridge process (pid %s%s) "
            "finishes on its own (at most %.0f s more) and exits. Until then their stores lack the "
            "last values (a job whose processes are killed at exit keeps them so): raise "
            "shutdown_timeout_s to wait for them.",
            ", ".join(backends),
            waited_s,
            bridges.pid,
            _continue_if_stopped(proc),
            CHILD_GRACE_S,
        )


def _exit_text(proc: subprocess.Popen[bytes] | None) -> str:
    code = None if proc is None else proc.poll()
    if code is None:
        return "its pipe broke"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _relay(stream: Any) -> None:
    """Copy the child's stderr (backends' own messages, its warnings) to this process's stderr."""
    with contextlib.suppress(OSError, ValueError), stream:  # closed at EOF, or when it breaks
        for line in iter(stream.readline, b""):
            with contextlib.suppress(Exception):  # our own stderr closed or replaced: the line is lost
                sys.stderr.write(line.decode("utf-8", errors="replace"))
                sys.stderr.flush()


def _finish_as_namespace_init(bridges: BridgeProcess, grace: float) -> None:
    """PID 1 of its PID namespace: the kernel kills the bridge process with it, so wait for the
    bridges' answer and their exit within the child's own bound (docs/design/bridges.md#process)."""
    deadline = time.monotonic() + grace + AFTER_GRACE_S
    if not bridges._closed_reply.is_set() and not bridges._ended.is_set():
        log.warning(
            "otel_train: this process is PID 1 of its PID namespace (a container without an init), "
            "so the bridge process (pid %s%s) ends when it exits: shutdown waits for the bridges to "
            "finish (at most %.0f s more).",
            bridges.pid,
            _continue_if_stopped(bridges.proc),
            grace + AFTER_GRACE_S,
        )
        bridges._wait_for_reply(deadline)
    if bridges._closed_reply.is_set():
        _wait_for_exit(bridges.proc, deadline)
    elif not bridges._dead and bridges.proc is not None and bridges.proc.poll() is None:
        log.warning(
            "otel_train: the bridges did not finish in time; the bridge process (pid %s) ends with "
            "this process (PID 1 of its PID namespace): what they had not written is lost (the run "
            "directory's JSONL has every value).",
            bridges.pid,
        )


def _wait_for_exit(proc: subprocess.Popen[bytes] | None, deadline: float) -> None:
    """Until the bridge process and what it started (W&B's service) have exited, or `deadline`.
    Here (PID 1) the orphaned service becomes this process's child: waiting reaps it too."""
    import psutil

    waiting: dict[int, psutil.Process] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            if proc is not None and proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    waiting.setdefault(child.pid, child)
        alive = [p for p in waiting.values() if _running(p)]
        if not alive and (proc is None or proc.poll() is not None):
            return
        time.sleep(0.05)


def _running(proc: Any) -> bool:
    """A psutil.Process still running (reaped here when it is this process's child)."""
    import psutil

    try:
        proc.wait(0)
    except psutil.TimeoutExpired:
        return True
    except psutil.Error:
        pass
    return False


def _continue_if_stopped(proc: subprocess.Popen[bytes] | None) -> str:
    """A child stopped (SIGSTOP, a debugger gone) cannot finish on its own: continue it. The note
    for a warning that names the child."""
    if proc is None or proc.poll() is not None:
        return ""
    try:
        with open(f"/proc/{proc.pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    if state not in ("T", "t"):
        return ""
    with contextlib.suppress(OSError):
        os.kill(proc.pid, signal.SIGCONT)
    return ", found stopped: continued"
