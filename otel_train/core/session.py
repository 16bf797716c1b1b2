"""Session: the running telemetry of one process, in the order of its life (its parts, its steps,
the hand-off of each interval to the worker, the close). Design: docs/design/core.md#session.
"""

from __future__ import annotations

import logging
import math
import operator
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from threading import get_ident
from typing import TYPE_CHECKING, Any

from otel_train import semconv
from otel_train.bridges.console import ConsoleSink
from otel_train.config import Config
from otel_train.core.buffer import (
    MAX_SPAN_RECORDS,
    MAX_STEP,
    Buffer,
    FlushBatch,
    ScalarsMessage,
    SpanRecord,
    mark_record,
    step_record,
)
from otel_train.core.cadence import steps_that_fit
from otel_train.distributed import Identity
from otel_train.goodput import StepClock, span_cause
from otel_train.hardware import autocast_dtype
from otel_train.profiling import advance_window, start_window

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from opentelemetry.metrics import Meter
    from opentelemetry.sdk.resources import Resource

    from otel_train.bridges.process import BridgeProcess
    from otel_train.control import ControlFile
    from otel_train.core.buffer import Message
    from otel_train.core.cadence import Cadence
    from otel_train.core.instruments import Instruments, StepReader
    from otel_train.core.worker import Worker
    from otel_train.crossrank import CrossRankReducer
    from otel_train.diagnostics import HangWatchdog, MemoryDumps
    from otel_train.exporters import Telemetry
    from otel_train.goodput import GoodputListener
    from otel_train.hardware import HardwareMonitor
    from otel_train.health import HealthEvents
    from otel_train.numerics import ModelWatch
    from otel_train.profiling import ProfiledStepsCounter, ProfileWindow, StepProfiler

log = logging.getLogger("otel_train")

_NEVER_NS = 2**63  # a perf_counter_ns no step ends at
_PLAIN_COUNTS = frozenset({int, type(None)})  # a step's tokens/samples taken as given (one lookup)


@dataclass(kw_only=True, eq=False, repr=False)
class Session:
    """Steps, timers, flushes and the shutdown of one process's telemetry (docs/design/core.md#session)."""

    # --- open: the parts `assemble.build_session` builds and wires ---------------------------------
    config: Config
    identity: Identity
    run_name: str
    run_dir: Path | None
    resource: Resource
    step_reader: StepReader
    telemetry: Telemetry
    meter: Meter
    instruments: Instruments
    otel_logger: Any | None
    events: HealthEvents
    console: ConsoleSink | None
    bridges: BridgeProcess | None
    worker: Worker  # the one owner of the sinks and flush listeners
    hardware: HardwareMonitor | None
    reducer: CrossRankReducer
    cadence: Cadence
    profiled_steps: ProfiledStepsCounter
    watches: list[ModelWatch] = field(default_factory=list)  # ot.watch(model) handles
    # gcd of the watches' `every` (never 0: a step may read it while another thread changes them):
    # only a step it divides can be watched; the others cost a modulo, not calls
    watch_period: int = 1
    memory_dumps: MemoryDumps | None = None  # CUDA allocator dumps on an OOM inside ot.step
    exit_error: tuple[SystemExit, int] | None = None  # sys.exit(code) out of step N: atexit says failed
    # attached by assemble.build_session once the session exists (they call back into it)
    goodput: GoodputListener = field(init=False)
    watchdog: HangWatchdog = field(init=False)
    control: ControlFile | None = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self.reinit_warned = False  # a second init() with other settings was warned about
        self.clock = StepClock(config.stall_timeout_s)  # goodput's books, kept by the hot path
        self.profiler: StepProfiler | None = None  # an ot.profile window, advanced at step ends
        self.buffer = Buffer(config.max_metric_names, config.max_values_per_interval)
        # The interval's event lists, read here by the hot path (one attribute, not two); flush()
        # points them at the fresh lists.
        self.timer_events = self.buffer.timer_events
        self.max_timer_events = self.buffer.max_timer_events
        self.step_events = self.buffer.step_events
        self.max_step_events = config.max_values_per_interval
        self.interval_steps = 0  # steps that ended (not failed) since the last flush
        # Copies of what the hot path reads from other objects, so that a step touches the session only:
        self._due_step, self._due_threshold = self.cadence.due_step, self.cadence.threshold
        self._tracing = self.worker.span_writer is not None
        self._trace_first, self._trace_every = config.trace_first, config.trace_every
        self._stall_gap_ns = self.clock.stall_gap_ns
        self.timing_level = config.timer_level
        self.step_index = -1  # last completed step
        self.step_end_ns: int | None = None  # perf_counter_ns when it ended (the stall watchdog reads it)
        # (last step, running step's start) while the loop idles on purpose (mark_idle): no stall
        self._idle_mark: tuple[int, int] | None = None
        self.progress_ns = 0  # perf_counter_ns of the latest eval batch (adapters.heartbeat)
        self._eval_timeout_ns = int(config.eval_timeout_s * 1e9)
        self.open_marks: dict[str, int] = {}  # "eval" / "checkpoint" -> an open span's start
        self.sampled, self._step_index_running = False, 0  # is the running step traced? its index
        self.step_start_ns = 0  # perf_counter_ns at the running step's start; 0 outside a step
        self.open_step: Any = None  # the scopes.StepScope ot.begin_step() opened, until ot.end_step()
        self._seq = 0
        self._last_flush = time.perf_counter()
        self._lockstep = self.identity.distributed and config.cross_rank  # flushes pair across ranks
        self._interval_s = config.log_interval_s
        self._due_ns = _time_due_ns(self._lockstep, self._last_flush, self._interval_s)
        self._perf_to_epoch_ns = time.time_ns() - time.perf_counter_ns()
        self._closed = False
        self._lock = threading.Lock()
        self.deferred_flushes = 0  # the worker's queue was full: the data goes with a later flush
        self.lost_steps = 0  # steps of flushes that never reached the run dir
        # The thread running ot.step(), the only one that flushes (until the first step, init()'s).
        self._step_thread = threading.get_ident()
        self._flush_requested = False  # another thread asked for one (SIGTERM's); not in lockstep
        self.shutdown_done = threading.Event()
        _warn_if_interval_outgrows_values(config)

    def add_watch(self, watch: ModelWatch) -> None:
        watches = [*self.watches, watch]  # copy-on-write too: a step may be iterating it
        self.watch_period = math.gcd(*(w.every for w in watches))  # first: a divisor of the old one
        self.watches = watches

    def remove_watch(self, watch: ModelWatch) -> None:
        self.watches = [x for x in self.watches if x is not watch]
        self.watch_period = math.gcd(*(w.every for w in self.watches)) or 1  # then: a multiple

    @property
    def prometheus_url(self) -> str | None:
        endpoint = self.telemetry.pull_endpoint
        return endpoint.url if endpoint is not None else None

    # --- steps (training thread) -----------------------------------------------------------------
    def begin_step(self, step: Any) -> int:
        if step.__class__ is int and abs(step) <= MAX_STEP:  # one call fewer than a chained comparison
            index: int = step
        elif step is None:
            index = self.step_index + 1
            self.clock.rerun_through = -1  # unnumbered steps restart from 0: re-runs cannot be told apart
        else:
            index = step_number(step, self.buffer, self.step_index)
        self._step_thread = get_ident()
        self._step_index_running = index
        self.sampled = self._tracing and (index < self._trace_first or index % self._trace_every == 0)
        if self.control is not None and self.control.pending:
            _apply_due_changes(self, index)
        if self.profiler is not None and self.profiler.next_step_active():
            self.sampled = self._tracing  # profiled steps are always traced
        if self.watches and index % self.watch_period == 0:
            for watch in self.watches:
                watch.begin_step(index)
        return index

    def end_step(
        self, index: int, start_ns: int, end_ns: int, tokens: Any, samples: Any, failed: bool, outer: int
    ) -> None:
        """One append to `step_events` and the flush check (`outer`: a nested step's outer one's start)."""
        if tokens.__class__ not in _PLAIN_COUNTS or samples.__class__ not in _PLAIN_COUNTS:
            tokens = count_of(tokens, "tokens", self.buffer)
            samples = count_of(samples, "samples", self.buffer)
        if outer and self.step_start_ns != start_ns:
            outer = 0  # the outer step ended first (a framework's step outlived a `with`)
        self.step_start_ns = outer  # a nested step's end: the outer one runs on, with its later timers
        self.step_index = index
        previous_end = self.step_end_ns
        self.step_end_ns = end_ns
        if previous_end is None or start_ns - previous_end > self._stall_gap_ns:
            self.clock.note_gap(start_ns, previous_end)
        if self.watches and index % self.watch_period == 0:
            for watch in self.watches:
                watch.end_step(index, failed)
        profiled = False
        if self.profiler is not None:
            profiled = advance_window(self, index)
        if self.sampled:
            if len(self.buffer.spans) < MAX_SPAN_RECORDS:
                self.buffer.spans.append(step_record(start_ns, end_ns, index, failed, profiled))
            self.sampled = False
        events = self.step_events
        if len(events) < self.max_step_events:
            events.append((index, start_ns, end_ns, tokens, samples, failed))
        else:  # a worker stuck for hours defers every flush: counts only (~43 MB per 1M steps otherwise)
            _uncapped_step(self.buffer, tokens, samples, failed)
        if failed or outer:  # a nested step: counted (the worker drops it), its outer one flushes
            self.buffer.steps += not failed
            return
        steps = self.interval_steps = self.interval_steps + 1
        # Due at the cadence's step or count, or once log_interval_s has passed (`_due_ns`, on
        # end_ns's clock: one comparison), or when another thread asked for a flush; not inside a
        # framework's open step (one that outlived the `with` block it began in).
        by_steps = index >= self._due_step or steps >= self._due_threshold
        if (
            (by_steps and self._cadence_due(steps, index)) or end_ns >= self._due_ns or self._flush_requested
        ) and self.open_step is None:
            self.flush()

    def _cadence_due(self, steps: int, index: int) -> bool:
        cadence = self.cadence
        due = cadence.due(steps, index)
        self._due_step, self._due_threshold = cadence.due_step, cadence.threshold
        return due

    def seconds_per_step(self) -> float | None:
        """The mean step time so far (for the control thread)."""
        steps, end, first = self.goodput.steps, self.step_end_ns, self.clock.first_step_start_ns
        return (end - first) * 1e-9 / steps if steps and end and first else None

    def start_profile(self, window: ProfileWindow, ranks: Sequence[int] | None) -> bool:
        """Start a profiler window at the next step (training thread); False if not on this rank."""
        if self.profiler is not None:
            log.warning("otel_train: Run.profile: a profiler window is still running; ignored.")
            return False
        base = self.run_dir if self.run_dir is not None else Path(self.config.output_dir) / self.run_name
        self.profiler = start_window(window, base, self.identity, ranks, log.warning)
        return self.profiler is not None

    def end_timer(self, name: str, start_ns: int, end_ns: int, error: type[BaseException] | None) -> None:
        """A timer's end off the `with` path (`stop()`, `ot.span`, a failed phase)."""
        if error is None:
            events = self.timer_events
            if len(events) < self.max_timer_events:
                events.append((name, start_ns, end_ns, self.step_start_ns))
            else:
                self.buffer.drop("too_many_values")
            return
        self.buffer.add_phase_error(name, error.__name__, (end_ns - start_ns) * 1e-9)
        if self.sampled and len(self.buffer.spans) < MAX_SPAN_RECORDS:
            self.buffer.spans.append(
                SpanRecord(name, start_ns, end_ns, self._step_index_running, error.__name__)
            )

    def begin_mark(self, name: str, start_ns: int) -> None:
        """An eval / checkpoint span begins: a checkpoint's is `saving`, an eval's `in_eval`."""
        self.open_marks[span_cause(name).partition("_")[0]] = start_ns  # eval, checkpoint, other

    def end_mark(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        error: type[BaseException] | None,
        attrs: Mapping[str, Any] | None,
    ) -> None:
        """An eval / checkpoint span: always traced, timed as a phase, goodput's eval / checkpoint."""
        self.end_timer(name, start_ns, end_ns, error)
        self.open_marks.pop(span_cause(name).partition("_")[0], None)
        self.progress_ns = max(self.progress_ns, end_ns)  # the stall watchdog counts from its end
        self.clock.note_span(name, end_ns - start_ns, self.step_start_ns != 0, self.step_end_ns)
        if self.worker.span_writer is not None and len(self.buffer.spans) < MAX_SPAN_RECORDS:
            step = max(self.step_index, 0)
            self.buffer.spans.append(mark_record(name, start_ns, end_ns, step, error, attrs))

    @property
    def running_step(self) -> int | None:
        return self._step_index_running if self.step_start_ns else None

    def last_step(self) -> tuple[int, float | None]:
        """(last completed step, when the loop last made progress as perf_counter seconds: that
        step's end or a later eval batch, eval batches counting up to `eval_timeout_s` after it;
        None while it idles on purpose, `mark_idle`, until a step begins): for the watchdog thread."""
        end_ns, profiler = self.step_end_ns, self.profiler
        if end_ns is None or self._idle_mark == (self.step_index, self.step_start_ns):
            return self.step_index, None
        if profiler is not None and profiler.busy:  # the profiler's work between steps is progress
            return self.step_index, time.perf_counter()
        progress = self.progress_ns
        if self.evaluating_s():
            progress = end_ns + self._eval_timeout_ns
        return self.step_index, max(end_ns, progress) * 1e-9

    def evaluating_s(self) -> float:
        """Seconds from the last step's end to the latest eval batch past `eval_timeout_s`; else 0."""
        end_ns, batch_ns = self.step_end_ns, self.clock.eval_batch_ns
        if end_ns is None or self.step_start_ns or batch_ns != self.progress_ns:
            return 0.0  # in a step (micro-batches), or the latest progress was no eval batch (a span's end)
        since = batch_ns - end_ns
        return since * 1e-9 if since > self._eval_timeout_ns else 0.0

    def saving(self) -> bool:
        """Whether a checkpoint save runs (begun after the last step began and ended, and after the
        last eval batch): the watchdog then waits checkpoint_timeout_s instead of stall_timeout_s."""
        latest = max(self.step_end_ns or 0, self.step_start_ns, self.progress_ns)
        return self.open_marks.get("checkpoint", 0) > latest

    def in_eval(self) -> bool:
        """Whether an `ot.span("eval")` begun after the last step began and ended is open: the
        watchdog then waits eval_timeout_s (the metrics computed after the last batch included)."""
        return self.open_marks.get("eval", 0) > max(self.step_end_ns or 0, self.step_start_ns)

    def mark_idle(self) -> None:
        """The loop pauses on purpose (between fit and test): no stall until a step begins, and what
        no step end would take is flushed now: steps, timers, and values where no peer pairs flushes
        (a rank-0-only eval's alone would unpair them; every rank pauses after the same step)."""
        self._idle_mark, self.clock.idle_after_ns = (self.step_index, self.step_start_ns), self.step_end_ns
        outside_step = not self.step_start_ns and get_ident() == self._step_thread
        values = not self._lockstep and (self.buffer.scalars or self.buffer.rows)
        if outside_step and (self.interval_steps or self.timer_events or values or self._flush_requested):
            self.flush(idle=True)

    # --- the flush hand-off: the interval to the worker ------------------------------------------
    def flush(self, final: bool = False, idle: bool = False) -> bool:
        """Hand the interval to the worker, never blocking: with the queue full the data stays in the
        buffer for the next step's try. Only the thread running the steps takes the buffer; one on
        another thread is done at its next step end. `idle`: past a full queue, schedule kept."""
        if not final and threading.get_ident() != self._step_thread:
            # at the next step end; in lockstep it rides with the next aligned flush instead
            self._flush_requested = not self._lockstep
            return False
        now = time.perf_counter()
        worker = self.worker
        if not final and not idle and worker.pending_batches() >= worker.max_batches:
            _defer_flush(self)
            return False
        with self._lock:
            self._flush_requested = False
            self.buffer.steps, self.interval_steps = self.buffer.steps + self.interval_steps, 0
            batch = self.buffer.take(
                self._seq, self.step_index, now - self._last_flush, self._perf_to_epoch_ns
            )
            self.timer_events, self.step_events = self.buffer.timer_events, self.buffer.step_events
            self._seq += 1
        batch.final = final
        batch.rerun_through = self.clock.rerun_through
        if not final:
            # Rank 0 decides the schedule here and sends it down with this flush (cadence.py).
            # A pause proposes no other interval (0 steps: the current one).
            steps = 0 if idle else batch.steps
            most = steps_that_fit(self.config.max_values_per_interval, worker.values_per_step)
            proposal = self.cadence.proposal(steps, batch.elapsed_s, worker.flush_cpu_s, most)
            self.cadence.flushed(proposal, batch.step)
            self._due_step, self._due_threshold = self.cadence.due_step, self.cadence.threshold
            batch.flush_interval, batch.flush_anchor = self.cadence.decision
        self._last_flush = now
        self._due_ns = _time_due_ns(self._lockstep, now, self._interval_s)
        if "torch" in sys.modules:
            _note_torch_state(batch, self.config.compute_dtype == "auto")
        with self._lock:  # the room was checked above (final, idle: taken regardless)
            self.worker.submit_batch(batch)
        return True

    def message(self, kind: type[Message], key: str, payload: Any, step: int | None) -> None:
        filed = self.step_index if step is None else step
        if kind is ScalarsMessage:
            self.buffer.add_row(filed, payload)  # rides the next flush: no queue for it to fill
        elif not self.worker.submit_message(kind(key, payload, filed)):
            _drop_message(self.buffer, self.worker.max_messages)

    # --- close -----------------------------------------------------------------------------------
    def shutdown(self, failed: bool = False) -> None:
        """Final flush, drain the worker, close sinks (`failed`: see Sink.close), stop exporters."""
        with self._lock:
            already = self._closed
            self._closed = True
        if already:  # another thread is shutting down: wait for it (bounded)
            self.shutdown_done.wait(self.config.shutdown_timeout_s + 1.0)
            return
        try:
            _close_deferring_interrupt(self, failed)
        finally:
            self.shutdown_done.set()


# --- what ot.step() accepts (docs/reliability.md#error-policy): tokens=/samples= and the logger
# API's step= are values (a bad one is dropped, counted and warned about once), a step number's
# type is the caller's.
def as_int(value: Any, call: str) -> int:
    """`value` as a plain int when it is an integer of any kind (numpy, a 0-dim integer tensor);
    any other type (a float, a str, a bool) is the caller's bug: TypeError naming the fix."""
    if value.__class__ is not bool and str(getattr(value, "dtype", "")) not in ("bool", "torch.bool"):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{call} needs an int, got {type(value).__name__} {value!r}: pass int(...) of it")


def step_number(step: Any, buffer: Buffer, last_step: int) -> int:
    """A step number as a plain int; one beyond int64 continues from the last step."""
    index = as_int(step, "ot.step(index)")
    if -MAX_STEP <= index <= MAX_STEP:
        return index
    buffer.drop("invalid_step")
    buffer.warn_once(
        "<step>",
        f"ot.step({index}) does not fit an int64; continuing from the last step "
        "(counted in otel_train.dropped{reason=invalid_step}).",
    )
    return last_step + 1


def count_of(value: Any, what: str, buffer: Buffer) -> int | None:
    """tokens= / samples= as a plain int. They arrive as a step ends, where raising would hide the
    step's own exception: a bad count is ignored, counted and warned about once."""
    if value is None or (value.__class__ is int and 0 <= value <= MAX_STEP):
        return value  # type: ignore[no-any-return]
    try:
        if isinstance(value, bool):
            raise TypeError  # True is no count of tokens
        number = operator.index(value)
    except TypeError:
        buffer.drop("invalid_type")
        buffer.warn_once(f"<{what}>", f"ot.step({what}=...) got {type(value).__name__}, not an int; ignored.")
        return None
    if 0 <= number <= MAX_STEP:
        return number
    buffer.drop("invalid_value")  # a negative count would take tokens away from the totals
    buffer.warn_once(
        f"<{what} range>", f"ot.step({what}={value!r}): a count must be >= 0 (and < 2**63); ignored."
    )
    return None


def _uncapped_step(buffer: Buffer, tokens: int | None, samples: int | None, failed: bool) -> None:
    """A step beyond the step_events cap: its counts only."""
    buffer.drop("too_many_values")
    if not failed:
        buffer.tokens += count_of(tokens, "tokens", buffer) or 0
        buffer.samples += count_of(samples, "samples", buffer) or 0


def message_step(step: Any, buffer: Buffer) -> int | None:
    """The logger API's step= (a framework hands its own on: a value, not the caller's bug) as a
    plain int, or None (the current step), also for a bad one (counted, warned about once)."""
    if step is None or (step.__class__ is int and -MAX_STEP <= step <= MAX_STEP):
        return step  # type: ignore[no-any-return]
    try:
        number: int | None = as_int(step, "step=")
    except TypeError:
        number = None
    if number is not None and -MAX_STEP <= number <= MAX_STEP:
        return number
    buffer.drop("invalid_step")
    buffer.warn_once(
        "<message step>",
        f"step={step!r} is not a step number (an int within int64); filed under the current step.",
    )
    return None


def _time_due_ns(lockstep: bool, last_flush_s: float, interval_s: float) -> int:
    """When log_interval_s will have passed since the last flush (perf_counter_ns); never in
    lockstep (time-based flushes would desync the ranks)."""
    due = (last_flush_s + interval_s) * 1e9
    return int(due) if not lockstep and due < _NEVER_NS else _NEVER_NS  # log_interval_s=inf: never


def _apply_due_changes(session: Session, index: int) -> None:
    """The control file's changes due at step `index` (it has some pending)."""
    control = session.control
    assert control is not None
    if index >= control.pending[0].apply_at_step:
        from otel_train.control import apply_due  # imports the OTel API: not at `import otel_train`

        apply_due(session, control.take_due(index), index)


def _note_torch_state(batch: FlushBatch, detect_dtype: bool) -> None:
    """A CUDA event when the batch holds CUDA values (the worker waits on it, never the training
    thread), and the active torch.autocast dtype for MFU's peak (thread-local: only readable here)."""
    latest = [v for vs in batch.scalars.values() for v in vs[-1:]]
    latest += [r.values for r in batch.layer_stats] + [h[2] for h in batch.histograms]
    if any(getattr(getattr(v, "device", None), "type", "") == "cuda" for v in latest):
        import torch

        # blocking: the worker waiting for it sleeps rather than spinning a CPU core
        batch.cuda_event = torch.cuda.Event(blocking=True)
        batch.cuda_event.record()  # on the training thread's current stream
    if detect_dtype:
        batch.autocast_dtype = autocast_dtype()


def _drop_message(buffer: Buffer, limit: int) -> None:
    """A logger API entry that found `limit` entries waiting: dropped, never waited for."""
    buffer.drop("message_queue_full")
    buffer.warn_once(
        "<message_queue_full>",
        f"otel_train: the background worker has {limit} log_text/log_samples/log_histogram/"
        "log_hyperparams entries waiting (it is behind or stuck); further ones are dropped and "
        "counted as otel_train.dropped{reason=message_queue_full}. Log them less often, or raise "
        "queue_size (the limit is 8 x queue_size, at least 64).",
    )


# --- close: each part within what is left of shutdown_timeout_s -----------------------------------
def _close_deferring_interrupt(session: Session, failed: bool) -> None:
    """`_close`, with a Ctrl-C during it delivered when it ends (within `shutdown_timeout_s`): cut in
    the middle, the close left the run's last rows unwritten, its threads and port held, and no way
    to finish it (a notebook's interrupt while `ot.shutdown()` drains). A second Ctrl-C raises at once."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        _close(session, failed)  # a user's own SIGINT handler decides for itself
        return
    interrupts: list[int] = []

    def held(signum: int, frame: Any) -> None:
        interrupts.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C cuts the close short

    signal.signal(signal.SIGINT, held)
    try:
        _close(session, failed)
    finally:
        if signal.getsignal(signal.SIGINT) is held:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupts:
        raise KeyboardInterrupt


def _close(session: Session, failed: bool) -> None:
    from otel_train.goodput import final_scalars

    started = time.monotonic()
    budget = session.config.shutdown_timeout_s
    for watch in list(session.watches):
        watch.remove()
    session.watchdog.close()
    if session.control is not None:
        session.control.close()
    if session.profiler is not None:
        session.profiler.stop()
        session.profiler = None
    session.reducer.stop_waiting()  # the flushes still queued must not wait for a peer's row
    _warn_if_no_step(session)
    session.flush(final=True)
    session.lost_steps += _drain_worker(session.worker, session.instruments, budget)
    for listener in session.worker.listeners:
        listener.close()
    final = {**session.worker.final_scalars, **final_scalars(session.goodput.totals)}
    for sink in session.worker.sinks:  # the bridge process gets what is left of 80 % of the budget
        try:
            if sink is session.bridges:
                timeout = max(0.1, 0.8 * budget - (time.monotonic() - started))
                session.bridges.close(dict(final), timeout=timeout, failed=failed)
            else:
                sink.close(dict(final), failed)
        except Exception as exc:  # the sinks' backends (bridges, their process, the disk)
            log.warning("otel_train: closing %s failed: %s", sink.name, exc)
    # Keep a margin inside the budget for the abandon path itself.
    session.telemetry.shutdown(max(0.1, 0.9 * budget - (time.monotonic() - started)))
    # Last, with what is left: a user hook that hangs (a webhook) never takes the sinks' and
    # exporters' time. From a hook itself this returns at once.
    session.events.close(max(0.1, budget - (time.monotonic() - started)))


def _warn_if_no_step(session: Session) -> None:
    """A run that timed phases but never marked a step has empty steps, throughput and goodput:
    ot.step was forgotten. (Values alone are no sign: an evaluation-only run logs them too.)"""
    buffer = session.buffer
    timed = buffer.timer_events or any(buffer.phases.values())
    if timed and session.step_end_ns is None and session.open_step is None:
        log.warning(
            "otel_train: the run timed phases but marked no step, so steps, throughput and "
            "goodput are empty: wrap each training step in `with ot.step(step):` (or "
            "`@ot.step`), or use a framework integration, which marks them."
        )


def _drain_worker(worker: Worker, instruments: Instruments, budget_s: float) -> int:
    """Stop the worker within half the budget; returns the steps it never wrote."""
    unwritten = 0
    if not worker.stop(timeout_s=max(0.2, budget_s * 0.5)):
        flushes, steps, messages = worker.unwritten()
        if flushes > 0 or messages > 0:
            unwritten = steps
            instruments.dropped.add(flushes + messages, {semconv.REASON: "shutdown_deadline"})
            log.warning(
                "otel_train: shutdown deadline (%.1fs): the background worker was still busy; %d "
                "flush(es) holding %d step(s) and %d log_text/log_samples/log_histogram/"
                "log_hyperparams entries were not written to the run dir or exporters. Raise "
                "OTEL_TRAIN_SHUTDOWN_TIMEOUT_S if this happens often.",
                budget_s,
                flushes,
                steps,
                messages,
            )
    for name, count in worker.sink_errors.items():
        log.warning(
            "otel_train: sink %s failed %d time(s) in this run; those writes are missing.", name, count
        )
    return unwritten


def _defer_flush(session: Session) -> None:
    """The worker's queue is full: the flush's steps go with a later one (counted; with an asked-for
    `log_interval`, said once)."""
    session.deferred_flushes += 1
    if session.deferred_flushes == 1 and session.config.log_interval is not None:
        log.warning(
            "otel_train: the steps came faster than the worker writes flushes (its queue of %d is "
            "full): with log_interval=%d a flush's steps now go with a later one, whose row covers "
            "them all. Raise log_interval, or use ot.log_metrics(values, step=N) for a row per step.",
            session.worker.max_batches, session.config.log_interval,
        )  # fmt: skip


def _warn_if_interval_outgrows_values(config: Config) -> None:
    """The user's log_interval stands (they may record less than once a step): a warning only."""
    if config.log_interval is not None and config.log_interval > config.max_values_per_interval:
        log.warning(
            "otel_train: log_interval=%d is more steps than max_values_per_interval=%d values: "
            "the step durations and any value recorded every step lose what does not fit at "
            "each flush (counted as otel_train.dropped{reason=too_many_values}). Raise "
            "OTEL_TRAIN_MAX_VALUES_PER_INTERVAL or lower OTEL_TRAIN_LOG_INTERVAL.",
            config.log_interval,
            config.max_values_per_interval,
        )
