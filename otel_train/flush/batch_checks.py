"""Checks of a flush batch's raw data on the worker, before it is resolved: what the training
thread's hot path appends unchecked (timer names, step counts) and what cannot be undone later (one
tensor recorded again after in-place changes); each problem is counted and warned about once
(`problem_warning`, by the worker)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from operator import itemgetter
from typing import Any

from otel_train.buffer import FlushBatch

_timer_name = itemgetter(0)  # of a timer event


# What the worker says, once per reason, the first time values are dropped (or suspect); {name}: the
# instrument. Every drop is also counted in otel_train.dropped{reason}.
PROBLEMS = {
    "invalid_type": "a value of {name} was not a number (None, a str, a bool, a complex number, ...)",
    "non_scalar_tensor": "a tensor of {name} had more than one element: record a scalar (x.mean())",
    "nonfinite": "a value of {name} was NaN or Inf",
    "overflow": "a value of {name} was too large for a float64",
    "invalid_timer_name": "a timer's name was not a str ({name}): its phases were",
    "negative_count": "ot.step({name}): a count must be >= 0; such counts were",
    "same_tensor": (
        "the same tensor object was recorded several times in one interval as {name}: values are "
        "read at the flush, so a tensor changed in place (an accumulator, a Parameter) gives its "
        "latest value for every step; record a copy (x.detach().clone()) or a float"
    ),
}


def problem_warning(reason: str, name: str) -> str:
    """The one warning for `reason` (a PROBLEMS key or a count reason without a message)."""
    text = PROBLEMS.get(reason, "values of {name} were").format(name=name)
    if reason == "same_tensor":
        return f"otel_train: {text}."
    counted = "invalid_value" if reason == "negative_count" else reason
    return f"otel_train: {text} dropped and counted as otel_train.dropped{{reason={counted}}} (warned once)."


def same_tensor_twice(values: Sequence[Any]) -> bool:
    """Is one tensor object among `values` more than once (recorded again after in-place changes)?"""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    seen: set[int] = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                return True
            seen.add(id(value))
    return False


def drop_bad_timer_names(batch: FlushBatch) -> None:
    """`ot.timer(name)` does not check its name on the hot path; here, before anything sorts or
    exports the names, a str subclass (a `str` Enum) becomes its plain string, and any other name
    (an Enum, None, an int) is dropped and counted, instead of failing the whole flush. The same
    for every other place a timer's name reaches: a raising block's phase errors and span, a CUDA
    timer's events and `ot.phase()` durations."""
    events = batch.timer_events
    if events and set(map(type, map(_timer_name, events))) != {str}:
        kept: list[tuple[str, int, int, int]] = []
        for name, start, end, began in events:
            plain = _plain_name(batch, name)
            if plain is not None:
                kept.append((plain, start, end, began))
        batch.timer_events = kept
    if any(name.__class__ is not str for name, _ in batch.phase_errors):
        errors: dict[tuple[str, str], list[float]] = {}
        for (name, error), values in batch.phase_errors.items():
            plain = _plain_name(batch, name, len(values))
            if plain is not None:
                errors.setdefault((plain, error), []).extend(values)
        batch.phase_errors = errors
    if any(name.__class__ is not str for name, _, _ in batch.cuda_timers):
        batch.cuda_timers = [
            (plain, start, end)
            for name, start, end in batch.cuda_timers
            if (plain := _plain_name(batch, name)) is not None
        ]
    if any(name.__class__ is not str for name in batch.phases):
        phases: dict[str, list[float]] = {}
        for name, values in batch.phases.items():
            plain = _plain_name(batch, name, len(values))
            if plain is not None:
                phases.setdefault(plain, []).extend(values)
        batch.phases = phases
    if any(record.name.__class__ is not str for record in batch.spans):  # a raising timer's span
        batch.spans = [  # (its phase error was counted above)
            replace(record, name=str.__str__(record.name)) if record.name.__class__ is not str else record
            for record in batch.spans
            if isinstance(record.name, str)
        ]


def _plain_name(batch: FlushBatch, name: Any, count: int = 1) -> str | None:
    """A timer's name as a plain str, or None (its `count` values dropped, counted and warned
    about once) when it is not a str."""
    if isinstance(name, str):
        return str.__str__(name)
    batch.dropped["invalid_timer_name"] = batch.dropped.get("invalid_timer_name", 0) + count
    batch.problems.setdefault("invalid_timer_name", repr(name))
    return None


def count_sum(batch: FlushBatch, what: str, counts: Sequence[int | None]) -> int:
    """The steps' tokens= or samples=, without negative ones (the hot path appends a plain int
    unchecked; a negative count would take tokens away): those are dropped and counted."""
    given: list[int] = list(filter(None, counts))
    if given and min(given) < 0:
        bad = [c for c in given if c < 0]
        batch.dropped["invalid_value"] = batch.dropped.get("invalid_value", 0) + len(bad)
        batch.problems.setdefault("negative_count", f"{what}={bad[0]}")
        given = [c for c in given if c > 0]
    return sum(given)
