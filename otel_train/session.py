"""Session: the running telemetry of one process: steps, timers, flushes and shutdown.

`assemble.build_session` builds and wires the parts (`SessionParts`); `_runtime` holds the active
session. The training thread calls only `begin_step`, `end_step`, `end_timer`, `record` and
`flush`, each one append to a flat per-interval list; the rest happens on the worker.
Design: docs/design/core.md#session.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from threading import get_ident
from typing import TYPE_CHECKING, Any

from otel_train.buffer import MAX_SPAN_RECORDS, Buffer, SpanRecord, mark_record, step_record
from otel_train.closing import close_listeners, close_sinks, drain_worker, stop_exporters
from otel_train.flush_handoff import drop_message, note_torch_state, warn_lost_flush
from otel_train.goodput import StepClock
from otel_train.profiling import advance_window, start_window
from otel_train.session_parts import SessionParts
from otel_train.step_input import MAX_STEP, count_of, step_number

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from otel_train.control import ControlFile
    from otel_train.diagnostics import HangWatchdog
    from otel_train.goodput import GoodputListener
    from otel_train.messages import Message
    from otel_train.profiling import ProfileWindow, StepProfiler

log = logging.getLogger("otel_train")

_NEVER_NS = 2**63  # a perf_counter_ns no step ends at


def _time_due_ns(lockstep: bool, last_flush_s: float, interval_s: float) -> int:
    """The perf_counter_ns when log_interval_s will have passed since the last flush; never in
    lockstep (time-based flushes would desync the ranks)."""
    due = (last_flush_s + interval_s) * 1e9
    return int(due) if not lockstep and due < _NEVER_NS else _NEVER_NS  # log_interval_s=inf: never


class Session(SessionParts):
    """Steps, timers, flushes and the shutdown of one process's telemetry (docs/design/core.md#session)."""

    # Attached by assemble.build_session once the session exists (they call back into it).
    goodput: GoodputListener
    watchdog: HangWatchdog
    control: ControlFile | None

    def __post_init__(self) -> None:
        config = self.config
        self.reinit_warned = False  # a second init() with other settings was warned about
        self.clock = StepClock(config.stall_timeout_s)  # goodput's books, kept by the hot path
        self.profiler: StepProfiler | None = None  # an ot.profile window, advanced at step ends
        self.buffer = Buffer(config.max_metric_names, config.max_values_per_interval)
        # The interval's timer and step events, read here by timing.TimerScope and end_step (one
        # attribute, not two); flush() points them at the fresh lists each time it takes the buffer.
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
        # (last step, running step's start) when an adapter said the loop idles (adapters.idle):
        # no stall until that changes, without a store on the step path
        self._idle_mark: tuple[int, int] | None = None
        self.sampled = False  # is the current step traced?
        self._step_index_running = 0
        self.step_start_ns = 0  # perf_counter_ns at the running step's start; 0 outside a step
        self.open_step: Any = None  # the timing.StepScope ot.begin_step() opened, until ot.end_step()
        self._seq = 0
        self._last_flush = time.perf_counter()
        self._lockstep = self.identity.distributed and config.cross_rank  # flushes pair across ranks
        self._interval_s = config.log_interval_s
        self._due_ns = _time_due_ns(self._lockstep, self._last_flush, self._interval_s)
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
        # another thread asked for a flush (log_metrics(step=...)); never in lockstep
        self._flush_requested = False
        self.shutdown_done = threading.Event()

    # --- hot path (training thread) ------------------------------------------------------------
    def begin_step(self, step: Any) -> int:
        if step.__class__ is int and -MAX_STEP <= step <= MAX_STEP:
            index: int = step
        elif step is None:
            index = self.step_index + 1
            self.clock.rerun_through = -1  # unnumbered steps restart from 0: re-runs cannot be told apart
        else:
            index = step_number(step, self.buffer, self.step_index)
        self._step_thread = get_ident()
        self._step_index_running = index
        self.sampled = self._tracing and (index < self._trace_first or index % self._trace_every == 0)
        control = self.control
        if control is not None and control.pending and index >= control.pending[0].apply_at_step:
            from otel_train.control import apply_due  # imports the OTel API: not at `import otel_train`

            apply_due(self, control.take_due(index), index)
        if self.profiler is not None and self.profiler.next_step_active():
            self.sampled = self._tracing  # profiled steps are always traced
        if self.watches and index % self.watch_period == 0:
            for watch in self.watches:
                watch.begin_step(index)
        return index

    def end_step(
        self, index: int, start_ns: int, end_ns: int, tokens: int | None, samples: int | None, failed: bool
    ) -> None:
        """One append to `step_events` and the flush check; the worker derives durations, counts,
        goodput's re-runs (resolve.resolve_steps). Cold-cache cost: see timing.TimerScope."""
        if (tokens.__class__ is not int and tokens is not None) or (
            samples.__class__ is not int and samples is not None
        ):
            tokens, samples = (
                count_of(tokens, "tokens", self.buffer),
                count_of(samples, "samples", self.buffer),
            )
        self.step_start_ns = 0
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
            profiled, self.profiler = advance_window(self.profiler, index, self.profiled_steps)
        if self.sampled:
            if len(self.buffer.spans) < MAX_SPAN_RECORDS:
                self.buffer.spans.append(step_record(start_ns, end_ns, index, failed, profiled))
            self.sampled = False
        events = self.step_events
        if len(events) < self.max_step_events:
            events.append((index, start_ns, end_ns, tokens, samples, failed))
        else:  # a worker stuck for hours defers every flush: counts only (~43 MB per 1M steps otherwise)
            self.buffer.add_uncapped_step(tokens, samples, failed)
        if failed:
            return
        steps = self.interval_steps = self.interval_steps + 1
        # Due at the cadence's step or count, or once log_interval_s has passed (`_due_ns`, on
        # end_ns's clock: one comparison), or when another thread asked for a flush.
        by_steps = index >= self._due_step or steps >= self._due_threshold
        if (by_steps and self._cadence_due(steps, index)) or end_ns >= self._due_ns or self._flush_requested:
            self.flush()

    def _cadence_due(self, steps: int, index: int) -> bool:
        cadence = self.cadence
        due = cadence.due(steps, index)
        self._due_step, self._due_threshold = cadence.due_step, cadence.threshold
        return due

    def seconds_per_step(self) -> float | None:
        """The mean step time so far (the control thread schedules changes with it)."""
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
        """A timer's end off the `with` path (`stop()`, `ot.span`, a failed phase). A `with ot.timer`
        that ends without an error appends to `timer_events` itself (timing.TimerScope)."""
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
        self.clock.note_span(name, end_ns - start_ns, self.step_start_ns != 0, self.step_end_ns)
        if self.worker.span_writer is not None and len(self.buffer.spans) < MAX_SPAN_RECORDS:
            step = max(self.step_index, 0)
            self.buffer.spans.append(mark_record(name, start_ns, end_ns, step, error, attributes))

    def flush(self, final: bool = False) -> bool:
        """Hand the interval to the worker. Never blocks, in lockstep too (telemetry never makes
        this rank wait for another): if the queue is full the data stays in the buffer (counters
        keep summing) and the next step tries again; in lockstep that flush's row then covers other
        steps than the peers' and is left out of that flush's cross-rank stats (`exchange`).

        Only the thread running the steps takes the buffer (the step counters are plain ints it
        alone increments); a flush asked for on another thread is done at its next step end."""
        if not final and self._step_thread is not None and threading.get_ident() != self._step_thread:
            # at the next step end; in lockstep it rides with the next aligned flush instead
            self._flush_requested = not self._lockstep
            return False
        now = time.perf_counter()
        worker = self.worker
        if not final and worker.pending_batches() >= worker.max_batches:
            self.deferred_flushes += 1
            return False
        with self._lock:
            self._flush_requested = False
            self.buffer.steps, self.interval_steps = self.interval_steps, 0
            batch = self.buffer.take(
                self._seq, self.step_index, now - self._last_flush, self._perf_to_epoch_ns
            )
            self.timer_events, self.step_events = self.buffer.timer_events, self.buffer.step_events
            self._seq += 1
        batch.final = final
        batch.rerun_through = self.clock.rerun_through
        if not final:
            # Rank 0 decides the schedule here and sends it down with this flush (cadence.py).
            proposal = self.cadence.proposal(batch.steps, batch.elapsed_s, worker.flush_cpu_s)
            self.cadence.flushed(proposal, batch.step)
            self._due_step, self._due_threshold = self.cadence.due_step, self.cadence.threshold
            batch.flush_interval, batch.flush_anchor = self.cadence.decision
        self._last_flush = now
        self._due_ns = _time_due_ns(self._lockstep, now, self._interval_s)
        if "torch" in sys.modules:
            note_torch_state(batch, self.config.compute_dtype == "auto")
        with self._lock:  # the room was checked above (final: never waits)
            handed = self.worker.submit_batch(batch, 0.0)
        if not handed:  # unreachable without a wait; kept so a lost flush is never silent
            self.lost_flushes += 1
            self.lost_steps += batch.steps
            self.buffer.drop("lost_flush")
            warn_lost_flush(batch, self.lost_flushes)
            return False
        return True

    def message(self, kind: type[Message], key: str, payload: Any, step: int | None) -> None:
        """Hand a log_text / log_samples / log_histogram / log_hyperparams entry to the worker."""
        if not self.worker.submit_message(kind(key, payload, self.step_index if step is None else step)):
            drop_message(self.buffer, self.worker.max_messages)

    # --- lifecycle -----------------------------------------------------------------------------------
    @property
    def running_step(self) -> int | None:
        """The index of the step begun and not yet ended (None outside a step)."""
        return self._step_index_running if self.step_start_ns else None

    def last_step(self) -> tuple[int, float | None]:
        """(last completed step, its end as perf_counter seconds or None): for the watchdog thread.
        None while the loop idles on purpose (`mark_idle`) until a step begins."""
        end_ns = self.step_end_ns
        if end_ns is None or self._idle_mark == (self.step_index, self.step_start_ns):
            return self.step_index, None
        return self.step_index, end_ns * 1e-9

    def mark_idle(self) -> None:
        """The loop pauses on purpose (a framework between fit and test): no stall until a step
        begins."""
        self._idle_mark = (self.step_index, self.step_start_ns)

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
        # The user's hooks get what the last flushes raised, with what is left of the budget: a
        # hook that hangs (a webhook) never takes the sinks' and exporters' time. From a hook
        # itself this returns at once.
        self.events.close(max(0.1, budget - (time.monotonic() - started)))
