"""Overhead of the DeepSpeed adapter on a launch-bound DeepSpeed loop (~10 ms steps), as ratios in
one run.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python bench/bench_deepspeed.py [--seconds 90] [--step-ms 10]

One process, one gloo rank (world 1), ZeRO-2, one otel_train session at library defaults, ONE
DeepSpeed engine over a seeded model of many tiny layers (the layer count is calibrated so that a
plain step takes `--step-ms`), passed through `instrument()`. The loop is always `engine(x)`,
`engine.backward(loss)`, `engine.step()`; what differs between the loops is whether the adapter's
wrappers are on the engine: A (off: the entries `instrument()` put in the engine's `__dict__` are
taken out, so DeepSpeed's own methods run), B (on: steps, phases, loss, lr, grad norm, ZeRO facts)
and C (off again: the A/A control). Blocks of `--block` steps rotate in a random order each round,
every block timed with perf_counter_ns (and the training thread's CPU time), as bench_launch.py
does (this VM's speed drifts within seconds). Reported: B/A - 1 and C/A - 1 as ratios of block
sums, with a bootstrap 95 % CI over the rounds, and the median of the rounds' own B/A ratios.

Why one engine: two engines built from the same seeded model differ by one to three percent in
step time on their own (where their tensors landed in memory; measured with `--engines`: a second
plain engine +1.4 % on a quiet machine, -3.0 % on a loaded one), a bias the A/A control of one
engine cannot see. `--engines` adds that control: D, a second plain engine, against A.
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

        before = set(engine.__dict__)
        instrument(engine)
        engine.toggle = Toggle(engine, before)
    return engine


def step(engine: Any, x: Any) -> None:
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def block(engine: Any, x: Any, n: int) -> tuple[int, int]:
    """(wall, training-thread CPU) nanoseconds of n steps."""
    start, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(n):
        step(engine, x)
    return time.perf_counter_ns() - start, time.thread_time_ns() - cpu


class Toggle:
    """Puts the adapter's wrappers on an instrumented engine, or takes them off (DeepSpeed's own
    methods then run): the entries instrument() added to the engine's `__dict__`, found by diff."""

    def __init__(self, engine: Any, before: set[str]) -> None:
        self.engine = engine
        self.wrappers = {
            k: v for k, v in engine.__dict__.items() if k not in before and callable(v) and k != "_otel_train"
        }
        if not {"forward", "backward", "step"} <= set(self.wrappers):
            raise RuntimeError(f"instrument() wrapped {sorted(self.wrappers)}: the bench cannot toggle it")

    def on(self) -> None:
        self.engine.__dict__.update(self.wrappers)

    def off(self) -> None:
        for name in self.wrappers:
            self.engine.__dict__.pop(name, None)


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
    parser.add_argument("--engines", action="store_true", help="also D: a second plain engine vs A")
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
        ms = block(probe, x, 10)[0] / 10 / 1e6
        if ms >= args.step_ms * 0.9 or layers > 4096:
            break
        layers = int(layers * max(1.2, args.step_ms / ms))
    del probe
    engine = build(layers, True)
    toggle: Toggle = engine.toggle
    block(engine, x, 20)  # warm up: optimizer state, the adapter's ZeRO facts
    plain = build(layers, False) if args.engines else None
    loops = ["A", "B", "C"] + (["D"] if plain is not None else [])
    sums: dict[str, list[tuple[int, int]]] = {k: [] for k in loops}
    rng = random.Random(1)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        rng.shuffle(loops)
        for name in loops:
            (toggle.on if name == "B" else toggle.off)()
            sums[name].append(block(plain if name == "D" else engine, x, args.block))
    toggle.on()
    ot.shutdown()
    step_ms = sum(w for w, _ in sums["A"]) / len(sums["A"]) / args.block / 1e6
    print(
        f"layers {layers}, plain step {step_ms:.2f} ms, rounds {len(sums['A'])} of {args.block} steps per loop"
    )
    labels = {"B": "B/A - 1 (adapter)", "C": "C/A - 1 (A/A control)", "D": "D/A - 1 (other engine)"}
    for clock, index in (("wall", 0), ("CPU", 1)):
        for name in [k for k in ("B", "C", "D") if k in sums]:
            pairs = [(p[index], q[index]) for p, q in zip(sums[name], sums["A"], strict=True)]
            ratio = sum(p for p, _ in pairs) / sum(q for _, q in pairs) - 1
            low, high = ci(pairs)
            median = statistics.median(p / q - 1 for p, q in pairs)
            print(
                f"{clock:4s} {labels[name]:24s} {ratio * 100:+.2f} %  95% CI [{low * 100:+.2f}, {high * 100:+.2f}] %"
                f"  median of rounds {median * 100:+.2f} %"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
