"""Hardware telemetry for one rank: GPUs (NVML), the CUDA allocator, the host, energy and MFU.

`assemble` builds one `HardwareMonitor` (`monitor.py`), the facade over the parts, each with one job
(the rules they follow are in reference/failure-modes.md §4):

* ``discovery``: NVML init and this rank's GPU, keyed by UUID (CUDA and NVML enumerate devices
  differently), found on a daemon thread under a timeout, because a hung ``nvmlInit`` must cost
  at most that timeout.
* ``gpu_sampler``: the NVML sampler thread. NVML is called only there; the SDK's callbacks read the
  snapshot it swaps in, so a hung NVML call stalls the sampler, never collection or export.
  ``nvml_reads`` holds the NVML calls of one device's sample (unsupported fields, lost GPUs, XIDs).
* ``host_sampler``: the psutil sampler thread (process CPU and memory, node memory).
* ``efficiency``: CUDA allocator memory, memory pressure, energy and MFU, computed at each flush on
  the background worker; ``mfu`` holds the FLOPs-per-token conventions and the peak-FLOP/s table.
* ``mps_memory``: Apple silicon's Metal allocator memory (`MpsMemory`, a flush listener of its own:
  no NVML there).

The parts' numbers go to OTel instruments made from their catalogue specs (`MetricSpec.create`);
their events go to the `health.EventChannel`.

Nothing in this package runs on the training thread's step path, imports torch, or initialises
CUDA on its own. One logger, ``otel_train.hardware``, for the whole package.

`HardwareMonitor` is loaded on first use (PEP 562): importing this package for a light name (the
session needs `autocast_dtype` at `import otel_train`) must not import the OTel SDK's metrics API.
"""

from typing import TYPE_CHECKING, Any

from otel_train.hardware.discovery import (
    RES_GPU_DRIVER_VERSION,
    RES_GPU_NAME,
    RES_GPU_PCI_BUS_ID,
    RES_GPU_UUID,
    Discovery,
    discover_with_timeout,
    parse_cuda_visible_devices,
)
from otel_train.hardware.mfu import autocast_dtype

if TYPE_CHECKING:
    from otel_train.hardware.monitor import HardwareMonitor
    from otel_train.hardware.mps_memory import MpsMemory

__all__ = [
    "RES_GPU_DRIVER_VERSION",
    "RES_GPU_NAME",
    "RES_GPU_PCI_BUS_ID",
    "RES_GPU_UUID",
    "Discovery",
    "HardwareMonitor",
    "MpsMemory",
    "autocast_dtype",
    "discover_with_timeout",
    "parse_cuda_visible_devices",
]


def __getattr__(name: str) -> Any:
    if name == "HardwareMonitor":
        from otel_train.hardware.monitor import HardwareMonitor

        return HardwareMonitor
    if name == "MpsMemory":
        from otel_train.hardware.mps_memory import MpsMemory

        return MpsMemory
    raise AttributeError(f"module 'otel_train.hardware' has no attribute {name!r}")
