"""The single-process core: from `ot.record` to the instruments and the run directory. The
training thread's `scopes` append to the session's `buffer`; `session` hands each interval to the
`worker`, which `resolve`s it and records it through `instruments`; `cadence` says when,
`assemble` builds a session, `runtime` holds it. One flush, read top to bottom:
docs/design/core.md#one-flush.

From outside the core, import the names below, the records in `otel_train.core.buffer` (what
producers append and flush listeners receive) and `otel_train.core.resolve`'s device-to-host copy
and histogram bucket counts.
"""

from __future__ import annotations

from otel_train.core.runtime import Run, current, report_failure, shutdown
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
    "report_failure",
    "shutdown",
    "span",
    "step",
    "timer",
]
