"""Cost of the cross-rank reduction at each flush (CrossRankReducer.on_flush), on real gloo ranks,
and straggler detection latency (flushes until a chronic straggler is reported).

    .venv/bin/python bench/bench_reduce.py [--flushes 200] [--ranks 1 2 4 8]

Latency: a DDP-like interval per rank (data / forward / backward holding the all-reduce /
optimizer, 10 steps, +-3 % jitter), the last rank 1.3x slower in forward from the first flush;
"flushes" = the 1-based flush at which every rank's on_straggler callback first names it (with
log_interval=10 that many x 10 steps), with the default threshold and EWMA. The callback runs one
flush after rank 0 found it (the verdict rides the next flush's exchange; rank 0's event does not
wait). Per-rank bytes and time against the job size, and the old all_gather beside the star
exchange: bench/bench_exchange.py.

Runs on the background worker in production, so this is not training-thread time; it bounds how
much worker time (and gloo traffic) one flush costs. "local" = not distributed (no process group):
no collective at all, only this rank's reductions and individual scores.
Prints the median (and p90) µs per flush over all ranks, and a bare all_gather of the same row (the
exchange before issue #18, kept here to compare).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from helpers.multirank import run_ranks

PHASES = {
    "data": 0.002,
    "forward": 0.030,
    "backward": 0.060,
    "optimizer": 0.005,
    "allreduce": 0.02,
    "zero_grad": 0.001,
}


def _interval(seq: int, rank: int) -> Any:
    from otel_train.core.buffer import Interval

    phases = {k: [v * (1 + 0.01 * ((rank + i + seq) % 3))] * 10 for i, (k, v) in enumerate(PHASES.items())}
    arrivals: dict[str, list[float]] = {}
    elapsed = 0.0
    for name, values in phases.items():
        elapsed += values[0]
        arrivals[name] = [elapsed] * 10
    return Interval(seq, seq * 10 + 9, time.time(), 1.0, 10, 0, 0, [0.12] * 10, phases, arrivals)


def _ddp_interval(seq: int, rank: int, world: int, rng: Any, factor: float = 1.3) -> Any:
    """Ten DDP-like steps: every rank's backward ends when the slowest rank's does."""
    from otel_train.core.buffer import Interval

    phases: dict[str, list[float]] = {"data": [], "forward": [], "backward": [], "optimizer": []}
    arrivals: dict[str, list[float]] = {"data": [], "forward": [], "backward": [], "optimizer": []}
    steps = []
    for _ in range(10):
        jitter = [[1 + rng.uniform(-0.03, 0.03) for _ in range(4)] for _ in range(world)]
        ends = [
            0.004 * j[0] + 0.030 * j[1] * (factor if r == world - 1 else 1.0) for r, j in enumerate(jitter)
        ]
        mine = jitter[rank]
        d = 0.004 * mine[0]
        f = ends[rank] - d
        sync = max(ends) + 0.030 * mine[2]
        o = 0.006 * mine[3]
        for name, value in (("data", d), ("forward", f), ("backward", sync - ends[rank]), ("optimizer", o)):
            phases[name].append(value)
        for name, at in (("data", d), ("forward", ends[rank]), ("backward", sync), ("optimizer", sync + o)):
            arrivals[name].append(at)
        steps.append(sync + o)
    return Interval(seq, seq * 10 + 9, time.time(), 1.0, 10, 0, 0, steps, phases, arrivals)


def latency_target(rank: int, world: int, flushes: int) -> int | None:
    import random

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    group = create_telemetry_group(identity, 60.0)
    named: list[bool] = []
    first: list[int] = []
    reducer = CrossRankReducer(
        identity,
        None,
        None,
        Config(),
        group=group,
        on_straggler=lambda reports: named.append(any(r.rank == world - 1 for r in reports)),
    )
    rng = random.Random(1000 * rank + 7)
    for seq in range(flushes):
        reducer.on_flush(_ddp_interval(seq, rank, world, rng))
        if not first and any(named):
            first.append(seq + 1)
    return first[0] if first else None


def _meter() -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    return MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("bench")


def _measure(reducer: Any, rank: int, flushes: int, warmup: int = 20) -> list[float]:
    for seq in range(warmup):
        reducer.on_flush(_interval(seq, rank))
    out = []
    for seq in range(warmup, warmup + flushes):
        iv = _interval(seq, rank)
        t0 = time.perf_counter()
        reducer.on_flush(iv)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def rank_target(rank: int, world: int, flushes: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.crossrank.up_row import pack_len
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    config = Config(timing_log_option="minmax")
    group = create_telemetry_group(identity, 60.0)
    reducer = CrossRankReducer(identity, _meter(), None, config, group=group)
    times = _measure(reducer, rank, flushes)
    assert reducer.collectives == (flushes + 20 if world > 1 else 0)
    bare: list[float] = []
    if group is not None:
        row = torch.zeros(pack_len(), dtype=torch.float64)
        out = torch.empty(world * row.numel(), dtype=torch.float64)
        for i in range(flushes + 20):
            t0 = time.perf_counter()
            dist.all_gather_single(out, row, group=group)
            if i >= 20:
                bare.append((time.perf_counter() - t0) * 1e6)
    return {"flush": times, "bare": bare}


def local(flushes: int) -> list[float]:
    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import Identity

    reducer = CrossRankReducer(Identity("bench"), _meter(), None, Config())
    times = _measure(reducer, 0, flushes)
    assert reducer.collectives == 0
    return times


def _row(label: str, values: list[float], bare: list[float]) -> str:
    p90 = statistics.quantiles(values, n=10)[-1] if len(values) >= 10 else max(values)
    b = f"{statistics.median(bare):10.0f}" if bare else f"{'-':>10}"
    return f"{label:>14} {statistics.median(values):12.0f} {p90:10.0f} {b}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flushes", type=int, default=200)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    print(
        f"CrossRankReducer.on_flush, {len(PHASES)} timers, {args.flushes} flushes, cpu_count={os.cpu_count()}"
    )
    print(f"{'ranks':>14} {'median µs':>12} {'p90 µs':>10} {'gather µs':>10}")
    print(_row("local (no PG)", local(args.flushes), []))
    for world in args.ranks:
        results = run_ranks(world, rank_target, (args.flushes,), timeout=300)
        flush = [v for r in results for v in r["flush"]]
        bare = [v for r in results for v in r["bare"]]
        print(_row(f"{world} gloo", flush, bare))
    print("\nDetection latency: last rank 1.3x slower in forward (DDP-like), flushes until reported")
    for world in [w for w in args.ranks if w > 1]:
        found = run_ranks(world, latency_target, (10,), timeout=300)
        print(f"{world:>6} gloo ranks: reported at flush {sorted(set(found))} (every rank's view)")


if __name__ == "__main__":
    main()
