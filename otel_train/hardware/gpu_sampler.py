"""The NVML sampler thread: SDK callbacks read the snapshot it swaps in, never NVML, so a hung NVML
call stalls only the sampler. Design: docs/design/hardware-and-numerics.md#hardware.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import Meter, Observation

from otel_train import semconv as sc
from otel_train.hardware.discovery import GpuDevice, log
from otel_train.hardware.nvml_reads import DeviceState, GpuLost, NvmlReads
from otel_train.health import EventChannel

GPU_SPECS = (
    sc.GPU_UTILIZATION, sc.GPU_MEMORY_UTILIZATION, sc.GPU_MEMORY_CONTROLLER, sc.GPU_MEMORY_USAGE,
    sc.GPU_MEMORY_LIMIT, sc.GPU_TEMPERATURE, sc.GPU_POWER, sc.GPU_ENERGY, sc.GPU_ERRORS, sc.GPU_IO,
    sc.GPU_CLOCK_SM, sc.GPU_CLOCK_MEMORY, sc.GPU_THROTTLE,
)  # fmt: skip


@dataclass(frozen=True)
class GpuSnapshot:
    """One sample of every GPU, swapped in whole: what callbacks and the flush read."""

    time: float = 0.0  # the sampler clock at the end of the sample
    obs: Mapping[str, list[Observation]] = field(default_factory=dict)
    energy_j: float | None = None  # summed over the rank's GPUs (None when not all report it)
    memory: tuple[tuple[str, int, int], ...] = ()  # (uuid, used, total)
    devices: tuple[str, ...] = ()  # the UUIDs sampled (an energy baseline holds for these only)


class GpuSampler:
    """Samples the rank's GPUs (``sample()``, on its own thread via ``run()``) into ``snapshot``;
    without a GPU (``attach`` never called, or no device) ``sample()`` does nothing."""

    def __init__(self, events: EventChannel) -> None:
        self._events = events
        self.clock: Callable[[], float] = time.monotonic  # the sample times' clock (tests replace it)
        self._reads: NvmlReads | None = None
        self.devices: list[DeviceState] = []
        self._lock = threading.Lock()
        self.snapshot = GpuSnapshot()
        self._busy_since: float | None = None
        self._stuck_warned = False
        self._follow: str | None = None  # a UUID to sample instead, from `follow`
        self.samples = 0  # taken so far (tests wait on it)

    def attach(self, nvml: Any, devices: Iterable[GpuDevice]) -> None:
        """Sample these devices through ``nvml`` (initialised by discovery; released on stop)."""
        self._reads = NvmlReads(nvml, self._events)
        self.devices = [DeviceState(d) for d in devices]

    def create_instruments(self, meter: Meter) -> None:
        for spec in GPU_SPECS:  # the callbacks read the snapshot only: never NVML
            spec.create(meter, lambda options, name=spec.name: self.snapshot.obs.get(name, ()))

    def follow(self, uuid: str) -> None:
        """Sample the GPU with this UUID from the next sample on: the device torch uses, when it
        is not the one discovery found before CUDA was initialised (CUDA's FASTEST_FIRST order)."""
        self._follow = uuid

    # -- thread ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event, interval_s: float) -> None:
        """The sampler thread: sample every ``interval_s`` until ``stop``; then release NVML."""
        try:
            while True:
                self.sample()  # NVML errors are handled per call (nvml_reads)
                if stop.wait(interval_s):
                    break
        finally:
            if not stop.is_set():  # a bug ended the thread (its traceback says which): no stale gauges
                self.snapshot = GpuSnapshot()
            self.release_nvml()

    def release_nvml(self) -> None:
        reads, self._reads = self._reads, None
        if reads is not None:
            reads.release(self.devices)

    def warn_if_stuck(self, interval_s: float) -> None:
        """Warn once when one NVML call has blocked the sampler for long (called at the flush)."""
        since, reads = self._busy_since, self._reads
        if since is None or self._stuck_warned:
            return
        stuck_for = self.clock() - since
        if stuck_for > max(2 * interval_s, 5.0):
            self._stuck_warned = True
            log.warning(
                "otel_train: NVML sampler has been stuck in %s for %.0f s; GPU gauges show the last values",
                (reads.current_call if reads is not None else "") or "an NVML call", stuck_for,
            )  # fmt: skip

    # -- sampling ----------------------------------------------------------------------------------
    def sample(self) -> None:
        """One sample of every device that is not lost, swapped in as the new snapshot."""
        reads = self._reads
        if reads is None:
            return
        with self._lock:
            self._busy_since = self.clock()
            try:
                if self._follow is not None:
                    self._switch_device(reads, self._follow)
                self.snapshot = self._sample_devices(reads)
            finally:
                self._busy_since = None
        self.samples += 1

    def _switch_device(self, reads: NvmlReads, uuid: str) -> None:
        self._follow = None
        device = reads.device_for_uuid(uuid)
        if device is None:
            return
        was = self.devices[0].dev if self.devices else None
        self.devices = [DeviceState(device)]
        log.warning(
            "otel_train: this rank's CUDA device is %s (%s), not %s: GPU metrics follow it from now on; "
            "the resource attribute hw.gpu.uuid still names the other. Set CUDA_DEVICE_ORDER=PCI_BUS_ID "
            "or initialise CUDA before ot.init() to find it from the start",
            device.name, device.uuid, f"{was.name} ({was.uuid})" if was else "the GPU found at start",
        )  # fmt: skip

    def _sample_devices(self, reads: NvmlReads) -> GpuSnapshot:
        samples, uuids = [], []
        for state in [s for s in self.devices if not s.lost]:
            try:
                samples.append(reads.sample_device(state, self.clock))
                uuids.append(state.dev.uuid)
            except GpuLost as exc:
                self._mark_lost(state, str(exc))
        obs: dict[str, list[Observation]] = {}
        for sample in samples:
            for name, points in sample.obs.items():
                obs.setdefault(name, []).extend(points)
        energies = [sample.energy_j for sample in samples if sample.energy_j is not None]
        energy = sum(energies) if samples and len(energies) == len(samples) else None  # all GPUs' or none
        memory = tuple(sample.memory for sample in samples if sample.memory is not None)
        return GpuSnapshot(self.clock(), obs, energy, memory, tuple(uuids))

    def _mark_lost(self, state: DeviceState, detail: str) -> None:
        state.lost = True
        message = f"GPU {state.dev.name} ({state.dev.uuid}) is lost: {detail}; its metrics stop"
        log.error("otel_train: %s", message)
        attributes = {sc.HW_ID: state.dev.uuid, sc.HW_NAME: state.dev.name}
        self._events.emit("gpu_lost", message, attributes, severity="ERROR")
