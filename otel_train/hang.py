"""Hang diagnosis: when a rank stops stepping (or on SIGUSR1), write every thread's Python stack
to the run directory and raise a health event that names the file.

A watchdog thread (waking about once a second; it also polls the runtime control file), not
the worker, does this: the worker may itself be stuck in the telemetry
collective when a peer hangs, and the training thread is the one that is stuck. The thread wakes
every `poll_s`, compares the perf_counter time of the last completed step (one attribute store on the
hot path) with `stall_timeout_s`, and reports each stall once (a new stall needs a step in between).

Signals: a Python-level handler runs only when the main thread executes bytecode, which a rank
blocked in a collective never does. So the watchdog listens on `signal.set_wakeup_fd`: the C-level
handler writes the signal number there from whichever thread gets it, and the watchdog wakes and
dumps while the main thread is still blocked (it released the GIL inside the collective). If the
process already has a wakeup fd (an asyncio loop in the main thread), `faulthandler` takes the
signal instead and writes raw stacks to `stacks.rank<k>.signal.txt`.

When PyTorch's Flight Recorder is on (`TORCH_FR_BUFFER_SIZE` or `TORCH_NCCL_TRACE_BUFFER_SIZE` > 0)
its buffer is dumped beside the stacks; with the Flight Recorder on (gloo too), `on_stall` hands the stall to hang
attribution (`hang_attribution`), which names the rank the others wait for. Nothing here touches CUDA or issues a collective; the job's own timeouts are
left as they are.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO

from otel_train.bridges.rundir import RunFiles
from otel_train.collectives import buffer_size
from otel_train.health import EventChannel

log = logging.getLogger("otel_train")


def format_stacks(header: str) -> str:
    """Every thread's Python stack, named, most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [header, ""]
    for ident, frame in sorted(sys._current_frames().items()):
        parts.append(f'--- thread "{names.get(ident, "?")}" (ident {ident}) ---')
        parts.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
        parts.append("")
    return "\n".join(parts)


def dump_flight_recorder(path: Path) -> Path | None:
    """The Flight Recorder buffer (pickled, readable with torch's fr_trace tool), when enabled: the
    NCCL recorder on CUDA builds, the CPU (gloo) one on CPU-only builds."""
    if buffer_size() <= 0 or "torch" not in sys.modules:
        return None
    try:
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace  # type: ignore[attr-defined]
        path.write_bytes(dump())
    except Exception as exc:  # not an NCCL build, no NCCL group yet, ...
        log.debug("otel_train: no Flight Recorder dump: %s", exc)
        return None
    return path


class HangWatchdog:
    """Stall detection and stack dumps for one rank (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path | None,
        rank: int,
        events: EventChannel,
        last_step: Callable[[], tuple[int, float | None]],
        stall_timeout_s: float,
        dump_signal: int | None = signal.SIGUSR1,
        poll_s: float | None = None,
        on_tick: Callable[[], None] | None = None,
        on_stall: Callable[[Path | None], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.dumps: list[Path] = []
        self._events = events
        self._last_step = last_step  # () -> (step index, perf_counter time it ended, or None)
        self._stall_timeout_s = stall_timeout_s
        self._poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, stall_timeout_s / 4))
        self._on_tick = on_tick  # more work for the same wake-up (the runtime control file)
        self._on_stall = on_stall  # called with the stacks file after a stall event (hang attribution)
        self._reported_for: float | None = None  # the step end time whose stall was reported
        self._stop = threading.Event()
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._previous_wakeup_fd: int | None = None
        self._previous_handler: object = None
        self._signal = dump_signal
        self._faulthandler_file: IO[str] | None = None
        self._thread = threading.Thread(target=self._run, name="otel_train-watchdog", daemon=True)

    def start(self) -> None:
        if self._signal is not None:
            self._install_signal(self._signal)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")
        self._thread.join(timeout=1.0)
        self._uninstall_signal()

    # --- the dump --------------------------------------------------------------------------------
    def dump(self, reason: str) -> Path | None:
        """Write this rank's stacks (and the Flight Recorder, if on) and emit an event naming them."""
        step, _ = self._last_step()
        header = f"otel_train stack dump: rank {self.rank}, pid {os.getpid()}, {reason}, last step {step}"
        text = format_stacks(f"{header}\n{time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
        if self.run_dir is None:
            log.warning("%s", text)
            return None
        path = RunFiles(self.run_dir, self.rank).stacks(len(self.dumps))
        try:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)  # whole or absent: a reader polling for the file never sees it half-written
        except OSError as exc:
            log.warning("otel_train: cannot write %s (%s); the stacks follow.\n%s", path, exc, text)
            return None
        self.dumps.append(path)
        files = [path.name]
        recorder = dump_flight_recorder(
            RunFiles(self.run_dir, self.rank).flight_recorder(len(self.dumps) - 1)
        )
        if recorder is not None:
            files.append(recorder.name)
        if reason == "signal":
            self._events.emit(
                "stack_dump",
                f"stacks of rank {self.rank} written to {path} on request",
                {"step": step, "file": str(path), "files": ",".join(files)},
                severity="INFO",
            )
        return path

    # --- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake_r is not None:
                ready, _, _ = select.select([self._wake_r], [], [], self._poll_s)
                if ready and self._drain_signals():
                    self.dump("signal")
            else:
                self._stop.wait(self._poll_s)
            if not self._stop.is_set():
                self._check_stall()
                if self._on_tick is not None:
                    try:
                        self._on_tick()
                    except Exception as exc:  # never let it kill stall detection
                        log.warning("otel_train: watchdog tick failed: %s", exc)

    def _check_stall(self) -> None:
        step, ended = self._last_step()
        if ended is None or ended == self._reported_for:
            return  # no step yet (start-up is not a stall), or this stall was reported
        idle = time.perf_counter() - ended
        if idle < self._stall_timeout_s:
            return
        self._reported_for = ended
        path = self.dump(f"no completed step for {idle:.0f}s")
        where = f"; stacks: {path}" if path is not None else ""
        self._events.emit(
            "stall",
            f"no completed step for {idle:.0f}s after step {step}{where}",
            {"step": step, **({"file": str(path)} if path is not None else {})},
        )
        if self._on_stall is not None:
            try:
                self._on_stall(path)
            except Exception as exc:  # never let it kill stall detection
                log.warning("otel_train: hang attribution failed: %s", exc)

    def _drain_signals(self) -> bool:
        assert self._wake_r is not None
        try:
            data = os.read(self._wake_r, 512)
        except (BlockingIOError, InterruptedError):
            return False
        return self._signal is not None and self._signal in data

    # --- signal plumbing -------------------------------------------------------------------------
    def _install_signal(self, signum: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("otel_train: init() off the main thread: no stack dumps on signal %d.", signum)
            return
        previous_handler = signal.getsignal(signum)
        if previous_handler not in (signal.SIG_DFL, None):
            log.warning(
                "otel_train: signal %s already has a handler; stack dumps stay on stall only "
                "(set dump_signal to another signal, or 0 to silence this).",
                signal.Signals(signum).name,
            )
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous_fd != -1:  # someone (asyncio) owns the wakeup fd: leave it and use faulthandler
            signal.set_wakeup_fd(previous_fd)
            os.close(read_fd)
            os.close(write_fd)
            self._install_faulthandler(signum)
            return
        self._wake_r, self._wake_w = read_fd, write_fd
        self._previous_handler = previous_handler
        signal.signal(signum, _ignore_signal)  # the dump happens on the watchdog thread

    def _install_faulthandler(self, signum: int) -> None:
        if self.run_dir is None:
            return
        self._faulthandler_file = RunFiles(self.run_dir, self.rank).signal_stacks.open("a")
        faulthandler.register(signum, file=self._faulthandler_file, all_threads=True, chain=False)

    def _uninstall_signal(self) -> None:
        if self._signal is None or threading.current_thread() is not threading.main_thread():
            return
        if self._wake_w is not None:
            current = signal.set_wakeup_fd(-1)
            if current != self._wake_w:  # someone replaced ours since: give theirs back
                signal.set_wakeup_fd(current)
            signal.signal(self._signal, signal.SIG_DFL)
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            self._wake_r = self._wake_w = None
        if self._faulthandler_file is not None:
            faulthandler.unregister(self._signal)
            self._faulthandler_file.close()
            self._faulthandler_file = None


def _ignore_signal(signum: int, frame: object) -> None:
    """Runs on the main thread when it next executes bytecode; the watchdog already dumped."""
