"""The process's runtime: the one active session (`_current`), the process hooks around it (the
atexit shutdown, the fork guard and the SIGTERM relay), and `Run`, what `ot.init()` returns. The
hot path reads `_current` as a plain module attribute on purpose: docs/design/core.md#runtime.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from otel_train.config import FIELDS, Config, ConfigError
from otel_train.config_loading import load_config
from otel_train.core.assemble import build_session, refuse_together
from otel_train.core.session import Session
from otel_train.distributed import RunInfo
from otel_train.redaction import redact_url

log = logging.getLogger("otel_train")

_current: Session | None = None  # the one global: the active session of this process
_hooks_installed = False
_previous_sigterm: Any = None
_closing: Session | None = None  # the session being (or last) shut down, so a second caller can wait


def init(
    config: Config | None = None, config_file: str | None = None, settings: Mapping[str, Any] | None = None
) -> Session:
    """Start (or return) the process's session."""
    global _current
    if _current is not None:
        _warn_if_different(_current, config, config_file, settings)
        return _current
    try:
        resolved = config or load_config(settings, config_file=config_file)
    except ConfigError as exc:
        refuse_together(str(exc))  # the other ranks of a process group refuse with it, at once
        raise
    session = build_session(resolved)
    _current = session
    _install_hooks()
    return session


def _warn_if_different(
    session: Session, config: Config | None, config_file: str | None, settings: Mapping[str, Any] | None
) -> None:
    """A second init() that asked for other settings: say so once. Invalid ones raise, as they
    would on a first call (a notebook cell run again with a misspelt keyword)."""
    if config is None and not config_file and not settings:
        return
    wanted = config or load_config(settings, config_file=config_file)
    if wanted == session.config or session.reinit_warned:
        return
    session.reinit_warned = True
    differing = sorted(k for k in FIELDS if getattr(wanted, k) != getattr(session.config, k))
    log.warning(
        "otel_train: init() was called again with different settings (%s); the running session keeps "
        "its own. Call ot.shutdown() first to start a new session with them.",
        ", ".join(differing),
    )


def shutdown(failed: bool = False) -> None:
    """End the running session (`failed`: the run ended by an error, see Sink.close)."""
    global _current, _closing
    session = _current
    if session is None:
        closing = _closing
        if closing is not None:  # shutting down on another thread (SIGTERM relay, atexit): wait
            closing.shutdown_done.wait(closing.config.shutdown_timeout_s + 1.0)
        return
    _current = None  # from here on every record call is a no-op
    _closing = session
    session.shutdown(failed)


def current() -> Session | None:
    return _current


def _shutdown_at_exit() -> None:
    """atexit: a script that ends by an uncaught exception, or by `sys.exit(code)` with a code
    other than 0 out of a step, ends its run as failed, with a `run_failed` event naming the error
    (what a reader of the run directory sees of a collective that broke because a peer died). An
    interactive interpreter keeps the last error of any earlier command, so there the run ends as
    it is."""
    interactive = hasattr(sys, "ps1") or "IPython" in sys.modules
    error = None if interactive else getattr(sys, "last_value", None)
    session = _current
    exited = session.exit_error if session is not None else None
    if error is None and session is not None and exited is not None and exited[1] == session.step_index:
        # sys.exit(1) leaves no sys.last_value: the step it left says so (`StepScope.__exit__`)
        error, ended = exited[0], "the script exited by sys.exit in a step:"
    else:
        ended = "the script ended by an uncaught"
    if error is not None:
        report_failure(error, ended)
    shutdown(failed=error is not None)


def report_failure(error: BaseException, ended: str) -> None:
    """The `run_failed` event: `<ended> <error type> at step N: <its first line>`."""
    session = _current
    if session is not None:
        name, lines = type(error).__name__, str(error).strip().splitlines()
        session.events.emit(
            "run_failed",
            f"{ended} {name} at step {session.step_index}: {(lines or [''])[0][:500]}",
            {"error.type": name, "step": session.step_index},
            severity="ERROR",
        )


def _forget_in_child() -> None:
    """After fork (DataLoader workers): the child never exports and every API call is a no-op."""
    global _current, _closing
    if _current is not None and _current.bridges is not None:
        _current.bridges.forget_in_child()
    _current = _closing = None


class _SigtermRelay:
    """Does the SIGTERM shutdown on a thread of its own, woken through a pipe by the handler; with
    the training's own handler, only asks for a flush (docs/design/core.md#runtime)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self.requested = False
        self.done = False
        threading.Thread(target=self._run, name="otel_train-sigterm", daemon=True).start()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid or self.done:  # a forked child, or our shutdown is over
            _deliver_sigterm(signum, frame)
            return
        user_handler = _previous_sigterm
        if callable(user_handler):
            self._wake()
            user_handler(signum, frame)
            return
        if not self.requested:
            self.requested = True
            try:
                os.write(self._write_fd, b"T")
            except OSError:
                self.done = True
                _deliver_sigterm(signum, frame)
        # else: the shutdown is under way; the relay delivers when it is done

    def _wake(self) -> None:
        if not self.requested:
            self.requested = True
            with contextlib.suppress(OSError):  # a full pipe: a wake-up is pending already
                os.write(self._write_fd, b"F")

    def _run(self) -> None:
        while True:
            try:
                os.read(self._read_fd, 1)
            except OSError:
                return
            if not callable(_previous_sigterm):
                break
            self.requested = False
            session = _current
            if session is not None:
                session.flush()  # off the training thread: done at its next step end
        session = _current or _closing
        if session is not None and session is _current:
            step = session.step_index
            session.events.emit(
                "terminated",
                f"SIGTERM at step {step}: the final flush and shutdown run, then the signal is "
                "delivered again; steps the loop runs meanwhile are not recorded",
                {"step": step},
            )
        budget = session.config.shutdown_timeout_s + 1.0 if session is not None else 0.0
        worker = threading.Thread(target=shutdown, name="otel_train-sigterm-shutdown", daemon=True)
        worker.start()
        worker.join(budget)  # shutdown is bounded; this is the backstop
        self.done = True
        os.kill(self.pid, signal.SIGTERM)


_relay: _SigtermRelay | None = None


def _deliver_sigterm(signum: int, frame: FrameType | None) -> None:
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    # Re-deliver with the default action so the exit status still says "terminated by SIGTERM".
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    relay = _relay
    if relay is None:
        _deliver_sigterm(signum, frame)
    else:
        relay.handle(signum, frame)


def _install_hooks() -> None:
    global _hooks_installed, _previous_sigterm, _relay
    if _hooks_installed:
        if _relay is not None and _relay.pid != os.getpid():  # init() again in a forked child
            _relay = _SigtermRelay()
        return
    _hooks_installed = True
    atexit.register(_shutdown_at_exit)
    os.register_at_fork(after_in_child=_forget_in_child)
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None) or callable(previous):
            _previous_sigterm = previous if callable(previous) else None
            _relay = _SigtermRelay()
            signal.signal(signal.SIGTERM, _on_sigterm)


# --- Run: what `ot.init()` returns; the session's internals stay behind
# `otel_train.testing.current_session()` ---
class Run:
    """One running session, as `ot.init()` returns it (a second `init()` returns the same run)."""

    __slots__ = ("_pid", "_session")

    def __init__(self, session: Session) -> None:
        self._session = session
        # A forked child inherits this object but not the session's threads: the parent's session
        # is never the child's to shut down (its watchdog's faulthandler timer would wait forever).
        self._pid = os.getpid()

    @property
    def run_id(self) -> str:
        return self._session.identity.run_id

    @property
    def run_name(self) -> str:
        return self._session.run_name

    @property
    def run_dir(self) -> Path | None:
        """None when `run_dir_enabled=False`."""
        return self._session.run_dir

    @property
    def rank(self) -> int:
        return self._session.identity.rank

    @property
    def world_size(self) -> int:
        return self._session.identity.world_size

    @property
    def prometheus_url(self) -> str | None:
        """The local `/metrics` URL, or None when the pull endpoint is off or its port was taken."""
        return self._session.prometheus_url

    def info(self) -> RunInfo:
        """`ot.run_info()` for this run."""
        session = self._session
        ident, config = session.identity, session.config
        return RunInfo(
            run_id=ident.run_id,
            run_name=session.run_name,
            run_dir=str(session.run_dir) if session.run_dir is not None else None,
            rank=ident.rank,
            local_rank=ident.local_rank,
            world_size=ident.world_size,
            step=session.step_index,
            role=ident.role,
            output_dir=config.output_dir,
            service_name=config.service_name,
            otlp_endpoint=redact_url(config.otlp_endpoint),  # user:password@ -> ***@
            otlp_metrics_endpoint=redact_url(config.otlp_metrics_endpoint),
            otlp_traces_endpoint=redact_url(config.otlp_traces_endpoint),
            otlp_logs_endpoint=redact_url(config.otlp_logs_endpoint),
            timing_log_level=config.timing_log_level,
            open_step=session.running_step,
            bridges=tuple(name for name in ("tensorboard", "wandb", "mlflow") if getattr(config, name)),
            rank_series=session.telemetry.rank_series,
        )

    def profile(
        self,
        wait: int = 0,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        ranks: Sequence[int] | None = None,
    ) -> bool:
        """Profile upcoming steps with torch.profiler: counting from the next step, skip
        `skip_first`, then `repeat` cycles of `wait` idle, `warmup` and `active` recorded steps.
        Chrome traces go to `<run dir>/profiles/rank<k>/`; profiled steps are traced and counted
        (`train.profiler.steps`). Call it any time on the training thread (for example when a
        condition arises; `ot.init()` returns the running run) on the ranks you name (default:
        every rank). Returns True when a window started on this rank. Raises ValueError beyond the
        caps: `active` <= 50, `repeat * active` <= 100, the whole window <= 100,000 steps."""
        from otel_train.profiling import ProfileWindow

        window = ProfileWindow(wait, warmup, active, repeat, skip_first)  # raises on bad arguments
        if current() is not self._session:  # shut down (or replaced): nothing to profile
            return False
        return self._session.start_profile(window, ranks)

    def shutdown(self) -> None:
        """`ot.shutdown()` for this run; safe to call twice, a no-op in a forked child."""
        if os.getpid() != self._pid:
            return
        if current() is self._session:
            shutdown()
        else:  # already replaced or shut down: idempotent, waits for a shutdown in progress
            self._session.shutdown()

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and other._session is self._session

    def __hash__(self) -> int:
        return id(self._session)

    def __repr__(self) -> str:
        return f"Run(run_name={self.run_name!r}, run_id={self.run_id!r}, rank={self.rank})"
