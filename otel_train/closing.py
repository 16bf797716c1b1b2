"""The end of a run, inside `shutdown_timeout_s`: drain the worker, close the flush listeners and
the sinks, stop the exporters. `Session.shutdown` runs these in this order after its final flush;
each takes the budget and the time the shutdown started, so the whole stays bounded."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from otel_train import semconv
from otel_train.bridges.base import Sink
from otel_train.interval import FlushListener

if TYPE_CHECKING:  # the SDK-backed modules are imported at init(), not when `import otel_train` runs
    from otel_train.bridges.process import BridgeProcess
    from otel_train.exporters import Telemetry
    from otel_train.flush import Instruments, Worker

log = logging.getLogger("otel_train")


def drain_worker(worker: Worker, instruments: Instruments, budget_s: float) -> tuple[int, int]:
    """Stop the worker within half the budget. Returns the (flushes, steps) it never wrote, counted
    as dropped{reason=shutdown_deadline} and warned about, as are sinks that failed in this run."""
    unwritten = (0, 0)
    if not worker.stop(timeout_s=max(0.2, budget_s * 0.5)):
        unwritten = _report_unwritten(worker, instruments, budget_s)
    for name, count in worker.sink_errors.items():
        log.warning(
            "otel_train: sink %s failed %d time(s) in this run; those writes are missing.", name, count
        )
    return unwritten


def _report_unwritten(worker: Worker, instruments: Instruments, budget_s: float) -> tuple[int, int]:
    """The worker was still busy at the deadline: say how much never reached the run dir."""
    flushes, steps = worker.unwritten()
    if flushes <= 0:
        return 0, 0
    instruments.dropped.add(flushes, {semconv.REASON: "shutdown_deadline"})
    log.warning(
        "otel_train: shutdown deadline (%.1fs): the background worker was still busy; %d flush(es) "
        "holding %d step(s) were not written to the run dir or exporters. Raise "
        "OTEL_TRAIN_SHUTDOWN_TIMEOUT_S if this happens often.",
        budget_s,
        flushes,
        steps,
    )
    return flushes, steps


def close_listeners(listeners: Sequence[FlushListener]) -> None:
    for listener in listeners:
        listener.close()


def close_sinks(
    sinks: Sequence[Sink],
    bridges: BridgeProcess | None,
    final: Mapping[str, float],
    budget_s: float,
    started: float,
) -> None:
    """Each sink gets the run's final scalars; the bridge process gets what is left of 80 % of the
    budget (it finishes on its own past it)."""
    for sink in sinks:
        try:
            if sink is bridges:
                left = max(0.1, 0.8 * budget_s - (time.monotonic() - started))
                bridges.close(dict(final), timeout=left)
            else:
                sink.close(dict(final))
        except Exception as exc:  # the sinks' backends (bridges, their process, the disk)
            log.warning("otel_train: closing %s failed: %s", sink.name, exc)


def stop_exporters(telemetry: Telemetry, budget_s: float, started: float) -> None:
    # Keep a margin inside the budget for the abandon path itself.
    remaining = max(0.1, 0.9 * budget_s - (time.monotonic() - started))
    telemetry.shutdown(remaining)
