"""The listener seam: what one flush hands to every `FlushListener` (health, hardware, the
cross-rank reducer, goodput, profiled steps), resolved to host floats.

`FlushHeader` holds what the training thread knows at the flush without resolving anything; the
raw `buffer.FlushBatch` and the resolved `Interval` both extend it, so those fields are declared
once and copied by `header_of`, never by hand."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any, Protocol


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
    # this process's flush schedule: every flush_interval steps from step flush_anchor on (cadence.py;
    # rank 0's is its decision, which its answers carry to the other ranks)
    flush_interval: int = 0
    flush_anchor: int = -1


def finite(values: Iterable[float]) -> list[float]:
    """The finite values, in order. Durations and arrivals are finite by construction (integer
    clock readings), so the usual case is one check at C speed, not a Python test per value: the
    worker's time per value is what bounds its share of a 1-2 ms step."""
    values = values if isinstance(values, list) else list(values)
    if all(map(math.isfinite, values)):
        return values
    return [v for v in values if math.isfinite(v)]


def header_of(flush: FlushHeader) -> dict[str, Any]:
    """The header fields of `flush`, by name (for building an `Interval` from a `FlushBatch`)."""
    return {f.name: getattr(flush, f.name) for f in fields(FlushHeader)}


@dataclass
class Interval(FlushHeader):
    phases: dict[str, list[float]] = field(default_factory=dict)  # timer name -> durations (s)
    # timer name -> seconds from its step's start to the timer's end (CPU timers inside a step only)
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    # seconds of data-phase timers (goodput.DATA_PHASES) inside steps that did not re-run a step
    data_s: float = 0.0
    rerun_s: float = 0.0  # seconds of steps that re-ran a step of the previous processes (goodput)
    scalars: dict[str, list[float]] = field(default_factory=dict)  # instrument name -> finite values
    # instrument name -> the step of each of its finite values, where known: values recorded the same
    # number of times in every step of the interval (see FlushBatch.step_indices); absent otherwise
    scalar_steps: dict[str, list[int]] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=dict)  # instrument name -> NaN/Inf values dropped
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
    """Called on the background worker at every flush, before the StepReader collects for the sinks.

    Gauges a listener sets here appear in the same flush's sink output.
    """

    def on_flush(self, interval: Interval) -> None: ...

    def close(self) -> None: ...
