"""One sample of one GPU through NVML, on the sampler's thread: unsupported values, lost GPUs and
XID events as docs/design/hardware-and-numerics.md#hardware says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.metrics import Observation

from otel_train import semconv as sc
from otel_train.hardware.discovery import GpuDevice, describe_device, handle_for_uuid, log, shutdown_quietly
from otel_train.health import EventChannel

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

PCIE_COUNTERS = {"receive": "NVML_PCIE_UTIL_RX_BYTES", "transmit": "NVML_PCIE_UTIL_TX_BYTES"}
_UNSUPPORTED_CODES = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND")
# A GPU that needs a reset (after a fatal XID) reports nothing trustworthy until it gets one: lost too.
_LOST_CODES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")
# NVML's "any unexpected error": one field failing on a healthy GPU, or the GPU gone. A probe tells.
_UNKNOWN_CODES = ("NVML_ERROR_UNKNOWN",)


class GpuLost(Exception):
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
    failures_told: set[tuple[str, int]] = field(default_factory=set)  # (field, NVML code) warned about


def _codes(nvml: Any, names: tuple[str, ...]) -> frozenset[int]:
    return frozenset(int(getattr(nvml, n)) for n in names if hasattr(nvml, n))


class DeviceSample:
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


class NvmlReads:
    """The NVML calls of a sample, through ``nvml`` (initialised by discovery; `release` frees it)."""

    def __init__(self, nvml: Any, events: EventChannel) -> None:
        self._nvml = nvml
        self._events = events
        self._unsupported_codes = _codes(nvml, _UNSUPPORTED_CODES)
        self._lost_codes = _codes(nvml, _LOST_CODES)
        self._unknown_codes = _codes(nvml, _UNKNOWN_CODES)
        self.current_call = ""  # the NVML function running now: the sampler's stuck warning names it

    def release(self, devices: Iterable[DeviceState]) -> None:
        """Free the devices' XID event sets and shut NVML down."""
        for state in devices:
            self._give_up_xids(state)
        shutdown_quietly(self._nvml)

    def sample_device(self, state: DeviceState, clock: Callable[[], float]) -> DeviceSample:
        """One sample of the device; raises `GpuLost` when it is gone. `clock` times the PCIe counter."""
        out = DeviceSample(state)
        for part in (self._sample_load, self._sample_errors, self._sample_clocks):
            part(state, out)
        self._sample_pcie(state, out, clock)
        return out

    def _sample_load(self, state: DeviceState, out: DeviceSample) -> None:
        """Utilisation, memory, temperature, power and the energy counter."""
        nvml: Any = self._nvml
        util = self._call(state, "utilization", "nvmlDeviceGetUtilizationRates")
        if util is not None:
            out.put(sc.GPU_UTILIZATION, util.gpu / 100.0)
            out.put(sc.GPU_MEMORY_CONTROLLER, util.memory / 100.0)
        mem = self._call(state, "memory", "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            out.put(sc.GPU_MEMORY_USAGE, int(mem.used))
            out.put(sc.GPU_MEMORY_LIMIT, int(mem.total))
            if mem.total > 0:
                out.put(sc.GPU_MEMORY_UTILIZATION, mem.used / mem.total)
            out.memory = (state.dev.uuid, int(mem.used), int(mem.total))
        temp = self._call(state, "temperature", "nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)
        if temp is not None:
            out.put(sc.GPU_TEMPERATURE, float(temp))
        power = self._call(state, "power", "nvmlDeviceGetPowerUsage")
        if power is not None:
            out.put(sc.GPU_POWER, power / 1000.0)  # mW -> W
        energy_mj = self._call(state, "energy", "nvmlDeviceGetTotalEnergyConsumption")
        if energy_mj is not None:
            out.energy_j = energy_mj / 1000.0  # mJ -> J
            out.put(sc.GPU_ENERGY, out.energy_j)

    def _sample_errors(self, state: DeviceState, out: DeviceSample) -> None:
        """ECC error counts and critical XID events."""
        nvml: Any = self._nvml
        for err_type, nvml_type in (("ecc_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                                    ("ecc_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")):  # fmt: skip
            ecc_type, volatile = getattr(nvml, nvml_type), nvml.NVML_VOLATILE_ECC
            count = self._call(state, err_type, "nvmlDeviceGetTotalEccErrors", ecc_type, volatile)
            if count is not None:
                out.put(sc.GPU_ERRORS, int(count), {sc.ERROR_TYPE: err_type})
        if self._drain_xids(state):
            out.put(sc.GPU_ERRORS, state.xid_count, {sc.ERROR_TYPE: "xid"})

    def _sample_clocks(self, state: DeviceState, out: DeviceSample) -> None:
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

    def _sample_pcie(self, state: DeviceState, out: DeviceSample, clock: Callable[[], float]) -> None:
        """hw.gpu.io: NVML gives PCIe throughput (KB/s over a short window), not a byte count, so
        the counter adds each sample's rate times the time since the previous sample."""
        nvml: Any = self._nvml
        now = clock()
        elapsed = now - state.io_sampled_at if state.io_sampled_at is not None else 0.0
        state.io_sampled_at = now
        for direction, counter in PCIE_COUNTERS.items():
            kbs = self._call(
                state, f"pcie_{direction}", "nvmlDeviceGetPcieThroughput", getattr(nvml, counter)
            )
            if kbs is not None:
                total = state.io_bytes.get(direction, 0.0) + kbs * 1024.0 * elapsed  # KB/s -> By
                state.io_bytes[direction] = total
                out.put(sc.GPU_IO, int(total), {sc.DIRECTION: direction})

    def _call(self, state: DeviceState, field_name: str, fn_name: str, *args: Any) -> Any | None:
        """One NVML call; None when unsupported (remembered) or failing (said once, asked again)."""
        if field_name in state.unsupported:
            return None
        if not hasattr(self._nvml, fn_name):
            state.unsupported.add(field_name)
            return None
        try:
            return self._invoke(fn_name, state.dev.handle, *args)
        except self._nvml.NVMLError as exc:
            if self._unsupported(exc):
                state.unsupported.add(field_name)
                log.debug("otel_train: %s not supported on %s (%s)", fn_name, state.dev.uuid, exc)
                return None
            if getattr(exc, "value", None) in self._unknown_codes:
                self._probe(state, fn_name, exc)  # raises GpuLost when the GPU itself is gone
            self._tell_failure(state, field_name, fn_name, exc)
            return None

    def _probe(self, state: DeviceState, fn_name: str, exc: Exception) -> None:
        """After an Unknown error: a GPU that cannot even say its UUID is gone."""
        try:
            self._invoke("nvmlDeviceGetUUID", state.dev.handle)
        except self._nvml.NVMLError as probe_exc:
            raise GpuLost(f"{fn_name}: {exc}; nvmlDeviceGetUUID: {probe_exc}") from probe_exc

    @staticmethod
    def _tell_failure(state: DeviceState, field_name: str, fn_name: str, exc: Exception) -> None:
        """A failing read is retried at every sample; each kind of failure is said once."""
        told = (field_name, int(getattr(exc, "value", -1)))
        if told not in state.failures_told:
            state.failures_told.add(told)
            log.warning(
                "otel_train: NVML %s failed on %s (%s); its value is missing while it fails (said once)",
                fn_name, state.dev.uuid, exc,
            )  # fmt: skip

    def device_for_uuid(self, want: str) -> GpuDevice | None:
        """The device with comparable UUID ``want``, through NVML (on the sampler's thread)."""
        try:
            handle = handle_for_uuid(self._nvml, want)
            return None if handle is None else describe_device(self._nvml, handle)
        except self._nvml.NVMLError as exc:
            log.warning("otel_train: NVML cannot find the GPU torch uses (%s): %s", want, exc)
            return None

    def _invoke(self, fn_name: str, *args: Any) -> Any:
        """``nvml.<fn_name>(*args)``, named in `current_call` while it runs; a lost GPU raises `GpuLost`."""
        self.current_call = fn_name
        try:
            return getattr(self._nvml, fn_name)(*args)
        except self._nvml.NVMLError as exc:
            if getattr(exc, "value", None) in self._lost_codes:
                raise GpuLost(f"{fn_name}: {exc}") from exc
            raise
        finally:
            self.current_call = ""

    def _unsupported(self, exc: Exception) -> bool:
        return getattr(exc, "value", None) in self._unsupported_codes

    # -- XID events --------------------------------------------------------------------------------
    def _drain_xids(self, state: DeviceState) -> bool:
        """Count critical XID events; True when XID reporting works on this device."""
        if "xid" in state.unsupported:
            return False
        if state.event_set is None and not self._register_xids(state):
            return False
        for _ in range(MAX_XID_EVENTS_PER_SAMPLE):
            try:
                data = self._invoke("nvmlEventSetWait", state.event_set, 0)
            except self._nvml.NVMLError as exc:
                if self._unsupported(exc):  # a count that can never move is not a 0
                    log.debug("otel_train: XID wait unavailable on %s (%s)", state.dev.uuid, exc)
                    self._give_up_xids(state)
                    return False
                break  # NVML_ERROR_TIMEOUT: no pending event
            state.xid_count += 1
            state.last_xid = int(getattr(data, "eventData", 0))
            _emit_xid(self._events, state, state.last_xid)
        return True

    def _register_xids(self, state: DeviceState) -> bool:
        """Create the device's XID event set; False (remembered) when the device cannot."""
        nvml: Any = self._nvml
        try:
            state.event_set = self._invoke("nvmlEventSetCreate")
            xid = nvml.nvmlEventTypeXidCriticalError
            self._invoke("nvmlDeviceRegisterEvents", state.dev.handle, xid, state.event_set)
        except nvml.NVMLError as exc:
            log.debug("otel_train: XID events unavailable on %s (%s)", state.dev.uuid, exc)
            self._give_up_xids(state)
            return False
        return True

    def _give_up_xids(self, state: DeviceState) -> None:
        """No XID count for this device (also at release): its event set, if any, is freed."""
        state.unsupported.add("xid")
        if state.event_set is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlEventSetFree(state.event_set)
            state.event_set = None


def _emit_xid(events: EventChannel, state: DeviceState, code: int) -> None:
    """A `gpu_xid` health event carrying the code (hw.errors{error.type="xid"} counts them)."""
    message = f"GPU {state.dev.name} ({state.dev.uuid}) reported XID {code}"
    attributes: dict[str, str | int] = {sc.HW_ID: state.dev.uuid, sc.HW_NAME: state.dev.name, sc.XID: code}
    events.emit("gpu_xid", message, attributes, severity="ERROR")
