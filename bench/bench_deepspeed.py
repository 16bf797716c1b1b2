"""Overhead of the DeepSpeed adapter on a launch-bound DeepSpeed loop (~10 ms steps), as ratios in
one run.

    DS_ACCELERATOR=cpu .venv/bin/python bench/bench_deepspeed.py [--seconds 90] [--step-ms 10]

One process, one gloo rank (world 1), ZeRO-2, one otel_train session at library defaults. Two
DeepSpeed engines over the same seeded model of many tiny layers (the layer count is calibrated so
that a plain step takes `--step-ms`): A (plain: `engine(x)`, `engine.backward(loss)`,
`engine.step()`), B (the same loop on an engine passed through `instrument()`: steps, phases,
loss, lr, grad norm, ZeRO facts) and C (A's engine again: the A/A control, the method's resolution
at that moment). Blocks of `--block` steps rotate in a random order each round, every block timed
with perf_counter_ns, as bench_launch.py does (this VM's speed drifts within seconds). Reported:
B/A - 1 and C/A - 1 as ratios of block sums, with a bootstrap 95 % CI over the rounds, and the
median of the rounds' own B/A ratios. The worker's flushes run during the blocks after a B step,
mostly other loops', so B/A - 1 is the training thread's cost (as in bench_launch.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29791")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", ".tools", "torch_extensions")
)


def build(layers: int, instrumented: bool) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if instrumented:
        from otel_train.integrations.deepspeed import instrument

        instrument(engine)
    return engine


def step(engine: Any, x: Any) -> None:
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def block(engine: Any, x: Any, n: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(n):
        step(engine, x)
    return time.perf_counter_ns() - start


def ci(pairs: list[tuple[int, int]], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(sum(b for b, _ in sample) / sum(a for _, a in sample) - 1)
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()
    import deepspeed
    import torch

    import otel_train as ot

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    ot.init(output_dir=tempfile.mkdtemp(prefix="bench-ds-"), verbosity=0, prometheus_port=0)
    x = torch.randn(4, 16)
    layers = 8
    while True:  # calibrate the plain step to --step-ms
        probe = build(layers, False)
        block(probe, x, 5)
        ms = block(probe, x, 10) / 10 / 1e6
        if ms >= args.step_ms * 0.9 or layers > 4096:
            break
        layers = int(layers * max(1.2, args.step_ms / ms))
    a, b = build(layers, False), build(layers, True)
    for engine in (a, b):
        block(engine, x, 20)  # warm up: optimizer state, the adapter's ZeRO facts
    loops = {"A": a, "B": b, "C": a}
    sums: dict[str, list[int]] = {k: [] for k in loops}
    rng = random.Random(1)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        order = list(loops)
        rng.shuffle(order)
        for name in order:
            sums[name].append(block(loops[name], x, args.block))
    ot.shutdown()
    ba = list(zip(sums["B"], sums["A"], strict=True))
    ca = list(zip(sums["C"], sums["A"], strict=True))
    step_ms = sum(sums["A"]) / len(sums["A"]) / args.block / 1e6
    print(f"layers {layers}, plain step {step_ms:.2f} ms, rounds {len(ba)} of {args.block} steps per loop")
    for label, pairs in (("B/A - 1 (adapter)", ba), ("C/A - 1 (A/A control)", ca)):
        ratio = sum(p for p, _ in pairs) / sum(q for _, q in pairs) - 1
        low, high = ci(pairs)
        print(f"{label:24s} {ratio * 100:+.2f} %  95% CI [{low * 100:+.2f}, {high * 100:+.2f}] %")
    median = statistics.median(p / q - 1 for p, q in ba)
    print(f"median of the rounds' B/A - 1: {median * 100:+.2f} %")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
