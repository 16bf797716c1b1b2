"""otel_train/core/worker.py: the background thread. The logger API's typed messages reach each sink's
method for their type, prepared on the worker (text redacted, a tensor's values resolved to finite
floats), in the order they were logged with the flushes around them."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

import otel_train as ot
from otel_train import semconv
from otel_train.bridges.base import Sink
from otel_train.core.buffer import (
    Buffer,
    FlushBatch,
    HistogramMessage,
    HparamsMessage,
    SamplesMessage,
    TextMessage,
)
from otel_train.core.session import Session
from otel_train.testing import current_session


class Recording(Sink):
    """Every call, in order, as (method, arguments)."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self.calls.append(("scalars", (step, scalars.get("train/loss"))))

    def write_text(self, key: str, text: str, step: int) -> None:
        self.calls.append(("text", (key, text, step)))

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        self.calls.append(("samples", (key, list(rows), step)))

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        self.calls.append(("histogram", (key, list(values), step)))

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        self.calls.append(("hparams", (dict(params),)))


@pytest.fixture
def session(quiet_session: Session) -> Session:
    return quiet_session


def test_each_message_type_reaches_its_sink_method_in_order(session: Session) -> None:
    sink = Recording()
    session.worker.add_sink(sink)
    ot.log_hyperparams({"lr": 0.1, "api_key": "s3cret"})
    with ot.step(0):
        ot.record("loss", 2.0)
    ot.log_text("notes", "pushed to https://user:hunter2@example.com")
    ot.log_samples([("2+2?", "4")], step=0)
    ot.log_histogram("weights", torch.tensor([1.0, math.nan, 3.0]), step=5)
    with ot.step(1):
        ot.record("loss", 1.0)
    ot.shutdown()
    assert sink.calls == [
        ("hparams", ({"lr": 0.1, "api_key": "***"},)),
        ("scalars", (0, 2.0)),
        ("text", ("notes", "pushed to https://***@example.com", 0)),
        ("samples", ("samples", [("2+2?", "4")], 0)),
        ("histogram", ("weights", [1.0, 3.0], 5)),  # resolved on the worker; NaN left out
        ("scalars", (1, 1.0)),
    ]


def test_messages_are_typed_records() -> None:
    """Frozen, one class per kind; the worker dispatches on the class, never on a kind string."""
    text = TextMessage("k", "t", 1)
    with pytest.raises(AttributeError):
        text.text = "changed"  # type: ignore[misc]
    names = {cls.event_name for cls in (TextMessage, SamplesMessage, HistogramMessage, HparamsMessage)}
    assert names == {"otel_train.text", "otel_train.samples", "otel_train.histogram", "otel_train.hparams"}


class _Eta(Sink):
    name = "eta"

    def __init__(self) -> None:
        self.etas: list[float | None] = []

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self.etas.append(scalars.get(semconv.ETA.key))


def _steps_batch(first: int, count: int, start_s: float, seconds_each: float) -> FlushBatch:
    """A flush of `count` steps from index `first`, the first beginning at epoch second `start_s`,
    each `seconds_each` long, flushed as the last ends (step events on the epoch clock)."""
    buffer = Buffer(max_names=10, max_values=1000)
    ns = int(seconds_each * 1e9)
    begin = int(start_s * 1e9)
    buffer.steps = count
    buffer.step_events.extend(
        (first + i, begin + i * ns, begin + (i + 1) * ns, None, None, False) for i in range(count)
    )
    batch = buffer.take(1, first + count - 1, count * seconds_each, perf_to_epoch_ns=0)
    batch.wall_time = start_s + count * seconds_each
    batch.wall_perf_ns = begin + count * ns  # the two clocks paired at the flush (one clock here)
    return batch


def test_the_eta_counts_from_the_first_step_and_reads_0_past_the_planned_last(tmp_path) -> None:
    """A resumed run (steps from 5000 of 6000) whose set-up before its first step took an hour:
    the ETA is the steps left at the steps' own rate (1 s each), not diluted by the set-up; once
    a step passes total_steps it reads 0, not the last estimate."""
    ot.init(total_steps=6000, prometheus_port=0, verbosity=0, output_dir=str(tmp_path), hardware=False)
    worker = current_session().worker
    sink = _Eta()
    worker.add_sink(sink)
    first_step_at = time.time() + 3600.0
    worker._process(_steps_batch(5000, 10, first_step_at, 1.0))
    worker._process(_steps_batch(5010, 1000, first_step_at + 10.0, 1.0))
    ot.shutdown()
    assert sink.etas[0] == pytest.approx(990.0)  # 990 steps left at 1 s each
    assert sink.etas[1] == 0.0  # step 6009 of 6000


def test_a_wall_clock_step_leaves_the_eta_alone(tmp_path) -> None:
    """NTP or a resumed VM moves time.time() by an hour mid-run: the ETA read 5,041 s for 2 s left
    (and a negative one for a step back). It is timed on the monotonic clock."""
    ot.init(total_steps=100, prometheus_port=0, verbosity=0, output_dir=str(tmp_path), hardware=False)
    worker = current_session().worker
    sink = _Eta()
    worker.add_sink(sink)
    worker._process(_steps_batch(0, 10, 1000.0, 1.0))
    for first, shift in ((10, 3600.0), (20, -3600.0)):
        batch = _steps_batch(first, 10, 1000.0 + first, 1.0)
        batch.wall_time += shift  # the wall clock stepped; the monotonic one did not
        worker._process(batch)
    ot.shutdown()
    assert sink.etas == [pytest.approx(90.0), pytest.approx(80.0), pytest.approx(70.0)]
