"""Session: the running telemetry of one process: steps, timers, flushes and shutdown.

`assemble.build_session` builds and wires the parts (`SessionParts`); `_runtime` holds the active
session and the process hooks. The training thread talks to the session only through
`begin_step`, `end_step`, `end_timer`, `record` and `flush`, all plain-Python appends and
counters; everything else happens on the worker.
"""

from __future__ import annotations

import itertools
import logging
import operator
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from otel_train.bridges.base import Sink
from otel_train.bridges.console import ConsoleSink
from otel_train.buffer import Buffer, FlushBatch, SpanRecord, SpanRole
from otel_train.closing import close_listeners, close_sinks, drain_worker, stop_exporters
from otel_train.config import Config
from otel_train.distributed import Identity
from otel_train.hardware import autocast_dtype
from otel_train.interval import FlushListener
from otel_train.profiling import advance_window, start_window

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from opentelemetry.metrics import Meter
    from opentelemetry.sdk.resources import Resource

    from otel_train.bridges.process import BridgeProcess
    from otel_train.cadence import Cadence
    from otel_train.control import ControlChange, ControlFile
    from otel_train.crossrank import CrossRankReducer
    from otel_train.diagnostics import HangWatchdog, MemoryDumps
    from otel_train.exporters import Telemetry
    from otel_train.goodput import GoodputListener
    from otel_train.hardware import HardwareMonitor
    from otel_train.health import HealthEvents
    from otel_train.instruments import Instruments
    from otel_train.messages import Message
    from otel_train.model_watch import ModelWatch
    from otel_train.profiling import ProfiledStepsCounter, ProfileWindow, StepProfiler
    from otel_train.step_reader import StepReader
    from otel_train.worker import Worker

log = logging.getLogger("otel_train")

_MAX_SPAN_RECORDS = 10_000


class GoodputClock:
    """Goodput bookkeeping, cumulative, written by the training thread only (goodput.StepClock)."""

    def start_goodput_clock(self, stall_timeout_s: float) -> None:
        from otel_train.goodput import DATA_PHASES, process_start_perf_s

        self.process_start_s = process_start_perf_s()
        self.first_step_start_ns: int | None = None
        self.startup_span_ns = 0
        self.stall_ns = 0
        self.nested_badput_ns = 0
        self.span_ns: dict[str, int] = {}
        self.data_ns = 0
        self._data_phases = DATA_PHASES
        self.rerun_ns = 0
        self.rerun_through = -1  # set by the goodput listener on a restart
        self._gap_span_ns = 0  # spans since the last step ended (not stall time)
        self._step_open = False
        self._stall_gap_ns = int(stall_timeout_s * 1e9)

    def _note_long_gap(self, gap_ns: int) -> None:
        """A gap between steps longer than stall_timeout_s: stall time, less the spans inside it."""
        stalled = gap_ns - self._gap_span_ns
        if stalled > self._stall_gap_ns:
            self.stall_ns += stalled


@dataclass(kw_only=True, eq=False, repr=False)
class SessionParts:
    """The parts a session runs with, built and wired by `assemble.build_session`, and the lists
    of sinks, listeners and watches that can change while it runs."""

    config: Config
    identity: Identity
    run_name: str
    run_dir: Path | None
    resumed: bool  # the same run_id restarted: appending to this rank's files
    resource: Resource
    step_reader: StepReader
    telemetry: Telemetry
    meter: Meter
    instruments: Instruments
    otel_logger: Any | None
    events: HealthEvents
    console: ConsoleSink | None
    bridges: BridgeProcess | None
    sinks: list[Sink]
    listeners: list[FlushListener]
    hardware: HardwareMonitor | None
    reducer: CrossRankReducer
    cadence: Cadence
    profiled_steps: ProfiledStepsCounter
    watches: list[ModelWatch] = field(default_factory=list)  # ot.watch(model) handles
    memory_dumps: MemoryDumps | None = None  # CUDA allocator dumps on an OOM inside ot.step

    def __post_init__(self) -> None:
        """Called by the generated __init__ (only if defined here); `Session` sets its running state."""

    # The worker thread iterates `sinks` and `listeners` at every flush: both lists are replaced
    # (copy-on-write), never changed in place, so no flush sees a list mid-change.
    def add_listener(self, listener: FlushListener) -> None:
        """Call `listener.on_flush(interval)` on the worker at every flush from now on."""
        self.listeners = [*self.listeners, listener]
        self._share_with_worker()

    def remove_listener(self, listener: FlushListener) -> None:
        """Stop calling `listener` (idempotent)."""
        self.listeners = [x for x in self.listeners if x is not listener]
        self._share_with_worker()

    def add_sink(self, sink: Sink) -> None:
        """Hand every flush and message to `sink` too (on the worker), from the next one on."""
        self.sinks = [*self.sinks, sink]
        self._share_with_worker()

    def _share_with_worker(self) -> None:
        worker = getattr(self, "worker", None)  # None while the session is still being wired
        if worker is not None:
            worker.sinks, worker.listeners = self.sinks, self.listeners

    def add_watch(self, watch: ModelWatch) -> None:
        """Call `watch` at every step's begin and end (training thread) until `remove_watch`."""
        self.watches = [*self.watches, watch]  # copy-on-write too: a step may be iterating it

    def remove_watch(self, watch: ModelWatch) -> None:
        """Stop calling `watch` (idempotent; `ModelWatch.remove()` calls it)."""
        self.watches = [x for x in self.watches if x is not watch]

    @property
    def flush_interval_steps(self) -> int:
        """Steps per flush now (the explicit log_interval, or the adaptive cadence's current value)."""
        return self.cadence.interval

    @property
    def prometheus_url(self) -> str | None:
        endpoint = self.telemetry.pull_endpoint
        return endpoint.url if endpoint is not None else None


class Session(SessionParts, GoodputClock):
    """Steps, timers, flushes and the shutdown of one process's telemetry (see the module doc)."""

    # Attached by assemble.build_session once the session exists (they call back into it).
    goodput: GoodputListener
    worker: Worker
    watchdog: HangWatchdog
    control: ControlFile | None

    def __post_init__(self) -> None:
        config = self.config
        self.on_exit: Callable[[], None] = self.shutdown  # `_runtime.init` sets ot.shutdown
        self.reinit_warned = False  # a second init() with other settings was warned about
        self.start_goodput_clock(config.stall_timeout_s)
        self.profiler: StepProfiler | None = None  # an ot.profile window, advanced at step ends
        self._pending_control: list[ControlChange] = []  # version order; replaced, never changed in place
        self._control_lock = threading.Lock()
        self.buffer = Buffer(config.max_metric_names, config.max_values_per_interval)
        self.timing_level = config.timing_log_level
        self.step_index = -1  # last completed step
        self.step_end_ns: int | None = None  # perf_counter_ns when it ended (the stall watchdog reads it)
        self.sampled = False  # is the current step traced?
        self._step_index_running = 0
        self.step_start_ns = 0  # perf_counter_ns at the running step's start; 0 outside a step
        self.open_step: Any = None  # the timing.StepScope ot.begin_step() opened, until ot.end_step()
        self._seq = 0
        self._last_flush = time.perf_counter()
        self._lockstep = self.identity.distributed and config.cross_rank  # flushes pair across ranks
        self._time_flush = not self._lockstep  # time-based flushes would desync ranks
        self._interval_s = config.log_interval_s
        self._perf_to_epoch_ns = time.time_ns() - time.perf_counter_ns()
        self._closed = False
        self._lock = threading.Lock()
        # Flush attempts that found the worker's queue full: the data stays in the buffer (counters
        # keep summing) and goes with a later flush.
        self.deferred_flushes = 0
        self.lost_flushes = 0
        self.lost_steps = 0  # steps in flushes that never reached the run dir (warned with the number)
        # The thread running ot.step(), the only one that flushes: until the first step, the one that
        # called init() (a flush from another thread before it would race the first step's counters).
        self._step_thread: int | None = threading.get_ident()
        self._flush_requested = False  # another thread asked for a flush (log_metrics(step=...))
        self.shutdown_done = threading.Event()

    # --- hot path (training thread) ------------------------------------------------------------
    def begin_step(self, step: Any) -> int:
        if step is None:
            index = self.step_index + 1
            self.rerun_through = -1  # unnumbered steps restart from 0: re-runs cannot be told apart
        elif step.__class__ is int and -_MAX_STEP <= step <= _MAX_STEP:
            index = step
        else:
            index = _step_number(step, self.buffer, self.step_index)
        self._step_thread = threading.get_ident()
        pending = self._pending_control
        if pending and index >= pending[0].apply_at_step:
            self._apply_due_controls(index)
        cfg = self.config
        self.sampled = self.worker.span_writer is not None and (
            index < cfg.trace_first or index % cfg.trace_every == 0
        )
        self._step_index_running = index
        self._step_open = True
        if self.profiler is not None and self.profiler.next_step_active():
            self.sampled = self.worker.span_writer is not None  # profiled steps are always traced
        if self.watches:
            for watch in self.watches:
                watch.begin_step(index)
        return index

    def end_step(
        self, index: int, start_ns: int, end_ns: int, tokens: int | None, samples: int | None, failed: bool
    ) -> None:
        buf = self.buffer
        if (tokens is not None and tokens.__class__ is not int) or (
            samples is not None and samples.__class__ is not int
        ):
            tokens, samples = _count(tokens, "tokens", buf), _count(samples, "samples", buf)
        self.step_index = index
        previous_end = self.step_end_ns
        self.step_end_ns = end_ns
        self._step_open = False
        if previous_end is None:
            self.first_step_start_ns = start_ns
        elif start_ns - previous_end > self._stall_gap_ns:
            self._note_long_gap(start_ns - previous_end)
        if self._gap_span_ns:
            self._gap_span_ns = 0
        if self.watches:
            for watch in self.watches:
                watch.end_step(index, failed)
        profiled = False
        if self.profiler is not None:
            profiled, self.profiler = advance_window(self.profiler, index, self.profiled_steps)
        if self.sampled:
            if len(buf.spans) < _MAX_SPAN_RECORDS:
                buf.spans.append(_step_record(start_ns, end_ns, index, failed, profiled))
            self.sampled = False
        if len(buf.step_indices) < buf.max_values:  # capped: see step_durations below
            buf.step_indices.append(index)  # which step the interval's recorded values belong to
        if failed:
            return
        if index <= self.rerun_through:  # goodput's wasted progress: re-running steps after a restart
            self.rerun_ns += end_ns - start_ns
        buf.steps += 1
        # Capped like every per-interval list: a worker stuck for hours defers every flush, and
        # this interval would grow until it returns (~43 MB per 1M steps).
        if len(buf.step_durations) < buf.max_values:
            buf.step_durations.append((end_ns - start_ns) * 1e-9)
        else:
            buf.drop("too_many_values")
        if tokens:
            buf.tokens += tokens
        if samples:
            buf.samples += samples
        cadence = self.cadence
        if (
            ((index >= cadence.due_step or buf.steps >= cadence.threshold) and cadence.due(buf.steps, index))
            or (self._flush_requested and not self._lockstep)
            or (self._time_flush and end_ns * 1e-9 - self._last_flush >= self._interval_s)  # same clock
        ):
            self.flush()

    def poll_control(self) -> None:
        """Watchdog thread: schedule a change from the control file (rank 0 decides the step)."""
        if self.control is None:
            return
        steps = self.goodput.steps
        end, first = self.step_end_ns, self.first_step_start_ns
        per_step = (end - first) * 1e-9 / steps if steps and end and first else None
        for change in self.control.poll(self.step_index, per_step):
            with self._control_lock:
                self._pending_control = [*self._pending_control, change]
            self.control.announce(change)

    def _apply_due_controls(self, index: int) -> None:
        """Training thread, as step `index` begins: the scheduled changes due by now, in version order."""
        from otel_train.control import apply_due  # imports the SDK: not at `import otel_train`

        with self._control_lock:
            pending = self._pending_control
            due = list(itertools.takewhile(lambda change: index >= change.apply_at_step, pending))
            self._pending_control = pending[len(due) :]
        apply_due(self, due, index)

    def start_profile(self, window: ProfileWindow, ranks: Sequence[int] | None) -> bool:
        """Start a profiler window at the next step (training thread); False if not on this rank."""
        if self.profiler is not None:
            log.warning("otel_train: ot.profile: a profiler window is still running; ignored.")
            return False
        base = self.run_dir if self.run_dir is not None else Path(self.config.output_dir) / self.run_name
        self.profiler = start_window(window, base, self.identity, ranks, log.warning)
        return self.profiler is not None

    def end_timer(self, name: str, start_ns: int, end_ns: int, error: type[BaseException] | None) -> None:
        buf = self.buffer
        if error is None:  # raw clock readings, one append: the worker derives duration and arrival
            timings = buf.timings.get(name) or buf.timings.setdefault(name, [])
            if len(timings) < buf.max_values:
                timings.append((start_ns, end_ns, self.step_start_ns))
            else:
                buf.drop("too_many_values")
            data = name in self._data_phases and self.step_start_ns  # goodput's data cause
            if data and self._step_index_running > self.rerun_through:
                self.data_ns += end_ns - start_ns
        else:
            buf.add_phase_error(name, error.__name__, (end_ns - start_ns) * 1e-9)
        if self.sampled and len(self.buffer.spans) < _MAX_SPAN_RECORDS:
            self.buffer.spans.append(
                SpanRecord(
                    name, start_ns, end_ns, self._step_index_running, error.__name__ if error else None
                )
            )

    def end_mark(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        error: type[BaseException] | None,
        attributes: Mapping[str, Any] | None,
    ) -> None:
        """An eval / checkpoint span: always traced (rare and short), timed as a phase, and
        accounted as goodput's eval / checkpoint badput."""
        self.end_timer(name, start_ns, end_ns, error)
        from otel_train.goodput import span_cause

        duration = end_ns - start_ns
        cause = span_cause(name)
        if cause != "other":
            self.span_ns[cause] = self.span_ns.get(cause, 0) + duration
        if self._step_open:
            if cause != "other":
                self.nested_badput_ns += duration
        else:
            self._gap_span_ns += duration
            if self.first_step_start_ns is None and cause != "other":
                self.startup_span_ns += duration  # not startup: its own cause
        if self.worker.span_writer is not None and len(self.buffer.spans) < _MAX_SPAN_RECORDS:
            step = max(self.step_index, 0)
            self.buffer.spans.append(_mark_record(name, start_ns, end_ns, step, error, attributes))

    def flush(self, final: bool = False) -> bool:
        """Hand the interval to the worker. Never blocks, in lockstep too (telemetry never makes
        this rank wait for another): if the queue is full the data stays in the buffer (counters
        keep summing) and the next step tries again; in lockstep that flush's row then covers other
        steps than the peers' and is left out of that flush's cross-rank stats (`exchange`).

        Only the thread running the steps takes the buffer (the step counters are plain ints it
        alone increments); a flush asked for on another thread is done at its next step end."""
        if not final and self._step_thread is not None and threading.get_ident() != self._step_thread:
            self._flush_requested = True
            return False
        now = time.perf_counter()
        worker = self.worker
        if not final and worker.pending_batches() >= worker.max_batches:
            self.deferred_flushes += 1
            return False
        with self._lock:
            self._flush_requested = False
            batch = self.buffer.take(
                self._seq, self.step_index, now - self._last_flush, self._perf_to_epoch_ns
            )
            self._seq += 1
        batch.final = final
        if not final:
            # Rank 0 decides the schedule here and sends it down with this flush (cadence.py).
            self.cadence.flushed(self.cadence.proposal(batch.steps, batch.elapsed_s), batch.step)
            batch.flush_interval, batch.flush_anchor = self.cadence.decision
        self._last_flush = now
        if "torch" in sys.modules:
            _note_torch_state(batch, self.config.compute_dtype == "auto")
        with self._lock:  # the room was checked above (final: never waits)
            handed = self.worker.submit_batch(batch, 0.0)
        if not handed:  # unreachable without a wait; kept so a lost flush is never silent
            self.lost_flushes += 1
            self.lost_steps += batch.steps
            self.buffer.drop("lost_flush")
            _warn_lost_flush(batch, self.lost_flushes)
            return False
        return True

    def message(self, kind: type[Message], key: str, payload: Any, step: int | None) -> None:
        self.worker.submit_message(kind(key, payload, self.step_index if step is None else step))

    # --- lifecycle -----------------------------------------------------------------------------------
    def last_step(self) -> tuple[int, float | None]:
        """(last completed step, its end as perf_counter seconds or None): for the watchdog thread."""
        end_ns = self.step_end_ns
        return self.step_index, (end_ns * 1e-9 if end_ns is not None else None)

    def shutdown(self) -> None:
        """Final flush, drain the worker, close sinks, stop exporters: bounded by shutdown_timeout_s
        for the network part. Idempotent."""
        with self._lock:
            already = self._closed
            self._closed = True
        if already:  # another thread is shutting down: wait for it (bounded)
            self.shutdown_done.wait(self.config.shutdown_timeout_s + 1.0)
            return
        try:
            self._shutdown()
        finally:
            self.shutdown_done.set()

    def _shutdown(self) -> None:
        from otel_train.goodput import final_scalars

        started = time.monotonic()
        budget = self.config.shutdown_timeout_s
        for watch in list(self.watches):
            watch.remove()
        self.watchdog.close()
        if self.control is not None:
            self.control.close()
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        self.reducer.stop_waiting()  # the flushes still queued must not wait for a peer's row
        self.flush(final=True)
        flushes, steps = drain_worker(self.worker, self.instruments, budget)
        self.lost_flushes += flushes
        self.lost_steps += steps
        close_listeners(self.listeners)
        final = {**self.worker.final_scalars, **final_scalars(self.goodput.totals)}
        close_sinks(self.sinks, self.bridges, final, budget, started)
        stop_exporters(self.telemetry, budget, started)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.on_exit()


_MAX_STEP = 2**63 - 1  # a step must fit an int64 (Prometheus, TensorBoard, JSON readers)


def _step_number(step: Any, buffer: Buffer, last_step: int) -> int:
    """A numpy integer, a 0-dim tensor or an integral float as a plain int; anything else
    (NaN, 3.5, 10**400, a string) continues from the last step, counted and warned once."""
    try:
        index = operator.index(step)
    except Exception:
        try:
            number = float(step)
            index = int(number) if number.is_integer() else None  # type: ignore[assignment]
        except Exception:
            index = None  # type: ignore[assignment]
    if index is None or not -_MAX_STEP <= index <= _MAX_STEP:
        buffer.drop("invalid_step")
        buffer.warn_once(
            "<step>",
            f"ot.step() got a step number it cannot use ({type(step).__name__}); continuing from "
            "the last step. Pass an int (counted in otel_train.dropped{reason=invalid_step}).",
        )
        return last_step + 1
    return index


def _count(value: Any, what: str, buffer: Buffer) -> int | None:
    """tokens= / samples= as a plain int (numpy integers, 0-dim tensors, integral floats)."""
    if value is None or value.__class__ is int:
        return value  # type: ignore[no-any-return]
    try:
        number = operator.index(value)
    except Exception:
        try:
            as_float = float(value)
            number = int(as_float) if as_float.is_integer() else round(as_float)
        except Exception:
            buffer.drop("invalid_type")
            buffer.warn_once(f"<{what}>", f"ot.step({what}=...) got {type(value).__name__}; ignored.")
            return None
    return number if 0 <= number <= _MAX_STEP else None


def _step_record(start_ns: int, end_ns: int, index: int, failed: bool, profiled: bool) -> SpanRecord:
    error = "StepFailed" if failed else None
    return SpanRecord(
        "step", start_ns, end_ns, index, error, SpanRole.STEP, {"train.profiled": True} if profiled else None
    )


def _mark_record(
    name: str,
    start_ns: int,
    end_ns: int,
    step: int,
    error: type[BaseException] | None,
    attributes: Mapping[str, Any] | None,
) -> SpanRecord:
    """An `ot.span` as a span record; attributes of other than plain types are left out."""
    attrs = {str(k): v for k, v in (attributes or {}).items() if isinstance(v, (str, int, float, bool))}
    return SpanRecord(name, start_ns, end_ns, step, error.__name__ if error else None, SpanRole.MARK, attrs)


def _holds_cuda_values(batch: FlushBatch) -> bool:
    """Does the interval hold CUDA tensors (the worker then waits on an event before reading them)?"""
    return (
        any(_on_cuda(v) for vs in batch.scalars.values() for v in vs[-1:])
        or any(_on_cuda(r.values) for r in batch.layer_stats)
        or any(_on_cuda(h[2]) for h in batch.histograms)
    )


def _note_torch_state(batch: FlushBatch, detect_dtype: bool) -> None:
    """Training thread, at a flush: a CUDA event when the batch holds CUDA values (the worker waits
    on it), and the active torch.autocast dtype for MFU's peak (thread-local: only readable here)."""
    if _holds_cuda_values(batch):
        batch.cuda_event = _record_cuda_event()
    if detect_dtype:
        batch.autocast_dtype = autocast_dtype()


def _warn_lost_flush(batch: FlushBatch, lost_flushes: int) -> None:
    log.warning(
        "otel_train: the background worker is stuck; flush %d (%d steps, up to step %d) was "
        "dropped (%d flushes lost so far).",
        batch.seq,
        batch.steps,
        batch.step,
        lost_flushes,
    )


def _on_cuda(value: Any) -> bool:
    device = getattr(value, "device", None)
    return device is not None and getattr(device, "type", "") == "cuda"


def _record_cuda_event() -> Any:
    import torch

    event = torch.cuda.Event()
    event.record()  # on the training thread's current stream; the worker waits on it
    return event
