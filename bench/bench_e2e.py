"""End-to-end overhead on the demo's training step, in one process: plain loop vs otel_train.

    .venv/bin/python bench/bench_e2e.py [--batch-size 16] [--pairs 40] [--block 10] [--threads 1]
                                        [--null] [--json PATH]

One seeded model (the demo's: 4 layers, d_model 128, context 128, the stdlib corpus, its optimizer,
LR schedule and grad clipping; batch 16 by default, half the demo's, so ~2 min hold 40 block pairs;
`--batch-size 32` is the demo's) is trained by two loops that share everything but the telemetry,
on one torch thread, fixed seed, warm-up first. A is the demo's loop with no otel_train call at all;
B is the same loop instrumented as the demo does it (`ot.step` with tokens/samples, `ot.timer`
data/forward/backward/optimizer/grad_clip, `ot.record` of the loss and grad_norm tensors and the lr
float) under one `ot.init(...)` session: library defaults (hardware on, run dir on, log_interval),
no bridges, no OTLP (so no span exporter either), no pull endpoint, console quiet. Blocks of A and
B alternate (AB BA AB ...); every step is timed back to back with perf_counter_ns. B's flushes are
phased to land mid-block, so the worker's share of a flush is paid inside B, never in the next A.
The session and its threads live through A too: their idle cost is in both (their CPU is printed).

Overhead = ratio of block means over paired blocks, with a bootstrap 95% CI over the pairs (and
the same from block medians: the typical step, robust to the VM's spikes). `--null` runs the plain
loop as B too (an A/A calibration: its CI shows the resolution of the method on this machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

# The repository root: examples/ is not installed, and a script's sys.path starts at bench/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import otel_train as ot
from examples.demo.data import CharVocab, get_batch, load_text, split
from examples.demo.model import CharTransformer, ModelConfig, flops_per_token
from examples.demo.train import build_parser, lr_at, make_optimizer, seed_everything
from otel_train.testing import current_session

DEMO = build_parser().parse_args([])  # the demo's defaults: model, optimizer, schedule, clipping


@dataclass
class Estimate:
    """B vs A over paired blocks, from one per-block statistic (mean or median step time)."""

    overhead_pct: float  # sum over pairs of B / sum of A, - 1
    ci95_pct: tuple[float, float]  # bootstrap over the pairs
    diff_us: float  # per-step B - A
    ci95_diff_us: tuple[float, float]


@dataclass
class Result:
    null: bool
    threads: int
    pairs: int
    block: int
    batch_size: int
    log_interval: int
    median_a_ms: float
    median_b_ms: float
    overhead_median_pct: float  # median of all B steps / median of all A steps, - 1
    block_means: Estimate  # everything, flush steps and spikes included
    block_medians: Estimate  # the typical step, robust to spikes
    flushes: int
    deferred_flushes: int
    worker_busy_ms_per_flush: float
    worker_behind_at_switch: int
    thread_cpu_s: dict[str, float]
    wall_s: float
    a_block_means_ms: list[float]
    b_block_means_ms: list[float]


class Loop:
    """The demo's model, data and optimizer; one step of A (plain) or B (instrumented)."""

    def __init__(self, args: argparse.Namespace) -> None:
        seed_everything(args.seed)
        text = load_text(None, DEMO.max_chars)
        vocab = CharVocab.from_text(text)
        self.data, _ = split(vocab.encode(text), val_fraction=0.1)
        self.cfg = ModelConfig(
            vocab_size=vocab.size, context=DEMO.context, n_layer=DEMO.layers, n_head=DEMO.heads,
            d_model=DEMO.d_model, tie_weights=not DEMO.untied,
        )  # fmt: skip
        self.model = CharTransformer(self.cfg)
        self.fpt = flops_per_token(self.cfg, self.model.num_params(non_embedding=True))
        self.optimizer = make_optimizer(self.model, DEMO.lr, DEMO.weight_decay, torch.device("cpu"))
        self.gen = torch.Generator().manual_seed(args.seed)
        self.batch, self.context, self.total = args.batch_size, DEMO.context, args.total_steps
        self.loss_sum = torch.zeros(())
        self.it = 0  # global iteration (lr schedule), shared by A and B
        self.b_index = 0  # B's own step index: trace sampling and flush cadence as in a plain run
        self.model.train()

    def _set_lr(self) -> float:
        lr = lr_at(self.it, DEMO.lr, DEMO.warmup, self.total, DEMO.min_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.it += 1
        return lr

    def plain(self) -> None:
        self._set_lr()
        x, y = get_batch(self.data, self.batch, self.context, self.gen)
        _, loss = self.model(x, y)
        assert loss is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), DEMO.grad_clip)
        self.optimizer.step()
        self.loss_sum += loss.detach()

    def instrumented(self) -> None:
        lr = self._set_lr()
        with ot.step(self.b_index, tokens=self.batch * self.context, samples=self.batch):
            with ot.timer("data"):
                x, y = get_batch(self.data, self.batch, self.context, self.gen)
            with ot.timer("forward"):
                _, loss = self.model(x, y)
                assert loss is not None
            with ot.timer("backward"):
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with ot.timer("optimizer"):
                with ot.timer("grad_clip", level=2):
                    grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), DEMO.grad_clip)
                self.optimizer.step()
            loss = loss.detach()
            ot.record("loss", loss)
            ot.record("lr", lr)
            ot.record("grad_norm", grad_norm)
        self.loss_sum += loss
        self.b_index += 1


def timed_block(step: Callable[[], None], n: int) -> list[int]:
    """Per-step nanoseconds of n consecutive steps (back-to-back stamps: nothing falls between)."""
    stamps = [time.perf_counter_ns()]
    for _ in range(n):
        step()
        stamps.append(time.perf_counter_ns())
    return [b - a for a, b in itertools.pairwise(stamps)]


def estimate(pairs: list[tuple[float, float]], resamples: int, seed: int) -> Estimate:
    """Point estimate and bootstrap 95% CIs (resampling the pairs) of B/A - 1 and B - A, in ns."""
    rng = random.Random(seed)
    n = len(pairs)
    ratios, diffs = [], []
    for _ in range(resamples):
        sample = [pairs[rng.randrange(n)] for _ in range(n)]
        a, b = sum(p[0] for p in sample), sum(p[1] for p in sample)
        ratios.append(100 * (b / a - 1.0))
        diffs.append((b - a) / n / 1e3)
    ratios.sort()
    diffs.sort()
    lo, hi = int(0.025 * resamples), int(0.975 * resamples) - 1
    a, b = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return Estimate(100 * (b / a - 1.0), (ratios[lo], ratios[hi]), (b - a) / n / 1e3, (diffs[lo], diffs[hi]))


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's named Python threads, by name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    return {names[t.id]: t.user_time + t.system_time for t in psutil.Process().threads() if t.id in names}


def run(args: argparse.Namespace) -> Result:
    torch.set_num_threads(args.threads)
    loop = Loop(args)
    out = tempfile.TemporaryDirectory(prefix="bench_e2e-")  # the run dir (JSONL per flush) goes here
    settings: dict[str, Any] = dict(
        run_name="bench-e2e", output_dir=out.name, otlp_endpoint=None, prometheus_port=0, console_exporter=False,
        verbosity=0, progress_bar=False, tensorboard=False, wandb=False, mlflow=False, hardware=True,
        total_steps=args.total_steps, flops_per_token=loop.fpt,
        log_interval=args.log_interval,  # fixed, so B's flushes can be phased to land mid-block
    )  # fmt: skip
    with out, ot.init(**settings):
        session = current_session()  # the internals: the worker's counters, the meter
        assert session is not None
        interval = session.config.log_interval
        if args.block % interval:
            raise SystemExit(f"--block ({args.block}) must be a multiple of log_interval ({interval})")
        step_b = loop.plain if args.null else loop.instrumented  # --null: an A/A calibration run
        timed_block(loop.plain, args.warmup)
        timed_block(step_b, args.warmup)
        while not args.null and session.interval_steps != interval // 2:  # flushes land mid-block
            loop.instrumented()
        cpu0, flushes0, busy0 = thread_cpu(), session.worker.flushes, session.worker.busy_s
        expected, behind = flushes0, 0
        start = time.perf_counter()
        a_blocks: list[list[int]] = []
        b_blocks: list[list[int]] = []
        for i in range(args.pairs):
            for kind in "AB" if i % 2 == 0 else "BA":
                if kind == "A":
                    a_blocks.append(timed_block(loop.plain, args.block))
                else:
                    b_blocks.append(timed_block(step_b, args.block))
                    expected += 0 if args.null else args.block // interval
                    behind += session.worker.flushes < expected  # worker still on this block's flush
        wall = time.perf_counter() - start
        flushes = session.worker.flushes - flushes0
        busy = session.worker.busy_s - busy0
        cpu1 = thread_cpu()
        deferred = session.deferred_flushes
    cpu = {name: cpu1[name] - cpu0.get(name, 0.0) for name in cpu1 if name != "MainThread"}

    a_all = [ns for blk in a_blocks for ns in blk]
    b_all = [ns for blk in b_blocks for ns in blk]
    means = [(statistics.fmean(a), statistics.fmean(b)) for a, b in zip(a_blocks, b_blocks, strict=True)]
    medians = [(statistics.median(a), statistics.median(b)) for a, b in zip(a_blocks, b_blocks, strict=True)]
    med_a, med_b = statistics.median(a_all), statistics.median(b_all)
    return Result(
        null=args.null,
        threads=args.threads,
        pairs=args.pairs,
        block=args.block,
        batch_size=args.batch_size,
        log_interval=interval,
        median_a_ms=med_a / 1e6,
        median_b_ms=med_b / 1e6,
        overhead_median_pct=100 * (med_b / med_a - 1),
        block_means=estimate(means, args.resamples, args.seed),
        block_medians=estimate(medians, args.resamples, args.seed),
        flushes=flushes,
        deferred_flushes=deferred,
        worker_busy_ms_per_flush=1e3 * busy / max(1, flushes),
        worker_behind_at_switch=behind,
        thread_cpu_s={k: round(v, 3) for k, v in cpu.items()},
        wall_s=wall,
        a_block_means_ms=[round(a / 1e6, 3) for a, _ in means],
        b_block_means_ms=[round(b / 1e6, 3) for _, b in means],
    )


def report(r: Result) -> None:
    print(
        f"demo model, batch {r.batch_size} x {DEMO.context}, {r.threads} torch thread(s); {r.pairs} pairs of "
        f"{r.block}-step blocks (AB BA ...), log_interval {r.log_interval}; {r.wall_s:.0f} s measured"
        + ("  [--null: B is the plain loop too]" if r.null else "")
    )
    print(
        f"{'':32}{'A plain':>10}{'B plain' if r.null else 'B otel_train':>14}{'B/A - 1':>10}{'95% CI':>18}{'B - A /step':>15}{'95% CI':>20}"
    )
    print(f"{'median step (ms)':32}{r.median_a_ms:10.3f}{r.median_b_ms:14.3f}{r.overhead_median_pct:+9.2f}%")
    for label, e in (("ratio of block means", r.block_means), ("ratio of block medians", r.block_medians)):
        ci = f"[{e.ci95_pct[0]:+.2f}, {e.ci95_pct[1]:+.2f}]%"
        ci_us = f"[{e.ci95_diff_us[0]:+.0f}, {e.ci95_diff_us[1]:+.0f}] µs"
        print(f"{label:56}{e.overhead_pct:+9.2f}%{ci:>18}{e.diff_us:+12.0f} µs{ci_us:>20}")
    per_step_us = 1e3 * r.worker_busy_ms_per_flush / r.log_interval
    print(
        f"flushes {r.flushes} (deferred {r.deferred_flushes}); worker {r.worker_busy_ms_per_flush:.2f} ms/flush "
        f"(= {per_step_us:.0f} µs per B step), still busy at {r.worker_behind_at_switch}/{r.pairs} B block ends"
    )
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.thread_cpu_s.items()))
    print(f"background thread CPU during the measurement (s, 10 ms ticks): {cpu}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--pairs", type=int, default=40, help="A/B block pairs")
    parser.add_argument("--block", type=int, default=10, help="steps per block (multiple of log_interval)")
    parser.add_argument("--log-interval", type=int, default=10, help="steps per flush (the demo's)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps of A, then of B")
    parser.add_argument(
        "--batch-size", type=int, default=16, help=f"sequences per step (demo: {DEMO.batch_size})"
    )
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--null", action="store_true", help="A/A calibration: B runs the plain loop too")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.pairs < 2 or args.block < 1 or args.warmup < 0:
        parser.error("need --pairs >= 2, --block >= 1, --warmup >= 0")
    args.total_steps = 2 * args.pairs * args.block + 3 * args.warmup
    result = run(args)
    report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
