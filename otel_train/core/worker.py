"""The background worker: each flush off the training thread (the batch resolved into an
`Interval`; the SDK, the flush listeners, the sinks) and the logger API's `Message` records, in
one ordered queue. Design: docs/design/core.md#worker.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from itertools import compress
from operator import le
from typing import Any

from opentelemetry._logs import SeverityNumber

from otel_train import semconv
from otel_train.bridges.base import Sink
from otel_train.core.buffer import (
    MAX_SPAN_RECORDS,
    MAX_STEP,
    TIMER_EVENTS_PER_VALUE,
    FlushBatch,
    FlushListener,
    HistogramMessage,
    HparamsMessage,
    Interval,
    Message,
    SamplesMessage,
    ScalarsMessage,
    StepEvent,
    TextMessage,
    header_of,
    span_records,
)
from otel_train.core.instruments import (
    STAT_KEY_TAKEN,
    ExemplarContexts,
    Instruments,
    SpanWriter,
    StepReader,
    add_stat_keys,
    exact_quantiles,
    feed_layer_stats,
    keep_case,
    key_for,
    leave_out,
    record_durations,
    scaler_skipped_steps,
    set_interval_stats,
)
from otel_train.core.resolve import (
    column_of,
    drop_bad_timer_names,
    dropped_steps,
    histogram_values,
    resolve_values,
    same_tensor_twice,
    seconds_between,
    timer_phases,
    value_owners,
    value_steps,
)
from otel_train.redaction import redact_text

log = logging.getLogger("otel_train")

FLUSH_CPU_WEIGHT = 0.3  # the newest flush's weight in the smoothed CPU per flush


class Worker:
    """The one background thread that turns flushes into telemetry."""

    # Row values another part adds where this rank has none (the reducer on rank 0: the loss a
    # pipeline's last stage recorded); rows only, this rank's own series stay as recorded.
    row_values: Callable[[], Mapping[str, float]] = dict
    # Called every `idle_s` while no flush or message comes (None: never): the cross-rank reducer's
    # keep-alive (`CrossRankReducer.keep_alive`), so that a rank that is alive but not flushing
    # is not taken for gone; it runs here because the exchange is used by this thread alone.
    on_idle: Callable[[], None] | None = None
    idle_s = 1.0

    def __init__(
        self,
        instruments: Instruments,
        step_reader: StepReader,
        sinks: list[Sink],
        listeners: list[FlushListener],
        span_writer: SpanWriter | None,
        queue_size: int,
        total_steps: int | None,
        otel_logger: Any | None = None,
    ) -> None:
        self.instruments = instruments
        self.step_reader = step_reader
        self.sinks = sinks
        self.listeners = listeners
        self.span_writer = span_writer
        self.total_steps = total_steps  # the plan; set_total_steps and the control file change it
        self._plan_in_rows = total_steps  # the plan the rows have carried so far
        self.otel_logger = otel_logger
        # Unbounded: the session bounds flush batches by `max_batches` and messages by
        # `max_messages`, so a burst of messages can never make a flush batch fail to enqueue.
        self.queue: queue.Queue[FlushBatch | Message | None] = queue.Queue()
        self.max_batches = queue_size
        self.max_messages = max(64, queue_size * 8)
        # Single-writer counters: *_put by the session (under its lock), *_done by this thread.
        self.batches_put = self.batches_done = 0
        self.steps_put = self.steps_done = 0
        self.failed_flushes = 0
        self._abandoned = False
        self.final_scalars: dict[str, float] = {}
        self._stat_keys: dict[str, float] = {}  # this flush's interval statistics of users' names
        self._spelling: dict[str, str] = {}  # folded bridge key -> the user's spelling (keep_case)
        # instruments whose values last came only with an explicit step: they have rows of their
        # own at those steps (ScalarsMessage), so the flushes' rows leave them out
        self._own_rows: set[str] = set()
        self.flushes = 0
        self.busy_s = 0.0  # worker time spent processing, for benchmarks
        self.cpu_s = 0.0  # the worker thread's own CPU time spent processing (time.thread_time)
        # Read by the training thread's adaptive cadence: the smoothed CPU of one flush (the first,
        # with its one-off set-up, left out; cadence.WORKER_SHARE), and the densest per-interval
        # list's values per step in the last flush with steps (cadence.steps_that_fit; 0: unknown).
        self.flush_cpu_s = 0.0
        self.values_per_step = 0.0
        self._names_warned: dict[str, int] = {}  # reason -> names warned about (MAX_NAMES_WARNED)
        self._errors_warned: set[str] = set()
        self.sink_errors: dict[str, int] = {}
        self._first_step_ns: int | None = None  # perf_counter_ns when the first step began (the ETA)
        self._last_step: StepEvent | None = None  # the last flush's last step (nested steps)
        self._steps_done = 0
        self.busy_since: float | None = None  # perf_counter when its item began (`stuck_message`)
        self.doing = "idle"
        self.stuck_reported: float | None = None  # the busy_since of the item already reported
        self._thread = threading.Thread(target=self._run, name="otel_train-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit_message(self, message: Message) -> bool:
        """Queue a message; False (not queued) when `max_messages` are waiting."""
        if self.queue.qsize() >= self.max_messages:
            return False
        self.queue.put(message)
        return True

    def pending_batches(self) -> int:
        return self.batches_put - self.batches_done

    def submit_batch(self, batch: FlushBatch) -> None:
        """Never waits: the caller serialises these calls and checked `max_batches` first."""
        self.batches_put += 1
        self.steps_put += batch.steps
        self.queue.put(batch)

    def stop(self, timeout_s: float) -> bool:
        """Finish what is queued and stop; False if not done within timeout_s (the rest is then
        abandoned: see `unwritten`)."""
        self.queue.put(None)
        self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            self._abandoned = True
            return False
        return True

    # The worker iterates `sinks` and `listeners` at every flush: both lists are replaced
    # (copy-on-write), never changed in place, so no flush sees a list mid-change.
    def add_listener(self, listener: FlushListener) -> None:
        self.listeners = [*self.listeners, listener]

    def remove_listener(self, listener: FlushListener) -> None:
        self.listeners = [x for x in self.listeners if x is not listener]

    def add_sink(self, sink: Sink) -> None:
        self.sinks = [*self.sinks, sink]

    def unwritten(self) -> tuple[int, int, int]:
        """(flush batches, steps, log_* messages) handed to the worker that it has not written (yet);
        the messages are those still queued."""
        with self.queue.mutex:  # a snapshot: the training thread may still queue more
            queued = list(self.queue.queue)
        messages = sum(1 for item in queued if item is not None and not isinstance(item, FlushBatch))
        return self.batches_put - self.batches_done, self.steps_put - self.steps_done, messages

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=self.idle_s) if self.on_idle is not None else self.queue.get()
            except queue.Empty:
                self._idle()
                continue
            if item is None or self._abandoned:
                return
            started, cpu_started = time.perf_counter(), time.thread_time()
            self.doing, self.busy_since = "processing a flush", started
            try:
                if isinstance(item, FlushBatch):
                    self._process(item)
                else:
                    self._deliver_message(item)
            except Exception as exc:  # the SDK, torch, user callbacks: one flush, not the thread
                self.failed_flushes += 1
                self.instruments.dropped.add(1, {semconv.REASON: "flush_failed"})
                log.warning(
                    "otel_train: flush %d (step %d) failed and was skipped (%d so far): %r",
                    getattr(item, "seq", -1),
                    getattr(item, "step", -1),
                    self.failed_flushes,
                    exc,
                )
            finally:
                self.busy_since, self.doing = None, "idle"
                self.busy_s += time.perf_counter() - started
                self._done(item, time.thread_time() - cpu_started)

    def _idle(self) -> None:
        on_idle = self.on_idle
        if on_idle is not None:
            on_idle()  # the reducer's keep-alive: it turns its exchange off rather than raise

    def _done(self, item: FlushBatch | Message, cpu_s: float) -> None:
        self.cpu_s += cpu_s
        if not isinstance(item, FlushBatch):
            return
        if not item.final and self.batches_done:
            smoothed = self.flush_cpu_s
            self.flush_cpu_s = cpu_s if smoothed == 0.0 else smoothed + FLUSH_CPU_WEIGHT * (cpu_s - smoothed)
        if not self._abandoned:
            self.steps_done += item.steps
            self.batches_done += 1

    # --- one flush ------------------------------------------------------------------------------
    def _process(self, batch: FlushBatch) -> None:
        interval = resolve_interval(batch, self._last_step)
        self._last_step = batch.step_events[-1] if batch.step_events else self._last_step
        for instrument, raw in batch.scalars.items():
            if raw and batch.stepped.get(instrument, 0) >= len(raw):
                self._own_rows.add(instrument)
            else:
                self._own_rows.discard(instrument)
        self.values_per_step = values_per_step(batch, interval) or self.values_per_step
        skipped = scaler_skipped_steps(batch, interval) if batch.layer_stats else set()
        self.instruments.admit_phases(batch, interval)
        for reason, name in batch.problems:
            self._warn_problem(reason, name)
        if batch.layer_stats:
            feed_layer_stats(self.instruments, batch, interval, skipped)
        exemplars: ExemplarContexts = {}
        if self.span_writer is not None and batch.spans:  # first: the exemplars link to the spans
            records = span_records(batch, MAX_SPAN_RECORDS)
            exemplars = self.span_writer.write(records, batch.perf_to_epoch_ns)
        self._feed(batch, interval, exemplars)
        for step, values in batch.rows:  # steps up to this flush's: before its own row
            self._deliver_message(ScalarsMessage("", values, step))
        for key, step, values in batch.histograms:
            self._deliver_message(HistogramMessage(key, values, step))
        for listener in self.listeners:
            self.doing = f"the flush listener {type(listener).__name__}"
            try:
                listener.on_flush(interval)
            except Exception as exc:  # listeners call torch, NVML, goodput files and user callbacks
                self._warn_once(
                    type(listener).__name__, f"otel_train: {type(listener).__name__} failed: {exc!r}"
                )
        self.doing = "collecting metrics (observable-instrument callbacks, e.g. ones made on ot.get_meter())"
        scalars = self.step_reader.collect_scalars(interval.elapsed_s)
        exact_quantiles(scalars, interval)
        keep_case(scalars, interval.scalars, self._spelling, batch.stepped)
        for key in add_stat_keys(scalars, self._stat_keys):
            self._warn_once(f"stat:{key}", STAT_KEY_TAKEN.format(key=key))
        self._stat_keys.clear()
        leave_out(scalars, self._own_rows)
        for key, value in self.row_values().items():
            scalars.setdefault(key, value)
        self.final_scalars.update(scalars)
        self.flushes += 1
        fresh = any(instrument not in self._own_rows for instrument in batch.scalars)
        # a plan changed after the last step (early stopping) reaches the rows at the final flush
        fresh = fresh or self.total_steps != self._plan_in_rows
        self._plan_in_rows = self.total_steps
        # Nothing new since the last row (a final flush after the last step, a flush filing a
        # log_metrics(step=N) row of its own): the gauges would write that row again.
        if interval.steps or fresh or batch.dropped or interval.phases or batch.phase_errors:
            self._to_sinks(lambda sink: sink.write_scalars(interval.step, interval.wall_time, scalars))

    def _feed(self, batch: FlushBatch, interval: Interval, exemplars: ExemplarContexts) -> None:
        ins = self.instruments
        if interval.steps:
            ins.steps.add(interval.steps)
            ins.current_step.set(interval.step)
            ins.last_step_time.set(interval.wall_time)
        if interval.tokens:
            ins.tokens.add(interval.tokens)
        if interval.samples:
            ins.samples.add(interval.samples)
        # Sampled steps' durations go one by one with their span's context (trace-based exemplars);
        # the rest reach the SDK as one aggregation step per series and flush (resolve.record_many).
        record_durations(ins.step_duration, interval.step_durations, None, {}, exemplars)
        for name, values in interval.phases.items():
            record_durations(ins.phase_duration, values, name, {semconv.PHASE: name}, exemplars)
        for (name, error), values in batch.phase_errors.items():
            attributes = {semconv.PHASE: name, semconv.ERROR_TYPE: error}
            record_durations(ins.phase_duration, values, name, attributes, exemplars)
        for instrument, values in interval.scalars.items():
            gauge = ins.gauge(instrument)
            if gauge is None:
                batch.dropped["too_many_names"] = batch.dropped.get("too_many_names", 0) + 1
                continue
            # the interval's mean (see semconv.INTERVAL_STATS); a stepped value's latest
            gauge.set(values[-1] if instrument in batch.stepped else math.fsum(values) / len(values))
            set_interval_stats(ins, self._stat_keys, instrument, values)
        for reason, count in batch.dropped.items():
            ins.dropped.add(count, {semconv.REASON: reason})
        if self._first_step_ns is None and batch.step_events:
            # the rate counts from the first step: set-up (a checkpoint load, compiling) is not a step
            self._first_step_ns = batch.step_events[0][1]
        self._steps_done += interval.steps
        if self.total_steps:
            ins.total_steps.set(self.total_steps)
            remaining = max(0, self.total_steps - (interval.step + 1))
            if self._steps_done and self._first_step_ns is not None:
                # on the monotonic clock: a wall-clock step (NTP, a resumed VM) is no elapsed time
                elapsed = (batch.wall_perf_ns - self._first_step_ns) * 1e-9
                ins.eta.set(remaining * elapsed / self._steps_done)

    def _deliver_message(self, message: Message) -> None:
        message = _prepared(message)
        self._log_record(message)
        self._to_sinks(lambda sink: _write(sink, message))

    def _to_sinks(self, write: Callable[[Sink], None]) -> None:
        for sink in self.sinks:
            self.doing = f"writing to the sink {type(sink).__name__}"
            try:
                write(sink)
            except Exception as exc:  # the run directory's files, the console, the bridges' backends
                self.sink_errors[sink.name] = self.sink_errors.get(sink.name, 0) + 1
                self.instruments.dropped.add(1, {semconv.REASON: "sink_error"})
                self._warn_once(
                    f"{sink.name}:{getattr(exc, 'filename', None)}",  # once per sink and file
                    f"otel_train: sink {sink.name} failed: {type(exc).__name__}: {exc}. "
                    "Further failures of this sink are counted in otel_train.dropped{reason=sink_error}.",
                )

    def _log_record(self, message: Message) -> None:
        """Messages also leave as OTel log records, for the collector, except a step's row of
        scalars: its values reach the OTel gauges with the next flush."""
        if self.otel_logger is None or isinstance(message, ScalarsMessage):
            return
        try:
            self.otel_logger.emit(
                severity_number=SeverityNumber.INFO,
                severity_text="INFO",
                body=_log_body(message),
                attributes={"otel_train.key": message.key, "train.step": message.step},
                event_name=message.event_name,
            )
        except Exception as exc:  # the OTel SDK's log pipeline
            self._warn_once("log_record", f"otel_train: could not emit a log record: {exc!r}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._errors_warned:
            self._errors_warned.add(key)
            log.warning(message)

    def _warn_problem(self, reason: str, name: str) -> None:
        """Once per name for the first MAX_NAMES_WARNED names of a reason, then one line for the
        rest: a run inventing names must not flood the log, nor grow this set."""
        key = f"problem:{reason}:{name}"
        if key in self._errors_warned:
            return
        warned = self._names_warned.get(reason, 0)
        if warned < MAX_NAMES_WARNED:
            self._names_warned[reason] = warned + 1
            self._warn_once(key, problem_warning(reason, name))
        elif warned == MAX_NAMES_WARNED:
            self._names_warned[reason] = warned + 1
            log.warning(
                "otel_train: values of more than %d names were dropped for %s; no more warnings for "
                "it (all are counted in otel_train.dropped{reason=%s}).",
                MAX_NAMES_WARNED,
                reason,
                "invalid_value" if reason == "bad_count" else reason,
            )


# --- one flush's interval: the batch's raw data as host floats ----------------------------
def resolve_interval(batch: FlushBatch, last_step: StepEvent | None = None) -> Interval:
    """The batch as host floats; bad values are dropped and counted in `batch.dropped`, non-finite
    ones also per instrument in the interval. `last_step`: the previous flush's last step event."""
    if batch.cuda_event is not None:
        batch.cuda_event.synchronize()  # waits here, on the worker, never on the training thread
    drop_bad_timer_names(batch)
    previous = last_step[0] if last_step is not None else None
    rerun_s, rerun_starts, failed_steps = resolve_steps(batch, last_step)
    scalars: dict[str, list[float]] = {}
    scalar_steps: dict[str, list[int]] = {}
    nonfinite: dict[str, int] = {}
    nonfinite_steps: dict[str, list[int]] = {}
    for instrument, raw in batch.scalars.items():
        resolved, dropped = resolve_values(raw)
        for reason, count in dropped.items():
            batch.dropped[reason] = batch.dropped.get(reason, 0) + count
            if reason in PROBLEMS:  # the worker warns once per reason and name
                batch.problems[reason, instrument] = None
        if len(set(map(id, raw))) < len(raw) and same_tensor_twice(raw):
            batch.problems["same_tensor", instrument] = None
        owners = value_owners(batch.step_indices, batch.after_step.get(instrument), previous, len(raw))
        if dropped.get("nonfinite", 0):
            nonfinite[instrument] = dropped["nonfinite"]
            if len(dropped) == 1:  # every value dropped was NaN/Inf: the dropped positions are theirs
                steps = dropped_steps(resolved, owners, instrument in batch.merged)
                if steps is not None:
                    nonfinite_steps[instrument] = steps
        values = [v for v in resolved if v is not None]
        if values:
            scalars[instrument] = values
            steps = value_steps(resolved, owners, instrument in batch.merged)
            if steps is not None:
                scalar_steps[instrument] = steps
    phases, arrivals, data_s = timer_phases(batch, rerun_starts)
    for name, start, end in batch.cuda_timers:
        try:
            end.synchronize()
            phases.setdefault(name, []).append(start.elapsed_time(end) / 1000.0)
        except RuntimeError:  # a CUDA error of torch's events
            batch.dropped["cuda_timer"] = batch.dropped.get("cuda_timer", 0) + 1
    if batch.dropped.get("too_many_values"):
        batch.problems["too_many_values", overflowed(batch, phases)] = None
    return Interval(
        **header_of(batch),
        phases=phases,
        arrivals=arrivals,
        data_s=data_s,
        rerun_s=rerun_s,
        failed_steps=failed_steps,
        scalars=scalars,
        scalar_steps=scalar_steps,
        nonfinite=nonfinite,
        nonfinite_steps=nonfinite_steps,
    )


def resolve_steps(
    batch: FlushBatch, last_step: StepEvent | None = None
) -> tuple[float, set[int], list[tuple[int, float]]]:
    """Fill the batch's step durations, indices, tokens and samples from its step events; return
    goodput's wasted progress in seconds (steps up to `rerun_through`), those steps' starts, and the
    failed steps as (the step that ended before it, seconds). Columns are read in C (`map`): the
    worker holds the GIL the training thread needs."""
    events = batch.step_events
    if not events:
        return 0.0, set(), []
    starts = column_of(events, 1)
    # The process's first steps: their interval's rates count from the first one's start, not init().
    if last_step is None and batch.wall_perf_ns > starts[0]:
        batch.elapsed_s = min(batch.elapsed_s, (batch.wall_perf_ns - starts[0]) * 1e-9)
    # a step that began before one that ended ahead of it held that one (ot.step in an open ot.step)
    if not all(map(le, starts, starts[1:])) or (last_step is not None and starts[0] <= last_step[1]):
        events = batch.step_events = outermost_steps(batch, last_step)
    indices, starts, ends, tokens, samples, failed = (column_of(events, k) for k in range(6))
    batch.step_indices.extend(indices)
    failed_steps: list[tuple[int, float]] = []
    if any(failed):  # failed steps: no duration, no counts
        before = [last_step[0] if last_step is not None else -1, *indices[:-1]]
        failed_steps = [
            (b, (e - s) * 1e-9) for b, s, e, f in zip(before, starts, ends, failed, strict=True) if f
        ]
        done = [not f for f in failed]
        indices, starts, ends, tokens, samples = (
            list(compress(column, done)) for column in (indices, starts, ends, tokens, samples)
        )
        batch.completed_step = max(indices, default=-1)
    batch.step_durations.extend(seconds_between(starts, ends))
    if starts:
        batch.last_step_start = batch.wall_time - (batch.wall_perf_ns - starts[-1]) * 1e-9
    batch.tokens += count_sum(batch, "tokens", tokens)
    batch.samples += count_sum(batch, "samples", samples)
    through = batch.rerun_through
    if through < 0:  # no earlier process of this run id (or unnumbered steps)
        return 0.0, set(), failed_steps
    reruns = [
        (start, end) for index, start, end in zip(indices, starts, ends, strict=True) if index <= through
    ]
    return sum([end - start for start, end in reruns]) * 1e-9, {start for start, _ in reruns}, failed_steps


def outermost_steps(batch: FlushBatch, last_step: StepEvent | None) -> list[StepEvent]:
    """The step events without those nested in another, so a step counts once: as the outer one,
    with the inner one's counts where it gave none. An inner step ends first; where the previous
    flush took it (`last_step`), the outer one is dropped instead. Counted as `nested_step`."""
    kept: list[StepEvent] = []
    for index, start, end, tokens, samples, failed in batch.step_events:
        while kept and kept[-1][1] >= start:  # the last kept step ran inside this one
            inner = kept.pop()
            tokens = inner[3] if tokens is None else tokens
            samples = inner[4] if samples is None else samples
            _count_nested(batch, inner[5])
        if not kept and last_step is not None and last_step[1] >= start:
            _count_nested(batch, failed)  # held the previous flush's last step, counted there
            batch.tokens += count_sum(batch, "tokens", [tokens if last_step[3] is None else None])
            batch.samples += count_sum(batch, "samples", [samples if last_step[4] is None else None])
            continue
        kept.append((index, start, end, tokens, samples, failed))
    return kept


def _count_nested(batch: FlushBatch, failed: bool) -> None:
    batch.steps -= not failed
    batch.dropped["nested_step"] = batch.dropped.get("nested_step", 0) + 1
    batch.problems["nested_step", "ot.step"] = None


def count_sum(batch: FlushBatch, what: str, counts: Sequence[int | None]) -> int:
    """The steps' tokens= or samples=; negative or huge ones (the hot path appends a plain int
    unchecked) are dropped and counted."""
    given: list[int] = list(filter(None, counts))
    if given and (min(given) < 0 or max(given) > MAX_STEP):
        bad = [c for c in given if not 0 <= c <= MAX_STEP]
        batch.dropped["invalid_value"] = batch.dropped.get("invalid_value", 0) + len(bad)
        batch.problems["bad_count", f"{what}={bad[0]}"] = None
        given = [c for c in given if 0 < c <= MAX_STEP]
    return sum(given)


def overflowed(batch: FlushBatch, phases: Mapping[str, list[float]]) -> str:
    """What outgrew max_values_per_interval in `batch` (for the warning): the first full list."""
    cap = batch.value_cap or MAX_STEP  # 0: uncapped lists (a test's batch)
    full = [name for name, raw in batch.scalars.items() if len(raw) >= cap]
    full += [f"the timer {name!r}" for name, values in phases.items() if len(values) >= cap]
    if len(batch.step_events) >= cap:
        full.append("the step durations (ot.step)")
    if len(batch.timer_events) >= cap * TIMER_EVENTS_PER_VALUE:
        full.append("all timers together")
    return full[0] if full else "a per-interval list (phases, CUDA timers, histograms, ot.watch)"


def values_per_step(batch: FlushBatch, interval: Interval) -> float | None:
    """Values per step of the densest per-interval list, counting the values dropped beyond the
    cap as its own (None: no step ended)."""
    steps = len(batch.step_indices)
    if not steps:
        return None
    densest = max(
        max(map(len, batch.scalars.values()), default=0),
        max(map(len, interval.phases.values()), default=0),
    )
    return max(1, densest + batch.dropped.get("too_many_values", 0)) / steps


# The warnings about one reason name at most this many names; then one line for the rest.
MAX_NAMES_WARNED = 20

# What the worker says, once per reason and name, the first time values are dropped (or suspect);
# {name}: the instrument. Every drop is also counted in otel_train.dropped{reason}.
PROBLEMS = {
    "invalid_type": "a value of {name} was not a number (None, a str, a bool, a complex number, ...)",
    "non_scalar_tensor": "a tensor of {name} had more than one element (record a scalar, x.mean())",
    "nonfinite": "a value of {name} was NaN or Inf",
    "no_data_tensor": "a value of {name} was a tensor with no data (a meta or fake tensor):",
    "overflow": "a value of {name} was too large for a float64",
    "invalid_timer_name": "a timer's name was not a str ({name}): its phases were",
    "too_many_names": (
        "the timer or span {name!r} is one name more than max_metric_names distinct timer and span "
        "names (a name made per step? raise OTEL_TRAIN_MAX_METRIC_NAMES if intended): its phases were"
    ),
    "bad_count": "ot.step({name}): a count must be >= 0 (and < 2**63); such counts were",
    "nested_step": (
        "an {name} began inside an open step (a decorated step under a framework's step marks, two "
        "decorated layers, or a step never ended: a generator left suspended inside `with "
        "ot.step()` holds its step open): a step is counted once, as the outer one; mark steps in "
        "one place and time the parts of a step with ot.timer. The nested steps were"
    ),
    "too_many_values": (
        "more values of {name} than max_values_per_interval came in one flush interval (raise "
        "OTEL_TRAIN_MAX_VALUES_PER_INTERVAL, or flush more often with log_interval); the rest were"
    ),
    "same_tensor": (
        "the same tensor object was recorded several times in one interval as {name}: values are "
        "read at the flush, so a tensor changed in place (an accumulator, a Parameter) gives its "
        "latest value for every step; record a copy (x.detach().clone()) or a float"
    ),
}


def problem_warning(reason: str, name: str) -> str:
    text = PROBLEMS.get(reason, "values of {name} were").format(name=name)
    if reason == "same_tensor":
        return f"otel_train: {text}."
    counted = "invalid_value" if reason == "bad_count" else reason
    joined = f"{text} dropped" if text.endswith(("were", ":")) else f"{text}: dropped"  # "... were dropped"
    return f"otel_train: {joined} and counted as otel_train.dropped{{reason={counted}}} (warned once)."


def _prepared(message: Message) -> Message:
    """As the sinks and the log record get it (hyperparameters were redacted by the API)."""
    match message:
        case HistogramMessage():
            return replace(message, values=histogram_values(message.values))
        case TextMessage():
            return replace(message, text=redact_text(message.text))
        case SamplesMessage():
            return replace(message, rows=[(redact_text(p), redact_text(o)) for p, o in message.rows])
        case HparamsMessage():
            return message
        case ScalarsMessage():
            return replace(message, values=_row(message.values))


def _row(values: Mapping[str, Any]) -> dict[str, float]:
    """A step's row: bridge keys and finite floats (drops were counted with the flush's values)."""
    resolved, _ = resolve_values(list(values.values()))
    return {key_for(k, {}): v for k, v in zip(values, resolved, strict=True) if v is not None}


def _write(sink: Sink, message: Message) -> None:
    match message:
        case TextMessage(key, text, step):
            sink.write_text(key, text, step)
        case SamplesMessage(key, rows, step):
            sink.write_samples(key, rows, step)
        case HistogramMessage(key, values, step):
            sink.write_histogram(key, values, step)
        case HparamsMessage(params=params):
            sink.write_hparams(params)
        case ScalarsMessage(values=values, step=step):
            if values:
                sink.write_scalars(step, time.time(), values)


def _log_body(message: Message) -> Any:
    match message:  # a ScalarsMessage has no log record (`_log_record`)
        case TextMessage(text=text):
            return text
        case SamplesMessage(rows=rows):
            return json.dumps([{"prompt": p, "output": o} for p, o in rows])
        case HistogramMessage(values=values):
            body: dict[str, Any] = {"count": len(values)}
            if values:
                body.update(min=min(values), max=max(values), mean=sum(values) / len(values))
            return body
        case HparamsMessage(params=params):
            return json.dumps(params, default=str, sort_keys=True)


def stuck_message(worker: Worker, limit_s: float) -> str | None:
    """Once per item: what `worker` is doing when it has been on it for `limit_s` (a user callback
    that hangs, a dead file system), else None."""
    since, doing = worker.busy_since, worker.doing
    if since is None or since == worker.stuck_reported:
        return None
    busy_s = time.perf_counter() - since
    if busy_s < limit_s:
        return None
    worker.stuck_reported = since
    return (
        f"the otel_train background worker has been {doing} for {busy_s:.0f}s; no telemetry is "
        "written until it returns (flushes wait; values beyond max_values_per_interval are dropped)"
    )
