"""The single-process core: from `ot.record` to the instruments and the run directory.

One flush, read top to bottom:

1. `scopes`: `ot.step`, `ot.timer` and `ot.span` (and `ot.record` in the package root) find the
   active session in `runtime._current` and append to its `buffer.Buffer`; nothing else runs on
   the training thread.
2. `session`: `Session.end_step` asks the `cadence.Cadence` whether a flush is due; `Session.flush`
   swaps the buffer's lists for fresh ones and hands them, as one `buffer.FlushBatch`, to the worker
   without waiting.
3. `worker`: the background thread takes the batch; `resolve` turns its raw values (tensors, clock
   readings) into host floats, the `buffer.Interval`.
4. `instruments` records the interval into the OTel SDK and writes the sampled steps' spans; the
   flush listeners (health, goodput, hardware, cross-rank) see the `Interval`; the step reader
   collects the flush's scalars for the sinks (run directory, console, bridges).

`assemble` builds a session and wires its parts at `ot.init()`; `runtime` holds the active one and
`Run`, its public face. Design: docs/design/core.md.

From outside the core, import the names below, the records in `otel_train.core.buffer` (what
producers append and flush listeners receive) and `otel_train.core.resolve.tensors_to_host`.
"""

from __future__ import annotations

from otel_train.core.runtime import Run, current
from otel_train.core.scopes import begin_step, end_step, phase, span, step, timer
from otel_train.core.session import Session, message_step

__all__ = [
    "Run",
    "Session",
    "begin_step",
    "current",
    "end_step",
    "message_step",
    "phase",
    "span",
    "step",
    "timer",
]
