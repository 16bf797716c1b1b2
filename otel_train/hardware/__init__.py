"""Hardware telemetry for one rank: GPUs (NVML), the CUDA allocator, the host, energy and MFU,
behind the `HardwareMonitor` facade. Design: docs/design/hardware-and-numerics.md#hardware.
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
    torch_cuda_if_loaded,
)
from otel_train.hardware.mfu import autocast_dtype
from otel_train.hardware.mps_memory import MpsMemory

if TYPE_CHECKING:
    from otel_train.hardware.monitor import HardwareMonitor

__all__ = [
    "RES_GPU_DRIVER_VERSION", "RES_GPU_NAME", "RES_GPU_PCI_BUS_ID", "RES_GPU_UUID", "Discovery",
    "HardwareMonitor", "MpsMemory", "autocast_dtype", "discover_with_timeout", "parse_cuda_visible_devices",
    "torch_cuda_if_loaded",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "HardwareMonitor":
        from otel_train.hardware.monitor import HardwareMonitor

        return HardwareMonitor
    raise AttributeError(f"module 'otel_train.hardware' has no attribute {name!r}")
