"""otel_train/core/worker.py: the background thread. The logger API's typed messages reach each sink's
method for their type, prepared on the worker (text redacted, a tensor's values resolved to finite
floats), in the order they were logged with the flushes around them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

import otel_train as ot
from otel_train.bridges.base import Sink
from otel_train.core.buffer import HistogramMessage, HparamsMessage, SamplesMessage, TextMessage
from otel_train.core.session import Session


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
