"""What `ot.step()` accepts: a step number, `tokens=` and `samples=` of any numeric type (numpy
integers, 0-dim tensors, integral floats) as plain ints, and the logger API's `step=`; anything
else is counted, warned about once and replaced, never raised into the training loop."""

from __future__ import annotations

import operator
from typing import Any

from otel_train.buffer import Buffer

MAX_STEP = 2**63 - 1  # a step must fit an int64 (Prometheus, TensorBoard, JSON readers)


def step_number(step: Any, buffer: Buffer, last_step: int) -> int:
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
    if index is None or not -MAX_STEP <= index <= MAX_STEP:
        buffer.drop("invalid_step")
        buffer.warn_once(
            "<step>",
            f"ot.step() got a step number it cannot use ({type(step).__name__}); continuing from "
            "the last step. Pass an int (counted in otel_train.dropped{reason=invalid_step}).",
        )
        return last_step + 1
    return index


def count_of(value: Any, what: str, buffer: Buffer) -> int | None:
    """tokens= / samples= as a plain int (numpy integers, 0-dim tensors, integral floats)."""
    if value is None or (value.__class__ is int and 0 <= value <= MAX_STEP):
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
    if 0 <= number <= MAX_STEP:
        return number
    buffer.drop("invalid_value")  # a negative count would take tokens away from the totals
    buffer.warn_once(
        f"<{what} range>", f"ot.step({what}={value!r}): a count must be >= 0 (and < 2**63); ignored."
    )
    return None


def message_step(step: Any, buffer: Buffer) -> int | None:
    """A step= argument of the logger API as a plain int (numpy, tensor, integral float), or None
    (the current step): also for a number that is no step (2.5, 2**70), which is counted and
    warned about once."""
    if step is None or (step.__class__ is int and -MAX_STEP <= step <= MAX_STEP):
        return step  # type: ignore[no-any-return]
    try:
        number: int | None = operator.index(step)
    except Exception:
        try:
            as_float = float(step)
            number = int(as_float) if as_float.is_integer() else None
        except Exception:
            number = None
    if isinstance(step, bool) or str(getattr(step, "dtype", "")) in ("bool", "torch.bool"):
        number = None  # True is no step 1, whether Python's, numpy's or torch's
    if number is not None and -MAX_STEP <= number <= MAX_STEP:
        return number
    buffer.drop("invalid_step")
    buffer.warn_once(
        "<message step>",
        f"step={step!r} is not a step number (an int within int64); filed under the current step.",
    )
    return None
