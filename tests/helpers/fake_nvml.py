"""An honest fake of the part of the `pynvml` (nvidia-ml-py) API that otel_train uses.

Same function names and argument order, same constants, same error model: ``NVMLError(code)``
returns the matching ``NVMLError_<Name>`` subclass and carries ``.value``. Strings come back as
``str``, the PCI bus id inside the PCI-info struct too (pynvml decodes both).
Units are NVML's: mW, mJ, MHz, KB/s, percent, °C.

Knobs for tests:
* ``FakeGpu.unsupported``: names of functions (``"nvmlDeviceGetUtilizationRates"``) that raise
  ``NVMLError_NotSupported`` for that GPU (``no_permission`` likewise raises NoPermission).
* ``FakeGpu.lost = True``: every call on that handle raises ``NVMLError_GpuIsLost``.
* ``FakeGpu.errors``: function name -> the NVML error code it raises for that GPU (Unknown,
  ResetRequired, InvalidArgument, ...).
* ``FakeNvml.init_error``: the code ``nvmlInit`` raises (LibraryNotFound, DriverNotLoaded, ...).
* ``FakeNvml.hang(names)``: calls to those functions block on a ``threading.Event`` until
  ``release()``; ``hanging`` is set while a call is blocked.
* ``FakeNvml.calls``: a count per function name (proves who called NVML, and how often).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# --- constants (values as in pynvml) -----------------------------------------------------------------
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
nvmlEventTypeXidCriticalError = 0x0000000000000008

nvmlClocksEventReasonGpuIdle = 0x0000000000000001
nvmlClocksEventReasonApplicationsClocksSetting = 0x0000000000000002
nvmlClocksEventReasonSwPowerCap = 0x0000000000000004
nvmlClocksEventReasonHwSlowdown = 0x0000000000000008
nvmlClocksEventReasonSyncBoost = 0x0000000000000010
nvmlClocksEventReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksEventReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x0000000000000080
nvmlClocksThrottleReasonGpuIdle = nvmlClocksEventReasonGpuIdle
nvmlClocksThrottleReasonSwPowerCap = nvmlClocksEventReasonSwPowerCap
nvmlClocksThrottleReasonHwSlowdown = nvmlClocksEventReasonHwSlowdown
nvmlClocksThrottleReasonSyncBoost = nvmlClocksEventReasonSyncBoost
nvmlClocksThrottleReasonSwThermalSlowdown = nvmlClocksEventReasonSwThermalSlowdown
nvmlClocksThrottleReasonHwThermalSlowdown = nvmlClocksEventReasonHwThermalSlowdown
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = nvmlClocksEventReasonHwPowerBrakeSlowdown


# --- errors (pynvml's model: NVMLError(code) -> subclass instance with .value) -------------------------
class NVMLError(Exception):
    _valClassMapping: dict[int, type[NVMLError]] = {}  # noqa: RUF012 (mirrors pynvml)
    _errcode_to_string: dict[int, str] = {}  # noqa: RUF012
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, code: int, text: str) -> type[NVMLError]:
    cls = type(f"NVMLError_{name}", (NVMLError,), {})
    NVMLError._valClassMapping[code] = cls
    NVMLError._errcode_to_string[code] = text
    setattr(sys.modules[__name__], cls.__name__, cls)
    return cls


NVMLError_Uninitialized = _error_class("Uninitialized", NVML_ERROR_UNINITIALIZED, "Uninitialized")
NVMLError_InvalidArgument = _error_class("InvalidArgument", NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument")
NVMLError_NotSupported = _error_class("NotSupported", NVML_ERROR_NOT_SUPPORTED, "Not Supported")
NVMLError_NoPermission = _error_class("NoPermission", NVML_ERROR_NO_PERMISSION, "Insufficient Permissions")
NVMLError_NotFound = _error_class("NotFound", NVML_ERROR_NOT_FOUND, "Not Found")
NVMLError_DriverNotLoaded = _error_class("DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")
NVMLError_Timeout = _error_class("Timeout", NVML_ERROR_TIMEOUT, "Timeout")
NVMLError_LibraryNotFound = _error_class(
    "LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"
)
NVMLError_FunctionNotFound = _error_class(
    "FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND, "Function Not Found"
)
NVMLError_GpuIsLost = _error_class("GpuIsLost", NVML_ERROR_GPU_IS_LOST, "GPU is lost")
NVMLError_ResetRequired = _error_class("ResetRequired", NVML_ERROR_RESET_REQUIRED, "GPU requires restart")
NVMLError_Unknown = _error_class("Unknown", NVML_ERROR_UNKNOWN, "Unknown Error")


# --- structs ---------------------------------------------------------------------------------------------
@dataclass
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass
class c_nvmlUtilization_t:
    gpu: int
    memory: int


@dataclass
class nvmlPciInfo_t:
    busId: str  # pynvml decodes the struct's char arrays
    busIdLegacy: str
    domain: int
    bus: int
    device: int


@dataclass
class c_nvmlEventData_t:
    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    pci_bus_id: str = "00000000:01:00.0"
    memory_total: int = 80 * 1024**3
    memory_used: int = 10 * 1024**3
    util_gpu: int = 75  # percent
    util_memory: int = 30  # percent
    temperature: int = 55  # °C
    power_mw: int = 350_000
    energy_mj: int = 1_000_000
    clock_sm_mhz: int = 1980
    clock_mem_mhz: int = 2619
    clock_reasons: int = 0
    pcie_tx_kbs: int = 1000
    pcie_rx_kbs: int = 2000
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    unsupported: set[str] = field(default_factory=set)
    no_permission: set[str] = field(default_factory=set)
    lost: bool = False
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    xids: list[int] = field(default_factory=list)  # pending critical XID events


class FakeHandle:
    """An opaque device handle (pynvml's c_nvmlDevice_t pointer)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def __repr__(self) -> str:
        return f"<FakeHandle {self.gpu.uuid}>"


class FakeEventSet:
    def __init__(self) -> None:
        self.handles: list[FakeHandle] = []
        self.freed = False


class FakeNvml:
    """Pass an instance where pynvml would be used (``HardwareMonitor(..., nvml=FakeNvml(...))``)."""

    def __init__(self, gpus: list[FakeGpu] | None = None, driver_version: str = "550.54.15") -> None:
        # Module-level names (constants, error classes, structs) are visible as attributes.
        for name, value in vars(sys.modules[__name__]).items():
            if name.startswith(("NVML", "nvml", "c_nvml")):
                setattr(self, name, value)
        self.gpus: list[FakeGpu] = list(gpus if gpus is not None else [FakeGpu(uuid=gpu_uuid(0))])
        self.driver_version = driver_version
        self.initialized = 0
        self.init_error: int | None = None
        self.call_latency_s = 0.0  # simulate NVML's per-call cost (bench)
        self.calls: Counter[str] = Counter()
        self.hanging = threading.Event()  # set while a call is blocked
        self._release = threading.Event()
        self._hang: set[str] = set()
        self._lock = threading.Lock()

    # -- test controls --
    def hang(self, *names: str) -> None:
        self._release.clear()
        self._hang = set(names)

    def release(self) -> None:
        self._hang = set()
        self._release.set()

    def _enter(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1
        if name in self._hang:
            self.hanging.set()
            self._release.wait()
            self.hanging.clear()
        if self.call_latency_s:
            time.sleep(self.call_latency_s)
        if name not in ("nvmlInit", "nvmlInitWithFlags") and self.initialized <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _dev(self, name: str, handle: FakeHandle) -> FakeGpu:
        self._enter(name)
        if not isinstance(handle, FakeHandle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = handle.gpu
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if name in gpu.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if name in gpu.no_permission:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        if name in gpu.errors:
            raise NVMLError(gpu.errors[name])
        return gpu

    # -- library --
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if "nvmlDeviceGetHandleByIndex" in self.gpus[index].no_permission:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)  # a GPU outside the job's device cgroup
        return FakeHandle(self.gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return FakeHandle(gpu)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    # -- device queries --
    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._dev("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._dev("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> nvmlPciInfo_t:
        gpu = self._dev("nvmlDeviceGetPciInfo", handle)
        bus_id = gpu.pci_bus_id
        return nvmlPciInfo_t(busId=bus_id, busIdLegacy=bus_id[-12:], domain=0, bus=1, device=0)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> c_nvmlUtilization_t:
        gpu = self._dev("nvmlDeviceGetUtilizationRates", handle)
        return c_nvmlUtilization_t(gpu=gpu.util_gpu, memory=gpu.util_memory)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: Any = None) -> c_nvmlMemory_t:
        gpu = self._dev("nvmlDeviceGetMemoryInfo", handle)
        return c_nvmlMemory_t(
            total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used, used=gpu.memory_used
        )

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        gpu = self._dev("nvmlDeviceGetTemperature", handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._dev("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        return self._dev("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:
        gpu = self._dev("nvmlDeviceGetClockInfo", handle)
        if type == NVML_CLOCK_SM:
            return gpu.clock_sm_mhz
        if type == NVML_CLOCK_MEM:
            return gpu.clock_mem_mhz
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._dev("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_reasons

    def nvmlDeviceGetPcieThroughput(self, device: FakeHandle, counter: int) -> int:
        gpu = self._dev("nvmlDeviceGetPcieThroughput", device)
        if counter == NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kbs
        if counter == NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_rx_kbs
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, errorType: int, counterType: int) -> int:
        gpu = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        if errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_corrected
        if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return gpu.ecc_uncorrected
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    # -- events (XID) --
    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        return FakeEventSet()

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: FakeEventSet) -> None:
        self._dev("nvmlDeviceRegisterEvents", handle)
        eventSet.handles.append(handle)

    def nvmlEventSetWait(self, eventSet: FakeEventSet, timeoutms: int) -> c_nvmlEventData_t:
        self._enter("nvmlEventSetWait")
        for handle in eventSet.handles:
            if handle.gpu.lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            if "nvmlEventSetWait" in handle.gpu.unsupported:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            if handle.gpu.xids:
                return c_nvmlEventData_t(handle, nvmlEventTypeXidCriticalError, handle.gpu.xids.pop(0))
        raise NVMLError(NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        self._enter("nvmlEventSetFree")
        eventSet.freed = True


def gpu_uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-44444444444{i % 10}"
