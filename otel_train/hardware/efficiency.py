"""Flush-time hardware figures on the background worker (CUDA allocator memory, memory pressure,
energy, MFU): docs/design/hardware-and-numerics.md#hardware.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.metrics import Meter

from otel_train import semconv as sc
from otel_train.config import Config
from otel_train.core.buffer import Interval
from otel_train.hardware.discovery import cuda_initialized, log, torch_cuda_if_loaded, torch_device_index
from otel_train.hardware.gpu_sampler import GpuSampler
from otel_train.hardware.mfu import float32_matmul_dtype, normalize_dtype, resolve_peak
from otel_train.health import EventChannel

MEMORY_PRESSURE_RATIO = 0.95  # reserved (allocator) or used (NVML) / limit above this -> event
MEMORY_PRESSURE_REARM = 0.90  # ... re-armed once back below this

# (instrument, its torch.cuda.memory_stats key): gauges, and counters of torch's running totals
CUDA_GAUGES = ((sc.CUDA_MEMORY_ALLOCATED, "allocated_bytes.all.current"),
               (sc.CUDA_MEMORY_RESERVED, "reserved_bytes.all.current"),
               (sc.CUDA_MEMORY_PEAK, "allocated_bytes.all.peak"))  # fmt: skip
CUDA_COUNTS = ((sc.CUDA_ALLOC_RETRIES, "num_alloc_retries"), (sc.CUDA_OOMS, "num_ooms"))
CUDA_SPECS = tuple(spec for spec, _ in CUDA_GAUGES + CUDA_COUNTS)
ENERGY_SPECS = (sc.POWER_AVERAGE, sc.ENERGY_PER_STEP, sc.ENERGY_PER_TOKEN)  # with a GPU NVML samples
MFU_SPECS = (sc.FLOPS, sc.MFU)


class FlushEfficiency:
    """The flush-time gauges of one rank; ``gpu`` is the NVML sampler whose snapshot they read."""

    def __init__(
        self, config: Config, meter: Meter, events: EventChannel, local_rank: int, gpu: GpuSampler
    ) -> None:
        self._config = config
        self._meter = meter
        self._events = events
        self._local_rank = local_rank
        self._gpu = gpu
        # torch.cuda when torch loaded it (never imported here); tests replace it with a fake
        self.torch_cuda: Callable[[], Any | None] = torch_cuda_if_loaded
        # None: detected (the autocast dtype seen at a flush, else bf16); see Config.compute_dtype.
        setting = config.compute_dtype
        self._dtype: str | None = normalize_dtype(setting) if setting != "auto" else None
        self._detected: str | None = None
        self._instruments: dict[str, Any] = {}
        self._energy_prev: tuple[float, float, tuple[str, ...]] | None = None
        self._cuda_prev: dict[str, int] = {}
        self._cuda_total: int | None = None
        self._pressure_active = False
        self._cuda_reserved_ratio: float | None = None
        self._peaks: dict[tuple[str | None, str], tuple[float | None, str | None]] = {}  # logged once each
        self._peak_logged = False  # "no device known yet" said
        self._mfu_event_sent = False
        self.on_pressure: Callable[[str], None] | None = None  # memory_dump.MemoryDumps, when wired

    def create(self, specs: tuple[sc.MetricSpec, ...]) -> None:
        for spec in specs:
            self._instruments[spec.name] = spec.create(self._meter)

    def compute_dtype(self, autocast: str | None = None) -> str:
        """The dtype MFU's peak is for: the setting, else the autocast dtype seen at a flush (kept
        once seen), else bf16. fp32 is tf32 when torch lets float32 matmuls use TF32 tensor cores."""
        if self._dtype is None and autocast is not None:
            self._detected = autocast
        dtype = self._dtype or self._detected or "bf16"
        return float32_matmul_dtype() if dtype == "fp32" else dtype

    # -- CUDA allocator --------------------------------------------------------------------------------
    def flush_cuda(self, interval: Interval) -> None:
        self._cuda_reserved_ratio = None  # a flush without CUDA reports no pressure from it
        tc = self.torch_cuda()
        if not cuda_initialized(tc):
            return
        device = torch_device_index(tc, self._local_rank)
        stats = tc.memory_stats(device)
        if not stats:
            return
        if sc.CUDA_MEMORY_ALLOCATED.name not in self._instruments:
            self.create(CUDA_SPECS)
        for spec, key in CUDA_GAUGES:
            if stats.get(key) is not None:
                self._instruments[spec.name].set(int(stats[key]))
        if stats.get("allocated_bytes.all.peak") is not None and self._config.cuda_peak_per_interval:
            # Next interval's peak starts from the current level. Process-wide: it also resets
            # what torch.cuda.max_memory_allocated() returns to user code (hence the setting).
            tc.reset_peak_memory_stats(device)
        self._add_cuda_counts(stats)
        if self._cuda_total is None:
            try:
                self._cuda_total = int(tc.get_device_properties(device).total_memory)
            except RuntimeError:  # torch's CUDA errors
                self._cuda_total = 0
        if stats.get("reserved_bytes.all.current") is not None and self._cuda_total:
            self._cuda_reserved_ratio = int(stats["reserved_bytes.all.current"]) / self._cuda_total

    def _add_cuda_counts(self, stats: Mapping[str, Any]) -> None:
        """Allocator retries and OOMs since the last flush (torch keeps running totals)."""
        for spec, key in CUDA_COUNTS:
            value = stats.get(key)
            if value is None:
                continue
            previous = self._cuda_prev.get(key, 0)
            delta = int(value) - previous if int(value) >= previous else int(value)  # stats were reset
            self._cuda_prev[key] = int(value)
            if delta > 0:
                self._instruments[spec.name].add(delta)

    def flush_pressure(self, interval: Interval) -> None:
        ratios: list[tuple[str, float]] = []
        if self._cuda_reserved_ratio is not None:
            ratios.append(("CUDA allocator reserved memory", self._cuda_reserved_ratio))
        for uuid, used, total in self._gpu.snapshot.memory:
            if total > 0:
                ratios.append((f"NVML used on {uuid}", used / total))
        if not ratios:
            return
        what, worst = max(ratios, key=lambda r: r[1])
        if worst > MEMORY_PRESSURE_RATIO and not self._pressure_active:
            self._pressure_active = True
            message = f"GPU memory pressure: {what} is {worst:.1%} of the device's memory"
            self._events.emit("memory_pressure", message, {"ratio": round(worst, 4)})
            if self.on_pressure is not None:
                self.on_pressure(message)
        elif worst < MEMORY_PRESSURE_REARM:
            self._pressure_active = False

    # -- energy ----------------------------------------------------------------------------------------
    def flush_energy(self, interval: Interval) -> None:
        snap = self._gpu.snapshot
        if snap.energy_j is None:  # also without a GPU
            return
        prev = self._energy_prev
        if prev is None or snap.energy_j < prev[1] or snap.devices != prev[2]:
            # first flush, the counter went back (a reset), or other GPUs (one lost, one followed)
            self._energy_prev = (snap.time, snap.energy_j, snap.devices)
            return
        dt = snap.time - prev[0]
        if dt <= 0:  # no new sample since the last flush: keep the baseline, report next time
            return
        power = (snap.energy_j - prev[1]) / dt
        self._energy_prev = (snap.time, snap.energy_j, snap.devices)
        inst = self._instruments
        inst[sc.POWER_AVERAGE.name].set(power)
        # Sample times do not coincide with flushes: the interval's energy is estimated as the
        # average power between the two latest samples times the interval's wall time.
        if interval.elapsed_s <= 0:
            return
        energy = power * interval.elapsed_s
        if interval.steps > 0:
            inst[sc.ENERGY_PER_STEP.name].set(energy / interval.steps)
        if interval.tokens > 0:
            inst[sc.ENERGY_PER_TOKEN.name].set(energy / interval.tokens)

    # -- MFU -------------------------------------------------------------------------------------------
    def _device_name(self) -> str | None:
        if self._gpu.devices:
            return self._gpu.devices[0].dev.name
        tc = self.torch_cuda()
        if cuda_initialized(tc):
            try:
                return str(tc.get_device_name(torch_device_index(tc, self._local_rank)))
            except RuntimeError:  # torch's CUDA errors
                return None
        return None

    def resolve_peak(self, dtype: str | None = None) -> tuple[float | None, str | None]:
        """(peak FLOP/s, source) for MFU at `dtype` (default: `compute_dtype()`); (None, None): no MFU."""
        dtype = dtype or self.compute_dtype()
        name = self._device_name()
        if (name, dtype) in self._peaks:
            return self._peaks[name, dtype]
        peak = resolve_peak(name, dtype, self._config.peak_flops, os.environ)
        if peak[0] is None and name is None:
            # No device known yet (CUDA may be initialised later): resolve again next flush.
            if not self._peak_logged:
                self._peak_logged = True
                log.info("otel_train: no MFU yet: no GPU device known; set peak_flops to force one")
            return peak
        self._peaks[name, dtype] = peak
        if peak[0] is None:
            log.info(
                "otel_train: no MFU: peak FLOP/s unknown for device %r (dtype %s); set peak_flops or %s",
                name, dtype, "OTEL_TRAIN_PEAK_FLOPS",
            )  # fmt: skip
        else:
            log.info("otel_train: MFU peak %.4g FLOP/s from %s (device %r)", peak[0], peak[1], name)
        return peak

    def flush_mfu(self, interval: Interval) -> None:
        fpt = self._config.flops_per_token
        if not fpt or interval.tokens <= 0 or interval.elapsed_s <= 0:
            return
        achieved = fpt * interval.tokens / interval.elapsed_s
        self._instruments[sc.FLOPS.name].set(achieved)
        dtype = self.compute_dtype(interval.autocast_dtype)
        peak, source = self.resolve_peak(dtype)
        if peak is None or source is None:
            return
        mfu = achieved / peak
        self._instruments[sc.MFU.name].set(
            mfu, {sc.PEAK_SOURCE: source, sc.COMPUTE_DTYPE: dtype, sc.PEAK_FLOPS: peak}
        )
        if mfu > 1.0 and not self._mfu_event_sent:
            self._mfu_event_sent = True
            message = (
                f"MFU {mfu:.0%} > 100%: the peak ({peak:.4g} FLOP/s from {source}) or flops_per_token "
                f"({fpt:.4g}) is wrong for this device/dtype"
            )
            self._events.emit("mfu_over_100", message, {"mfu": round(mfu, 4), sc.PEAK_SOURCE: source})
