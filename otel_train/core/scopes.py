"""step(), timer(), span(), and for framework hooks begin_step()/end_step(), `.start()`/`.stop()`
and phase(). Before `init()` they do nothing (but a wrong argument type raises:
docs/reliability.md#error-policy); on the training thread they only read the clock and append.
Design: docs/design/core.md#session.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from math import isfinite
from time import perf_counter_ns
from types import TracebackType
from typing import Any, TypeVar, overload

# The hot path reads `runtime._current` directly, on purpose: docs/design/core.md#runtime.
from otel_train.core import runtime
from otel_train.core.session import Session, as_int

F = TypeVar("F", bound=Callable[..., Any])


class _NullScope:
    """No-op scope: the shared `_NULL`, or one from `timer()` that keeps its arguments for the
    decorator form (a function decorated before `init()` is timed once a session runs)."""

    __slots__ = ("cuda", "level", "name")
    name: str | None  # None on the shared `_NULL`: its decorator returns the function itself
    level: Any
    cuda: bool

    def __enter__(self) -> _NullScope:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start(self, at_ns: int | None = None) -> _NullScope:
        _earlier(None, at_ns, 0)  # the same argument checks as a running scope's
        return self

    def stop(self, error: type[BaseException] | None = None, at_ns: int | None = None) -> None:
        _error_type(error)
        if at_ns is not None and at_ns.__class__ is not int:
            raise _not_ns(f"stop(at_ns={at_ns!r})", at_ns)

    def __call__(self, fn: F) -> F:
        return _timed(fn, self.name, self.level, self.cuda)


_NULL = _NullScope()
_NULL.name, _NULL.level, _NULL.cuda = None, 1, False
_new_scope = object.__new__


class StepScope:
    """`with ot.step(n, tokens=..., samples=...):` or `@ot.step` / `@ot.step(tokens=...)`."""

    __slots__ = ("_index", "_outer", "_session", "_start", "index", "samples", "tokens")

    def __init__(self, index: int | None, tokens: int | None, samples: int | None) -> None:
        self.index = index
        self.tokens = tokens
        self.samples = samples
        self._session: Session | None = None

    def __enter__(self) -> StepScope:
        session = runtime._current
        self._session = session
        if session is None:  # before init(): a no-op, but a wrong type is a bug there too
            _check_index(self.index)
            return self
        self._index = session.begin_step(self.index)
        self._outer = session.step_start_ns  # the start of a step this one is nested in; 0: none
        self._start = session.step_start_ns = perf_counter_ns()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        session = self._session
        if session is not None:
            try:
                session.end_step(
                    self._index,
                    self._start,
                    perf_counter_ns(),
                    self.tokens,
                    self.samples,
                    exc_type is not None,
                    self._outer,
                )
            except BaseException:  # re-raised: a Ctrl-C (Jupyter's interrupt) before end_step closed
                # the step; close it, or every later step would count as nested in it, never flushed
                if session.step_start_ns == self._start:
                    session.step_start_ns = self._outer
                raise
            if exc_type is not None:  # a failed step's duration: phase "step" of its error type
                seconds = (perf_counter_ns() - self._start) * 1e-9
                session.buffer.add_phase_error("step", exc_type.__name__, seconds)
                if isinstance(exc, SystemExit) and exc.code not in (0, None):
                    session.exit_error = (exc, self._index)
                if session.memory_dumps is not None:
                    session.memory_dumps.on_step_error(exc_type, exc)

    def __call__(self, fn: F) -> F:
        if self.index is not None:
            raise TypeError(
                f"@ot.step({self.index!r}) on {getattr(fn, '__qualname__', fn)!r}: a decorated function is one "
                "step per call, numbered on from the last, so it takes no step number. Write @ot.step "
                "(or @ot.step(tokens=..., samples=...)), or number the steps with `with ot.step(n):`."
            )
        tokens, samples = self.tokens, self.samples
        return _wrap(fn, lambda: StepScope(None, tokens, samples))


# no __init__ frame and one global lookup: a step scope is made on every step
_new_step_scope = functools.partial(_new_scope, StepScope)


@overload
def step(index: F, *, tokens: int | None = None, samples: int | None = None) -> F: ...
@overload
def step(index: int | None = None, *, tokens: int | None = None, samples: int | None = None) -> StepScope: ...
def step(index: Any = None, *, tokens: int | None = None, samples: int | None = None) -> Any:
    """Mark one training step. Steps are numbered from 0; `index=None` continues from the last."""
    if callable(index):
        return StepScope(None, tokens, samples)(index)
    scope = _new_step_scope()
    scope.index, scope.tokens, scope.samples, scope._session = index, tokens, samples, None
    return scope


class TimerScope:
    """`with ot.timer("forward"):`. Its end appends one tuple to `timer_events` and touches nothing
    else: each object touched between torch's calls costs cache misses (README, Performance)."""

    __slots__ = ("_session", "_start", "name")
    _start: int  # perf_counter_ns at the start (set by __enter__)

    def __init__(self, name: str) -> None:
        self.name = name
        self._session: Session | None = None

    def start(self, at_ns: int | None = None) -> TimerScope:
        """Start without a `with` block (`at_ns`: an earlier `perf_counter_ns()` reading, for a
        phase whose start a framework hook saw); `stop()` ends it. Returns the scope."""
        self.__enter__()
        self._start = _earlier(self._session, at_ns, self._start)
        return self

    def stop(self, error: type[BaseException] | None = None, at_ns: int | None = None) -> None:
        """End the phase `start()` began (`error`: the exception type if the phase failed; `at_ns`:
        an earlier `perf_counter_ns()` reading where it ended, for a hook that runs after the end:
        that is also this rank's arrival). A stop without a start, or a second stop, does nothing."""
        error, end = _error_type(error), _stop_ns(at_ns)
        session = getattr(self, "_session", None)  # unset: made by timer() and never started
        if session is None:
            return
        self._session = None
        self._end(session, max(end, self._start), error)

    def __enter__(self) -> TimerScope:
        self._session = runtime._current
        self._start = perf_counter_ns()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        end = perf_counter_ns()
        session = self._session
        if session is None:
            return
        if exc_type is None:
            events = session.timer_events
            if len(events) < session.max_timer_events:
                events.append((self.name, self._start, end, session.step_start_ns))
                return
        session.end_timer(self.name, self._start, end, exc_type)

    def _end(self, session: Session, end_ns: int, error: type[BaseException] | None) -> None:
        session.end_timer(self.name, self._start, end_ns, error)

    def __call__(self, fn: F) -> F:
        """`@ot.timer("forward")`: each call of `fn` in a fresh timer. An enabled scope keeps no
        level (a slot would cost every timer): it decorates at level 1; a no-op one keeps its own."""
        return _timed(fn, self.name, 1, isinstance(self, CudaTimerScope))


# no __init__ frame and one global lookup: a timer is made on every step
_new_timer_scope = functools.partial(_new_scope, TimerScope)


class CudaTimerScope(TimerScope):
    """`ot.timer(name, cuda=True)`: the device time between two CUDA events, resolved on the
    worker (no sync on the training thread); off CUDA, a CPU timer. Both events go on the stream
    current at the start: the end event times that stream's work even if the body switched streams,
    and torch's stream lookup (~4 µs on an H200, a third of an event's cost) is paid once."""

    __slots__ = ("_cuda_start", "_stream")

    def __enter__(self) -> CudaTimerScope:
        super().__enter__()
        self._stream = _cuda_stream() if self._session is not None else None
        self._cuda_start = _cuda_event(self._stream) if self._stream is not None else None
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        session = self._session
        if session is not None and self._cuda_start is not None:
            session.buffer.add_cuda_timer(self.name, self._cuda_start, _cuda_event(self._stream))
            return
        super().__exit__(exc_type, exc, tb)

    def _end(self, session: Session, end_ns: int, error: type[BaseException] | None) -> None:
        if self._cuda_start is not None:  # the device's time, not the hook's clock reading
            session.buffer.add_cuda_timer(self.name, self._cuda_start, _cuda_event(self._stream))
        else:
            super()._end(session, end_ns, error)


def timer(name: str, level: int = 1, cuda: bool = False) -> TimerScope | _NullScope:
    """`with ot.timer("forward"):` — time a phase; `@ot.timer("forward")` times each call of a
    function (sync or async; a generator function raises TypeError), also one decorated before
    `init()`. `cuda=True` times the device work with CUDA events (resolved on the worker, no sync on
    the training thread). Before `init()` or above the configured `timing_log_level` it does nothing."""
    session = runtime._current
    if session is None:
        _check_level("timer", name, level)  # before init() too: a wrong type is the caller's bug
        return _off(name, level, cuda)
    try:
        if level > session.timing_level:
            return _off(name, level, cuda)
    except TypeError:  # level="1", None: the message names the fix, not the comparison
        raise _bad_level("timer", name, level) from None
    if cuda:
        return CudaTimerScope(name)
    scope = _new_timer_scope()
    scope.name = name
    return scope


def _off(name: str, level: Any, cuda: bool) -> _NullScope:
    """A no-op scope that keeps the timer's arguments for the decorator form (the level may be
    raised later)."""
    scope = _new_scope(_NullScope)
    scope.name, scope.level, scope.cuda = name, level, cuda
    return scope


def _check_level(call: str, name: Any, level: Any) -> None:
    """Before `init()`: the TypeError a running session would raise for the level."""
    try:
        level > 1  # noqa: B015 (the comparison is the check)
    except TypeError:
        raise _bad_level(call, name, level) from None


def _check_index(index: Any) -> None:
    """Before `init()`: the step number's type check a running session makes (`as_int`)."""
    if index is not None and index.__class__ is not int:
        as_int(index, "ot.step(index)")


def _bad_level(call: str, name: Any, level: Any) -> TypeError:
    return TypeError(
        f"ot.{call}({name!r}, level={level!r}): the level must be an int (1 is the default; a timer "
        "above the timing_log_level setting does nothing)"
    )


def _timed(fn: F, name: str | None, level: int, cuda: bool) -> F:
    """`fn`, each call timed by a fresh `timer(name, level, cuda)`; without a name (`_NULL`) `fn`."""
    if callable(name):  # a bare `@ot.timer`: the decorated function was taken as the name
        raise TypeError(
            f"@ot.timer on {getattr(name, '__qualname__', name)!r} needs a name: write "
            "@ot.timer('forward') (the phase it times), as `with ot.timer('forward'):` does."
        )
    if name is None:
        return fn
    return _wrap(fn, lambda: timer(name, level, cuda))


class MarkScope:
    """`with ot.span("eval"):` — a short span that is always traced, also timed as a phase."""

    __slots__ = ("_session", "_start", "attributes", "name")
    _start: int  # perf_counter_ns at the start (set by __enter__)

    def __init__(self, name: str, attributes: Mapping[str, Any] | None) -> None:
        self.name = name
        self.attributes = attributes
        self._session: Session | None = None

    def start(self, at_ns: int | None = None) -> MarkScope:
        """Start without a `with` block (`at_ns`: an earlier `perf_counter_ns()` reading)."""
        self.__enter__()
        self._start = _earlier(self._session, at_ns, self._start)
        return self

    def stop(self, error: type[BaseException] | None = None, at_ns: int | None = None) -> None:
        """End the span `start()` began (`at_ns`: an earlier `perf_counter_ns()` reading where it
        ended, for a hook that runs after the end); a second stop does nothing."""
        error, end = _error_type(error), _stop_ns(at_ns)
        if self._session is not None:
            self._session.end_mark(self.name, self._start, max(end, self._start), error, self.attributes)
            self._session = None

    def __enter__(self) -> MarkScope:
        session = self._session = runtime._current
        self._start = perf_counter_ns()
        if session is not None:
            session.begin_mark(self.name, self._start)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            self._session.end_mark(self.name, self._start, perf_counter_ns(), exc_type, self.attributes)
            self._session = None


def span(name: str, attributes: Mapping[str, Any] | None = None) -> MarkScope | _NullScope:
    """`with ot.span("eval"):` (see MarkScope). A name that is not a str is dropped, counted
    (`invalid_name`) and warned about once; a `str` Enum's value is used."""
    if name.__class__ is not str:
        if not isinstance(name, str):
            session = runtime._current
            if session is not None:
                session.buffer.drop("invalid_name")
                session.buffer.warn_once(
                    "<span name>", f"ot.span({name!r}): the name must be a str; dropped."
                )
            return _NULL
        name = str.__str__(name)
    return MarkScope(name, attributes)


def begin_step(index: Any = None, *, start_ns: int | None = None) -> int | None:
    """Begin a step without a `with` block (framework hooks): `ot.end_step()` ends it. `index=None`
    continues from the last step; `start_ns` (a `perf_counter_ns()` reading) backdates the start,
    e.g. to the end of the previous step so that data loading belongs to this step. Timers that
    end inside the step record when this rank reached them (straggler arrivals), as in `ot.step`.
    Returns the step number, or None before `init()`. A step still open is ended first."""
    if start_ns is not None and start_ns.__class__ is not int:
        raise _not_ns(f"begin_step(start_ns={start_ns!r})", start_ns)
    session = runtime._current
    if session is None:
        _check_index(index)  # before init() too: a wrong type is the caller's bug
        return None
    earlier: StepScope | None = session.open_step
    if earlier is not None:
        session.buffer.warn_once(
            "<begin_step>",
            f"ot.begin_step() while step {earlier._index} is open: ending it first "
            "(call ot.end_step() once per step).",
        )
        end_step()
    scope = StepScope(index, None, None).__enter__()
    if start_ns is not None and 0 < start_ns <= scope._start:
        scope._start = session.step_start_ns = start_ns
    session.open_step = scope
    return scope._index


def end_step(*, tokens: int | None = None, samples: int | None = None, failed: bool = False) -> None:
    """End the step `ot.begin_step()` began: `tokens`/`samples` processed in it on this rank;
    `failed=True` traces it as failed and leaves it out of the step counts and durations (its
    duration goes to phase `step` with error.type `StepFailed`, as a raising `ot.step`'s with its error's)."""
    session = runtime._current
    if session is None:
        return
    scope: StepScope | None = session.open_step
    if scope is None:
        session.buffer.drop("no_open_step")
        session.buffer.warn_once(
            "<end_step>", "ot.end_step() without ot.begin_step(): ignored (counted as no_open_step)."
        )
        return
    session.open_step = None
    scope.tokens, scope.samples = tokens, samples
    scope.__exit__(StepFailed if failed else None, None, None)


class StepFailed(Exception):
    """`ot.end_step(failed=True)`: the step ended without an exception object (its error type)."""


def phase(name: str, seconds: float, level: int = 1) -> None:
    """A phase known only by its duration (a framework reports it): counted and exported like a
    timer's, with no arrival (its end on this rank's clock is unknown). A negative, non-finite or
    non-numeric duration is dropped and counted; a level that is not an int raises TypeError."""
    session = runtime._current
    if session is None:
        _check_level("phase", name, level)  # before init() too: a wrong type is the caller's bug
        return
    try:
        if level > session.timing_level:
            return
    except TypeError:
        raise _bad_level("phase", name, level) from None
    try:
        value = float(seconds)
    except (TypeError, ValueError, OverflowError):  # None, "x", 10**400: a value, dropped below
        value = float("nan")
    if not (isfinite(value) and value >= 0.0) or not isinstance(name, str):
        session.buffer.drop("invalid_value")
        session.buffer.warn_once(
            f"<phase {name!r}>", f"ot.phase({name!r}, {seconds!r}) needs a duration >= 0 in seconds; dropped."
        )
        return
    session.buffer.add_phase(name, value)


def _earlier(session: Session | None, at_ns: Any, now_ns: int) -> int:
    """`start(at_ns=)`; a later or non-positive reading is a bad value: timed from now, counted."""
    if at_ns is None:
        return now_ns
    if at_ns.__class__ is not int:
        raise _not_ns(f"start(at_ns={at_ns!r})", at_ns)
    if 0 < at_ns <= now_ns:
        return at_ns  # type: ignore[no-any-return]
    if session is not None:
        session.buffer.drop("invalid_value")
        session.buffer.warn_once(
            "<at_ns>",
            f"start(at_ns={at_ns}) is not an earlier time.perf_counter_ns() reading; timed from now.",
        )
    return now_ns


def _stop_ns(at_ns: Any) -> int:
    """`stop(at_ns=)`: where the scope ended, never later than now (its start bounds it below)."""
    now = perf_counter_ns()
    if at_ns is None:
        return now
    if at_ns.__class__ is not int:
        raise _not_ns(f"stop(at_ns={at_ns!r})", at_ns)
    return min(at_ns, now)  # type: ignore[no-any-return]


def _not_ns(call: str, value: Any) -> TypeError:
    return TypeError(
        f"{call} needs an int from time.perf_counter_ns(), got {type(value).__name__} "
        "(time.perf_counter() is seconds as a float)"
    )


def _error_type(error: Any) -> type[BaseException] | None:
    if error is None or (isinstance(error, type) and issubclass(error, BaseException)):
        return error  # type: ignore[no-any-return]
    raise TypeError(
        f"stop(error={error!r}) needs an exception class or None: pass type(exc), not the exception"
    )


def _wrap(fn: F, scope: Callable[[], Any]) -> F:
    """Decorate `fn` (sync or async) so each call runs inside a fresh `scope()`."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"ot.timer/ot.step cannot decorate the generator function {fn.__qualname__}: a call only "
            "makes the generator. Time its use instead: `with ot.timer(name):` around the loop body "
            "(or around `next(it)` for the data wait)."
        )
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            with scope():
                return await fn(*args, **kwargs)

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with scope():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# torch.cuda once a CUDA timer asked for it, False without CUDA: torch.cuda.is_available() and the
# import statement cost the training thread a µs or two per event.
_torch_cuda: Any = None


def _cuda_stream() -> Any:
    """torch's current CUDA stream (of the current device); None without CUDA."""
    global _torch_cuda
    if _torch_cuda is None:
        try:
            import torch
        except ImportError:  # cuda=True in a process without torch: a host timer
            _torch_cuda = False
        else:
            _torch_cuda = torch.cuda if torch.cuda.is_available() else False
    return _torch_cuda.current_stream() if _torch_cuda else None


def _cuda_event(stream: Any) -> Any:
    """A timing event recorded now on `stream` (from `_cuda_stream()`). Blocking: the worker that
    waits for it sleeps rather than spinning a CPU core until the device gets there."""
    event = _torch_cuda.Event(enable_timing=True, blocking=True)
    event.record(stream)
    return event
