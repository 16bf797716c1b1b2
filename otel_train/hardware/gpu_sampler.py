"""The NVML sampler: the rank's GPUs sampled on a thread of their own, read from a snapshot.

NVML is called only on this sampler's thread. SDK callbacks read a snapshot that the sampler swaps
in atomically, so a hung NVML call stalls only the sampler: collection and export go on with the
last values (opentelemetry-python #3098/#3461: a slow callback kills the reader). A value the
device does not support (NotSupported, NoPermission, missing function) is omitted, never reported
as 0, and not asked for again. A lost GPU (GpuIsLost / Unknown) stops its series and emits one
``gpu_lost`` health event.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_train import semconv as sc
from otel_train.hardware.discovery import GpuDevice, shutdown_quietly
from otel_train.health import EventChannel

# One logger for the whole hardware subsystem (its modules were one file): users filter on it.
log = logging.getLogger("otel_train.hardware")

MAX_XID_EVENTS_PER_SAMPLE = 64

# Clock-event (throttle) reasons -> NVML bits. GpuIdle and ApplicationsClocksSetting are not
# slowdowns and are left out. "sw_slowdown" is SyncBoost (software lowered clocks to match the
# sync-boost group); NVML has no other software slowdown bit besides the power cap and thermal.
THROTTLE_BITS: dict[str, int] = {
    "power_cap": 0x4,  # SwPowerCap
    "thermal": 0x20 | 0x40,  # SwThermalSlowdown | HwThermalSlowdown
    "hw_slowdown": 0x8 | 0x80,  # HwSlowdown | HwPowerBrakeSlowdown
    "sw_slowdown": 0x10,  # SyncBoost
}

GPU_SPECS = (
    sc.GPU_UTILIZATION, sc.GPU_MEMORY_UTILIZATION, sc.GPU_MEMORY_CONTROLLER, sc.GPU_MEMORY_USAGE,
    sc.GPU_MEMORY_LIMIT, sc.GPU_TEMPERATURE, sc.GPU_POWER, sc.GPU_ENERGY, sc.GPU_ERRORS, sc.GPU_IO,
    sc.GPU_CLOCK_SM, sc.GPU_CLOCK_MEMORY, sc.GPU_THROTTLE,
)  # fmt: skip

_UNSUPPORTED_CODES = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND")
_LOST_CODES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN")


class _GpuLost(Exception):
    pass


@dataclass
class DeviceState:
    """What the sampler knows about one GPU: the fields it does not ask for again, lost, XIDs."""

    dev: GpuDevice
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False
    event_set: Any = None
    xid_count: int = 0
    last_xid: int | None = None
    io_bytes: dict[str, float] = field(default_factory=dict)  # hw.gpu.io by direction (integrated)
    io_sampled_at: float | None = None


@dataclass(frozen=True)
class GpuSnapshot:
    """One sample of every GPU, swapped in whole: what callbacks and the flush read."""

    time: float = 0.0  # the sampler clock at the end of the sample
    obs: Mapping[str, list[Observation]] = field(default_factory=dict)
    energy_j: float | None = None  # summed over the rank's GPUs (None when not all report it)
    memory: tuple[tuple[str, int, int], ...] = ()  # (uuid, used, total)


def _codes(nvml: Any, names: tuple[str, ...]) -> frozenset[int]:
    return frozenset(int(getattr(nvml, n)) for n in names if hasattr(nvml, n))


class _DeviceSample:
    """Observations of one device in one sample, each with the device's identity attributes."""

    def __init__(self, state: DeviceState) -> None:
        self.attrs = {sc.HW_ID: state.dev.uuid, sc.HW_NAME: state.dev.name}
        self.typed_attrs = {**self.attrs, sc.HW_TYPE: sc.HW_TYPE_GPU}  # for specs that carry hw.type
        self.obs: dict[str, list[Observation]] = {}
        self.energy_j: float | None = None
        self.memory: tuple[str, int, int] | None = None

    def put(self, spec: sc.MetricSpec, value: float, extra: Mapping[str, str] | None = None) -> None:
        base = self.typed_attrs if sc.HW_TYPE in spec.attributes else self.attrs
        attrs = {**base, **extra} if extra else base
        self.obs.setdefault(spec.name, []).append(Observation(value, attrs))


class GpuSampler:
    """Samples the rank's GPUs (``sample()``, on its own thread via ``run()``) into ``snapshot``.

    Without a GPU (``attach`` never called, or no device) ``sample()`` does nothing.
    """

    def __init__(self, events: EventChannel) -> None:
        self._events = events
        self.clock: Callable[[], float] = time.monotonic  # the sample times' clock (tests replace it)
        self._nvml: Any | None = None
        self.devices: list[DeviceState] = []
        self._unsupported_codes: frozenset[int] = frozenset()
        self._lost_codes: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self.snapshot = GpuSnapshot()
        self._busy_since: float | None = None
        self._current_call = ""
        self._stuck_warned = False
        self._samples = 0
        self._sample_cond = threading.Condition()

    def attach(self, nvml: Any, devices: Iterable[GpuDevice]) -> None:
        """Sample these devices through ``nvml`` (initialised by discovery; released on stop)."""
        self._nvml = nvml
        self.devices = [DeviceState(d) for d in devices]
        self._unsupported_codes = _codes(nvml, _UNSUPPORTED_CODES)
        self._lost_codes = _codes(nvml, _LOST_CODES)

    def create_instruments(self, meter: Meter) -> None:
        for spec in GPU_SPECS:
            spec.create(meter, self._observe(spec.name))

    def _observe(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return self.snapshot.obs.get(name, ())  # cache only: never NVML here

        return callback

    # -- thread ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event, interval_s: float) -> None:
        """The sampler thread: sample every ``interval_s`` until ``stop``; then release NVML."""
        try:
            while True:
                try:
                    self.sample()
                except Exception:  # never let the sampler die
                    log.debug("otel_train: GPU sample failed", exc_info=True)
                if stop.wait(interval_s):
                    break
        finally:
            self.release_nvml()

    def release_nvml(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        for state in self.devices:
            if state.event_set is not None:
                with contextlib.suppress(Exception):
                    nvml.nvmlEventSetFree(state.event_set)
                state.event_set = None
        shutdown_quietly(nvml)

    @property
    def samples_taken(self) -> int:
        return self._samples

    def wait_for_samples(self, n: int, timeout_s: float) -> bool:
        """Block until at least ``n`` samples were taken (tests); False on timeout."""
        with self._sample_cond:
            return self._sample_cond.wait_for(lambda: self._samples >= n, timeout_s)

    def warn_if_stuck(self, interval_s: float) -> None:
        """Warn once when one NVML call has blocked the sampler for long (called at the flush)."""
        since = self._busy_since
        if since is None or self._stuck_warned:
            return
        stuck_for = self.clock() - since
        if stuck_for > max(2 * interval_s, 5.0):
            self._stuck_warned = True
            log.warning(
                "otel_train: NVML sampler has been stuck in %s for %.0f s; GPU gauges show the last values",
                self._current_call or "an NVML call", stuck_for,
            )  # fmt: skip

    # -- sampling ----------------------------------------------------------------------------------
    def sample(self) -> None:
        """One sample of every device that is not lost, swapped in as the new snapshot."""
        if self._nvml is None:
            return
        with self._lock:
            self._busy_since = self.clock()
            try:
                self.snapshot = self._sample_devices()
            finally:
                self._busy_since = None
        with self._sample_cond:
            self._samples += 1
            self._sample_cond.notify_all()

    def _sample_devices(self) -> GpuSnapshot:
        obs: dict[str, list[Observation]] = {}
        energy_total: float | None = 0.0
        memory: list[tuple[str, int, int]] = []
        for state in self.devices:
            if state.lost:
                continue
            try:
                sample = self._sample_device(state)
            except _GpuLost as exc:
                self._mark_lost(state, str(exc))
                continue
            for name, points in sample.obs.items():
                obs.setdefault(name, []).extend(points)
            energy = sample.energy_j
            energy_total = None if energy is None or energy_total is None else energy_total + energy
            if sample.memory is not None:
                memory.append(sample.memory)
        if not any(not s.lost for s in self.devices):
            energy_total = None
        return GpuSnapshot(self.clock(), obs, energy_total, tuple(memory))

    def _sample_device(self, state: DeviceState) -> _DeviceSample:
        out = _DeviceSample(state)
        self._sample_load(state, out)
        self._sample_errors(state, out)
        self._sample_clocks(state, out)
        self._sample_pcie(state, out)
        return out

    def _sample_load(self, state: DeviceState, out: _DeviceSample) -> None:
        """Utilisation, memory, temperature, power and the energy counter."""
        nvml: Any = self._nvml
        util = self._call(state, "utilization", "nvmlDeviceGetUtilizationRates")
        if util is not None:
            out.put(sc.GPU_UTILIZATION, util.gpu / 100.0)
            out.put(sc.GPU_MEMORY_CONTROLLER, util.memory / 100.0)
        mem_info = self._call(state, "memory", "nvmlDeviceGetMemoryInfo")
        if mem_info is not None:
            out.put(sc.GPU_MEMORY_USAGE, int(mem_info.used))
            out.put(sc.GPU_MEMORY_LIMIT, int(mem_info.total))
            if mem_info.total > 0:
                out.put(sc.GPU_MEMORY_UTILIZATION, mem_info.used / mem_info.total)
            out.memory = (state.dev.uuid, int(mem_info.used), int(mem_info.total))
        temp = self._call(
            state, "temperature", "nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        )
        if temp is not None:
            out.put(sc.GPU_TEMPERATURE, float(temp))
        power = self._call(state, "power", "nvmlDeviceGetPowerUsage")
        if power is not None:
            out.put(sc.GPU_POWER, power / 1000.0)  # mW -> W
        energy_mj = self._call(state, "energy", "nvmlDeviceGetTotalEnergyConsumption")
        out.energy_j = energy_mj / 1000.0 if energy_mj is not None else None  # mJ -> J
        if out.energy_j is not None:
            out.put(sc.GPU_ENERGY, out.energy_j)

    def _sample_errors(self, state: DeviceState, out: _DeviceSample) -> None:
        """ECC error counts and critical XID events."""
        nvml: Any = self._nvml
        for err_type, nvml_type in (("ecc_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                                    ("ecc_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")):  # fmt: skip
            count = self._call(
                state, err_type, "nvmlDeviceGetTotalEccErrors", getattr(nvml, nvml_type),
                getattr(nvml, "NVML_VOLATILE_ECC", 0),
            )  # fmt: skip
            if count is not None:
                out.put(sc.GPU_ERRORS, int(count), {sc.ERROR_TYPE: err_type})
        if self._drain_xids(state):
            out.put(sc.GPU_ERRORS, state.xid_count, {sc.ERROR_TYPE: "xid"})

    def _sample_clocks(self, state: DeviceState, out: _DeviceSample) -> None:
        """SM and memory clocks and the clock-event (throttle) reasons."""
        nvml: Any = self._nvml
        for spec, field_name, clock in ((sc.GPU_CLOCK_SM, "clock_sm", "NVML_CLOCK_SM"),
                                        (sc.GPU_CLOCK_MEMORY, "clock_mem", "NVML_CLOCK_MEM")):  # fmt: skip
            mhz = self._call(state, field_name, "nvmlDeviceGetClockInfo", getattr(nvml, clock))
            if mhz is not None:
                out.put(spec, mhz * 1e6)  # MHz -> Hz
        reasons = self._call(state, "clock_reasons", "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None and "clock_reasons" in state.unsupported:
            reasons = self._call(state, "throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        if reasons is not None:
            for reason, bits in THROTTLE_BITS.items():
                out.put(sc.GPU_THROTTLE, 1 if int(reasons) & bits else 0, {sc.THROTTLE_REASON: reason})

    def _sample_pcie(self, state: DeviceState, out: _DeviceSample) -> None:
        """hw.gpu.io: NVML gives PCIe throughput (KB/s over a short window), not a byte count, so
        the counter adds each sample's rate times the time since the previous sample."""
        nvml: Any = self._nvml
        now = self.clock()
        elapsed = now - state.io_sampled_at if state.io_sampled_at is not None else 0.0
        state.io_sampled_at = now
        for direction, counter in (
            ("receive", "NVML_PCIE_UTIL_RX_BYTES"),
            ("transmit", "NVML_PCIE_UTIL_TX_BYTES"),
        ):
            kbs = self._call(
                state, f"pcie_{direction}", "nvmlDeviceGetPcieThroughput", getattr(nvml, counter)
            )
            if kbs is not None:
                total = state.io_bytes.get(direction, 0.0) + kbs * 1024.0 * elapsed  # KB/s -> By
                state.io_bytes[direction] = total
                out.put(sc.GPU_IO, int(total), {sc.DIRECTION: direction})

    def _call(self, state: DeviceState, field_name: str, fn_name: str, *args: Any) -> Any | None:
        """One NVML call; None when unsupported (remembered) or failing transiently."""
        if field_name in state.unsupported:
            return None
        nvml = self._nvml
        fn = getattr(nvml, fn_name, None)
        if fn is None:
            state.unsupported.add(field_name)
            return None
        self._current_call = fn_name
        try:
            return fn(state.dev.handle, *args)
        except Exception as exc:
            code = getattr(exc, "value", None)
            if code in self._lost_codes:
                raise _GpuLost(f"{fn_name}: {exc}") from exc
            if code in self._unsupported_codes:
                state.unsupported.add(field_name)
                log.debug("otel_train: %s not supported on %s (%s)", fn_name, state.dev.uuid, exc)
            return None
        finally:
            self._current_call = ""

    # -- XID events --------------------------------------------------------------------------------
    def _drain_xids(self, state: DeviceState) -> bool:
        """Count critical XID events; True when XID reporting works on this device."""
        if "xid" in state.unsupported:
            return False
        if state.event_set is None and not self._register_xids(state):
            return False
        nvml: Any = self._nvml
        for _ in range(MAX_XID_EVENTS_PER_SAMPLE):
            try:
                self._current_call = "nvmlEventSetWait"
                data = nvml.nvmlEventSetWait(state.event_set, 0)
            except Exception as exc:
                code = getattr(exc, "value", None)
                if code in self._lost_codes:
                    raise _GpuLost(f"nvmlEventSetWait: {exc}") from exc
                if code in self._unsupported_codes:  # a count that can never move is not a 0
                    log.debug("otel_train: XID wait unavailable on %s (%s)", state.dev.uuid, exc)
                    self._give_up_xids(state)
                    return False
                break  # NVML_ERROR_TIMEOUT: no pending event
            finally:
                self._current_call = ""
            state.xid_count += 1
            state.last_xid = int(getattr(data, "eventData", 0))
            _emit_xid(self._events, state, state.last_xid)
        return True

    def _register_xids(self, state: DeviceState) -> bool:
        """Create the device's XID event set; False (remembered) when the device cannot."""
        nvml: Any = self._nvml
        try:
            self._current_call = "nvmlEventSetCreate"
            state.event_set = nvml.nvmlEventSetCreate()
            self._current_call = "nvmlDeviceRegisterEvents"
            nvml.nvmlDeviceRegisterEvents(
                state.dev.handle, nvml.nvmlEventTypeXidCriticalError, state.event_set
            )
        except Exception as exc:
            if getattr(exc, "value", None) in self._lost_codes:
                raise _GpuLost(f"nvmlDeviceRegisterEvents: {exc}") from exc
            log.debug("otel_train: XID events unavailable on %s (%s)", state.dev.uuid, exc)
            self._give_up_xids(state)
            return False
        finally:
            self._current_call = ""
        return True

    def _give_up_xids(self, state: DeviceState) -> None:
        nvml: Any = self._nvml
        state.unsupported.add("xid")
        if state.event_set is not None:
            with contextlib.suppress(Exception):
                nvml.nvmlEventSetFree(state.event_set)
            state.event_set = None

    def _mark_lost(self, state: DeviceState, detail: str) -> None:
        state.lost = True
        message = f"GPU {state.dev.name} ({state.dev.uuid}) is lost: {detail}; its metrics stop"
        log.error("otel_train: %s", message)
        try:
            self._events.emit("gpu_lost", message, {sc.HW_ID: state.dev.uuid, sc.HW_NAME: state.dev.name})
        except Exception:
            log.debug("otel_train: gpu_lost event channel failed", exc_info=True)


def _emit_xid(events: EventChannel, state: DeviceState, code: int) -> None:
    """A `gpu_xid` health event carrying the code (hw.errors{error.type="xid"} counts them)."""
    message = f"GPU {state.dev.name} ({state.dev.uuid}) reported XID {code}"
    attributes: dict[str, str | int] = {sc.HW_ID: state.dev.uuid, sc.HW_NAME: state.dev.name, sc.XID: code}
    try:
        events.emit("gpu_xid", message, attributes, severity="ERROR")
    except Exception:
        log.warning("otel_train: %s", message)
