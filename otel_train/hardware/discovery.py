"""Finding this rank's GPU: NVML init and the rank -> device mapping (by UUID), on a daemon thread
under a timeout. Design: docs/design/hardware-and-numerics.md#hardware.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

# One logger for the whole hardware package (its modules import it from here): users filter on it.
log = logging.getLogger("otel_train.hardware")

# Resource attribute keys for the rank's GPU (identity lives in the Resource).
RES_GPU_UUID = "hw.gpu.uuid"
RES_GPU_PCI_BUS_ID = "hw.gpu.pci_bus_id"
RES_GPU_NAME = "hw.gpu.name"
RES_GPU_DRIVER_VERSION = "hw.gpu.driver_version"


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
    Like CUDA, parsing stops at the first invalid entry (e.g. ``-1`` hides every GPU)."""
    if value is None:
        return None
    entries = (raw.strip() for raw in value.split(","))
    return list(itertools.takewhile(lambda e: re.fullmatch(r"[0-9]+|(GPU|MIG)-[0-9A-Za-z/_-]+", e), entries))


def _uuid_key(uuid: str) -> str:
    """Comparable form of a GPU UUID: NVML says 'GPU-3b6a…', torch '3b6a…'."""
    return re.sub(r"^(gpu-)?(mig-)?", "", uuid.strip().lower())


def _nvml_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def torch_cuda_if_loaded() -> Any | None:
    return getattr(sys.modules.get("torch"), "cuda", None)  # never import torch (or initialise CUDA)


def cuda_initialized(torch_cuda: Any | None) -> TypeGuard[Any]:
    return torch_cuda is not None and bool(torch_cuda.is_initialized())


def torch_device_index(torch_cuda: Any, local_rank: int) -> int:
    count = int(torch_cuda.device_count())
    return local_rank if 0 <= local_rank < count else int(torch_cuda.current_device())


def discover_gpus(
    local_rank: int,
    nvml: Any | None = None,
    environ: Mapping[str, str] | None = None,
    torch_cuda: Any | None = None,
) -> Discovery:
    """Initialise NVML and find this rank's GPU (synchronous: NVML may block). The rank's device is
    entry ``local_rank`` of CUDA_VISIBLE_DEVICES (or the only entry), unless torch has initialised
    CUDA: then torch's UUID for it wins (CUDA's FASTEST_FIRST order can differ from NVML's PCI order)."""
    env = os.environ if environ is None else environ
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError as exc:
            return Discovery(None, reason=f"nvidia-ml-py not importable ({type(exc).__name__})")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:  # no driver, no library (NVMLError_LibraryNotFound), ...
        return Discovery(None, reason=f"nvmlInit failed: {exc}")
    try:
        driver: str | None = _nvml_text(nvml.nvmlSystemGetDriverVersion())
    except nvml.NVMLError:
        driver = None
    try:
        handle = _rank_handle(nvml, local_rank, env, torch_cuda)
        if handle is None:
            shutdown_quietly(nvml)
            visible = env.get("CUDA_VISIBLE_DEVICES")
            reason = f"no GPU for local rank {local_rank} (CUDA_VISIBLE_DEVICES={visible!r})"
            return Discovery(None, driver_version=driver, reason=reason)
        device = describe_device(nvml, handle)
    except nvml.NVMLError as exc:
        shutdown_quietly(nvml)
        return Discovery(None, driver_version=driver, reason=f"GPU lookup failed: {exc}")
    return Discovery(nvml, [device], driver)


def describe_device(nvml: Any, handle: Any) -> GpuDevice:
    """The device behind ``handle``: its UUID, name and PCI bus id (NVML errors propagate)."""
    uuid = _nvml_text(nvml.nvmlDeviceGetUUID(handle))
    name = _nvml_text(nvml.nvmlDeviceGetName(handle))
    try:
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        bus_id: str | None = _nvml_text(getattr(pci, "busId", b"")) or None
    except nvml.NVMLError:
        bus_id = None
    return GpuDevice(handle, uuid, name, bus_id)


def torch_uuid(torch_cuda: Any, local_rank: int) -> str | None:
    """The comparable UUID of the CUDA device this rank uses, once torch has initialised CUDA."""
    if not cuda_initialized(torch_cuda):
        return None
    try:
        return _uuid_key(
            str(torch_cuda.get_device_properties(torch_device_index(torch_cuda, local_rank)).uuid)
        )
    except (RuntimeError, AttributeError) as exc:  # torch without `.uuid`, a CUDA error
        log.debug("torch device UUID lookup failed (%s)", exc)
        return None


def same_uuid(a: str, b: str) -> bool:
    return _uuid_key(a) == _uuid_key(b)


def handle_for_uuid(nvml: Any, want: str) -> Any | None:
    """NVML's handle of the device with comparable UUID ``want`` (a physical GPU or a MIG slice)."""
    # torch prints the bare UUID; NVML wants "GPU-<uuid>" (or "MIG-<uuid>" for a MIG slice,
    # which no enumeration of physical GPUs below would find).
    for prefix in ("GPU-", "MIG-"):
        with contextlib.suppress(nvml.NVMLError):
            return nvml.nvmlDeviceGetHandleByUUID(prefix + want)
    for handle, uuid in _all_devices(nvml):
        if _uuid_key(uuid) == want:
            return handle
    return None


def shutdown_quietly(nvml: Any) -> None:
    with contextlib.suppress(nvml.NVMLError):
        nvml.nvmlShutdown()


def _all_devices(nvml: Any) -> list[tuple[Any, str]]:
    """(handle, UUID) of every GPU NVML lets us query. One it refuses (NoPermission for a GPU
    outside this job's device cgroup, a lost GPU) is skipped instead of failing the lookup."""
    out = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            out.append((handle, _nvml_text(nvml.nvmlDeviceGetUUID(handle))))
        except nvml.NVMLError as exc:
            log.debug("otel_train: NVML device %d skipped (%s)", i, exc)
    return out


def _rank_handle(nvml: Any, local_rank: int, env: Mapping[str, str], torch_cuda: Any | None) -> Any | None:
    want = torch_uuid(torch_cuda, local_rank)
    if want is not None:
        with contextlib.suppress(nvml.NVMLError):
            handle = handle_for_uuid(nvml, want)
            if handle is not None:
                return handle
        log.debug("torch's device %s not found through NVML; using CUDA_VISIBLE_DEVICES", want)
    visible = parse_cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    entries = visible if visible is not None else [str(i) for i in range(int(nvml.nvmlDeviceGetCount()))]
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
    """discover_gpus on a daemon thread; a hung ``nvmlInit`` (go-nvml#152) costs at most timeout_s.
    One that returns after the timeout is shut down again: nobody samples through it."""
    result: list[Discovery] = []
    abandoned: list[bool] = []
    lock = threading.Lock()
    env = dict(os.environ if environ is None else environ)

    def discover() -> None:
        found = discover_gpus(local_rank, nvml, env, torch_cuda)
        with lock:
            if not abandoned:
                result.append(found)
                return
        if found.nvml is not None:
            shutdown_quietly(found.nvml)

    thread = threading.Thread(target=discover, name="otel-train-nvml-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        if not result:
            abandoned.append(True)
            return Discovery(None, reason=f"NVML init/lookup did not return within {timeout_s:g}s")
    return result[0]
