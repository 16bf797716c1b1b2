"""The hot-path accumulator (the training thread only appends here: no OTel SDK, device value or
I/O) and the records that leave it: a flush's `FlushBatch`, the `Interval` the worker resolves it
into for every `FlushListener`, and the logger API's `Message` records. Design:
docs/design/core.md#one-flush.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Protocol

from otel_train import semconv

log = logging.getLogger("otel_train")


# --- the listener seam: what the training thread knows at a flush (`FlushHeader`), extended by the
# raw `FlushBatch` and the resolved `Interval`, so the shared fields are declared once ---
@dataclass
class FlushHeader:
    seq: int  # flush sequence number: the same on every rank for the same flush
    step: int  # index of the last completed step (-1 before the first)
    wall_time: float  # time.time() at the flush
    elapsed_s: float  # wall seconds since the previous flush
    steps: int  # steps completed in this interval
    tokens: int
    samples: int
    step_durations: list[float] = field(default_factory=list)  # seconds, one per step
    _: KW_ONLY  # the rest by name only, so the subclasses' own fields keep their positions
    final: bool = False  # the last flush, from shutdown()
    autocast_dtype: str | None = None  # the torch.autocast dtype active on the training thread at the flush
    # this process's flush schedule: every flush_interval steps from step flush_anchor on (cadence.py)
    flush_interval: int = 0
    flush_anchor: int = -1
    completed_step: int | None = None  # where steps failed: the highest index of one that did not
    last_step_start: float = math.nan  # time.time() when the interval's last completed step began


def finite(values: Iterable[float]) -> list[float]:
    """The finite values, in order: in the usual case (all finite) one check at C speed."""
    values = values if isinstance(values, list) else list(values)
    if all(map(math.isfinite, values)):
        return values
    return [v for v in values if math.isfinite(v)]


def header_of(flush: FlushHeader) -> dict[str, Any]:
    return {f.name: getattr(flush, f.name) for f in fields(FlushHeader)}


@dataclass
class Interval(FlushHeader):
    phases: dict[str, list[float]] = field(default_factory=dict)  # timer name -> durations (s)
    # timer name -> seconds from its step's start to the timer's end (CPU timers inside a step only)
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    # seconds of data-phase timers (goodput.DATA_PHASES) inside steps that did not re-run a step
    data_s: float = 0.0
    rerun_s: float = 0.0  # seconds of steps that re-ran a step of the previous processes (goodput)
    failed_steps: list[tuple[int, float]] = field(default_factory=list)  # (step ended before it, seconds)
    scalars: dict[str, list[float]] = field(default_factory=dict)  # instrument name -> finite values
    # instrument name -> the step of each of its finite values, where known: values recorded the same
    # number of times in every step of the interval (see FlushBatch.step_indices); absent otherwise
    scalar_steps: dict[str, list[int]] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)  # instrument name -> NaN/Inf values dropped
    # instrument name -> the steps of those values, where the worker could tell (one value a step)
    nonfinite_steps: dict[str, list[int]] = field(default_factory=dict)
    # (step, layers) for each watched step whose per-layer gradient norms held NaN/Inf, in module order
    nonfinite_grads: list[tuple[int, list[str]]] = field(default_factory=list)
    # (step, layer labels, per-layer gradient L2 norms) for each watched step, in step order; an
    # absent gradient is 0.0, a non-finite one NaN/Inf (also listed in nonfinite_grads)
    layer_grad_norms: list[tuple[int, tuple[str, ...], list[float]]] = field(default_factory=list)
    # (step, layer labels, per-layer parameter L2 norms) for each watched step, in step order
    layer_param_norms: list[tuple[int, tuple[str, ...], list[float]]] = field(default_factory=list)
    # (step, [sum, sum of squares]) of each watched step's batch (ot.watch), in step order
    batch_fingerprints: list[tuple[int, list[float]]] = field(default_factory=list)


class FlushListener(Protocol):
    """Called on the worker at every flush, before the StepReader collects: gauges a listener sets
    here appear in the same flush's sink output."""

    def on_flush(self, interval: Interval) -> None: ...

    def close(self) -> None: ...


# --- the buffer ---
MAX_STEP = 2**63 - 1  # a step or a count must fit an int64 (Prometheus, TensorBoard, JSON readers)
MAX_ERROR_TYPES = 8
MAX_SPAN_RECORDS = 10_000  # span records per interval (sampled steps, their timers, ot.span marks)
# All timers together may append this many times max_values_per_interval events per interval (the
# cap per timer name is applied on the worker).
TIMER_EVENTS_PER_VALUE = 16


class SpanRole(Enum):
    """A whole step, a timer inside one (a child of the step's span), or an `ot.span` mark (a
    sibling under the step's trace root)."""

    STEP = "step"
    PHASE = "phase"
    MARK = "mark"


BAD_NAME = (
    "record() name {!r} cannot be made a valid metric name (ASCII letters, digits, _ and /, at most 120 "
    "characters); dropped."
)

# (index, start_ns, end_ns, tokens, samples, failed): one step as the training thread saw it end
StepEvent = tuple[int, int, int, int | None, int | None, bool]


@dataclass
class SpanRecord:
    name: str
    start_ns: int  # perf_counter_ns
    end_ns: int
    step: int
    error: str | None = None
    kind: SpanRole = SpanRole.PHASE
    attributes: dict[str, str | int | float] | None = None


def step_record(start_ns: int, end_ns: int, index: int, failed: bool, profiled: bool) -> SpanRecord:
    attrs: dict[str, str | int | float] | None = {"train.profiled": True} if profiled else None
    return SpanRecord("step", start_ns, end_ns, index, "StepFailed" if failed else None, SpanRole.STEP, attrs)


def mark_record(
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


def span_records(batch: FlushBatch, limit: int) -> list[SpanRecord]:
    """The batch's span records and its traced steps' timers (matched by the step's start), at most
    `limit` in all."""
    records = batch.spans
    traced = {r.start_ns: r.step for r in records if r.kind is SpanRole.STEP}
    if not traced:
        return records
    timers = [
        SpanRecord(name, start, end, traced[began])
        for name, start, end, began in batch.timer_events
        if began in traced
    ]
    return records + timers[: max(0, limit - len(records))]


# A LayerStats record that is no metric: the GradScaler's found_inf of a fused optimizer's step (its
# optimizer step ran, and skipped the update on the device), so the worker drops that step's gradients.
SCALER_FOUND_INF = "otel_train.scaler_found_inf"


@dataclass
class LayerStats:
    """One ot.watch statistic for every layer of a watched step."""

    instrument: str
    labels: tuple[str, ...]
    values: Any  # a 1-D device tensor, one value per label
    step: int


@dataclass(kw_only=True)
class FlushBatch(FlushHeader):
    """One interval as the training thread hands it over (raw values), for the worker to resolve."""

    phases: dict[str, list[float]]  # ot.phase() durations (timers' are in `timer_events`)
    # every timer that ended without an error, in order: (name, start_ns, end_ns, its step's start_ns
    # or 0 outside a step); the worker derives durations, arrivals, spans and goodput's data time
    timer_events: list[tuple[str, int, int, int]]
    phase_errors: dict[tuple[str, str], list[float]]
    scalars: dict[str, list[Any]]  # instrument name -> raw values (numbers or tensors)
    cuda_timers: list[tuple[str, Any, Any]]  # (phase, start event, end event)
    spans: list[SpanRecord]
    dropped: dict[str, int]
    perf_to_epoch_ns: int
    wall_perf_ns: int = 0  # time.perf_counter_ns() read with wall_time: the clocks paired at the flush
    cuda_event: Any = None  # recorded on the training stream at the flush, when tensors are on CUDA
    layer_stats: list[LayerStats] = field(default_factory=list)
    histograms: list[tuple[str, int, Any]] = field(default_factory=list)  # (key, step, device tensor)
    # every step that ended, failed ones too, in order (the worker fills it from step_events)
    step_indices: list[int] = field(default_factory=list)
    merged: set[str] = field(default_factory=set)  # instruments fed by several record names (no order)
    # instrument -> how many of the interval's steps had ended when its first value came, where
    # that value came between steps (`ot.record` after a decorated step returned): see value_owners
    after_step: dict[str, int] = field(default_factory=dict)
    # instrument -> how many of its values were logged with log_metrics(step=N): such a value has
    # a row of its own and the gauge holds its latest, not the interval's mean
    stepped: dict[str, int] = field(default_factory=dict)
    # every step that ended, up to max_values_per_interval (the rest: counts in the header only)
    step_events: list[StepEvent] = field(default_factory=list)
    value_cap: int = 0  # max_values_per_interval: the worker caps each timer's durations at it (0: no cap)
    rerun_through: int = -1  # steps up to this index re-run the previous processes' (goodput)
    # worker: (reason, name) of each problem found (an ordered set; warned once per reason and name)
    problems: dict[tuple[str, str], None] = field(default_factory=dict)
    # log_metrics(values, step=N)'s rows, in call order: with the flush, not the message queue,
    # which a row every step would outrun whenever the worker is a few flushes behind
    rows: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


class Buffer:
    def __init__(self, max_names: int, max_values: int) -> None:
        self.max_names = max_names
        self.max_values = max_values
        self.max_timer_events = max_values * TIMER_EVENTS_PER_VALUE
        self._name_map: dict[str, str | None] = {}  # record name -> instrument name (None: rejected)
        self._owners: dict[str, str] = {}  # instrument name -> first record name that claimed it
        self._prom_owners: dict[str, str] = {}  # Prometheus name -> the user instrument holding it
        # rejected record names cached in _name_map, oldest first, at most max_names x 8, with the
        # reason they are dropped: a run inventing a name every step keeps a bounded map, while
        # repeated names stay cheap
        self._rejected: dict[str, str] = {}
        self.warned: set[str] = set()
        self._user_names = 0
        self._reset()

    def _reset(self) -> None:
        self.scalars: dict[str, list[Any]] = {}
        self.phases: dict[str, list[float]] = {}
        # one flat list (see FlushBatch), so a timer's end touches little (capped at max_timer_events)
        self.timer_events: list[tuple[str, int, int, int]] = []
        self.step_events: list[StepEvent] = []  # appended by Session.end_step (see FlushBatch)
        self.phase_errors: dict[tuple[str, str], list[float]] = {}
        self.cuda_timers: list[tuple[str, Any, Any]] = []
        self.spans: list[SpanRecord] = []
        self.dropped: dict[str, int] = {}
        self.layer_stats: list[LayerStats] = []
        self.histograms: list[tuple[str, int, Any]] = []
        self.stepped: dict[str, int] = {}  # see FlushBatch.stepped
        self.after_step: dict[str, int] = {}  # record name -> see FlushBatch.after_step
        self.rows: list[tuple[int, dict[str, Any]]] = []  # see FlushBatch.rows
        self.steps = 0  # steps that ended without failing: set by the session before take()
        self.tokens = 0  # of the steps beyond the step_events cap only (session._uncapped_step)
        self.samples = 0

    # --- hot path ------------------------------------------------------------------------------
    def add_scalar(self, name: str, value: Any) -> None:
        values = self.scalars.get(name)
        if values is None:
            values = self._open_scalar(name)
            if values is None:
                return
        if len(values) < self.max_values:
            if (
                value.__class__ is not float
                and value.__class__ is not int
                and getattr(value, "requires_grad", False)
            ):
                value = value.detach()  # never keep an autograd graph alive until the flush
            values.append(value)
        else:
            self.drop("too_many_values")

    def add_phase(self, name: str, seconds: float) -> None:
        self._append(self.phases.setdefault(name, []), seconds)

    def add_phase_error(self, name: str, error: str, seconds: float) -> None:
        key = (name, error)
        values = self.phase_errors.get(key)
        if values is None:
            if len(self.phase_errors) >= MAX_ERROR_TYPES * 4:
                self.drop("too_many_error_types")
                return
            values = self.phase_errors[key] = []
        self._append(values, seconds)

    # --- ot.watch (watched steps only) ------------------------------------------------------------
    def add_layer_stats(self, records: list[LayerStats]) -> None:
        if len(self.layer_stats) + len(records) <= self.max_values:
            self.layer_stats.extend(records)
        else:
            self.drop("too_many_values", len(records))

    def add_cuda_timer(self, name: str, start: Any, end: Any) -> None:
        self._append(self.cuda_timers, (name, start, end))

    def add_histogram(self, key: str, step: int, values: Any) -> None:
        self._append(self.histograms, (key, step, values))

    def add_row(self, step: int, values: dict[str, Any]) -> None:
        self._append(self.rows, (step, values))

    def add_internal(self, instrument: str, value: Any) -> None:
        """A catalogue gauge fed by otel_train itself, under the instrument's own name (so no
        user record name is ever reported as merged with it)."""
        values = self.scalars.get(instrument)
        if values is None:
            self._name_map[instrument] = instrument
            values = self.scalars[instrument] = []
        self._append(values, value)

    def instrument_of(self, name: str) -> str | None:
        """The instrument a record() name seen before maps to (None: unseen or rejected)."""
        return self._name_map.get(name) if isinstance(name, str) else None

    def has_user_name_for(self, instrument: str) -> bool:
        """Whether a user's record() name maps to `instrument` (from its first record on, so the
        series stays the user's and never switches back to otel_train's own values)."""
        owner = self._owners.get(instrument)
        return owner is not None and owner != instrument

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count

    def _append(self, values: list[Any], item: Any) -> None:
        if len(values) < self.max_values:
            values.append(item)
        else:
            self.drop("too_many_values")

    # --- first sight of a name (once per name, not per step) ------------------------------------
    def _open_scalar(self, name: str) -> list[Any] | None:
        """Register a record() name (`scalars` is by record name; take() merges by instrument)."""
        if not isinstance(name, str):
            self.drop("invalid_name")
            self.warn_once(repr(name), f"record() name {name!r} is not a string; dropped.")
            return None
        if name in self._name_map:
            instrument = self._name_map[name]
        else:
            instrument, refusal = self._map_name(name)
            self._name_map[name] = instrument
            if instrument is None:
                self._rejected[name] = refusal
                if len(self._rejected) > self.max_names * 8:
                    oldest = next(iter(self._rejected))
                    del self._rejected[oldest], self._name_map[oldest]
        if instrument is None:
            self.drop(self._rejected.get(name, "invalid_name"))  # evicted meanwhile by another thread
            return None
        values: list[Any] = []
        self.scalars[name] = values
        return values

    def _map_name(self, name: str) -> tuple[str | None, str]:
        """The instrument `name` feeds, or None and the reason it is dropped."""
        instrument = semconv.instrument_name_for(name)
        if instrument is None:
            self.warn_once(name, BAD_NAME.format(name))
            return None, "invalid_name"
        spec = semconv.BY_NAME.get(instrument)
        if spec is None and self._user_names >= self.max_names and self._is_new(instrument):
            # Refused before reserved_by's ~100 pattern matches (~15 us), which a name beyond the
            # cache would pay at every call.
            self._warn_too_many_names(name)
            return None, "too_many_names"
        if spec is not None and spec.kind is not semconv.Kind.GAUGE:
            self.warn_once(
                name, f"record() name {name!r} collides with the {spec.kind.value} {instrument!r}; dropped."
            )
            return None, "invalid_name"
        if spec is None or instrument in semconv.INTERVAL_STAT_NAMES:
            reserved = semconv.reserved_by(semconv.otel_name(instrument))
            if reserved is not None:
                self.warn_once(
                    name,
                    f"record() name {name!r} would overwrite or duplicate otel_train's own {reserved!r} "
                    "(its keys in the run dir and bridges, or its Prometheus series); dropped and counted "
                    "as otel_train.dropped{reason=reserved_name}. Use a name of your own, e.g. "
                    f"'custom/{name.strip('/').replace('/', '_')}'.",
                )
                return None, "reserved_name"
            # Names that differ only in . _ / - become ONE Prometheus name: one instrument for them.
            # Names that differ only in case stay apart (run dir and bridges are case-sensitive)
            # and share one OTel instrument (its names are not).
            prom = semconv.prometheus_sanitized(semconv.otel_name(instrument))
            claimed = self._prom_owners.setdefault(prom, instrument)
            if claimed != instrument and semconv.otel_name(claimed) == semconv.otel_name(instrument):
                self.warn_once(
                    name,
                    f"record() names {self._owners.get(claimed, claimed)!r} and {name!r} differ only in "
                    f"case: separate keys in the run dir and bridges, one OTLP/Prometheus series "
                    f"{semconv.otel_name(instrument)!r} (OTel names are case-insensitive) holding the "
                    "last one recorded in each interval.",
                )
            elif claimed != instrument:
                self.warn_once(
                    name, f"record() name {name!r} is the Prometheus name {prom!r} of {claimed!r}; merged."
                )
                instrument = claimed
        owner = self._owners.get(instrument)
        if owner is None:
            if spec is None and self._user_names >= self.max_names:
                self._warn_too_many_names(name)
                return None, "too_many_names"
            if spec is None:
                self._user_names += 1
            self._owners[instrument] = name
        elif owner != name:
            self.warn_once(name, f"record() names {owner!r} and {name!r} both map to {instrument!r}; merged.")
        return instrument, ""

    def _is_new(self, instrument: str) -> bool:
        """Whether a user instrument name would claim a new instrument (nor held, nor merged)."""
        otel = semconv.otel_name(instrument)
        return instrument not in self._owners and semconv.prometheus_sanitized(otel) not in self._prom_owners

    def _warn_too_many_names(self, name: str) -> None:
        self.warn_once(
            "<max_metric_names>",
            f"record() got more than max_metric_names={self.max_names} distinct names (first over: {name!r}); "
            "new names are dropped and counted as otel_train.dropped{reason=too_many_names}. "
            "Raise OTEL_TRAIN_MAX_METRIC_NAMES if intended.",
        )

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned and len(self.warned) < 1000:
            self.warned.add(key)
            log.warning(message if message.startswith("otel_train: ") else f"otel_train: {message}")

    # --- flush ----------------------------------------------------------------------------------
    def take(self, seq: int, step: int, elapsed_s: float, perf_to_epoch_ns: int) -> FlushBatch:
        """Swap out this interval's data (training thread; O(names))."""
        scalars: dict[str, list[Any]] = {}
        merged_names: set[str] = set()
        # A snapshot: another thread may record a new name meanwhile (list() copies under the GIL).
        for record_name, values in list(self.scalars.items()):
            instrument = self._name_map.get(record_name)
            if instrument is None or not values:
                continue
            merged = scalars.get(instrument)
            if merged is None:
                scalars[instrument] = values
            else:
                merged.extend(values)  # two names' values, no longer in step order
                merged_names.add(instrument)
        batch = FlushBatch(
            seq=seq,
            step=step,
            wall_time=time.time(),
            wall_perf_ns=time.perf_counter_ns(),
            elapsed_s=elapsed_s,
            steps=self.steps,
            tokens=self.tokens,
            samples=self.samples,
            phases=self.phases,
            timer_events=self.timer_events,
            phase_errors=self.phase_errors,
            scalars=scalars,
            cuda_timers=self.cuda_timers,
            spans=self.spans,
            dropped=self.dropped,
            perf_to_epoch_ns=perf_to_epoch_ns,
            layer_stats=self.layer_stats,
            histograms=self.histograms,
            merged=merged_names,
            after_step={
                instrument: ended
                for name, ended in self.after_step.items()
                if (instrument := self._name_map.get(name)) is not None and instrument not in merged_names
            },
            stepped=self.stepped,
            step_events=self.step_events,
            value_cap=self.max_values,
            rows=self.rows,
        )
        self._reset()
        return batch


# --- what the logger API hands the worker besides flushes (log_text, log_samples, log_histogram,
# log_hyperparams: in the flushes' queue, so they keep their order; log_metrics(step=N)'s row rides
# the next flush itself, FlushBatch.rows) ---
@dataclass(frozen=True)
class TextMessage:
    event_name: ClassVar[str] = "otel_train.text"  # the OTel log record's event name
    key: str
    text: str
    step: int


@dataclass(frozen=True)
class SamplesMessage:
    event_name: ClassVar[str] = "otel_train.samples"
    key: str
    rows: list[tuple[str, str]]  # (prompt, output)
    step: int


@dataclass(frozen=True)
class HistogramMessage:
    event_name: ClassVar[str] = "otel_train.histogram"
    key: str
    values: Any  # a tensor, array or sequence as recorded; finite floats once the worker resolved it
    step: int


@dataclass(frozen=True)
class HparamsMessage:
    event_name: ClassVar[str] = "otel_train.hparams"
    key: str
    params: dict[str, Any]  # already redacted by ot.log_hyperparams
    step: int


@dataclass(frozen=True)
class ScalarsMessage:
    """`ot.log_metrics(values, step=N)`: one row at step N for the run dir and the bridges."""

    event_name: ClassVar[str] = "otel_train.scalars"
    key: str
    values: dict[str, Any]  # instrument name -> the value as recorded (a tensor stays on its device)
    step: int


Message = TextMessage | SamplesMessage | HistogramMessage | HparamsMessage | ScalarsMessage
