"""Hot-path overhead, side by side in one run: otel_train vs the same instrumentation written
directly against the OTel SDK. Also: training-thread flush cost, worker time per flush, RSS growth
over a 100,000-step loop, and shutdown time with the collector down.

    .venv/bin/python bench/bench_core.py [--quick]

Ratios are the result; absolute times are context (2-core VM, noisy neighbours).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import otel_train as ot
from otel_train import semconv
from otel_train.testing import current_session


def _per_call_us(fn: Callable[[int], None], n: int, repeats: int = 5) -> float:
    """Median over repeats of (time for n calls) / n, in microseconds."""
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter_ns()
        fn(n)
        samples.append((time.perf_counter_ns() - start) / n / 1000)
    return statistics.median(samples)


def _sdk_pipeline() -> tuple[object, object]:
    """A direct-SDK setup comparable to ours: MeterProvider + a delta reader + tracer."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
    return provider, provider.get_meter("bench")


def bench_measurements(n: int) -> list[tuple[str, float, float]]:
    provider, meter = _sdk_pipeline()
    hist = meter.create_histogram(
        "train.phase.duration", "s", explicit_bucket_boundaries_advisory=semconv.PHASE_BUCKETS
    )
    gauge = meter.create_gauge("train.loss")
    counter = meter.create_counter("train.tokens")
    attrs = {"train.phase": "forward", "run_id": "r", "rank": 0}

    def sdk_timer(k: int) -> None:
        for _ in range(k):
            start = time.perf_counter_ns()
            hist.record((time.perf_counter_ns() - start) * 1e-9, attrs)

    def sdk_record(k: int) -> None:
        for i in range(k):
            gauge.set(float(i), {"run_id": "r", "rank": 0})

    def sdk_counter(k: int) -> None:
        for _ in range(k):
            counter.add(1, {"run_id": "r", "rank": 0})

    ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, log_interval=1_000_000, log_interval_s=1e9,
            max_values_per_interval=10**9)  # fmt: skip
    session = current_session()
    assert session is not None

    def ot_timer(k: int) -> None:
        for _ in range(k):
            with ot.timer("forward"):
                pass

    def ot_record(k: int) -> None:
        for i in range(k):
            ot.record("loss", float(i))

    def ot_step_counter(k: int) -> None:
        for _ in range(k):
            session.step_events.append((0, 0, 0, 1, None, False))  # what ot.step(tokens=...) adds per step

    rows = []
    for label, ours, theirs in (
        ("timer (enter+exit)", ot_timer, sdk_timer),
        ("record scalar", ot_record, sdk_record),
        ("counter add", ot_step_counter, sdk_counter),
    ):
        rows.append((label, _per_call_us(ours, n), _per_call_us(theirs, n)))
        session.flush()  # hand what the benchmark accumulated to the worker
    ot.shutdown()
    provider.shutdown()  # type: ignore[attr-defined]
    return rows


def bench_full_step(n: int) -> tuple[float, float, float]:
    """step + 4 timers + 6 scalars: otel_train, direct SDK (histograms/gauges + a span per step
    when sampled is left out to favour the SDK), and bare loop."""
    provider, meter = _sdk_pipeline()
    step_hist = meter.create_histogram(
        "train.step.duration", "s", explicit_bucket_boundaries_advisory=semconv.STEP_BUCKETS
    )
    phase_hist = meter.create_histogram(
        "train.phase.duration", "s", explicit_bucket_boundaries_advisory=semconv.PHASE_BUCKETS
    )
    gauges = [meter.create_gauge(f"train.s{i}") for i in range(6)]
    steps = meter.create_counter("train.steps")
    phase_attrs = [{"train.phase": p} for p in ("data", "forward", "backward", "optimizer")]

    def sdk(k: int) -> None:
        for i in range(k):
            t0 = time.perf_counter_ns()
            for attrs in phase_attrs:
                s = time.perf_counter_ns()
                phase_hist.record((time.perf_counter_ns() - s) * 1e-9, attrs)
            for g in gauges:
                g.set(float(i))
            steps.add(1)
            step_hist.record((time.perf_counter_ns() - t0) * 1e-9)

    names = [f"s{i}" for i in range(6)]

    def ours(k: int) -> None:
        for i in range(k):
            with ot.step(tokens=512, samples=4):
                with ot.timer("data"):
                    pass
                with ot.timer("forward"):
                    pass
                with ot.timer("backward"):
                    pass
                with ot.timer("optimizer"):
                    pass
                for name in names:
                    ot.record(name, float(i))

    def bare(k: int) -> None:
        for _ in range(k):
            pass

    ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, log_interval=100, traces=False)
    ours_us = _per_call_us(ours, n)
    ot.shutdown()
    sdk_us = _per_call_us(sdk, n)
    provider.shutdown()  # type: ignore[attr-defined]
    return ours_us, sdk_us, _per_call_us(bare, n)


def bench_flush(rounds: int, bridges: bool) -> tuple[float, float, float]:
    """Training-thread cost of a flush (swap + enqueue) and worker time per flush."""
    tmp = tempfile.mkdtemp()
    ot.init(prometheus_port=0, verbosity=0, output_dir=tmp, log_interval=10**9, log_interval_s=1e9,
            tensorboard=bridges, wandb=bridges, mlflow=bridges, queue_size=rounds + 2)  # fmt: skip
    session = current_session()
    assert session is not None
    costs = []
    for _r in range(rounds):
        for i in range(10):
            with ot.step(tokens=512):
                for phase in ("data", "forward", "backward", "optimizer"):
                    with ot.timer(phase):
                        pass
                ot.record("loss", 1.0 / (1 + i))
                ot.record("lr", 1e-3)
        start = time.perf_counter_ns()
        session.flush()
        costs.append((time.perf_counter_ns() - start) / 1000)
        time.sleep(0.02)
    time.sleep(1.0)
    worker_ms = session.worker.busy_s * 1000 / max(1, session.worker.flushes)
    ot.shutdown()
    return statistics.median(costs), max(costs), worker_ms


def bench_memory(steps: int) -> tuple[float, float]:
    tmp = tempfile.mkdtemp()
    proc = psutil.Process()
    ot.init(prometheus_port=0, verbosity=0, output_dir=tmp, log_interval=100)
    warm = 2_000
    for _ in range(warm):
        with ot.step(tokens=512):
            with ot.timer("forward"):
                pass
            ot.record("loss", 1.0)
    gc.collect()
    before = proc.memory_info().rss
    for i in range(steps):
        with ot.step(tokens=512):
            with ot.timer("forward"):
                pass
            with ot.timer("backward"):
                pass
            ot.record("loss", float(i % 7))
            ot.record("lr", 1e-3)
    gc.collect()
    after = proc.memory_info().rss
    dropped = current_session().deferred_flushes  # type: ignore[union-attr]
    ot.shutdown()
    return (after - before) / 2**20, float(dropped)


def bench_slow_backend(seconds: float) -> tuple[int, int, int]:
    """Steps completed in a fixed wall time without and with a bridge whose every write sleeps 5 s.
    Returns (steps without, steps with, writes the slow bridge dropped)."""
    from otel_train.bridges.base import Sink
    from otel_train.bridges.threaded import ThreadedSink

    class SleepySink(Sink):
        name = "sleepy"

        def write_scalars(self, step: int, wall_time: float, scalars: object) -> None:
            time.sleep(5.0)

    def run(slow: bool) -> tuple[int, int]:
        ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, log_interval=10)
        session = current_session()
        sleepy = ThreadedSink(SleepySink(), queue_size=4, name="sleepy", close_timeout_s=0.1)
        if slow:
            session.worker.add_sink(sleepy)
        steps = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            with ot.step(tokens=512):
                with ot.timer("forward"):
                    sum(range(2000))  # a little CPU work per step
                ot.record("loss", 1.0)
            steps += 1
        ot.shutdown()
        return steps, sleepy.dropped

    without, _ = run(False)
    with_slow, dropped = run(True)
    return without, with_slow, dropped


def bench_shutdown_collector_down() -> list[tuple[str, float]]:
    from helpers.otlp_receiver import refused_endpoint, tarpit

    rows = []
    for kind in ("refused", "tarpit"):
        for protocol in ("http/protobuf", "grpc"):
            ctx = tarpit() if kind == "tarpit" else None
            endpoint = ctx.__enter__() if ctx else refused_endpoint()
            ot.init(otlp_endpoint=endpoint, otlp_protocol=protocol, prometheus_port=0, verbosity=0,
                    run_dir_enabled=False, metric_export_interval_s=0.5, log_interval=5)  # fmt: skip
            for i in range(50):
                with ot.step(i):
                    ot.record("loss", 1.0)
            time.sleep(1.0)
            start = time.perf_counter()
            ot.shutdown()
            rows.append((f"{kind}/{protocol}", time.perf_counter() - start))
            if ctx:
                ctx.__exit__(None, None, None)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n = 20_000 if args.quick else 100_000
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")

    print("## Per measurement (µs, median of 5 runs)")
    print(f"{'measurement':<22}{'otel_train':>12}{'OTel SDK':>12}{'ratio':>8}")
    for label, ours, sdk in bench_measurements(n):
        print(f"{label:<22}{ours:>12.3f}{sdk:>12.3f}{ours / sdk:>8.2f}")

    ours, sdk, bare = bench_full_step(n // 5)
    print("\n## Fully instrumented step: step + 4 timers + 6 scalars (µs/step)")
    print(
        f"otel_train {ours:.2f}   direct OTel SDK {sdk:.2f}   ratio {ours / sdk:.2f}   (bare loop {bare:.3f})"
    )

    print("\n## Flush on the training thread (µs) and worker time per flush (ms)")
    for bridges in (False, True):
        median, worst, worker = bench_flush(30 if args.quick else 100, bridges)
        label = "run dir + console + TB + W&B + MLflow" if bridges else "run dir + console"
        print(f"{label:<40} median {median:7.1f} µs   max {worst:7.1f} µs   worker {worker:6.2f} ms/flush")

    without, with_slow, dropped = bench_slow_backend(3.0 if args.quick else 10.0)
    print("\n## Steps in a fixed wall time with a bridge whose write sleeps 5 s")
    print(
        f"without {without:,}   with {with_slow:,}   ratio {with_slow / without:.3f}   bridge writes dropped {dropped}"
    )

    steps = 20_000 if args.quick else 100_000
    growth, dropped = bench_memory(steps)
    print(
        f"\n## RSS growth over {steps:,} instrumented steps: {growth:.1f} MiB (flushes deferred: {dropped:.0f})"
    )

    print("\n## shutdown() with the collector down (s; budget 2.0)")
    for label, seconds in bench_shutdown_collector_down():
        print(f"{label:<24} {seconds:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
