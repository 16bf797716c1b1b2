"""The host sampler thread: this process's CPU and memory and the node's memory (psutil); SDK
callbacks read the last sample. Design: docs/design/hardware-and-numerics.md#hardware."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import psutil
from opentelemetry.metrics import Meter, Observation

from otel_train import semconv as sc
from otel_train.hardware.discovery import log

HOST_SPECS = (sc.PROCESS_CPU_UTILIZATION, sc.PROCESS_MEMORY_USAGE, sc.SYSTEM_MEMORY_USAGE)


class HostSampler:
    """Samples ``process`` (this one unless set before ``create_instruments``) into ``observations``."""

    def __init__(self) -> None:
        self.process: Any | None = None
        self.cpus = 1  # CPUs available to the process (its affinity): process.cpu.utilization's 1
        self._primed = False
        self.observations: Mapping[str, list[Observation]] = {}

    def create_instruments(self, meter: Meter) -> None:
        if self.process is None:
            self.process = psutil.Process()
        self.cpus = _available_cpus(self.process)
        for spec in HOST_SPECS:
            spec.create(meter, lambda options, name=spec.name: self.observations.get(name, ()))

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """The host sampler thread: sample every ``interval_s`` until ``stop``."""
        try:
            while True:
                try:
                    self.sample()
                except (psutil.Error, OSError):  # a /proc read refused or gone: the next sample retries
                    log.debug("otel_train: host sample failed", exc_info=True)
                if stop.wait(interval_s):
                    break
        finally:
            if not stop.is_set():  # a bug ended the thread (its traceback says which): no stale gauges
                self.observations = {}

    def sample(self) -> None:
        proc = self.process
        if proc is None:
            return
        obs: dict[str, list[Observation]] = {}
        cpu = proc.cpu_percent(None)
        if self._primed:  # psutil's first reading has no reference interval (always 0.0)
            obs[sc.PROCESS_CPU_UTILIZATION.name] = [Observation(cpu / 100.0 / self.cpus)]
        self._primed = True
        obs[sc.PROCESS_MEMORY_USAGE.name] = [Observation(int(proc.memory_info().rss))]
        vm = psutil.virtual_memory()
        # "free" is what is available to new allocations (MemAvailable: free + reclaimable cache,
        # not MemFree), so used + free = total.
        obs[sc.SYSTEM_MEMORY_USAGE.name] = [
            Observation(int(vm.total - vm.available), {sc.MEMORY_STATE: "used"}),
            Observation(int(vm.available), {sc.MEMORY_STATE: "free"}),
        ]
        self.observations = obs


def _available_cpus(process: Any) -> int:
    """The CPUs this process may run on (its affinity; all of the host's where psutil has none)."""
    try:
        return max(1, len(process.cpu_affinity()))
    except (AttributeError, psutil.Error, OSError):  # macOS has no cpu_affinity
        return max(1, psutil.cpu_count() or 1)
