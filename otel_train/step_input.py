"""What `ot.step()` accepts: a step number of any integer type (numpy integers, 0-dim integer
tensors) as a plain int, any other type being the caller's bug (TypeError naming the fix);
`tokens=`/`samples=` and the logger API's `step=`, which arrive as values (a bad one is dropped,
counted and warned about once; docs/reliability.md#error-policy)."""

from __future__ import annotations

import operator
from typing import Any

from otel_train.buffer import Buffer

MAX_STEP = 2**63 - 1  # a step must fit an int64 (Prometheus, TensorBoard, JSON readers)


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
    """The step number as a plain int; one beyond int64 continues from the last step, counted and
    warned about once."""
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
    """tokens= / samples= as a plain int (numpy integers, 0-dim integer tensors). They arrive as
    a step ends, where raising would hide the step's own exception: a count of another type, a
    negative or a huge one, is a bad value, ignored, counted and warned about once."""
    if value is None or (value.__class__ is int and 0 <= value <= MAX_STEP):
        return value  # type: ignore[no-any-return]
    try:
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


def message_step(step: Any, buffer: Buffer) -> int | None:
    """A step= argument of the logger API (a framework's logger hands its own on: a value, not
    the caller's bug) as a plain int, or None (the current step): also for a step that is no
    integer (2.5, True, "3") or does not fit an int64, which is counted and warned about once."""
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
