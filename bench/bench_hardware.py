"""Cost of hardware telemetry: NVML sampling (off the training thread) and per-step cost on it.

    .venv/bin/python bench/bench_hardware.py [--quick] [--real]

Runs against tests/helpers/fake_nvml.py (no GPU needed), so "NVML cost" here is our Python overhead per
sample; a real driver adds its own per-call latency (~10 µs to ms, PCIe throughput ~20 ms), which
lands on the sampler thread only. `--real` samples the machine's own GPU 0 through the driver
(needs nvidia-ml-py and an NVIDIA driver): the driver's latency included. The training-thread numbers compare an identical CPU "step" with
the sampler running (at an aggressive interval, to magnify any GIL contention) and without it,
in interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.fake_nvml import FakeGpu, FakeNvml, gpu_uuid  # noqa: E402

from otel_train.config import Config  # noqa: E402
from otel_train.core.buffer import Interval  # noqa: E402
from otel_train.hardware import HardwareMonitor, discover_with_timeout  # noqa: E402


def per_call_us(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def make(
    interval_s: float, real: bool
) -> tuple[HardwareMonitor, InMemoryMetricReader, FakeNvml | None, MeterProvider]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    nvml = None if real else FakeNvml([FakeGpu(uuid=gpu_uuid(0))])
    # nvmlInit without persistence mode can take seconds per GPU
    discovery = discover_with_timeout(0, timeout_s=60) if real else discover_with_timeout(0, nvml, {})
    if real and not discovery.devices:
        raise SystemExit(f"--real: no GPU found through NVML: {discovery.reason}")
    mon = HardwareMonitor(
        Config(hardware_interval_s=interval_s, flops_per_token=1e9),
        provider.get_meter("bench"),
        None,
        0,
        discovery,
    )
    return mon, reader, nvml, provider


def step_work() -> None:
    x = 0
    for i in range(400):  # a ~20-40 µs pure-Python "step" (holds the GIL like a real loop's host code)
        x += i * i


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--real", action="store_true", help="the machine's GPU 0 through its NVIDIA driver")
    args = parser.parse_args()
    n = 200 if args.quick else 1000
    rows: list[tuple[str, str, str]] = []

    mon, reader, nvml, provider = make(3600.0, args.real)
    mon.start(background=False)
    mon.sample_once()  # the first sample also registers the XID event set
    calls_before = sum(nvml.calls.values()) if nvml else 0
    mon.sample_once()
    calls_per_sample = (
        f"{sum(nvml.calls.values()) - calls_before} NVML calls per sample" if nvml else "real driver"
    )
    rows.append(
        ("GPU sample (sampler thread)", f"{per_call_us(mon.gpu_sampler.sample, n):.1f} µs", calls_per_sample)
    )
    rows.append(
        ("host sample (sampler thread)", f"{per_call_us(mon.host_sampler.sample, n // 4):.1f} µs", "psutil")
    )
    rows.append(
        (
            "collect() of all hw instruments",
            f"{per_call_us(reader.get_metrics_data, n // 4):.1f} µs",
            "SDK reader; cache only",
        )
    )
    flush = Interval(seq=0, step=10, wall_time=0.0, elapsed_s=1.0, steps=10, tokens=10_000, samples=10)
    rows.append(
        (
            "on_flush (background worker)",
            f"{per_call_us(lambda: mon.on_flush(flush), n):.1f} µs",
            "energy + MFU (+ CUDA if init)",
        )
    )
    if nvml is not None:
        nvml.call_latency_s = 0.001
        t0 = time.perf_counter()
        mon.gpu_sampler.sample()
        rows.append(
            (
                "GPU sample, 1 ms/NVML call",
                f"{(time.perf_counter() - t0) * 1e3:.1f} ms",
                "all of it off the training thread",
            )
        )
    mon.close()
    provider.shutdown()

    # Training thread: identical steps with and without a running sampler (interleaved).
    steps = 300 if args.quick else 2000
    rounds = 3 if args.quick else 7
    with_mon: list[float] = []
    without: list[float] = []
    for _ in range(rounds):
        for running in (False, True):
            m = None
            if running:
                m, _, _, p = make(0.005, args.real)  # 200 samples/s: far above the 5 s default
                m.start()
            t0 = time.perf_counter()
            for _ in range(steps):
                step_work()
            dt = (time.perf_counter() - t0) / steps * 1e6
            (with_mon if running else without).append(dt)
            if m is not None:
                m.close()
                p.shutdown()
    base, loaded = statistics.median(without), statistics.median(with_mon)
    rows.append(("step, no monitor", f"{base:.1f} µs", f"median of {rounds} rounds x {steps} steps"))
    rows.append(
        (
            "step, sampler at 200 Hz",
            f"{loaded:.1f} µs",
            f"Δ {loaded - base:+.1f} µs (GIL share of the sampler)",
        )
    )
    rows.append(("hardware calls on the step path", "0", "HardwareMonitor has no per-step hook"))

    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  {'cost':>12}  note")
    print("-" * (width + 40))
    for name, cost, note in rows:
        print(f"{name:<{width}}  {cost:>12}  {note}")


if __name__ == "__main__":
    main()
