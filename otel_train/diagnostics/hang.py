"""Hang diagnosis: when a rank stops stepping (or on SIGUSR1), a watchdog thread writes every
thread's Python stack to the run directory and raises a health event naming the file.
Design: docs/design/diagnostics.md#hang.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO

from otel_train.diagnostics.collectives import buffer_size
from otel_train.health import EventChannel
from otel_train.run_directory import RunFiles, replace_whole

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
    """The Flight Recorder buffer (pickled, readable with torch's fr_trace tool), when it records: the
    NCCL recorder on CUDA builds, the CPU (gloo) one on CPU-only builds."""
    if buffer_size() <= 0 or "torch" not in sys.modules:
        return None
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError as exc:
        log.debug("otel_train: no Flight Recorder dump: %s", exc)
        return None
    # NCCL's recorder first; a gloo-only job on a CUDA build has an empty one: then the CPU recorder.
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        dump = getattr(c10d, name, None)
        try:
            # without C++ stack traces: symbolizing them imports torch._dynamo and _inductor at the
            # first dump (seconds on a loaded host, a frozen-looking watchdog); ours are in stacks.*
            data = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False) if dump else None
            if data and pickle.loads(data).get("entries"):
                path.write_bytes(data)
                return path
        except Exception as exc:  # torch's private dump API: no NCCL group yet, an unreadable dump, ...
            log.debug("otel_train: no Flight Recorder dump from %s: %s", name, exc)
    return None


# faulthandler's timer (the watchdog's backstop) is cancelled before every fork, under a lock the
# watchdog arms it under: docs/design/diagnostics.md#hang.
_backstop_lock = threading.Lock()
_backstop_armed = False


def _cancel_backstop_locked() -> None:
    global _backstop_armed
    if _backstop_armed:
        faulthandler.cancel_dump_traceback_later()
        _backstop_armed = False


def _cancel_backstop_before_fork() -> None:
    _backstop_lock.acquire()  # released after the fork, in parent and child
    _cancel_backstop_locked()


os.register_at_fork(
    before=_cancel_backstop_before_fork,
    after_in_parent=_backstop_lock.release,
    after_in_child=_backstop_lock.release,
)


def _arm_backstop_timer(timeout_s: float, file: IO[str]) -> None:
    global _backstop_armed
    with _backstop_lock:
        faulthandler.dump_traceback_later(timeout_s, repeat=False, file=file, exit=False)
        _backstop_armed = True


def _cancel_backstop_timer() -> None:
    with _backstop_lock:
        _cancel_backstop_locked()


class RawStacks:
    """faulthandler's stack dumps, written from C where no Python thread can run: its file (bounded
    to RAW_STACKS_MAX_BYTES), its timer (the watchdog's backstop, re-armed at each tick: a tick
    missed for longer is a stall of its own) and its registration on the dump signal."""

    def __init__(self, backstop_s: float) -> None:
        self.file: IO[str] | None = None
        self._backstop_s = backstop_s
        self._last_tick: float | None = None
        self._signal: int | None = None  # the dump signal faulthandler is registered for

    def open(self, path: Path) -> None:
        try:
            self.file = path.open("a", encoding="utf-8")
        except OSError as exc:
            log.warning("otel_train: no raw (faulthandler) stack dumps: %s", exc)

    def tick(self) -> float | None:
        """Re-arm the timer; the seconds since the last tick when they outran it (the watchdog
        thread could not run, and the timer could have fired), else None."""
        if self.file is None:
            return None
        now, last = time.monotonic(), self._last_tick
        self._last_tick = now
        _arm_backstop_timer(self._backstop_s, self.file)
        return now - last if last is not None and now - last > self._backstop_s else None

    def disarm(self) -> None:
        """No timer, and no gap judged from the last tick (the loop idles on purpose, or has no step)."""
        if self._last_tick is not None:
            _cancel_backstop_timer()
        self._last_tick = None

    def bound(self) -> None:
        """Empty the file beyond RAW_STACKS_MAX_BYTES (design page, #hang)."""
        if self.file is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self.file.fileno()).st_size > RAW_STACKS_MAX_BYTES:
                os.ftruncate(self.file.fileno(), 0)
                log.warning(
                    "otel_train: %s grew past %d bytes and was emptied.", self.file.name, RAW_STACKS_MAX_BYTES
                )

    def register(self, signum: int, chain: bool) -> None:
        """Raw stacks from C on the dump signal, then (chain) the handler the signal had."""
        if self.file is not None and self._signal is None:
            faulthandler.register(signum, file=self.file, all_threads=True, chain=chain)
            self._signal = signum

    def unregister(self) -> None:
        if self._signal is not None:
            faulthandler.unregister(self._signal)  # gives the signal back to the wakeup-fd handler
            self._signal = None

    def close(self) -> None:
        self.disarm()
        self.unregister()
        if self.file is not None:
            self.file.close()
            with contextlib.suppress(OSError):
                if Path(self.file.name).stat().st_size == 0:
                    Path(self.file.name).unlink()  # no raw dump was written: leave no empty file
            self.file = None


SIGNAL_DUMP_INTERVAL_S = 5.0  # at most one stack dump per this many seconds on the dump signal
RAW_STACKS_MAX_BYTES = 8 * 1024 * 1024  # faulthandler's file: emptied beyond this
MAX_STALL_DUMPS = 10  # stack dumps on stall per session (a slow loop stalls at every step)
STALLED_POLL_S = 0.01  # how closely a stalled step's end is watched for (goodput's stall ends there)


class HangWatchdog:
    """Stall detection and stack dumps for one rank (docs/design/diagnostics.md#hang)."""

    def __init__(
        self,
        run_dir: Path | None,
        rank: int,
        events: EventChannel,
        last_step: Callable[[], tuple[int, float | None]],
        stall_timeout_s: float,
        dump_signal: int | None = signal.SIGUSR1,
        on_tick: Callable[[], None] | None = None,
        on_stall: Callable[[Path | None], None] | None = None,
        role: str = "",
        saving: Callable[[], bool] = lambda: False,
        checkpoint_timeout_s: float = 1800.0,
        first_step_timeout_s: float = 1800.0,
        step_start: Callable[[], int] = lambda: 0,
        on_step_stall: Callable[[int, float, int | None], None] | None = None,
        evaluating_s: Callable[[], float] = lambda: 0.0,
        in_eval: Callable[[], bool] = lambda: False,
        eval_timeout_s: float = 7200.0,
    ) -> None:
        self.rank = rank
        self._files = RunFiles(run_dir, rank, role) if run_dir is not None else None
        self.dumps: list[Path] = []
        self._events = events
        self._last_step = last_step  # () -> (step index, perf_counter time it ended, or None)
        self._stall_timeout_s = stall_timeout_s
        self._saving = saving  # () -> whether a checkpoint save runs (its own timeout)
        self._checkpoint_timeout_s = checkpoint_timeout_s
        self._first_step_timeout_s = first_step_timeout_s
        self._evaluating_s = evaluating_s  # () -> seconds of eval batches past eval_timeout_s, else 0
        self._in_eval = in_eval  # () -> whether an ot.span("eval") runs (eval_timeout_s applies)
        self._eval_timeout_s = eval_timeout_s
        self._poll_s = min(1.0, max(0.05, stall_timeout_s / 4))
        # faulthandler's timer fires when this thread has not re-armed it for this long.
        self._raw = RawStacks(stall_timeout_s + max(2.0, 4 * self._poll_s))
        self._on_tick = on_tick  # more work for the same wake-up (is the worker stuck?)
        self._on_stall = on_stall  # called with the stacks file after a stall event (hang attribution)
        self._step_start = step_start  # () -> perf_counter_ns of the running step's start, 0 outside one
        self._on_step_stall = on_step_stall  # goodput's note_step_stall
        # A stall declared inside a step, until the loop progresses: (last step, the progress time it
        # was measured from, where the step's stalled part began), perf_counter seconds.
        self._stalled_in_step: tuple[int, float, float] | None = None
        self._ticked: int | None = None  # the last step at the previous tick: where a gap began
        self._stall_dumps = 0
        self._reported_for: float | None = None  # the step end time whose stall was reported
        self._stop = threading.Event()
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._previous_handler: object = None
        self._signal = dump_signal
        self._requests = 0  # dump-signal requests not yet answered by a dump
        self._last_signal_dump = -math.inf
        self._thread = threading.Thread(target=self._run, name="otel_train-watchdog", daemon=True)

    def start(self) -> None:
        if self._files is not None:
            self._raw.open(self._files.raw_stacks)
        if self._signal is not None:
            self._install_signal(self._signal)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")
        self._thread.join(timeout=1.0)
        self._settle_step_stall()  # a stalled step that ended just before the shutdown
        self._uninstall_signal()
        self._raw.close()

    # --- the dump --------------------------------------------------------------------------------
    def dump(self, reason: str, requests: int = 1) -> Path | None:
        """Write this rank's stacks (and the Flight Recorder, if on) and emit an event naming them."""
        step, _ = self._last_step()
        header = f"otel_train stack dump: rank {self.rank}, pid {os.getpid()}, {reason}, last step {step}"
        text = format_stacks(f"{header}\n{time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
        if self._files is None:
            log.warning("%s", text)
            return None
        path = self._files.stacks(len(self.dumps))
        try:
            # whole or absent: a reader polling for the file never sees it half-written
            replace_whole(path, text)
        except OSError as exc:
            log.warning("otel_train: cannot write %s (%s); the stacks follow.\n%s", path, exc, text)
            return None
        self.dumps.append(path)
        files = [path.name]
        recorder = dump_flight_recorder(self._files.flight_recorder(len(self.dumps) - 1))
        if recorder is not None:
            files.append(recorder.name)
        if reason == "signal":
            coalesced = f" ({requests} requests since the last dump)" if requests > 1 else ""
            self._events.emit(
                "stack_dump",
                f"stacks of rank {self.rank} written to {path} on request{coalesced}",
                {"step": step, "file": str(path), "files": ",".join(files), "requests": requests},
                severity="INFO",
            )
        return path

    # --- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wait()
            if self._stop.is_set():
                return
            self._answer_signals()
            settled = self._settle_step_stall()
            self._check_stall()
            self._arm_backstop(booked=settled or self._stalled_in_step is not None)
            if self._on_tick is not None:
                self._on_tick()

    def _wait(self) -> None:
        """Until the next tick, a dump signal or (during a step's stall, every STALLED_POLL_S) progress."""
        stalled = self._stalled_in_step
        deadline = time.monotonic() + self._poll_s
        while True:
            timeout = self._poll_s if stalled is None else STALLED_POLL_S
            if self._wake_r is not None:
                ready, _, _ = select.select([self._wake_r], [], [], timeout)
                if ready:
                    self._requests += self._drain_signals()
                    return
            elif self._stop.wait(timeout):
                return
            if stalled is None or self._stop.is_set() or time.monotonic() >= deadline:
                return
            progressed = self._last_step()[1]
            if progressed is not None and progressed != stalled[1]:
                return

    def _answer_signals(self) -> None:
        """One dump for the requests so far, at most one per SIGNAL_DUMP_INTERVAL_S."""
        now = time.monotonic()
        if now - self._last_signal_dump < SIGNAL_DUMP_INTERVAL_S:
            return
        if self._requests:
            requests, self._requests = self._requests, 0
            self._last_signal_dump = now
            self.dump("signal", requests)
        self._raw.bound()

    def _arm_backstop(self, booked: bool) -> None:
        """(Re-)arm faulthandler's timer once steps have begun; report when it could have fired.
        While the loop idles on purpose nothing is judged: no timer, and no gap since the last tick.
        `booked`: a stall this tick settled or declared holds the gap's time already."""
        step, progressed = self._last_step()
        if progressed is None:
            self._raw.disarm()
            self._ticked = None
            return
        missed = self._raw.tick()
        ticked, self._ticked = self._ticked, step
        if missed is None or ticked is None:
            return
        was_step = ticked  # where the loop was when the gap began: it has gone on since
        if self._raw.file is not None:
            self._events.emit(
                "stall",
                f"the watchdog thread could not run for {missed:.0f}s after step {was_step}: the process "
                "was stopped or frozen (SIGSTOP, a VM or container pause) or a C call held the GIL; "
                f"faulthandler's stacks: {self._raw.file.name}",
                {"step": was_step, "file": self._raw.file.name},
            )
        # A freeze inside a step that ended before this thread ran again is seen by nobody else
        # (goodput books one between steps itself; a save's or an evaluation's time is theirs).
        if not booked and not self._saving() and not self._in_eval() and self._on_step_stall is not None:
            # at least the freeze: the gap less the wait it began in (at most one poll)
            self._on_step_stall(was_step, max(0.0, missed - self._poll_s), step + 1)

    def stalled_s(self) -> float:
        """The `train.stall.duration` gauge: how long this rank has had no step or eval batch, once
        past the stall timeout (the checkpoint timeout during a save, the first step's timeout
        while it runs), else 0."""
        step, ended = self._last_step()
        if ended is None:
            return self._first_step_s(step)
        idle = time.perf_counter() - ended
        return idle if idle >= self._timeout_s(self._saving()) else 0.0

    def _timeout_s(self, saving: bool) -> float:
        if saving:
            return self._checkpoint_timeout_s
        return self._eval_timeout_s if self._in_eval() else self._stall_timeout_s

    def _first_step_s(self, step: int) -> float:
        """How long the first step has run, once past `first_step_timeout_s` (compilation, warm-up
        and the collectives' set-up are in it), else 0: a first batch or all-reduce that never comes."""
        started = self._step_start() * 1e-9
        if step >= 0 or not started:
            return 0.0  # idle on purpose after steps, or no step begun: start-up is not a stall
        running = time.perf_counter() - started
        return running if running >= self._first_step_timeout_s else 0.0

    def _check_stall(self) -> None:
        step, ended = self._last_step()
        if ended is None:
            running = self._first_step_s(step)
            started = self._step_start() * 1e-9
            if running and started != self._reported_for:
                self._reported_for = started
                self._report(step, f"the first step has run for {running:.0f}s (past first_step_timeout_s)")
            return
        if ended == self._reported_for:
            return  # this stall was reported
        idle = time.perf_counter() - ended
        saving = self._saving()
        if idle < self._timeout_s(saving):
            return
        self._reported_for = ended
        step_start_ns = self._step_start()
        if step_start_ns and not saving:  # a hung save is checkpoint time, booked by its span
            self._stalled_in_step = (step, ended, max(ended, step_start_ns * 1e-9))
        evaluating = self._evaluating_s()
        if evaluating:
            what = f"eval batches but no step for {evaluating:.0f}s (past eval_timeout_s): an evaluation that never ends?"
        else:
            inside = " (in a checkpoint save)" if saving else " (in an eval span)" if self._in_eval() else ""
            what = f"no step or eval batch for {idle:.0f}s{inside}"
        self._report(step, f"{what} after step {step}")

    def _report(self, step: int, what: str) -> None:
        """A stall: this rank's stacks (up to MAX_STALL_DUMPS), its event, the hang attribution."""
        path = self.dump(what) if self._stall_dumps < MAX_STALL_DUMPS else None
        self._stall_dumps += 1
        if self._stall_dumps == MAX_STALL_DUMPS:
            log.warning(
                "otel_train: stall stack dump %d of %d for this run; later stalls are reported without "
                "stacks (the dump signal still writes them). Raise stall_timeout_s if steps are this slow.",
                self._stall_dumps, MAX_STALL_DUMPS,
            )  # fmt: skip
        where = f"; stacks: {path}" if path is not None else ""
        self._events.emit(
            "stall",
            f"{what}{where}",
            {"step": step, **({"file": str(path)} if path is not None else {})},
        )
        if self._on_stall is not None:
            try:
                self._on_stall(path)
            except Exception as exc:  # it parses torch's Flight Recorder dump, whose format is torch's
                log.warning("otel_train: hang attribution failed: %s", exc)

    def _settle_step_stall(self) -> bool:
        """End a stall declared inside a step once the loop progresses (its time: goodput's badput);
        whether it did."""
        stalled = self._stalled_in_step
        if stalled is None:
            return False
        after_step, since, stalled_from = stalled
        _, progressed = self._last_step()
        if progressed is None or progressed == since:
            return False
        self._stalled_in_step = None
        if self._on_step_stall is not None:
            self._on_step_stall(after_step, max(0.0, progressed - stalled_from), None)
        return True

    def _drain_signals(self) -> int:
        """How many dump signals arrived (one byte each in the wakeup fd)."""
        assert self._wake_r is not None
        try:
            data = os.read(self._wake_r, 4096)
        except (BlockingIOError, InterruptedError):
            return 0
        return data.count(self._signal) if self._signal is not None else 0

    # --- signal plumbing -------------------------------------------------------------------------
    def _install_signal(self, signum: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("otel_train: init() off the main thread: no stack dumps on signal %d.", signum)
            return
        previous_handler = signal.getsignal(signum)
        ours = previous_handler is _ignore_signal  # left by an earlier session of this process
        if previous_handler not in (signal.SIG_DFL, None) and not ours:
            other = "SIGUSR1" if signum == signal.SIGUSR2 else "SIGUSR2"
            log.warning(
                "otel_train: signal %s already has a handler; stack dumps stay on stall only "
                "(set stack_dump_signal to another signal, e.g. %s, or to off to silence this).",
                signal.Signals(signum).name, other,
            )  # fmt: skip
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous_fd != -1:  # someone (asyncio) owns the wakeup fd: leave it and use faulthandler
            signal.set_wakeup_fd(previous_fd)
            os.close(read_fd)
            os.close(write_fd)
            self._raw.register(signum, chain=False)
            return
        self._wake_r, self._wake_w = read_fd, write_fd
        self._previous_handler = signal.SIG_DFL if ours else previous_handler
        signal.signal(signum, _ignore_signal)  # the dump happens on the watchdog thread
        self._raw.register(signum, chain=True)  # faulthandler first (from C), then the handler above

    def _uninstall_signal(self) -> None:
        self._raw.unregister()  # from any thread: its file is closed next
        if self._signal is None or threading.current_thread() is not threading.main_thread():
            return  # (a shutdown on the SIGTERM thread) the handler stays ours: it ignores the signal
        if self._wake_w is not None:
            current = signal.set_wakeup_fd(-1)
            if current != self._wake_w:  # someone replaced ours since: give theirs back
                signal.set_wakeup_fd(current)
            # The default action terminates: a `kill -USR1` after shutdown must not kill the run, so
            # our no-op handler stays. Not SIG_IGN: an ignored signal is inherited across exec by
            # every process started later, where a new session could not take the signal.
            if self._previous_handler not in (signal.SIG_DFL, None):
                signal.signal(self._signal, self._previous_handler)  # type: ignore[arg-type]
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            self._wake_r = self._wake_w = None


def _ignore_signal(signum: int, frame: object) -> None:
    """Runs on the main thread when it next executes bytecode; the watchdog already dumped."""
