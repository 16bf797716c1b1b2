"""Real NVML + CUDA checks (run on a GPU machine; skipped without CUDA)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers.events import Events
from helpers.waiting import wait_for
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_train import semconv as sc
from otel_train.config import Config
from otel_train.core.buffer import Interval
from otel_train.hardware import RES_GPU_UUID, HardwareMonitor, discover_with_timeout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and an NVIDIA driver"),
]


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], float]]]:
    out: dict[str, list[tuple[dict[str, Any], float]]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for scope in rm.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = [(dict(p.attributes or {}), p.value) for p in metric.data.data_points]
    return out


def one(pts: dict[str, list[tuple[dict[str, Any], float]]], name: str) -> float:
    [(_, v)] = pts[name]
    return v


def matmul_workload(seconds: float) -> int:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize()
        n += 20
    return n


@pytest.fixture
def monitor() -> Iterator[tuple[HardwareMonitor, InMemoryMetricReader, Events]]:
    pytest.importorskip("pynvml")
    torch.cuda.init()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    events = Events()
    local_rank = torch.cuda.current_device()
    # nvmlInit without persistence mode can take seconds per GPU
    discovery = discover_with_timeout(local_rank, timeout_s=60)
    mon = HardwareMonitor(
        Config(hardware_interval_s=0.25, flops_per_token=1e9),
        provider.get_meter("gpu-test"),
        events,
        local_rank,
        discovery,
    )
    mon.start()
    yield mon, reader, events
    mon.close(timeout_s=2)
    provider.shutdown()


def test_real_nvml_values_are_plausible(
    monitor: tuple[HardwareMonitor, InMemoryMetricReader, Events],
) -> None:
    mon, reader, events = monitor
    assert mon.gpu_sampler.devices
    # str(_CUuuid) is the bare 8-4-4-4-12 hex form; NVML's is "GPU-<same>".
    torch_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid).lower()
    assert mon.discovery.resource_attributes()[RES_GPU_UUID].lower().removeprefix("gpu-") == torch_uuid
    wait_for(lambda: mon.gpu_sampler.samples >= 1, 10, "GPU samples")
    before = points(reader)
    matmul_workload(2.0)
    seen = mon.gpu_sampler.samples
    wait_for(lambda: mon.gpu_sampler.samples >= seen + 2, 10, "GPU samples")
    after = points(reader)

    util = one(after, sc.GPU_UTILIZATION.name)
    assert 0.0 <= util <= 1.0
    used, limit = one(after, sc.GPU_MEMORY_USAGE.name), one(after, sc.GPU_MEMORY_LIMIT.name)
    assert 0 < used <= limit
    assert 5 <= one(after, sc.GPU_TEMPERATURE.name) <= 110  # °C (liquid-cooled idle can be ~20)
    assert one(after, sc.GPU_POWER.name) > 0
    if sc.GPU_ENERGY.name in before:
        assert one(after, sc.GPU_ENERGY.name) > one(before, sc.GPU_ENERGY.name)
    assert one(after, sc.GPU_CLOCK_SM.name) > 100e6
    assert {a[sc.THROTTLE_REASON] for a, _ in after.get(sc.GPU_THROTTLE.name, [])} <= {
        "power_cap", "thermal", "hw_slowdown", "sw_slowdown",
    }  # fmt: skip
    for attrs, _ in after[sc.GPU_UTILIZATION.name]:
        assert attrs[sc.HW_ID].lower().removeprefix("gpu-") == torch_uuid
    assert not [e for e in events.items if e[0] == "gpu_lost"]


def test_allocator_energy_and_mfu_at_flush(
    monitor: tuple[HardwareMonitor, InMemoryMetricReader, Events],
) -> None:
    mon, reader, _ = monitor
    wait_for(lambda: mon.gpu_sampler.samples >= 1, 10, "GPU samples")
    mon.on_flush(Interval(seq=0, step=0, wall_time=time.time(), elapsed_s=1.0, steps=1, tokens=1, samples=1))
    # Live across the next flush: "allocated > 0" must not hinge on cuBLAS workspaces staying cached.
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    start = time.monotonic()
    n = matmul_workload(1.5)
    seen = mon.gpu_sampler.samples
    wait_for(lambda: mon.gpu_sampler.samples >= seen + 1, 10, "GPU samples")
    mon.on_flush(
        Interval(
            seq=1,
            step=n,
            wall_time=time.time(),
            elapsed_s=time.monotonic() - start,
            steps=n,
            tokens=n * 100,
            samples=n,
        )
    )
    pts = points(reader)
    assert one(pts, sc.CUDA_MEMORY_ALLOCATED.name) >= held.numel()  # bytes, not MiB
    assert one(pts, sc.CUDA_MEMORY_RESERVED.name) >= one(pts, sc.CUDA_MEMORY_ALLOCATED.name)
    # The workload's two 32 MiB operands came and went after the first flush reset the peak.
    assert one(pts, sc.CUDA_MEMORY_PEAK.name) >= held.numel() + 2 * 4096 * 4096 * 2
    del held
    if sc.POWER_AVERAGE.name in pts:  # energy counter supported (Volta+)
        assert 10 < one(pts, sc.POWER_AVERAGE.name) < 2000
        assert one(pts, sc.ENERGY_PER_STEP.name) > 0
    assert one(pts, sc.FLOPS.name) > 0
    peak, _ = mon.efficiency.resolve_peak()
    if peak is not None:
        assert 0 < one(pts, sc.MFU.name) < 1


def test_cuda_event_timer_agrees_with_an_independent_event_pair() -> None:
    """`ot.timer(name, cuda=True)` vs a torch.cuda.Event pair measured by hand: within 5 %."""
    import otel_train as ot
    from otel_train.testing import capture_metrics

    x = torch.randn(4096, 4096, device="cuda")
    reference = 0.0
    with capture_metrics(log_interval=1000, hardware=False) as cap:
        for i in range(10):
            with ot.step(i):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                with ot.timer("matmul", cuda=True):
                    start.record()
                    for _ in range(20):
                        x = (x @ x).clamp_(-1, 1)
                    end.record()
            end.synchronize()  # the test's own check, outside the instrumented region
            reference += start.elapsed_time(end) / 1000.0
    ours = cap.last("timers/matmul/total")
    assert ours is not None and cap.last("timers/matmul/count") == 10
    assert ours == pytest.approx(reference, rel=0.05)


def test_no_device_sync_during_instrumented_steps_between_flushes() -> None:
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call: none may happen
    in steps, timers (host and CUDA), record() of device tensors or the flush hand-over."""
    import otel_train as ot
    from otel_train.testing import capture_metrics

    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")
    with capture_metrics(log_interval=10, hardware=False) as cap:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(9):  # stays inside one interval: the flush's resolution is the only sync
                with ot.step(i, tokens=64 * 1024, samples=64):
                    with ot.timer("forward", cuda=True):
                        loss = model(x).pow(2).mean()
                    with ot.timer("backward", cuda=True):
                        loss.backward()
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                    with ot.timer("optimizer"):
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    ot.record("loss", loss)
                    ot.record("grad_norm", grad_norm)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with ot.step(9):  # the 10th step flushes; resolution happens on the worker
            ot.record("loss", loss)
    assert cap.last("train/loss") is not None and cap.last("train/grad_norm") is not None
    assert cap.last("timers/forward/count") == 9
