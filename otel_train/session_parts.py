"""SessionParts: what a session runs with, built and wired by `assemble.build_session` (config,
identity, exporters, instruments, events, the worker that owns the sinks and flush listeners, the
cross-rank reducer, the cadence, ...), and the lists that can change while it runs (sinks,
listeners, `ot.watch` handles). `session.Session` adds the hot path and the lifecycle on top.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.bridges.base import Sink
from otel_train.bridges.console import ConsoleSink
from otel_train.config import Config
from otel_train.distributed import Identity
from otel_train.interval import FlushListener

if TYPE_CHECKING:  # the SDK is imported at init(), not when `import otel_train` runs
    from opentelemetry.metrics import Meter
    from opentelemetry.sdk.resources import Resource

    from otel_train.bridges.process import BridgeProcess
    from otel_train.cadence import Cadence
    from otel_train.crossrank import CrossRankReducer
    from otel_train.diagnostics import MemoryDumps
    from otel_train.exporters import Telemetry
    from otel_train.flush import Instruments, StepReader, Worker
    from otel_train.hardware import HardwareMonitor
    from otel_train.health import HealthEvents
    from otel_train.numerics import ModelWatch
    from otel_train.profiling import ProfiledStepsCounter


@dataclass(kw_only=True, eq=False, repr=False)
class SessionParts:
    """The parts a session runs with, built and wired by `assemble.build_session`, and the lists
    of sinks, listeners and watches that can change while it runs."""

    config: Config
    identity: Identity
    run_name: str
    run_dir: Path | None
    resource: Resource
    step_reader: StepReader
    telemetry: Telemetry
    meter: Meter
    instruments: Instruments
    otel_logger: Any | None
    events: HealthEvents
    console: ConsoleSink | None
    bridges: BridgeProcess | None
    worker: Worker  # the one owner of the sinks and flush listeners
    hardware: HardwareMonitor | None
    reducer: CrossRankReducer
    cadence: Cadence
    profiled_steps: ProfiledStepsCounter
    watches: list[ModelWatch] = field(default_factory=list)  # ot.watch(model) handles
    # gcd of the watches' `every` (1 without watches, never 0: another thread may change them
    # while a step reads both): a step whose index it divides calls them (only such a step can be
    # a watched one; the others cost a modulo at their begin and end, not two calls per watch)
    watch_period: int = 1
    memory_dumps: MemoryDumps | None = None  # CUDA allocator dumps on an OOM inside ot.step

    def __post_init__(self) -> None:
        """Called by the generated __init__ (only if defined here); `Session` sets its running state."""

    @property
    def sinks(self) -> Sequence[Sink]:
        return self.worker.sinks

    @property
    def listeners(self) -> Sequence[FlushListener]:
        return self.worker.listeners

    def add_listener(self, listener: FlushListener) -> None:
        """Call `listener.on_flush(interval)` on the worker at every flush from now on."""
        self.worker.add_listener(listener)

    def remove_listener(self, listener: FlushListener) -> None:
        """Stop calling `listener` (idempotent)."""
        self.worker.remove_listener(listener)

    def add_sink(self, sink: Sink) -> None:
        """Hand every flush and message to `sink` too (on the worker), from the next one on."""
        self.worker.add_sink(sink)

    def add_watch(self, watch: ModelWatch) -> None:
        """Call `watch` at the begin and end of the steps `watch_period` divides (training thread)
        until `remove_watch`."""
        watches = [*self.watches, watch]  # copy-on-write too: a step may be iterating it
        self.watch_period = math.gcd(*(w.every for w in watches))  # first: a divisor of the old one
        self.watches = watches

    def remove_watch(self, watch: ModelWatch) -> None:
        """Stop calling `watch` (idempotent; `ModelWatch.remove()` calls it)."""
        self.watches = [x for x in self.watches if x is not watch]
        self.watch_period = math.gcd(*(w.every for w in self.watches)) or 1  # then: a multiple

    @property
    def flush_interval_steps(self) -> int:
        """Steps per flush now (the explicit log_interval, or the adaptive cadence's current value)."""
        return self.cadence.interval

    @property
    def prometheus_url(self) -> str | None:
        endpoint = self.telemetry.pull_endpoint
        return endpoint.url if endpoint is not None else None
