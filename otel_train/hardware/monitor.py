"""HardwareMonitor: the facade `assemble` builds, over discovery, the two samplers and the flush
figures (the parts: docs/design/hardware-and-numerics.md#hardware)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from opentelemetry.metrics import Meter

from otel_train.config import Config
from otel_train.core.buffer import Interval
from otel_train.hardware.discovery import Discovery, log, same_uuid, shutdown_quietly, torch_uuid
from otel_train.hardware.efficiency import ENERGY_SPECS, MFU_SPECS, FlushEfficiency
from otel_train.hardware.gpu_sampler import GpuSampler
from otel_train.hardware.host_sampler import HostSampler
from otel_train.health import EventChannel, NullEventChannel

_GPU_THREAD = "otel-train-hw-gpu"
_HOST_THREAD = "otel-train-hw-host"


class HardwareMonitor:
    """GPU (NVML), CUDA allocator, host, energy and MFU telemetry for one rank; a flush listener."""

    def __init__(
        self, config: Config, meter: Meter, events: EventChannel | None, local_rank: int, discovery: Discovery
    ) -> None:
        """`discovery`: this rank's GPU as found before the Resource (whose GPU attributes it gives)."""
        self._config = config
        self._meter = meter
        events = events if events is not None else NullEventChannel()
        self.discovery = discovery
        self._local_rank = local_rank
        self._device_checked = False  # against torch's device, once CUDA is initialised
        self._interval_s = config.hardware_interval_s
        self._started = False
        self._closed = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.gpu_sampler = GpuSampler(events)
        self.host_sampler = HostSampler()
        self.efficiency = FlushEfficiency(config, meter, events, local_rank, self.gpu_sampler)

    def start(self, background: bool = True) -> None:
        """Create the instruments and start the sampler threads (``background=False``: no threads;
        call ``sample_once()`` yourself; for tests and benchmarks)."""
        if self._started or not self._config.hardware:
            return
        self._started = True
        disc = self.discovery
        if disc.nvml is not None and disc.devices:
            self.gpu_sampler.attach(disc.nvml, disc.devices)
            d = disc.devices[0]
            log.info("otel_train: GPU metrics on for %s (%s)", d.name, d.uuid)
            self.gpu_sampler.create_instruments(self._meter)
            self.efficiency.create(ENERGY_SPECS)
        else:
            log.info("otel_train: no GPU metrics: %s", disc.reason or "no GPU")
        self.host_sampler.create_instruments(self._meter)
        self.efficiency.create(MFU_SPECS)
        if background:
            if self.gpu_sampler.devices:
                self._spawn(self.gpu_sampler.run, _GPU_THREAD)
            self._spawn(self.host_sampler.run, _HOST_THREAD)

    def sample_once(self) -> None:
        """Take one GPU and one host sample now, on the calling thread."""
        self.gpu_sampler.sample()
        self.host_sampler.sample()

    def close(self, timeout_s: float = 0.5) -> None:
        """Stop sampling. A sampler stuck in NVML is abandoned (daemon thread), never waited on."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not any(t.name == _GPU_THREAD for t in self._threads):
            self.gpu_sampler.release_nvml()  # no sampler thread: release here (the thread does so on exit)
        if not self._started and self.discovery.nvml is not None:
            shutdown_quietly(self.discovery.nvml)  # discovered for resource attributes only

    def on_flush(self, interval: Interval) -> None:
        if not self._started or self._closed:
            return
        if not self._device_checked:
            self._check_device()
        eff = self.efficiency
        for part in (eff.flush_cuda, eff.flush_pressure, eff.flush_energy, eff.flush_mfu):
            try:
                part(interval)
            except Exception:  # torch.cuda, NVML and MFU reads (code this library does not own)
                log.debug("otel_train: hardware flush step %s failed", part.__name__, exc_info=True)
        self.gpu_sampler.warn_if_stuck(self._interval_s)

    def _check_device(self) -> None:
        """Discovery ran before CUDA was initialised, by CUDA_VISIBLE_DEVICES index (NVML's PCI
        order); once torch knows its device, a different GPU is followed from then on."""
        want = torch_uuid(self.efficiency.torch_cuda(), self._local_rank)
        if want is None:
            return  # CUDA not initialised yet (or never: a CPU run)
        self._device_checked = True
        devices = self.gpu_sampler.devices
        if devices and not same_uuid(devices[0].dev.uuid, want):
            self.gpu_sampler.follow(want)

    def _spawn(self, run: Callable[[threading.Event, float], None], name: str) -> None:
        thread = threading.Thread(target=run, args=(self._stop, self._interval_s), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
