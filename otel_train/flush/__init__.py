"""The background worker and what it does with one flush: the only place the OTel SDK, the sinks
and the flush listeners run, off the training thread. Design: docs/design/core.md#one-flush.

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
