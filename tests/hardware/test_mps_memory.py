"""Apple silicon memory gauges (mps_memory.py). There is no Apple hardware here, so `torch.mps` is
a minimal fake: the three functions the listener calls, returning byte counts; the listener's own
logic (skip when mps is unused, skip functions a torch build lacks, one gauge per reading) is real,
and so are the SDK meter and reader."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_train import semconv as sc
from otel_train.core.buffer import Interval
from otel_train.hardware.mps_memory import MpsMemory, loaded_torch_mps


class FakeMps:
    def __init__(self, allocated: int, driver: int) -> None:
        self.allocated, self.driver = allocated, driver

    def current_allocated_memory(self) -> int:
        return self.allocated

    def driver_allocated_memory(self) -> int:
        return self.driver


def _values(reader: InMemoryMetricReader) -> dict[str, float]:
    out: dict[str, float] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for scope in rm.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = metric.data.data_points[0].value
    return out


def _flush(listener: MpsMemory) -> None:
    listener.on_flush(Interval(seq=0, step=0, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=0, samples=0))


def test_mps_memory_gauges_once_mps_holds_memory() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    fake = FakeMps(0, 0)
    listener = MpsMemory(meter, lambda: fake)
    _flush(listener)
    assert _values(reader) == {}  # mps unused: no series
    fake.allocated, fake.driver = 3 << 20, 8 << 20
    _flush(listener)
    # recommended_max_memory is missing from this (older) fake build: skipped, not an error
    assert _values(reader) == {sc.MPS_MEMORY_ALLOCATED.name: 3 << 20, sc.MPS_MEMORY_DRIVER.name: 8 << 20}


def test_no_mps_no_gauges() -> None:
    reader = InMemoryMetricReader()
    listener = MpsMemory(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: None)
    _flush(listener)
    assert _values(reader) == {}
    assert loaded_torch_mps() is None  # this Linux machine: torch's mps backend is not available
