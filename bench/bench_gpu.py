"""Step-time overhead of otel_train on a real GPU, side by side in one process.

    python bench/bench_gpu.py [--rounds 5] [--model demo|large|both]

Needs CUDA and an NVIDIA driver. The demo's char transformer trains on the GPU in interleaved rounds:
each round times the same number of optimizer steps under each configuration, with
`torch.cuda.synchronize()` before and after the timed steps only:

- `plain`: the loop with no otel_train calls and no session;
- `hot path`: `ot.step`, four `ot.timer(..., cuda=True)`, `ot.record` of the loss and grad norm
  (tensors), a run directory; no hardware sampling; the adaptive flush cadence (the default);
- `defaults`: the same with hardware telemetry on (real NVML sampling every 5 s): the settings a
  user gets from `ot.init()`;
- `+ watch/50`: defaults and `ot.watch(model, every=50, activations=True)`;
- `flush/10`: defaults with `log_interval=10` (a flush every 10 steps, what the demo used to set):
  the worker's CPU per flush, paid for by a training thread that needs the GIL to launch kernels.

For each instrumented configuration it also prints the worker's CPU per flush and the CPU share of
otel_train's threads during the timed steps. `demo` is the demo's model (4 layers, d_model 128,
batch 32 x 128): a step of a few milliseconds, host-bound, the case where any host-side cost shows.
`large` (12 layers, d_model 1024, batch 16 x 512, bf16 autocast) is GPU-bound. Ratios are the
result; absolute times are context.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

# The repository root: examples/ is not installed, and a script's sys.path starts at bench/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import otel_train as ot
from examples.demo.data import CharVocab, get_batch, load_text, split
from examples.demo.model import CharTransformer, ModelConfig
from otel_train.testing import current_session


@dataclass(frozen=True)
class Shape:
    layers: int
    d_model: int
    heads: int
    batch: int
    context: int
    steps: int  # timed steps per round and configuration
    bf16: bool


SHAPES = {
    "demo": Shape(layers=4, d_model=128, heads=4, batch=32, context=128, steps=150, bf16=False),
    "large": Shape(layers=12, d_model=1024, heads=16, batch=16, context=512, steps=60, bf16=True),
}
# configuration -> ot.init settings (None: no session) and ot.watch's period (0: no watch)
CONFIGS: dict[str, tuple[dict[str, Any] | None, int]] = {
    "plain": (None, 0),
    "hot path": ({"hardware": False}, 0),
    "defaults": ({}, 0),
    "+ watch/50": ({}, 50),
    "flush/10": ({"log_interval": 10}, 0),
}


@dataclass
class Round:
    ms_per_step: float
    flushes: int = 0
    worker_cpu_s: float = 0.0
    threads_cpu_s: float = 0.0  # every otel_train thread, the worker included
    wall_s: float = 0.0


def otel_threads_cpu_s() -> float:
    """CPU seconds (user + system) of this process's otel_train threads."""
    ids = {t.native_id for t in threading.enumerate() if t.name.startswith("otel")}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


class Trainer:
    def __init__(self, shape: Shape) -> None:
        torch.manual_seed(0)
        text = load_text(None, 1_000_000)
        vocab = CharVocab.from_text(text)
        self.data = split(vocab.encode(text))[0]  # on the host, as the demo batches it
        self.shape = shape
        cfg = ModelConfig(
            vocab_size=vocab.size, context=shape.context, n_layer=shape.layers, n_head=shape.heads,
            d_model=shape.d_model,
        )  # fmt: skip
        self.model = CharTransformer(cfg).cuda()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.gen = torch.Generator().manual_seed(0)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.data, self.shape.batch, self.shape.context, self.gen, torch.device("cuda"))

    def plain_step(self) -> None:
        x, y = self.batch()
        with torch.autocast("cuda", torch.bfloat16, enabled=self.shape.bf16):
            _, loss = self.model(x, y)
        assert loss is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def instrumented_step(self, step: int) -> None:
        tokens = self.shape.batch * self.shape.context
        with ot.step(step, tokens=tokens, samples=self.shape.batch):
            with ot.timer("data"):
                x, y = self.batch()
            with (
                ot.timer("forward", cuda=True),
                torch.autocast("cuda", torch.bfloat16, enabled=self.shape.bf16),
            ):
                _, loss = self.model(x, y)
            assert loss is not None
            with ot.timer("backward", cuda=True):
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with ot.timer("optimizer", cuda=True):
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
            ot.record("loss", loss.detach())
            ot.record("grad_norm", grad_norm)


def timed(steps: int, body: Callable[[int], None], first: int) -> float:
    """Milliseconds per step over `steps` steps, the device drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        body(first + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def run_config(trainer: Trainer, config: str, out: str, step0: int) -> Round:
    steps = trainer.shape.steps
    settings, watch_every = CONFIGS[config]
    if settings is None:
        timed(3, lambda _: trainer.plain_step(), 0)
        return Round(timed(steps, lambda _: trainer.plain_step(), 0))
    flops = 6 * sum(p.numel() for p in trainer.model.parameters())
    ot.init(output_dir=out, prometheus_port=0, verbosity=0, flops_per_token=flops, **settings)
    session = current_session()
    assert session is not None
    try:
        if watch_every:
            ot.watch(trainer.model, every=watch_every, activations=True)
        # 3 steps out of the timing: the first step books startup, a watch's first step sets up
        timed(3, trainer.instrumented_step, step0)
        worker = session.worker
        flushes, worker_cpu, threads_cpu = worker.flushes, worker.cpu_s, otel_threads_cpu_s()
        start = time.perf_counter()
        ms = timed(steps, trainer.instrumented_step, step0 + 3)
        return Round(
            ms, worker.flushes - flushes, worker.cpu_s - worker_cpu, otel_threads_cpu_s() - threads_cpu,
            time.perf_counter() - start,
        )  # fmt: skip
    finally:
        ot.shutdown()


def bench(name: str, rounds: int, out: str) -> dict[str, list[Round]]:
    trainer = Trainer(SHAPES[name])
    results: dict[str, list[Round]] = {c: [] for c in CONFIGS}
    step0 = 0
    for r in range(rounds):
        for config in list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS)):
            results[config].append(run_config(trainer, config, out, step0))
            step0 += trainer.shape.steps + 3
    return results


def hot_path_us(steps: int) -> dict[str, float]:
    """Training-thread µs per step of the API alone (empty bodies): `ot.step` with four timers and
    two recorded values, timers on the host clock vs CUDA events, values floats vs CUDA tensors."""
    # a tensor of its own per step and name, as a loop's loss is (one tensor twice is warned about)
    losses = [torch.ones((), device="cuda") for _ in range(steps)]
    norms = [torch.ones((), device="cuda") for _ in range(steps)]
    out: dict[str, float] = {}
    # a flush per 1,000 steps: the adaptive cadence (about once a second) would take more than
    # max_values_per_interval CUDA timers at these step times, and drop the rest
    ot.init(prometheus_port=0, verbosity=0, hardware=False, run_dir_enabled=False, log_interval=1000)
    try:
        for label, cuda in (
            ("empty ot.step", None),
            ("4 host timers, 2 floats", False),
            ("4 CUDA timers, 2 tensors", True),
        ):
            samples = []
            for _ in range(5):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for i in range(steps):
                    with ot.step():
                        if cuda is None:
                            continue
                        for phase in ("data", "forward", "backward", "optimizer"):
                            with ot.timer(phase, cuda=cuda):
                                pass
                        ot.record("loss", losses[i] if cuda else 1.0)
                        ot.record("grad_norm", norms[i] if cuda else 1.0)
                samples.append((time.perf_counter() - start) / steps * 1e6)
            out[label] = statistics.median(samples)
    finally:
        ot.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--model", choices=("demo", "large", "both"), default="both")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs CUDA and an NVIDIA driver")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, otel_train {ot.__version__}")
    print("\n## the API alone, training-thread µs per step (median of 5 x 2,000 steps)")
    for label, us in hot_path_us(2000).items():
        print(f"{label:<28}{us:>8.1f} µs")
    out = tempfile.mkdtemp(prefix="bench-gpu-")
    for name in ("demo", "large") if args.model == "both" else (args.model,):
        shape = SHAPES[name]
        results = bench(name, args.rounds, out)
        base = statistics.median(r.ms_per_step for r in results["plain"])
        print(
            f"\n## {name}: {shape.layers} layers, d_model {shape.d_model}, batch {shape.batch} x {shape.context}"
            f"{', bf16' if shape.bf16 else ''}; {shape.steps} steps per round, median of {args.rounds} rounds"
        )
        print(
            f"{'config':<12}{'ms/step':>9}{'overhead':>10}{'paired':>9}{'flushes':>9}{'worker/flush':>14}"
            f"{'threads CPU':>13}  rounds (ms/step)"
        )
        for config, rounds in results.items():
            med = statistics.median(r.ms_per_step for r in rounds)
            # each round's ratio to the plain run beside it: slow drift of the machine cancels
            paired = statistics.median(
                r.ms_per_step / p.ms_per_step - 1 for r, p in zip(rounds, results["plain"], strict=True)
            )
            flushes = sum(r.flushes for r in rounds)
            per_flush = f"{1e3 * sum(r.worker_cpu_s for r in rounds) / flushes:.1f} ms" if flushes else "-"
            wall = sum(r.wall_s for r in rounds)
            share = f"{100 * sum(r.threads_cpu_s for r in rounds) / wall:.1f} %" if wall else "-"
            print(
                f"{config:<12}{med:>9.3f}{100 * (med - base) / base:>9.1f}%{100 * paired:>8.1f}%{flushes:>9}"
                f"{per_flush:>14}{share:>13}  "
                f"{[round(r.ms_per_step, 2) for r in rounds]}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
