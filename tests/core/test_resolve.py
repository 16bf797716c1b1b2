"""otel_train/resolve.py: what the worker makes of an interval (issue #32's cheaper paths give
what the careful ones give): scalar tensors read with one stack, timers' raw clock readings turned
into durations and arrivals."""

from __future__ import annotations

import math
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import pytest
import torch

import otel_train as ot
from otel_train.core import instruments, resolve, worker
from otel_train.core.buffer import Buffer, Interval, SpanRecord, header_of
from otel_train.testing import capture_metrics, current_session


def _careful(values: list[Any], monkeypatch: pytest.MonkeyPatch) -> tuple[list[float | None], dict[str, int]]:
    with monkeypatch.context() as patch:
        patch.setattr(resolve, "_stacked_scalars", lambda values: None)
        return resolve.resolve_values(values)


def _losses(n: int) -> list[Any]:
    weight = torch.randn(4, requires_grad=True)
    return [(weight * (i + 1)).square().mean().detach() for i in range(n)]


COMMON: dict[str, Callable[[], list[Any]]] = {
    "0-dim losses": lambda: _losses(50),
    "with nan and inf": lambda: [*_losses(3), torch.tensor(math.nan), torch.tensor(-math.inf)],
    "one-element 1-d": lambda: [torch.tensor([0.5]), torch.tensor([2.0])],
    "float64": lambda: [torch.tensor(1 / 3, dtype=torch.float64)] * 3,
}
ODD: dict[str, Callable[[], list[Any]]] = {
    # mixed dtypes: one stack would promote them (int64 70000 with fp16 became inf)
    "int and float tensors": lambda: [torch.tensor(3), torch.tensor(0.25)],
    "int64 beside fp16": lambda: [torch.tensor(70000), torch.tensor(1.5, dtype=torch.float16)],
    "numbers": lambda: [1.0, 2, 3.5],
    "mixed numbers and tensors": lambda: [1.0, torch.tensor(2.0)],
    "mixed shapes": lambda: [torch.tensor(1.0), torch.tensor([2.0])],
    "a complex tensor": lambda: [torch.tensor(1.0), torch.tensor(1 + 2j)],
    "a non-scalar tensor": lambda: [torch.tensor(1.0), torch.ones(2)],
    "a meta tensor": lambda: [torch.tensor(1.0), torch.empty((), device="meta")],
    "all meta": lambda: [torch.empty((), device="meta")] * 2,
    "a Parameter": lambda: [torch.nn.Parameter(torch.tensor(1.0))],
    "empty tensors": lambda: [torch.ones(0), torch.ones(0)],
}


@pytest.mark.parametrize("case", list(COMMON))
def test_one_stack_path_takes_the_common_interval_and_equals_the_careful_path(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = COMMON[case]()
    assert resolve._stacked_scalars(values) is not None  # the fast path is the one taken
    assert resolve.resolve_values(values) == _careful(values, monkeypatch)


@pytest.mark.parametrize("case", list(ODD))
def test_anything_else_takes_the_careful_path(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    values = ODD[case]()
    assert resolve._stacked_scalars(values) is None
    assert resolve.resolve_values(values) == _careful(values, monkeypatch)


@pytest.mark.parametrize("case", ["a meta tensor", "all meta"])
def test_a_meta_tensor_never_reaches_a_torch_op(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's first meta dispatch imports torch's meta kernels (1.2 s idle here, past the
    2 s shutdown deadline on a loaded host: the worker was still in torch at exit and the process
    aborted), so the fast path turns meta tensors away before stacking anything."""
    stack, stacked = torch.stack, []

    def watched_stack(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        stacked.append([t.is_meta for t in tensors])
        return stack(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "stack", watched_stack)
    assert resolve._stacked_scalars(ODD[case]()) is None
    assert not any(any(meta) for meta in stacked), "a meta tensor reached torch.stack"


def test_nonfinite_tensors_are_dropped_and_counted_on_the_fast_path() -> None:
    values = [torch.tensor(1.5), torch.tensor(math.nan), torch.tensor(math.inf)]
    assert resolve.resolve_values(values) == ([1.5, None, None], {"nonfinite": 2})


class _Intervals:
    def __init__(self) -> None:
        self.seen: list[Interval] = []

    def on_flush(self, interval: Interval) -> None:
        self.seen.append(interval)

    def close(self) -> None:
        pass


def test_timers_become_durations_and_arrivals_capped_per_name() -> None:
    with capture_metrics(log_interval=1000, max_values_per_interval=3, run_dir_enabled=False) as cap:
        session = current_session()
        assert session is not None
        listener = _Intervals()
        session.worker.add_listener(listener)
        with ot.timer("forward"):  # outside a step: a duration, no arrival
            pass
        for i in range(4):
            with ot.step(i), ot.timer("forward"):
                pass
            with ot.step(10 + i), ot.timer("data"):
                pass
    data_s = session.goodput.data_s  # after the final flush
    phases = {k: v for x in listener.seen for k, v in x.phases.items()}
    arrivals = {k: v for x in listener.seen for k, v in x.arrivals.items()}
    assert len(phases["forward"]) == 3 and len(arrivals["forward"]) == 2  # capped at 3; 1 outside a step
    assert len(phases["data"]) == 3 and len(arrivals["data"]) == 3
    assert all(0 <= d < 1 for d in phases["forward"] + arrivals["forward"])
    # over the cap: 2 forward, 1 data, and 5 of the 8 step durations
    assert cap.last("otel_train/dropped/too_many_values") == 8
    assert data_s > 0  # goodput's data cause, from the flushed timers (capped ones included)


def test_durations_are_computed_as_the_span_computes_them() -> None:
    """Exemplars link a histogram value to its span by (phase, seconds): both from the same ns."""
    buffer = Buffer(max_names=10, max_values=10)
    start = perf_counter_ns()
    readings = [(start, start + 1_234_567, start - 10), (start + 7, start + 999_999_937, 0)]
    buffer.timer_events.extend(("forward", s, e, b) for s, e, b in readings)
    phases, arrivals, _ = resolve.timer_phases(buffer.take(0, 0, 1.0, 0))
    spans = [SpanRecord("forward", s, e, 0) for s, e, _ in readings]
    assert phases["forward"] == [instruments._seconds(span) for span in spans]
    assert arrivals["forward"] == [(start + 1_234_567 - (start - 10)) * 1e-9]


def test_the_interval_carries_every_header_field_of_its_batch() -> None:
    """`FlushBatch` and `Interval` share `FlushHeader`: each of its fields reaches the listeners."""
    buffer = Buffer(max_names=10, max_values=10)
    buffer.steps, buffer.tokens, buffer.samples = 3, 100, 2  # tokens, samples: of steps beyond the cap
    buffer.step_events.extend([(5, 0, 100_000_000, 100, 2, False), (6, 0, 200_000_000, 100, 2, False)])
    buffer.step_events.append((7, 0, 10**9, 999, 99, True))  # failed: no duration, no counts
    batch = buffer.take(7, 41, 2.5, 0)
    batch.final, batch.autocast_dtype, batch.flush_interval, batch.flush_anchor = True, "bfloat16", 5, 20
    interval = worker.resolve_interval(batch)
    assert header_of(interval) == header_of(batch)
    assert batch.step_indices == [5, 6, 7]  # failed steps too: values recorded in them belong to them
    assert header_of(interval) == {
        "seq": 7, "step": 41, "wall_time": batch.wall_time, "elapsed_s": 2.5, "steps": 3, "tokens": 300,
        "samples": 6, "step_durations": [0.1, 0.2], "final": True, "autocast_dtype": "bfloat16",
        "flush_interval": 5, "flush_anchor": 20, "completed_step": 6,
        "last_step_start": batch.wall_time - batch.wall_perf_ns * 1e-9,  # step 6 began at perf 0
    }  # fmt: skip


def test_the_last_completed_steps_start_is_read_on_the_flush_s_wall_clock() -> None:
    """Where the step began on the wall clock, from the perf_counter reading paired with the
    flush's time.time(): exact however long after the step's end the flush ran."""
    buffer = Buffer(max_names=10, max_values=10)
    began = perf_counter_ns()
    buffer.step_events.append((0, began - 9_000_000, began - 5_000_000, None, None, False))
    buffer.step_events.append((1, began, began + 2_000_000, None, None, False))
    buffer.step_events.append((2, began + 2_000_000, began + 3_000_000, None, None, True))  # failed
    batch = buffer.take(1, 2, 1.0, 0)
    interval = worker.resolve_interval(batch)
    assert interval.last_step_start == batch.wall_time - (batch.wall_perf_ns - began) * 1e-9  # step 1's
    assert 0 < batch.wall_time - interval.last_step_start < 60
    no_step = Buffer(max_names=10, max_values=10).take(2, 2, 1.0, 0)
    assert math.isnan(worker.resolve_interval(no_step).last_step_start)


# --- the column reading of step and timer events equals the per-event reading it replaced ----------


def _steps_per_event(batch: Any) -> tuple[float, set[int]]:
    """worker.resolve_steps as it was: one Python pass per column over the step events."""
    events = batch.step_events
    batch.step_indices.extend([index for index, *_ in events])
    done = [event for event in events if not event[5]]
    batch.step_durations.extend([(end - start) * 1e-9 for _, start, end, *_ in done])
    batch.tokens += sum([tokens for *_, tokens, _, _ in done if tokens])
    batch.samples += sum([samples for *_, samples, _ in done if samples])
    if batch.rerun_through < 0:
        return 0.0, set()
    reruns = [(start, end) for index, start, end, *_ in done if index <= batch.rerun_through]
    return sum([end - start for start, end in reruns]) * 1e-9, {start for start, _ in reruns}


def _timers_per_event(batch: Any, rerun_starts: set[int]) -> tuple[dict, dict, float]:
    """resolve.timer_phases as it was: a sort by name, then Python passes over each name's events."""
    from itertools import groupby

    phases = {name: list(values) for name, values in batch.phases.items()}
    arrivals: dict[str, list[float]] = {}
    cap = batch.value_cap or len(batch.timer_events)
    over = data_ns = 0
    for name, group in groupby(sorted(batch.timer_events, key=lambda e: e[0]), key=lambda e: e[0]):
        readings = list(group)
        if name in resolve.DATA_PHASES:
            data_ns += sum([e - s for _, s, e, b in readings if b and b not in rerun_starts])
        durations = phases.setdefault(name, [])
        room = max(0, cap - len(durations))
        if len(readings) > room:
            over += len(readings) - room
            readings = readings[:room]
        durations.extend([(e - s) * 1e-9 for _, s, e, _ in readings])
        last = {b: e for _, _, e, b in readings if b}  # one arrival per step: the timer's last end there
        arrived = [(e - b) * 1e-9 for b, e in last.items()]
        if arrived:
            arrivals[name] = arrived
    if over:
        batch.dropped["too_many_values"] = batch.dropped.get("too_many_values", 0) + over
    return phases, arrivals, data_ns * 1e-9


SHAPES = [
    "periodic",
    "periodic, ragged end",
    "a timer in some steps",
    "a name twice a step",
    "a later name twice a step",
    "outside steps",
]


def _random_batch(rng: Any, shape: str) -> Any:
    buffer = Buffer(max_names=50, max_values=rng.choice([3, 50, 10_000]))
    names = rng.sample(["data", "forward", "backward", "optimizer", "zeta", "dataloader"], rng.randint(1, 5))
    clock = rng.randrange(10**15)
    for index in range(rng.randint(0, 60)):
        began = clock
        step_names = list(names)
        if shape == "a timer in some steps" and index % 3:
            step_names = step_names[:-1]
        if shape == "a name twice a step":
            step_names.append(step_names[0])
        if shape == "a later name twice a step":  # every column of period 1 + len(names) is one name
            step_names.append(step_names[len(step_names) // 2])
        for name in step_names:
            start, clock = clock, clock + rng.randrange(1, 10**7)
            outside = shape == "outside steps" and rng.random() < 0.3
            buffer.timer_events.append((name, start, clock, 0 if outside else began))
        failed = rng.random() < 0.2
        tokens = rng.choice([None, 0, rng.randrange(1, 10**6)])
        samples = rng.choice([None, 0, rng.randrange(1, 100)])
        buffer.step_events.append((index, began, clock, tokens, samples, failed))
    if shape == "periodic, ragged end" and buffer.timer_events:
        buffer.timer_events.pop()
    if rng.random() < 0.3:
        buffer.add_phase(names[0], 0.25)  # an ot.phase value under a timer's name comes first
    batch = buffer.take(0, 0, 1.0, 0)
    batch.value_cap = buffer.max_values
    batch.rerun_through = rng.choice([-1, 5, 100])
    return batch


@pytest.mark.parametrize("shape", SHAPES)
def test_column_reading_of_steps_and_timers_equals_the_per_event_reading(shape: str) -> None:
    import copy
    import random

    rng = random.Random(shape)
    for _ in range(300):
        batch = _random_batch(rng, shape)
        reference = copy.deepcopy(batch)
        rerun = worker.resolve_steps(batch)
        assert rerun[:2] == _steps_per_event(reference)
        assert (batch.step_indices, batch.step_durations) == (
            reference.step_indices,
            reference.step_durations,
        )
        assert (batch.tokens, batch.samples) == (reference.tokens, reference.samples)
        phases, arrivals, data_s = resolve.timer_phases(batch, rerun[1])
        expected = _timers_per_event(reference, rerun[1])
        assert (phases, arrivals, data_s) == expected
        assert list(phases) == list(expected[0])  # the same name order too
        assert batch.dropped == reference.dropped


def test_the_periodic_split_is_taken_for_the_usual_loop_and_not_for_others() -> None:
    usual = ("data", "forward", "backward") * 4 + ("data",)
    assert resolve._period(usual) == 3
    assert resolve._period(("forward",) * 5) == 1
    assert resolve._period(("data", "forward", "forward") * 3) == 0  # a name twice a step
    assert resolve._period(("data", "forward", "data", "backward")) == 0
    assert resolve._period(("data", "forward", "backward")) == 3


def test_every_place_a_timer_name_reaches_drops_a_non_str_and_takes_a_str_enums_value() -> None:
    """The hot path checks no timer name: the worker makes a `str` Enum its plain string and drops
    (and counts, each value) any other name in the timers' events, a raising block's phase errors
    and span record, CUDA timers' events and `adapters.phase()` durations, before anything exports them."""
    import enum

    from otel_train.core.resolve import drop_bad_timer_names

    class Plain(enum.Enum):
        FORWARD = "forward"

    class Named(str, enum.Enum):
        BACKWARD = "backward"

    buffer = Buffer(max_names=10, max_values=10)
    buffer.timer_events.extend([(Named.BACKWARD, 1, 2, 0), (Plain.FORWARD, 3, 4, 0)])  # type: ignore[list-item]
    buffer.add_phase_error(Named.BACKWARD, "ValueError", 0.5)  # type: ignore[arg-type]
    buffer.add_phase_error(Plain.FORWARD, "ValueError", 0.5)  # type: ignore[arg-type]
    buffer.add_phase_error(Plain.FORWARD, "ValueError", 0.25)  # type: ignore[arg-type]
    buffer.add_phase(Named.BACKWARD, 0.1)  # type: ignore[arg-type]
    buffer.cuda_timers.extend([(Plain.FORWARD, None, None), (Named.BACKWARD, None, None)])  # type: ignore[list-item]
    spans = [SpanRecord(Plain.FORWARD, 1, 2, 0, "ValueError"), SpanRecord(Named.BACKWARD, 1, 2, 0)]  # type: ignore[arg-type]
    buffer.spans.extend(spans)
    batch = buffer.take(0, 1, 1.0, 0)
    drop_bad_timer_names(batch)
    assert [e[0].__class__ for e in batch.timer_events] == [str] and batch.timer_events[0][0] == "backward"
    assert batch.phase_errors == {("backward", "ValueError"): [0.5]}
    assert list(batch.phases) == ["backward"] and type(next(iter(batch.phases))) is str
    assert [(name, type(name)) for name, _, _ in batch.cuda_timers] == [("backward", str)]
    assert [(r.name, type(r.name)) for r in batch.spans] == [("backward", str)]
    # one timer event, two phase-error values, one CUDA timer; the span's phase error counted them
    assert batch.dropped["invalid_timer_name"] == 4
    assert ("invalid_timer_name", repr(Plain.FORWARD)) in batch.problems


def test_a_histogram_drops_bools_and_complex_numbers_and_never_reads_a_str_as_digits() -> None:
    import numpy as np

    assert resolve.histogram_values([1, 2.5, True, np.bool_(False), 1 + 2j, "x", math.nan]) == [1.0, 2.5]
    assert resolve.histogram_values("123") == [] and resolve.histogram_values(b"12") == []
    assert resolve.histogram_values(True) == [] and resolve.histogram_values(3) == [3.0]
    assert resolve.histogram_values(torch.tensor([True, False])) == []
    assert resolve.histogram_values(np.array([True, False])) == []
    assert resolve.histogram_values(torch.tensor([[1.0, 2.0]])) == [1.0, 2.0]


def test_the_first_intervals_rates_count_from_the_first_step_not_from_init() -> None:
    """A flush's seconds (its rates' denominator) for the process's first steps are counted from
    the first one's start, not from init() (model loading before step 0 is no step time); later
    flushes keep theirs."""
    buffer = Buffer(max_names=10, max_values=10)
    now = perf_counter_ns()
    for k in range(5):  # 5 steps over the last 0.5 s, a minute after init()
        buffer.step_events.append(
            (k, now - 500_000_000 + k * 100_000_000, now - 400_000_000 + k * 100_000_000, 100, None, False)
        )
    first = buffer.take(1, 4, 60.0, 0)
    assert 0.5 <= worker.resolve_interval(first).elapsed_s < 1.0  # from step 0's start to the flush
    buffer.step_events.append((5, now, now + 1000, 100, None, False))
    later = buffer.take(2, 5, 60.0, 0)
    assert worker.resolve_interval(later, first.step_events[-1]).elapsed_s == 60.0  # not the first steps


def test_value_owners_give_values_recorded_after_each_step_the_step_before_them() -> None:
    from otel_train.core.resolve import value_owners

    steps = [10, 11, 12, 13]
    # recorded in the steps: the interval's steps, whatever the count
    assert value_owners(steps, None, 9, 4) == steps
    # after each step, the first after the previous interval's last step (9): 9..12 (13's comes later)
    assert value_owners(steps, 0, 9, 4) == [9, 10, 11, 12]
    # the final flush holds the last step's value too
    assert value_owners(steps, 0, 9, 5) == [9, 10, 11, 12, 13]
    # the first interval: the first value came after its first step
    assert value_owners([0, 1, 2, 3], 1, None, 3) == [0, 1, 2]
    # before any step at all, or a count that does not fit one value after each step: unchanged
    assert value_owners([0, 1, 2, 3], 0, None, 4) == [0, 1, 2, 3]
    assert value_owners(steps, 0, 9, 2) == steps
    assert value_owners(steps, 0, 9, 8) == steps
