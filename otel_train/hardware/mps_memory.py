"""Apple silicon (`mps`): the Metal allocator's memory as gauges, read at the flush on the worker.
Design: docs/design/hardware-and-numerics.md#mps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from otel_train import semconv as sc
from otel_train.core.buffer import Interval
from otel_train.hardware.discovery import log

# (gauge, torch.mps function); a function the torch build lacks is skipped
READINGS = (
    (sc.MPS_MEMORY_ALLOCATED, "current_allocated_memory"),
    (sc.MPS_MEMORY_DRIVER, "driver_allocated_memory"),
    (sc.MPS_MEMORY_LIMIT, "recommended_max_memory"),
)


def loaded_torch_mps() -> Any | None:
    """`torch.mps` when torch is loaded and its mps backend is available, else None."""
    torch = sys.modules.get("torch")
    return torch.mps if torch is not None and torch.backends.mps.is_available() else None


class MpsMemory:
    """Flush listener: the `train.mps.memory.*` gauges (module doc)."""

    def __init__(self, meter: Any, torch_mps: Callable[[], Any | None] = loaded_torch_mps) -> None:
        self._meter = meter
        self._torch_mps = torch_mps
        self._gauges: dict[str, Any] = {}

    def on_flush(self, interval: Interval) -> None:
        mps = self._torch_mps()
        if mps is None:
            return
        values: dict[sc.MetricSpec, int] = {}
        for spec, function in READINGS:
            read = getattr(mps, function, None)
            if read is None:
                continue
            try:
                values[spec] = int(read())
            except RuntimeError:  # torch's MPS errors
                log.debug("otel_train: torch.mps.%s() failed", function, exc_info=True)
        if not self._gauges and not values.get(sc.MPS_MEMORY_DRIVER):
            return  # mps unused so far: no series
        for spec, value in values.items():
            gauge = self._gauges.get(spec.name)
            if gauge is None:
                gauge = self._gauges[spec.name] = spec.create(self._meter)
            gauge.set(value)

    def close(self) -> None:
        pass
