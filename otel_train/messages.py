"""What the logger API hands the worker besides flushes (`ot.log_text`, `ot.log_samples`,
`ot.log_histogram`, `ot.log_hyperparams`, `ot.log_metrics(step=N)`'s row): one small frozen record
per kind, dispatched by class on the worker. They travel in the flushes' queue, so they keep their
order with the scalars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


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
