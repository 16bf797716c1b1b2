"""The background worker and what it does with one flush: the only place the OTel SDK, the sinks
and the flush listeners run, off the training thread.

The story of one flush (the training thread only hands a `buffer.FlushBatch` over: `Session.flush`):

1. `worker.Worker` (the one thread, one ordered queue of flush batches and API messages) takes it.
2. `resolve` turns its raw values into host floats: device tensors in one transfer per device and dtype,
   timers' clock readings into phase durations and arrivals, giving the `interval.Interval`;
   `batch_checks` first drops what the hot path appended unchecked (a timer named by an Enum, a
   negative count) and notes each problem, which the worker warns about once.
3. `instruments` records the interval into the SDK instruments (durations as one aggregation step
   per series through `histogram_feed`, with exemplars from `tracing`'s step trace ids);
   `tracing` writes the sampled steps' spans.
4. The flush listeners (health, goodput, hardware, cross-rank, ...) see the `Interval`.
5. `step_reader` collects the SDK's metrics for this flush (observable callbacks included) and the
   flat scalars go to the sinks (run directory, console, bridge process).

Names are loaded on first use (PEP 562): these modules import the OTel SDK, and `import otel_train`
must not. From outside, import only the names below (tests/test_architecture.py: walled packages).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_train.flush.instruments import Instruments
    from otel_train.flush.resolve import tensors_to_host
    from otel_train.flush.step_reader import StepReader
    from otel_train.flush.tracing import SpanWriter
    from otel_train.flush.worker import Worker, stuck_message

__all__ = ["Instruments", "SpanWriter", "StepReader", "Worker", "stuck_message", "tensors_to_host"]

_HOMES = {
    "Instruments": "instruments",
    "tensors_to_host": "resolve",
    "StepReader": "step_reader",
    "SpanWriter": "tracing",
    "Worker": "worker",
    "stuck_message": "worker",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'otel_train.flush' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"otel_train.flush.{home}"), name)
