"""Hardware telemetry: NVML sampler thread, CUDA allocator, host gauges, energy and MFU.

Rules this module keeps (see reference/failure-modes.md §4):

* NVML is called only on our own threads: the discovery thread (``nvmlInit`` and device lookup,
  under a timeout) and the GPU sampler thread. SDK callbacks read a snapshot that the sampler
  swaps in atomically, so a hung NVML call stalls only the sampler: collection and export go on
  with the last values (opentelemetry-python #3098/#3461: a slow callback kills the reader).
* Only the GPU this rank uses is sampled, keyed by UUID (CUDA and NVML enumerate differently).
* A value the device does not support (NotSupported, NoPermission, missing function) is omitted,
  never reported as 0, and not asked for again.
* A lost GPU (GpuIsLost / Unknown) stops its series and emits one ``gpu_lost`` health event.
* Nothing here runs on the training thread's step path; allocator, energy and MFU values are
  computed at the interval flush, on the background worker (``on_flush``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_train import semconv as sc
from otel_train.config import Config
from otel_train.interval import Interval
from otel_train.mfu import normalize_dtype, resolve_peak

log = logging.getLogger(__name__)

# Resource attribute keys for the rank's GPU (identity lives in the Resource).
RES_GPU_UUID = "hw.gpu.uuid"
RES_GPU_PCI_BUS_ID = "hw.gpu.pci_bus_id"
RES_GPU_NAME = "hw.gpu.name"
RES_GPU_DRIVER_VERSION = "hw.gpu.driver_version"

MEMORY_PRESSURE_RATIO = 0.95  # reserved (allocator) or used (NVML) / limit above this -> event
MEMORY_PRESSURE_REARM = 0.90  # ... re-armed once back below this
MAX_XID_EVENTS_PER_SAMPLE = 64
_GPU_THREAD = "otel-train-hw-gpu"

# Clock-event (throttle) reasons -> NVML bits. GpuIdle and ApplicationsClocksSetting are not
# slowdowns and are left out. "sw_slowdown" is SyncBoost (software lowered clocks to match the
# sync-boost group); NVML has no other software slowdown bit besides the power cap and thermal.
THROTTLE_BITS: dict[str, int] = {
    "power_cap": 0x4,  # SwPowerCap
    "thermal": 0x20 | 0x40,  # SwThermalSlowdown | HwThermalSlowdown
    "hw_slowdown": 0x8 | 0x80,  # HwSlowdown | HwPowerBrakeSlowdown
    "sw_slowdown": 0x10,  # SyncBoost
}


class EventSink(Protocol):
    """Where health events go (the core's health module implements it)."""

    def emit(
        self, event: str, message: str, attributes: Mapping[str, str | int | float] | None = None
    ) -> None: ...


class _NullSink:
    def emit(
        self, event: str, message: str, attributes: Mapping[str, str | int | float] | None = None
    ) -> None:
        return None


# --- discovery -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuDevice:
    handle: Any
    uuid: str
    name: str
    pci_bus_id: str | None


@dataclass
class Discovery:
    """Result of NVML init + mapping this rank to its GPU. ``nvml`` is None when GPU metrics are off."""

    nvml: Any | None
    devices: list[GpuDevice] = field(default_factory=list)
    driver_version: str | None = None
    reason: str | None = None  # why there is no GPU (None when devices were found)

    def resource_attributes(self) -> dict[str, str]:
        if not self.devices:
            return {}
        dev = self.devices[0]
        out = {RES_GPU_UUID: dev.uuid, RES_GPU_NAME: dev.name}
        if dev.pci_bus_id:
            out[RES_GPU_PCI_BUS_ID] = dev.pci_bus_id
        if self.driver_version:
            out[RES_GPU_DRIVER_VERSION] = self.driver_version
        return out


def parse_cuda_visible_devices(value: str | None) -> list[str] | None:
    """Entries of CUDA_VISIBLE_DEVICES (indices, GPU-/MIG- UUIDs); None when unset (all devices).

    Like CUDA, parsing stops at the first invalid entry (e.g. ``-1`` hides every GPU).
    """
    if value is None:
        return None
    out: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.isdigit() or re.match(r"^(GPU|MIG)-[0-9A-Za-z/_-]+$", entry):
            out.append(entry)
        else:
            break
    return out


def _uuid_key(uuid: str) -> str:
    """Comparable form of a GPU UUID: NVML says 'GPU-3b6a…', torch '3b6a…'."""
    u = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            u = u[len(prefix) :]
    return u


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def _torch_cuda_if_loaded() -> Any | None:
    torch = sys.modules.get("torch")  # never import torch (or initialise CUDA) on our own
    return getattr(torch, "cuda", None) if torch is not None else None


def _cuda_initialized(torch_cuda: Any | None) -> bool:
    if torch_cuda is None:
        return False
    try:
        return bool(torch_cuda.is_initialized())
    except Exception:
        return False


def _torch_device_index(torch_cuda: Any, local_rank: int) -> int:
    count = int(torch_cuda.device_count())
    return local_rank if 0 <= local_rank < count else int(torch_cuda.current_device())


def discover_gpus(
    local_rank: int,
    nvml: Any | None = None,
    environ: Mapping[str, str] | None = None,
    torch_cuda: Any | None = None,
) -> Discovery:
    """Initialise NVML and find this rank's GPU (synchronous: NVML may block; see discover_with_timeout).

    The rank's device is entry ``local_rank`` of CUDA_VISIBLE_DEVICES (or the only entry). When
    torch has already initialised CUDA, torch's own UUID for that device wins: CUDA's default
    device order (FASTEST_FIRST) can differ from NVML's PCI order.
    """
    env = os.environ if environ is None else environ
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except Exception as exc:  # ImportError, or a broken install
            return Discovery(None, reason=f"nvidia-ml-py not importable ({type(exc).__name__})")
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return Discovery(None, reason=f"nvmlInit failed: {exc}")
    try:
        driver: str | None = _text(nvml.nvmlSystemGetDriverVersion())
    except Exception:
        driver = None
    try:
        handle = _rank_handle(nvml, local_rank, env, torch_cuda)
        if handle is None:
            _quiet_shutdown(nvml)
            return Discovery(None, driver_version=driver, reason=_rank_reason(local_rank, env))
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        name = _text(nvml.nvmlDeviceGetName(handle))
        try:
            pci = nvml.nvmlDeviceGetPciInfo(handle)
            bus_id: str | None = _text(getattr(pci, "busId", b"")) or None
        except Exception:
            bus_id = None
    except Exception as exc:
        _quiet_shutdown(nvml)
        return Discovery(None, driver_version=driver, reason=f"GPU lookup failed: {exc}")
    return Discovery(nvml, [GpuDevice(handle, uuid, name, bus_id)], driver)


def _rank_reason(local_rank: int, env: Mapping[str, str]) -> str:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return f"no GPU for local rank {local_rank} (CUDA_VISIBLE_DEVICES={visible!r})"


def _quiet_shutdown(nvml: Any) -> None:
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


def _all_devices(nvml: Any) -> list[tuple[Any, str]]:
    """(handle, UUID) of every GPU NVML lets us query. One it refuses (NoPermission for a GPU
    outside this job's device cgroup, a lost GPU) is skipped instead of failing the lookup."""
    out = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            out.append((handle, _text(nvml.nvmlDeviceGetUUID(handle))))
        except Exception as exc:
            log.debug("otel_train: NVML device %d skipped (%s)", i, exc)
    return out


def _rank_handle(nvml: Any, local_rank: int, env: Mapping[str, str], torch_cuda: Any | None) -> Any | None:
    if _cuda_initialized(torch_cuda):
        try:
            assert torch_cuda is not None
            index = _torch_device_index(torch_cuda, local_rank)
            want = _uuid_key(str(torch_cuda.get_device_properties(index).uuid))
            # torch prints the bare UUID; NVML wants "GPU-<uuid>" (or "MIG-<uuid>" for a MIG slice,
            # which no enumeration of physical GPUs below would find).
            for prefix in ("GPU-", "MIG-"):
                with contextlib.suppress(Exception):
                    return nvml.nvmlDeviceGetHandleByUUID(prefix + want)
            for handle, uuid in _all_devices(nvml):
                if _uuid_key(uuid) == want:
                    return handle
        except Exception as exc:
            log.debug("torch device UUID lookup failed (%s); using CUDA_VISIBLE_DEVICES", exc)
    visible = parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    entries = visible if visible is not None else [str(i) for i in range(int(nvml.nvmlDeviceGetCount()))]
    if not entries:
        return None
    if 0 <= local_rank < len(entries):
        entry = entries[local_rank]
    elif len(entries) == 1:
        entry = entries[0]  # one GPU per process (e.g. SLURM --gpus-per-task=1)
    else:
        return None  # a wrong GPU is worse than none
    if entry.isdigit():
        # Index entries are NVML (PCI) order only with CUDA_DEVICE_ORDER=PCI_BUS_ID; torch's UUID
        # above is exact once CUDA is initialised.
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    if entry.startswith("MIG-"):
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    matches = [h for h, uuid in _all_devices(nvml) if _uuid_key(uuid).startswith(_uuid_key(entry))]
    return matches[0] if len(matches) == 1 else None  # CUDA accepts unique UUID prefixes


def discover_with_timeout(
    local_rank: int,
    nvml: Any | None = None,
    environ: Mapping[str, str] | None = None,
    torch_cuda: Any | None = None,
    timeout_s: float = 5.0,
) -> Discovery:
    """discover_gpus on a daemon thread; a hung ``nvmlInit`` (go-nvml#152) costs at most timeout_s."""
    result: list[Discovery] = []
    env = dict(os.environ if environ is None else environ)
    thread = threading.Thread(
        target=lambda: result.append(discover_gpus(local_rank, nvml, env, torch_cuda)),
        name="otel-train-nvml-init",
        daemon=True,
    )
    thread.start()
    thread.join(timeout_s)
    if not result:
        return Discovery(None, reason=f"NVML init/lookup did not return within {timeout_s:g}s")
    return result[0]


# --- sampling ------------------------------------------------------------------------------------------
class _GpuLost(Exception):
    pass


@dataclass
class _DeviceState:
    dev: GpuDevice
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False
    event_set: Any = None
    xid_count: int = 0
    last_xid: int | None = None


@dataclass(frozen=True)
class _GpuSnapshot:
    time: float = 0.0  # time.monotonic() at the end of the sample
    obs: Mapping[str, list[Observation]] = field(default_factory=dict)
    energy_j: float | None = None  # summed over the rank's GPUs (None when not all report it)
    memory: tuple[tuple[str, int, int], ...] = ()  # (uuid, used, total)


_UNSUPPORTED_CODES = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND")
_LOST_CODES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN")


def _codes(nvml: Any, names: tuple[str, ...]) -> frozenset[int]:
    return frozenset(int(getattr(nvml, n)) for n in names if hasattr(nvml, n))


class HardwareMonitor:
    """GPU (NVML), CUDA allocator, host, energy and MFU telemetry for one rank.

    ``start()`` discovers the GPU, creates the instruments on ``meter`` and starts the sampler
    threads; ``on_flush(interval)`` (a FlushListener, on the background worker) sets the allocator,
    energy and MFU gauges; ``close()`` stops the threads without waiting on a hung NVML call.
    """

    def __init__(
        self,
        config: Config,
        meter: Meter,
        events: EventSink | None,
        local_rank: int,
        nvml: Any | None = None,
        torch_cuda: Any | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        discovery: Discovery | None = None,
        init_timeout_s: float = 5.0,
        compute_dtype: str = "bf16",
        process: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._meter = meter
        self._events: EventSink = events if events is not None else _NullSink()
        self._local_rank = local_rank
        self._nvml_arg = nvml
        self._torch_cuda_arg = torch_cuda
        self._environ = os.environ if environ is None else environ
        self._discovery = discovery
        self._init_timeout_s = init_timeout_s
        self._dtype = compute_dtype
        self._process = process
        self._clock = clock
        self._flops_per_token: float | None = config.flops_per_token
        self._interval_s = config.hardware_interval_s

        self._started = False
        self._closed = False
        self._nvml: Any | None = None
        self._devices: list[_DeviceState] = []
        self._unsupported_codes: frozenset[int] = frozenset()
        self._lost_codes: frozenset[int] = frozenset()
        self._gpu_lock = threading.Lock()
        self._gpu_snapshot = _GpuSnapshot()
        self._host_obs: Mapping[str, list[Observation]] = {}
        self._host_primed = False
        self._gpu_busy_since: float | None = None
        self._gpu_current_call = ""
        self._stuck_warned = False
        self._samples = 0
        self._sample_cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._instruments: dict[str, Any] = {}

        # flush state (background worker only)
        self._energy_prev: tuple[float, float] | None = None
        self._cuda_prev: dict[str, int] = {}
        self._cuda_total: int | None = None
        self._pressure_active = False
        self._cuda_reserved_ratio: float | None = None
        self._peak: tuple[float | None, str | None] | None = None
        self._peak_logged = False
        self._mfu_event_sent = False

    # -- public API -------------------------------------------------------------------------------------
    def gpu_resource_attributes(self) -> dict[str, str]:
        """{'hw.gpu.uuid', 'hw.gpu.pci_bus_id', 'hw.gpu.name', 'hw.gpu.driver_version'} of this rank's
        GPU ({} without one). Runs discovery (bounded by init_timeout_s) if start() has not."""
        if not self._config.hardware:
            return {}
        return self._discover().resource_attributes()

    @property
    def gpu_available(self) -> bool:
        return bool(self._devices)

    def set_flops_per_token(self, flops_per_token: float | None, dtype: str | None = None) -> None:
        """Model training FLOPs per token (see otel_train.mfu) and optionally the compute dtype."""
        self._flops_per_token = flops_per_token if flops_per_token and flops_per_token > 0 else None
        if dtype is not None:
            self.set_compute_dtype(dtype)

    def set_compute_dtype(self, dtype: str) -> None:
        """The dtype whose peak MFU divides by ('bf16', 'fp16', 'tf32', 'fp32', 'fp8')."""
        if normalize_dtype(dtype) is None:
            log.warning("otel_train: unknown compute dtype %r for MFU; keeping %r", dtype, self._dtype)
            return
        self._dtype = dtype
        self._peak = None
        self._peak_logged = False

    def start(self, background: bool = True) -> None:
        """Discover, create instruments, start sampling (``background=False``: no threads; call
        ``sample_once()`` yourself; for tests and benchmarks)."""
        if self._started or not self._config.hardware:
            return
        self._started = True
        disc = self._discover()
        if disc.nvml is not None and disc.devices:
            self._nvml = disc.nvml
            self._devices = [_DeviceState(d) for d in disc.devices]
            self._unsupported_codes = _codes(disc.nvml, _UNSUPPORTED_CODES)
            self._lost_codes = _codes(disc.nvml, _LOST_CODES)
            d = disc.devices[0]
            log.info("otel_train: GPU metrics on for %s (%s)", d.name, d.uuid)
            self._create_gpu_instruments()
        else:
            log.info("otel_train: no GPU metrics: %s", disc.reason or "no GPU")
        self._create_host_instruments()
        self._create_flush_instruments()
        if background:
            if self._devices:
                self._spawn(self._gpu_loop, _GPU_THREAD)
            self._spawn(self._host_loop, "otel-train-hw-host")

    def sample_once(self) -> None:
        """Take one GPU and one host sample now, on the calling thread."""
        self._sample_gpus()
        self._sample_host()

    def wait_for_samples(self, n: int, timeout_s: float) -> bool:
        """Block until at least ``n`` GPU samples were taken (tests); False on timeout."""
        with self._sample_cond:
            return self._sample_cond.wait_for(lambda: self._samples >= n, timeout_s)

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
            self._release_nvml()  # no sampler thread: release here (the thread does so on exit)
        if not self._started and self._discovery is not None and self._discovery.nvml is not None:
            _quiet_shutdown(self._discovery.nvml)  # discovered for resource attributes only

    # -- discovery / instruments -------------------------------------------------------------------
    def _discover(self) -> Discovery:
        if self._discovery is None:
            self._discovery = discover_with_timeout(
                self._local_rank, self._nvml_arg, self._environ, self._torch_cuda(), self._init_timeout_s
            )
        return self._discovery

    def _torch_cuda(self) -> Any | None:
        return self._torch_cuda_arg if self._torch_cuda_arg is not None else _torch_cuda_if_loaded()

    def _create(
        self, spec: sc.MetricSpec, callback: Callable[[CallbackOptions], Iterable[Observation]] | None = None
    ) -> Any:
        m, kind = self._meter, spec.kind
        kw: dict[str, Any] = {"unit": spec.unit, "description": spec.description}
        inst: Any
        if kind is sc.Kind.OBSERVABLE_GAUGE:
            inst = m.create_observable_gauge(spec.name, callbacks=[callback] if callback else None, **kw)
        elif kind is sc.Kind.OBSERVABLE_COUNTER:
            inst = m.create_observable_counter(spec.name, callbacks=[callback] if callback else None, **kw)
        elif kind is sc.Kind.OBSERVABLE_UP_DOWN_COUNTER:
            inst = m.create_observable_up_down_counter(
                spec.name, callbacks=[callback] if callback else None, **kw
            )
        elif kind is sc.Kind.GAUGE:
            inst = m.create_gauge(spec.name, **kw)
        elif kind is sc.Kind.COUNTER:
            inst = m.create_counter(spec.name, **kw)
        else:  # pragma: no cover - no such spec in this module
            raise ValueError(f"unsupported kind {kind} for {spec.name}")
        self._instruments[spec.name] = inst
        return inst

    def _gpu_reader(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return self._gpu_snapshot.obs.get(name, ())  # cache only: never NVML here

        return callback

    def _host_reader(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return self._host_obs.get(name, ())

        return callback

    def _create_gpu_instruments(self) -> None:
        for spec in (
            sc.GPU_UTILIZATION, sc.GPU_MEMORY_UTILIZATION, sc.GPU_MEMORY_USAGE, sc.GPU_MEMORY_LIMIT,
            sc.GPU_TEMPERATURE, sc.GPU_POWER, sc.GPU_ENERGY, sc.GPU_ERRORS, sc.GPU_CLOCK_SM,
            sc.GPU_CLOCK_MEMORY, sc.GPU_THROTTLE, sc.GPU_PCIE_THROUGHPUT,
        ):  # fmt: skip
            self._create(spec, self._gpu_reader(spec.name))
        for spec in (sc.POWER_AVERAGE, sc.ENERGY_PER_STEP, sc.ENERGY_PER_TOKEN):
            self._create(spec)

    def _create_host_instruments(self) -> None:
        try:
            import psutil

            if self._process is None:
                self._process = psutil.Process()
        except Exception as exc:
            log.info("otel_train: no host metrics (psutil unavailable: %s)", exc)
            return
        for spec in (sc.PROCESS_CPU_UTILIZATION, sc.PROCESS_MEMORY_USAGE, sc.SYSTEM_MEMORY_USAGE):
            self._create(spec, self._host_reader(spec.name))

    def _create_flush_instruments(self) -> None:
        self._create(sc.FLOPS)
        self._create(sc.MFU)

    def _ensure_cuda_instruments(self) -> None:
        if sc.CUDA_MEMORY_ALLOCATED.name not in self._instruments:
            for spec in (
                sc.CUDA_MEMORY_ALLOCATED, sc.CUDA_MEMORY_RESERVED, sc.CUDA_MEMORY_PEAK, sc.CUDA_ALLOC_RETRIES,
                sc.CUDA_OOMS,
            ):  # fmt: skip
                self._create(spec)

    # -- threads -------------------------------------------------------------------------------------
    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _gpu_loop(self) -> None:
        try:
            while True:
                try:
                    self._sample_gpus()
                except Exception:  # never let the sampler die
                    log.debug("otel_train: GPU sample failed", exc_info=True)
                if self._stop.wait(self._interval_s):
                    break
        finally:
            self._release_nvml()

    def _host_loop(self) -> None:
        while True:
            try:
                self._sample_host()
            except Exception:
                log.debug("otel_train: host sample failed", exc_info=True)
            if self._stop.wait(self._interval_s):
                break

    def _release_nvml(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        for state in self._devices:
            if state.event_set is not None:
                with contextlib.suppress(Exception):
                    nvml.nvmlEventSetFree(state.event_set)
                state.event_set = None
        _quiet_shutdown(nvml)

    # -- GPU sampling (sampler thread) -------------------------------------------------------------
    def _call(self, state: _DeviceState, field_name: str, fn_name: str, *args: Any) -> Any | None:
        """One NVML call; None when unsupported (remembered) or failing transiently."""
        if field_name in state.unsupported:
            return None
        nvml = self._nvml
        fn = getattr(nvml, fn_name, None)
        if fn is None:
            state.unsupported.add(field_name)
            return None
        self._gpu_current_call = fn_name
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
            self._gpu_current_call = ""

    def _sample_gpus(self) -> None:
        if self._nvml is None:
            return
        with self._gpu_lock:
            self._gpu_busy_since = self._clock()
            try:
                obs: dict[str, list[Observation]] = {}
                energy_total: float | None = 0.0
                memory: list[tuple[str, int, int]] = []
                for state in self._devices:
                    if state.lost:
                        continue
                    try:
                        dev_obs, energy, mem = self._sample_device(state)
                    except _GpuLost as exc:
                        self._mark_lost(state, str(exc))
                        continue
                    for name, points in dev_obs.items():
                        obs.setdefault(name, []).extend(points)
                    energy_total = None if energy is None or energy_total is None else energy_total + energy
                    if mem is not None:
                        memory.append(mem)
                if not any(not s.lost for s in self._devices):
                    energy_total = None
                self._gpu_snapshot = _GpuSnapshot(self._clock(), obs, energy_total, tuple(memory))
            finally:
                self._gpu_busy_since = None
        with self._sample_cond:
            self._samples += 1
            self._sample_cond.notify_all()

    def _sample_device(
        self, state: _DeviceState
    ) -> tuple[dict[str, list[Observation]], float | None, tuple[str, int, int] | None]:
        nvml = self._nvml
        attrs = {sc.HW_ID: state.dev.uuid, sc.HW_NAME: state.dev.name}
        out: dict[str, list[Observation]] = {}

        def put(spec: sc.MetricSpec, value: float, extra: Mapping[str, str] | None = None) -> None:
            out.setdefault(spec.name, []).append(Observation(value, {**attrs, **extra} if extra else attrs))

        util = self._call(state, "utilization", "nvmlDeviceGetUtilizationRates")
        if util is not None:
            put(sc.GPU_UTILIZATION, util.gpu / 100.0)
            put(sc.GPU_MEMORY_UTILIZATION, util.memory / 100.0)
        mem_info = self._call(state, "memory", "nvmlDeviceGetMemoryInfo")
        mem: tuple[str, int, int] | None = None
        if mem_info is not None:
            put(sc.GPU_MEMORY_USAGE, int(mem_info.used))
            put(sc.GPU_MEMORY_LIMIT, int(mem_info.total))
            mem = (state.dev.uuid, int(mem_info.used), int(mem_info.total))
        temp = self._call(
            state, "temperature", "nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        )
        if temp is not None:
            put(sc.GPU_TEMPERATURE, float(temp))
        power = self._call(state, "power", "nvmlDeviceGetPowerUsage")
        if power is not None:
            put(sc.GPU_POWER, power / 1000.0)  # mW -> W
        energy_mj = self._call(state, "energy", "nvmlDeviceGetTotalEnergyConsumption")
        energy = energy_mj / 1000.0 if energy_mj is not None else None  # mJ -> J
        if energy is not None:
            put(sc.GPU_ENERGY, energy)
        for err_type, nvml_type in (("ecc_corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
                                    ("ecc_uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")):  # fmt: skip
            count = self._call(
                state, err_type, "nvmlDeviceGetTotalEccErrors", getattr(nvml, nvml_type),
                getattr(nvml, "NVML_VOLATILE_ECC", 0),
            )  # fmt: skip
            if count is not None:
                put(sc.GPU_ERRORS, int(count), {sc.ERROR_TYPE: err_type})
        if self._drain_xids(state):
            put(sc.GPU_ERRORS, state.xid_count, {sc.ERROR_TYPE: "xid"})
        for spec, field_name, clock in ((sc.GPU_CLOCK_SM, "clock_sm", "NVML_CLOCK_SM"),
                                        (sc.GPU_CLOCK_MEMORY, "clock_mem", "NVML_CLOCK_MEM")):  # fmt: skip
            mhz = self._call(state, field_name, "nvmlDeviceGetClockInfo", getattr(nvml, clock))
            if mhz is not None:
                put(spec, mhz * 1e6)  # MHz -> Hz
        reasons = self._call(state, "clock_reasons", "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None and "clock_reasons" in state.unsupported:
            reasons = self._call(state, "throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        if reasons is not None:
            for reason, bits in THROTTLE_BITS.items():
                put(sc.GPU_THROTTLE, 1 if int(reasons) & bits else 0, {sc.THROTTLE_REASON: reason})
        for direction, counter in (
            ("receive", "NVML_PCIE_UTIL_RX_BYTES"),
            ("transmit", "NVML_PCIE_UTIL_TX_BYTES"),
        ):
            kbs = self._call(
                state, f"pcie_{direction}", "nvmlDeviceGetPcieThroughput", getattr(nvml, counter)
            )
            if kbs is not None:
                put(sc.GPU_PCIE_THROUGHPUT, kbs * 1024.0, {sc.DIRECTION: direction})  # KB/s -> By/s
        return out, energy, mem

    def _drain_xids(self, state: _DeviceState) -> bool:
        """Count critical XID events; True when XID reporting works on this device."""
        nvml: Any = self._nvml
        if "xid" in state.unsupported:
            return False
        if state.event_set is None:
            try:
                self._gpu_current_call = "nvmlEventSetCreate"
                state.event_set = nvml.nvmlEventSetCreate()
                self._gpu_current_call = "nvmlDeviceRegisterEvents"
                nvml.nvmlDeviceRegisterEvents(
                    state.dev.handle, nvml.nvmlEventTypeXidCriticalError, state.event_set
                )
            except Exception as exc:
                if getattr(exc, "value", None) in self._lost_codes:
                    raise _GpuLost(f"nvmlDeviceRegisterEvents: {exc}") from exc
                log.debug("otel_train: XID events unavailable on %s (%s)", state.dev.uuid, exc)
                state.unsupported.add("xid")
                if state.event_set is not None:
                    with contextlib.suppress(Exception):
                        nvml.nvmlEventSetFree(state.event_set)
                    state.event_set = None
                return False
            finally:
                self._gpu_current_call = ""
        for _ in range(MAX_XID_EVENTS_PER_SAMPLE):
            try:
                self._gpu_current_call = "nvmlEventSetWait"
                data = nvml.nvmlEventSetWait(state.event_set, 0)
            except Exception as exc:
                code = getattr(exc, "value", None)
                if code in self._lost_codes:
                    raise _GpuLost(f"nvmlEventSetWait: {exc}") from exc
                if code in self._unsupported_codes:  # a count that can never move is not a 0
                    log.debug("otel_train: XID wait unavailable on %s (%s)", state.dev.uuid, exc)
                    state.unsupported.add("xid")
                    with contextlib.suppress(Exception):
                        nvml.nvmlEventSetFree(state.event_set)
                    state.event_set = None
                    return False
                break  # NVML_ERROR_TIMEOUT: no pending event
            finally:
                self._gpu_current_call = ""
            state.xid_count += 1
            state.last_xid = int(getattr(data, "eventData", 0))
            log.warning("otel_train: GPU %s reported XID %s", state.dev.uuid, state.last_xid)
        return True

    def _mark_lost(self, state: _DeviceState, detail: str) -> None:
        state.lost = True
        message = f"GPU {state.dev.name} ({state.dev.uuid}) is lost: {detail}; its metrics stop"
        log.error("otel_train: %s", message)
        try:
            self._events.emit("gpu_lost", message, {sc.HW_ID: state.dev.uuid, sc.HW_NAME: state.dev.name})
        except Exception:
            log.debug("otel_train: gpu_lost event sink failed", exc_info=True)

    # -- host sampling (host thread) ----------------------------------------------------------------
    def _sample_host(self) -> None:
        proc = self._process
        if proc is None:
            return
        import psutil

        obs: dict[str, list[Observation]] = {}
        cpu = proc.cpu_percent(None)
        if self._host_primed:  # psutil's first reading has no reference interval (always 0.0)
            obs[sc.PROCESS_CPU_UTILIZATION.name] = [Observation(cpu / 100.0)]
        self._host_primed = True
        obs[sc.PROCESS_MEMORY_USAGE.name] = [Observation(int(proc.memory_info().rss))]
        vm = psutil.virtual_memory()
        # "free" is what is available to new allocations (free + reclaimable cache), so
        # used + free = total.
        obs[sc.SYSTEM_MEMORY_USAGE.name] = [
            Observation(int(vm.total - vm.available), {sc.MEMORY_STATE: "used"}),
            Observation(int(vm.available), {sc.MEMORY_STATE: "free"}),
        ]
        self._host_obs = obs

    # -- flush (background worker) --------------------------------------------------------------------
    def on_flush(self, interval: Interval) -> None:
        if not self._started or self._closed:
            return
        self._cuda_reserved_ratio = None
        parts = (
            self._check_sampler,
            self._flush_cuda,
            self._flush_pressure,
            self._flush_energy,
            self._flush_mfu,
        )
        for part in parts:
            try:
                part(interval)
            except Exception:
                log.debug("otel_train: hardware flush step %s failed", part.__name__, exc_info=True)

    def _check_sampler(self, interval: Interval) -> None:
        since = self._gpu_busy_since
        if since is None or self._stuck_warned:
            return
        stuck_for = self._clock() - since
        if stuck_for > max(2 * self._interval_s, 5.0):
            self._stuck_warned = True
            log.warning(
                "otel_train: NVML sampler has been stuck in %s for %.0f s; GPU gauges show the last values",
                self._gpu_current_call or "an NVML call", stuck_for,
            )  # fmt: skip

    def _flush_cuda(self, interval: Interval) -> None:
        tc = self._torch_cuda()
        if not _cuda_initialized(tc):
            return
        assert tc is not None
        device = _torch_device_index(tc, self._local_rank)
        stats = tc.memory_stats(device)
        if not stats:
            return
        self._ensure_cuda_instruments()
        inst = self._instruments
        allocated = stats.get("allocated_bytes.all.current")
        reserved = stats.get("reserved_bytes.all.current")
        peak = stats.get("allocated_bytes.all.peak")
        if allocated is not None:
            inst[sc.CUDA_MEMORY_ALLOCATED.name].set(int(allocated))
        if reserved is not None:
            inst[sc.CUDA_MEMORY_RESERVED.name].set(int(reserved))
        if peak is not None:
            inst[sc.CUDA_MEMORY_PEAK.name].set(int(peak))
            if self._config.cuda_peak_per_interval:
                # Next interval's peak starts from the current level. Process-wide: it also resets
                # what torch.cuda.max_memory_allocated() returns to user code (hence the setting).
                tc.reset_peak_memory_stats(device)
        for spec, key in ((sc.CUDA_ALLOC_RETRIES, "num_alloc_retries"), (sc.CUDA_OOMS, "num_ooms")):
            value = stats.get(key)
            if value is None:
                continue
            previous = self._cuda_prev.get(key, 0)
            delta = int(value) - previous if int(value) >= previous else int(value)  # stats were reset
            self._cuda_prev[key] = int(value)
            if delta > 0:
                inst[spec.name].add(delta)
        if self._cuda_total is None:
            try:
                self._cuda_total = int(tc.get_device_properties(device).total_memory)
            except Exception:
                self._cuda_total = 0
        if reserved is not None and self._cuda_total:
            self._cuda_reserved_ratio = int(reserved) / self._cuda_total

    def _flush_pressure(self, interval: Interval) -> None:
        ratios: list[tuple[str, float]] = []
        if self._cuda_reserved_ratio is not None:
            ratios.append(("CUDA allocator reserved memory", self._cuda_reserved_ratio))
        for uuid, used, total in self._gpu_snapshot.memory:
            if total > 0:
                ratios.append((f"NVML used on {uuid}", used / total))
        if not ratios:
            return
        what, worst = max(ratios, key=lambda r: r[1])
        if worst > MEMORY_PRESSURE_RATIO and not self._pressure_active:
            self._pressure_active = True
            message = f"GPU memory pressure: {what} is {worst:.1%} of the device's memory"
            log.warning("otel_train: %s", message)
            self._events.emit("memory_pressure", message, {"ratio": round(worst, 4)})
        elif worst < MEMORY_PRESSURE_REARM:
            self._pressure_active = False

    def _flush_energy(self, interval: Interval) -> None:
        if not self._devices:
            return
        snap = self._gpu_snapshot
        if snap.energy_j is None:
            return
        prev = self._energy_prev
        if prev is None or snap.energy_j < prev[1]:  # first flush, or the counter went back (reset)
            self._energy_prev = (snap.time, snap.energy_j)
            return
        dt = snap.time - prev[0]
        if dt <= 0:  # no new sample since the last flush: keep the baseline, report next time
            return
        power = (snap.energy_j - prev[1]) / dt
        self._energy_prev = (snap.time, snap.energy_j)
        inst = self._instruments
        inst[sc.POWER_AVERAGE.name].set(power)
        # Sample times do not coincide with flushes: the interval's energy is estimated as the
        # average power between the two latest samples times the interval's wall time.
        energy = power * interval.elapsed_s if interval.elapsed_s > 0 else None
        if energy is None:
            return
        if interval.steps > 0:
            inst[sc.ENERGY_PER_STEP.name].set(energy / interval.steps)
        if interval.tokens > 0:
            inst[sc.ENERGY_PER_TOKEN.name].set(energy / interval.tokens)

    def _device_name(self) -> str | None:
        if self._devices:
            return self._devices[0].dev.name
        tc = self._torch_cuda()
        if _cuda_initialized(tc):
            assert tc is not None
            try:
                return str(tc.get_device_name(_torch_device_index(tc, self._local_rank)))
            except Exception:
                return None
        return None

    def resolve_peak(self) -> tuple[float | None, str | None]:
        """(peak FLOP/s, source) used for MFU; (None, None) when unknown (no MFU)."""
        if self._peak is not None:
            return self._peak
        name = self._device_name()
        peak = resolve_peak(name, self._dtype, self._config.peak_flops, self._environ)
        if peak[0] is None and name is None:
            # No device known yet (CUDA may be initialised later): resolve again next flush.
            if not self._peak_logged:
                self._peak_logged = True
                log.info("otel_train: no MFU yet: no GPU device known; set peak_flops to force one")
            return peak
        self._peak = peak
        if peak[0] is None:
            log.info(
                "otel_train: no MFU: peak FLOP/s unknown for device %r (dtype %s); set peak_flops or %s",
                name, self._dtype, "OTEL_TRAIN_PEAK_FLOPS",
            )  # fmt: skip
        else:
            log.info("otel_train: MFU peak %.4g FLOP/s from %s (device %r)", peak[0], peak[1], name)
        return peak

    def _flush_mfu(self, interval: Interval) -> None:
        fpt = self._flops_per_token
        if not fpt or interval.tokens <= 0 or interval.elapsed_s <= 0:
            return
        achieved = fpt * interval.tokens / interval.elapsed_s
        self._instruments[sc.FLOPS.name].set(achieved)
        peak, source = self.resolve_peak()
        if peak is None or source is None:
            return
        mfu = achieved / peak
        self._instruments[sc.MFU.name].set(mfu, {sc.PEAK_SOURCE: source})
        if mfu > 1.0 and not self._mfu_event_sent:
            self._mfu_event_sent = True
            message = (
                f"MFU {mfu:.0%} > 100%: the peak ({peak:.4g} FLOP/s from {source}) or flops_per_token "
                f"({fpt:.4g}) is wrong for this device/dtype"
            )
            log.warning("otel_train: %s", message)
            self._events.emit("mfu_over_100", message, {"mfu": round(mfu, 4), sc.PEAK_SOURCE: source})
