"""Overhead on a launch-bound loop: many tiny torch ops per step, one torch thread, the Python
thread holding the GIL nearly all the time (a small model on a GPU looks like this to Python).

    .venv/bin/python bench/bench_launch.py [--step-ms 5 10 30] [--configs defaults tensorboard ...]
                                           [--seconds 40] [--quick] [--preset 2ms|10ms] [--keeping]
                                           [--json PATH]

The ~2 ms set (defaults, watch, all bridges, fr, fr-own; ~15 min at 120 s a row, a quarter more
with `--keeping`), in one command:

    .venv/bin/python bench/bench_launch.py --preset 2ms --seconds 120 --json /tmp/launch-2ms.json

and the ~10 ms set the same way with `--preset 10ms`.

Each (step time, configuration) runs in a fresh child process of this script, so sessions, bridge
processes and imports never leak from one measurement into the next. Inside it, four loops share
one seeded model: A (no otel_train call), B (the same step instrumented like the README: `ot.step`,
4 timers, the loss tensor and the lr float recorded), N (B's code with an API that does nothing:
the floor that five `with` blocks, two calls and the loss's `detach()` cost any instrumentation of
this shape) and C (A again: the A/A control). Blocks of ~10 ms of steps (`fine_block`) rotate
(in a random order each round), every step timed back to back with perf_counter_ns: this VM's speed drifts by
2x within seconds, which blocks of a second or more (one flush each) could not resolve (A/A pairs of
600-step blocks moved +-8 %, of 5-step blocks +-0.45 %, in 60 s). Ratios of block sums, with a
bootstrap 95% CI over the block pairs: B/A - 1 (what the user sees), C/A - 1 (the resolution of the
method at that moment), N/A - 1 (the shape's floor) and B/N - 1 (otel_train above that floor). Below
each row, the median of the block pairs' own ratios (B/A and A/A), the statistic issue #32 names.

`--keeping` adds a fifth loop, K: B's code with the cheapest API that keeps what it records (both
clock readings of each block, the step's numbers and the values, in lists dropped every flush
interval; no worker, no checks). K/A - 1 is what keeping the data costs this loop at all; B/K - 1 is otel_train above that.
It adds a sixth loop too, F: B's code with an API made of C only (each `ot.step` and `ot.timer` a new
`_thread.RLock`, whose `__enter__`/`__exit__` are C; `ot.record` a C `dict.__setitem__`), keeping
nothing: F/A - 1 is the floor of this loop's shape even for an API written in C (issue #32: a C
hot path could not go below it).

Short blocks spread the work of otel_train's own threads (the worker's flush, the hardware sampler,
the watchdog) over all four loops, so `threads` adds their whole CPU time, as if every microsecond
of it held the GIL against training: the worker's as a share of the B blocks' time (B steps cause
its flushes), the periodic threads' as a share of the run's. A flush that B's step sets off runs
during the blocks after it, mostly the other loops' (a fixed rotation ABNC BNCA ... put it in N's
nearly always: earlier figures' N/A carried the flushes and B/N missed them), so B/A - 1 is the
training thread's cost and `bound` = B/A - 1 + threads an upper bound on otel_train's. The flush
interval is the one the library's adaptive cadence settles on while B runs alone before the
measurement (`settle_cadence`), then frozen.

Configurations: `defaults` (library defaults: run dir, hardware sampler, adaptive cadence; no OTLP
endpoint, no pull endpoint, console quiet), `tensorboard`, `wandb` (offline), `mlflow` (local
store), each alone on top of the defaults, `all` (the three bridges), and `watch` (the defaults
plus `ot.watch(model)` at its default cadence: per-layer norms, the batch fingerprint, and the
checks that read them: gradient flow, unsharded data, replica divergence). Reported beside the
ratios: flushes, the worker thread's CPU per flush (time.thread_time inside the worker) and the
bridge process's CPU per flush (psutil on the child process, when bridges run there: another
process, it never holds the training process's GIL).

`--device cuda` runs the loop on the GPU (each op a kernel launch: the launch-bound case of a small
model on a fast GPU), B's forward, backward and optimizer timers with CUDA events
(`ot.timer(..., cuda=True)`), and every block ends with `torch.cuda.synchronize()` before its last
reading, so a block's sum holds the device's queued work; the `fr` configurations stay on the host.

The step time is reached by calibration: the number of passes over the 8 tiny layers is scaled
until a plain step takes `--step-ms` (each op is a few microseconds of dispatch, so ~2 ms is a few
hundred ops on a 2-core VM, 60 on a fast core); the row's `ops` column is the resulting ops per step.

Collectives (issue #26 item 5): both `fr` configurations run a 1-rank gloo process group and one
tiny `all_reduce` per step (inside the backward timer, where DDP's would be). `fr`: PyTorch's Flight
Recorder on (`TORCH_FR_BUFFER_SIZE=2000`) in A, B and C, so B/A - 1 is otel_train's cost with the
Flight Recorder on, collective telemetry included: with one rank otel_train does not start its
collective monitor by itself, so the bench attaches the same `collectives.start_monitor` a rank of
a distributed job runs. Its reads of the recorder are budgeted in wall time (at most 0.2 % of it),
so `threads` counts their CPU as a share of the run's time, like the periodic threads'. `fr-own`: the Flight Recorder's own cost, without otel_train; the recorder
is set once per process, so processes alternate instead of blocks: per round one process with it
off (A: `TORCH_FR_BUFFER_SIZE=0`, since torch 2.13 records by default), one with it on (B) and one
off again (C, the A/A control), in rotating order, each timing
plain blocks only, with the step calibrated once and reused by all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "tensorboard": {"tensorboard": True},
    "wandb": {"wandb": True, "wandb_mode": "offline"},
    "mlflow": {"mlflow": True},
    "all": {"tensorboard": True, "wandb": True, "wandb_mode": "offline", "mlflow": True},
    "watch": {},
    "fr": {},
    "fr-own": {},  # no otel_train: the Flight Recorder's own cost (measure_fr_own)
}
WATCHED = frozenset({"watch"})  # configurations that also call ot.watch(model.net)
COLLECTIVE = frozenset({"fr"})  # a 1-rank gloo group, the Flight Recorder on, an all_reduce per step
FR_BUFFER = "2000"  # TORCH_FR_BUFFER_SIZE, as collectives.TORCH_DEFAULT_BUFFER
PRESETS = {"2ms": 2.0, "10ms": 10.0}  # --preset: that step time, defaults watch all fr fr-own


class LaunchBoundModel:
    """`depth` tiny layers applied `repeats` times: every op is a few microseconds of dispatch."""

    def __init__(self, ops_per_step: int, seed: int = 0, device: str = "cpu") -> None:
        import torch

        torch.manual_seed(seed)
        self.torch = torch
        # on a GPU: every op a kernel launch, the phases timed with CUDA events (ot.timer(cuda=True))
        # and a block's end waits for the device, so a block's time is its steps' whole time
        self.cuda = device == "cuda"
        self.sync: Callable[[], None] | None = torch.cuda.synchronize if self.cuda else None
        self.layers = [torch.nn.Linear(16, 16, device=device) for _ in range(8)]
        self.net = stack_module(self)  # the same layers as one module (what ot.watch is given)
        self.params = [p for layer in self.layers for p in layer.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=1e-3)
        self.x = torch.randn(4, 16, device=device)
        # forward: 2 ops per layer; backward about 2x; optimizer: one per parameter (foreach off)
        self.passes = max(1, ops_per_step // (6 * len(self.layers)))
        self.lr = 1e-3
        self.collective: Callable[[], None] | None = None  # one all_reduce per step (fr configurations)

    def ops_per_step(self) -> int:
        """Torch ops a plain step dispatches (about: linear + tanh forward, twice that backward, the
        loss, one optimizer op per parameter)."""
        return 6 * len(self.layers) * self.passes + 3 + len(self.params)

    def data(self) -> Any:
        return self.x + 0.0

    def forward(self, x: Any) -> Any:
        return self.net(x)

    def layer_passes(self, x: Any) -> Any:
        for _ in range(self.passes):
            for layer in self.layers:
                x = self.torch.tanh(layer(x))
        return (x * x).mean()

    def backward(self, loss: Any) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.collective is not None:
            self.collective()

    def optimize(self) -> None:
        self.opt.step()

    def plain(self) -> None:
        x = self.data()
        loss = self.forward(x)
        self.backward(loss)
        self.optimize()

    def instrumented(self, ot: Any, index: int) -> None:
        with ot.step(index, tokens=64, samples=4):
            with ot.timer("data"):
                x = self.data()
            with ot.timer("forward", cuda=self.cuda):
                loss = self.forward(x)
            with ot.timer("backward", cuda=self.cuda):
                self.backward(loss)
            with ot.timer("optimizer", cuda=self.cuda):
                self.optimize()
            ot.record("loss", loss.detach())
            ot.record("lr", self.lr)


class NullScope:
    """A `with` block that does nothing."""

    def __enter__(self) -> NullScope:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class NullApi:
    """`ot.step`, `ot.timer` and `ot.record` doing nothing: the floor any API of this shape costs
    the instrumented loop (its calls, five `with` blocks, the loss's detach), otel_train or not."""

    scope = NullScope()

    def step(self, index: int, tokens: int, samples: int) -> NullScope:
        return self.scope

    def timer(self, name: str, cuda: bool = False) -> NullScope:
        return self.scope

    def record(self, name: str, value: Any) -> None:
        return None


NULL_API = NullApi()


class CFloorApi:
    """`ot.step`, `ot.timer` and `ot.record` as C calls returning C context managers, keeping
    nothing: `--keeping`'s F loop, the floor of this loop's shape for an API written in C."""

    def __init__(self) -> None:
        import _thread

        self.last: dict[str, Any] = {}
        self.step = _thread.RLock  # RLock(index, tokens=, samples=): its constructor ignores them
        self.timer = _thread.RLock
        self.record = self.last.__setitem__


class KeepingScope:
    """A `with` block that keeps its name and both clock readings, as a timer's end does."""

    __slots__ = ("events", "name", "start")

    def __enter__(self) -> KeepingScope:
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.append((self.name, self.start, time.perf_counter_ns()))


class KeepingStepScope:
    """A step that keeps (index, start, end, tokens, samples, failed), as `ot.step`'s end does."""

    __slots__ = ("events", "index", "samples", "start", "tokens")

    def __enter__(self) -> KeepingStepScope:
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        end = time.perf_counter_ns()
        self.events.append((self.index, self.start, end, self.tokens, self.samples, exc_type is not None))


class KeepingApi:
    """`ot.step`, `ot.timer` and `ot.record` reduced to what any API that records this loop must
    do: read the clock at both ends of each block and keep the readings, the step's numbers and the
    values until a flush, here every `interval` steps, dropped (no worker, no checks, no hand-off):
    `--keeping`'s K loop, the floor of an API that keeps its data."""

    def __init__(self, interval: int) -> None:
        self.interval, self.steps = interval, 0
        self.events: list[tuple[str, int, int]] = []
        self.steps_kept: list[tuple[int, int, int, int, int, bool]] = []
        self.values: dict[str, list[Any]] = {}

    def _scope(self, name: str) -> KeepingScope:
        scope = KeepingScope()
        scope.events, scope.name = self.events, name
        return scope

    def step(self, index: int, tokens: int, samples: int) -> KeepingStepScope:
        self.steps += 1
        if self.steps >= self.interval:  # the "flush": a fresh interval
            self.events, self.steps_kept, self.values, self.steps = [], [], {}, 0
        scope = KeepingStepScope()
        scope.events, scope.index, scope.tokens, scope.samples = self.steps_kept, index, tokens, samples
        return scope

    def timer(self, name: str, cuda: bool = False) -> KeepingScope:
        return self._scope(name)

    def record(self, name: str, value: Any) -> None:
        values = self.values.get(name)
        if values is None:
            values = self.values[name] = []
        values.append(value)


def stack_module(model: LaunchBoundModel) -> Any:
    """An nn.Module over the model's layers whose forward is the model's layer passes."""
    import torch

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(model.layers)

        def forward(self, x: Any) -> Any:
            return model.layer_passes(x)

    return Stack()


def timed_block(step: Callable[[], None], n: int, sync: Callable[[], None] | None = None) -> list[int]:
    """Each step's nanoseconds; `sync` (the device's) before the last reading, whose step then
    holds the device's queued work."""
    stamps = [time.perf_counter_ns()]
    for _ in range(n):
        step()
        stamps.append(time.perf_counter_ns())
    if sync is not None:
        sync()
        stamps[-1] = time.perf_counter_ns()
    return [b - a for a, b in itertools.pairwise(stamps)]


def estimate(pairs: list[tuple[float, float]], resamples: int, seed: int) -> dict[str, Any]:
    """B/A - 1 in % over paired blocks (ratio of their sums: the flushes' rare slow blocks count in
    full), with a bootstrap 95% CI (resampling the pairs); and `median`, the median of the pairs'
    own ratios (issue #32's acceptance reads that one: it leaves the rare slow blocks out)."""
    rng = random.Random(seed)
    n = len(pairs)
    ratios = []
    for _ in range(resamples):
        sample = [pairs[rng.randrange(n)] for _ in range(n)]
        ratios.append(100 * (sum(p[1] for p in sample) / sum(p[0] for p in sample) - 1.0))
    ratios.sort()
    point = 100 * (sum(p[1] for p in pairs) / sum(p[0] for p in pairs) - 1.0)
    median = 100 * (statistics.median([b / a for a, b in pairs]) - 1.0)
    return {
        "pct": point,
        "ci95": (ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]),
        "median": median,
    }


CALIBRATION_S = 3.0  # the last calibration round's length: this VM's speed drifts 2x within seconds


def calibrate(model: LaunchBoundModel, target_ms: float) -> None:
    """Scale the number of passes so a plain step takes about target_ms: three quick rounds, then
    one over CALIBRATION_S (a 20-step median landed anywhere from 5 to 13.5 ms for "10 ms")."""
    for steps in (20, 20, 20, max(20, round(CALIBRATION_S * 1e3 / target_ms))):
        timed_block(model.plain, 5, model.sync)
        ms = statistics.median(timed_block(model.plain, steps, model.sync)) / 1e6
        model.passes = max(1, round(model.passes * target_ms / ms))


def start_collective(model: LaunchBoundModel, directory: str, flight_recorder: bool) -> None:
    """A 1-rank gloo process group, the Flight Recorder on or off (torch reads it once per process,
    when the first group is created; torch 2.13's is on unless the variable is 0, so "off" sets
    0: earlier fr-own runs that only unset it compared the recorder with itself), and one tiny
    all_reduce per step."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ.pop(name, None)
    os.environ["TORCH_FR_BUFFER_SIZE"] = FR_BUFFER if flight_recorder else "0"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{directory}/pg", rank=0, world_size=1)
    tiny = model.torch.zeros(4)
    model.collective = lambda: dist.all_reduce(tiny)


FINE_BLOCK_MS = 10.0  # A, B, N and C alternate this often: the VM's speed drifts 2x within seconds


def fine_block(step_ms: float) -> int:
    """Steps per block: ~10 ms of steps, at least 2 (measured here: A/A pairs of 5-step blocks at
    2 ms resolve +-0.45 % in 60 s where 600-step blocks resolve +-8 %)."""
    return max(2, round(FINE_BLOCK_MS / step_ms))


SETTLE_FLUSHES = 5  # flushes of B alone before measuring: the adaptive cadence's interval settles
SETTLE_MAX_S = 60.0


def settle_cadence(session: Any, step_b: Callable[[], None], step_ms: float) -> None:
    """Run B alone until the adaptive cadence has chosen its interval (SETTLE_FLUSHES flushes),
    then freeze it: interleaved with A, N and C, B's steps come at a quarter of their rate, and the
    cadence, which counts wall time per step, would flush four times as often per B step."""
    worker, deadline = session.worker, time.monotonic() + SETTLE_MAX_S
    while worker.flushes < SETTLE_FLUSHES and time.monotonic() < deadline:
        timed_block(step_b, warmup_steps(step_ms))
    session.cadence.adaptive = False


def warmup_steps(step_ms: float) -> int:
    return max(20, int(1200 / step_ms))  # >= 1.2 s: the first flushes happen before measuring


class ThreadTimed:
    """A flush listener that counts the CPU time (of the worker thread) `listener` takes."""

    def __init__(self, listener: Any) -> None:
        self.listener, self.cpu_s = listener, 0.0

    def on_flush(self, interval: Any) -> None:
        started = time.thread_time()
        try:
            self.listener.on_flush(interval)
        finally:
            self.cpu_s += time.thread_time() - started

    def close(self) -> None:
        self.listener.close()


def background_cpu_ns() -> tuple[int, int]:
    """CPU time (Linux schedstat, ns) of this process's Python threads other than the calling
    (training) one: (the worker, whose flushes the B steps cause; the others: the hardware sampler,
    the watchdog, the control poller, which run on a wall-clock period whatever the loop does)."""
    import threading

    me = threading.get_native_id()
    worker = others = 0
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None or tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                used = int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended
        if thread.name == "otel_train-worker":
            worker += used
        else:
            others += used
    return worker, others


def measure_fr_own(
    step_ms: float, flight_recorder: bool, seconds: float, seed: int, passes: int
) -> dict[str, Any]:
    """fr-own, one process: plain blocks (no otel_train) with one all_reduce per step, the Flight
    Recorder on or off; `passes` 0: calibrate (the first process; the others reuse its passes)."""
    import torch

    torch.set_num_threads(1)
    model = LaunchBoundModel(300, seed)
    out = tempfile.TemporaryDirectory(prefix="bench_launch-")
    with out:
        start_collective(model, out.name, flight_recorder)
        if passes:
            model.passes = passes
        else:
            calibrate(model, step_ms)
        block = warmup_steps(step_ms)  # whole processes alternate: blocks this long are enough
        timed_block(model.plain, block)  # warm-up
        means = [
            statistics.fmean(timed_block(model.plain, block))
            for _ in range(max(2, int(seconds * 1000 / step_ms / block)))
        ]
        torch.distributed.destroy_process_group()
    return {"passes": model.passes, "ops": model.ops_per_step(), "means": means}


def measure(
    step_ms: float,
    config: str,
    seconds: float,
    seed: int,
    resamples: int,
    keeping: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """One configuration at one step time (runs in its own process); `keeping`: a fifth loop, K."""
    import psutil
    import torch

    import otel_train as ot
    from otel_train.testing import current_session

    torch.set_num_threads(1)
    model = LaunchBoundModel(300, seed, device)
    out = tempfile.TemporaryDirectory(prefix="bench_launch-")
    if config in COLLECTIVE:
        start_collective(model, out.name, flight_recorder=True)
    calibrate(model, step_ms)
    os.environ.setdefault("WANDB_SILENT", "true")
    settings: dict[str, Any] = dict(
        run_name=f"launch-{config}", output_dir=out.name, prometheus_port=0, verbosity=0, progress_bar=False,
    )  # fmt: skip
    settings.update(CONFIGS[config])
    block = fine_block(step_ms)
    rounds = max(2, int(seconds * 1000 / step_ms / block / 4))
    index = itertools.count()
    with out, ot.init(**settings):
        session = current_session()  # the internals: the worker's counters, the meter
        assert session is not None
        if config in WATCHED:
            ot.watch(model.net)
        if config in COLLECTIVE:  # one rank: attach the monitor every rank of a distributed job runs
            from otel_train.diagnostics.collectives import start_monitor

            monitor = start_monitor(session.meter, None, 0)
            if monitor is None:
                raise SystemExit("the Flight Recorder did not start")
            timed_monitor = ThreadTimed(monitor)
            session.worker.add_listener(timed_monitor)
        worker = session.worker
        bridge_pid = session.bridges.pid if getattr(session, "bridges", None) is not None else None
        child = psutil.Process(bridge_pid) if bridge_pid else None

        def step_b() -> None:
            model.instrumented(ot, next(index))

        timed_block(model.plain, warmup_steps(step_ms), model.sync)
        settle_cadence(session, step_b, step_ms)
        if child is not None:  # wait for the bridges' one-off set-up (imports, run creation) to end
            deadline, last = time.monotonic() + 120, sum(child.cpu_times()[:2])
            while time.monotonic() < deadline:
                time.sleep(1.0)
                now = sum(child.cpu_times()[:2])
                if now - last < 0.05:
                    break
                last = now
        time.sleep(0.5)
        flushes0, cpu0 = worker.flushes, getattr(worker, "cpu_s", 0.0)
        monitor_cpu0 = timed_monitor.cpu_s if config in COLLECTIVE else 0.0
        child_cpu0 = sum(child.cpu_times()[:2]) if child else 0.0
        background0 = background_cpu_ns()
        loops = {
            "A": model.plain,
            "B": step_b,
            "N": lambda: model.instrumented(NULL_API, 0),
            "C": model.plain,
        }
        if keeping:  # the cheapest API that keeps what B keeps, flushed as often
            keeping_api = KeepingApi(session.cadence.interval or 1000)
            loops["K"] = lambda: model.instrumented(keeping_api, 0)
            c_floor = CFloorApi()
            loops["F"] = lambda: model.instrumented(c_floor, 0)
        sums: dict[str, list[int]] = {kind: [] for kind in loops}
        start = time.perf_counter()
        order, shuffle = list(loops), random.Random(seed).shuffle
        for _ in range(rounds):
            shuffle(order)  # a random order per round: a fixed rotation always put N after B,
            for kind in order:  # and with it the flush B's last step set off
                sums[kind].append(sum(timed_block(loops[kind], block, model.sync)))
        wall = time.perf_counter() - start
        background = background_cpu_ns()  # before the wait: the last flush's work
        # belongs to B steps, but so does the first one's, which began before the window
        time.sleep(0.3)  # let the last flush finish before reading the worker's CPU
        flushes = worker.flushes - flushes0
        worker_cpu = getattr(worker, "cpu_s", 0.0) - cpu0
        monitor_ns = 1e9 * (timed_monitor.cpu_s - monitor_cpu0) if config in COLLECTIVE else 0.0
        child_cpu = (sum(child.cpu_times()[:2]) - child_cpu0) if child else 0.0
        interval = session.cadence.interval
    if config in COLLECTIVE:
        torch.distributed.destroy_process_group()
    b_time_s = sum(sums["B"]) / 1e9
    b_vs_a = estimate(list(zip(sums["A"], sums["B"], strict=True)), resamples, seed)
    b_vs_n = estimate(list(zip(sums["N"], sums["B"], strict=True)), resamples, seed)
    # the worker's CPU over the B blocks' time (B steps cause its flushes), the periodic threads'
    # over the whole run's (they run every few seconds whatever the loop is doing), and so the
    # Flight Recorder's reads (on the worker, but at most so often in wall time: MAX_READ_SHARE)
    worker_ns, others_ns = (after - before for after, before in zip(background, background0, strict=True))
    worker_ns, others_ns = worker_ns - monitor_ns, others_ns + monitor_ns
    background_pct = 100 * (worker_ns / 1e9 / b_time_s + others_ns / 1e9 / wall)
    return {
        "step_ms": step_ms,
        "config": config,
        "plain_step_ms": sum(sums["A"]) / len(sums["A"]) / block / 1e6,
        "ops": model.ops_per_step(),
        "rounds": rounds,
        "block": block,
        "wall_s": wall,
        "b_vs_a": b_vs_a,
        "c_vs_a": estimate(list(zip(sums["A"], sums["C"], strict=True)), resamples, seed),
        # the instrumented loop's own shape (5 with blocks, 2 calls, the loss's detach) with an API
        # that does nothing, and otel_train's cost above that floor
        "n_vs_a": estimate(list(zip(sums["A"], sums["N"], strict=True)), resamples, seed),
        "b_vs_n": b_vs_n,
        # otel_train's own threads' CPU (above), all of it counted as taken from training (GIL
        # held throughout): the flushes B's steps set off land mostly in the other loops' blocks,
        # so B/A holds the training thread's cost and this the threads'; their sum is the bound
        "background_pct": background_pct,
        "bound_pct": b_vs_a["pct"] + background_pct,
        "flushes": flushes,
        "flush_interval_steps": interval,
        "worker_ms_per_flush": 1e3 * worker_cpu / max(1, flushes),
        "bridge_ms_per_flush": 1e3 * child_cpu / max(1, flushes) if child else None,
        # --keeping: the cheapest API that keeps the data (K/A - 1) and otel_train above it; an API
        # of C calls and C with-blocks keeping nothing (F/A - 1) and otel_train above that
        **{
            f"{second.lower()}_vs_{first.lower()}": (
                estimate(list(zip(sums[first], sums[second], strict=True)), resamples, seed)
                if keeping
                else None
            )
            for first, second in (("A", "K"), ("K", "B"), ("A", "F"), ("F", "B"))
        },
    }


def report(r: dict[str, Any]) -> str:
    def pct(e: dict[str, Any] | None) -> str:
        return f"{e['pct']:+6.2f}% [{e['ci95'][0]:+.2f}, {e['ci95'][1]:+.2f}]" if e else "-"

    def share(value: float | None) -> str:
        return f"{value:+6.2f}%" if value is not None else "-"

    bridge = f"{r['bridge_ms_per_flush']:.2f}" if r["bridge_ms_per_flush"] is not None else "-"
    return (
        f"{r['step_ms']:>5.0f} ms {r['config']:<8} {r['plain_step_ms']:7.2f} {r['ops']:>5} {r['block']:>5}  "
        f"{pct(r['b_vs_a']):>26}  {pct(r['c_vs_a']):>26}  {pct(r.get('n_vs_a')):>26}  "
        f"{pct(r.get('b_vs_n')):>26}  {share(r['background_pct']):>8} {share(r['bound_pct']):>8}  "
        f"{r['flushes']:>4} {r['flush_interval_steps'] or '-'!s:>5} {r['worker_ms_per_flush']:8.2f} {bridge:>8}"
    )


HEADER = (
    f"{'step':>8} {'config':<8} {'A (ms)':>7} {'ops':>5} {'block':>5}  {'B/A - 1 [95% CI]':>26}  "
    f"{'A/A control C/A - 1':>26}  {'no-op API N/A - 1':>26}  {'otel_train B/N - 1':>26}  "
    f"{'threads':>8} {'bound':>8}  {'fl.':>4} {'every':>5} {'wrk ms/fl':>8} {'brg ms/fl':>8}"
)


FR_OWN_ROUNDS = 3


def run_child(args: list[str]) -> dict[str, Any] | str:
    """Run this script with `args` in a fresh process: its RESULT, or the end of its stderr."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    return json.loads(line[len("RESULT ") :]) if line is not None else proc.stderr.strip()[-800:]


def fr_own(step_ms: float, seconds: float, seed: int, resamples: int) -> dict[str, Any] | str:
    """The Flight Recorder's own cost: rounds of three processes (off, on, off again) in rotating
    order, the first calibrating the step; blocks are paired by position within a round."""
    share = seconds / (3 * FR_OWN_ROUNDS)
    passes = 0
    got: dict[str, list[dict[str, Any]]] = {"A": [], "B": [], "C": []}
    for i in range(FR_OWN_ROUNDS):
        for kind in "ABCABC"[i % 3 : i % 3 + 3]:
            mode = "on" if kind == "B" else "off"
            args = [
                "--fr-own-child",
                mode,
                str(step_ms),
                str(passes),
                "--seconds",
                str(share),
                "--seed",
                str(seed),
            ]
            result = run_child(args)
            if isinstance(result, str):
                return result
            passes = result["passes"]
            got[kind].append(result)
    pairs: dict[str, list[tuple[float, float]]] = {
        kind: [
            pair
            for a, x in zip(got["A"], got[kind], strict=True)
            for pair in zip(a["means"], x["means"], strict=False)
        ]
        for kind in "BC"
    }
    a_blocks = [m for r in got["A"] for m in r["means"]]
    return {
        "step_ms": step_ms,
        "config": "fr-own",
        "plain_step_ms": statistics.median(a_blocks) / 1e6,
        "ops": got["A"][0]["ops"],
        "rounds": FR_OWN_ROUNDS,
        "b_vs_a": estimate(pairs["B"], resamples, seed),
        "c_vs_a": estimate(pairs["C"], resamples, seed),
        "block": warmup_steps(step_ms),
        "background_pct": None,
        "bound_pct": None,
        "flushes": 0,
        "flush_interval_steps": None,
        "worker_ms_per_flush": 0.0,
        "bridge_ms_per_flush": None,
    }


def _pct(e: dict[str, Any]) -> str:
    return f"{e['pct']:+.2f}% [{e['ci95'][0]:+.2f}, {e['ci95'][1]:+.2f}] (median {e['median']:+.2f}%)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[5.0, 10.0, 30.0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per configuration")
    parser.add_argument(
        "--quick", action="store_true", help="10 ms steps, defaults and all bridges, 15 s each"
    )
    parser.add_argument(
        "--preset", choices=list(PRESETS), help="that step time with defaults, watch, all, fr and fr-own"
    )
    parser.add_argument(
        "--keeping",
        action="store_true",
        help="a fifth loop K, the cheapest API that keeps what B keeps (K/A - 1, B/K - 1), and a sixth, F, an all-C API keeping nothing (F/A - 1)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the loop on the GPU, CUDA-event timers",
    )
    parser.add_argument("--resamples", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("STEP_MS", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--fr-own-child", nargs=3, metavar=("MODE", "STEP_MS", "PASSES"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.fr_own_child:
        mode, step, passes = args.fr_own_child
        result = measure_fr_own(float(step), mode == "on", args.seconds, args.seed, int(passes))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.one:
        result = measure(
            float(args.one[0]),
            args.one[1],
            args.seconds,
            args.seed,
            args.resamples,
            args.keeping,
            args.device,
        )
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.quick:
        args.step_ms, args.configs, args.seconds = [10.0], ["defaults", "all"], 15.0
    if args.preset:
        args.step_ms, args.configs = [PRESETS[args.preset]], ["defaults", "watch", "all", "fr", "fr-own"]
    if args.device == "cuda":
        on_host = [c for c in args.configs if c in COLLECTIVE or c == "fr-own"]
        if on_host:  # a gloo all_reduce of host tensors
            print(f"--device cuda: {', '.join(on_host)} left out (a gloo collective on the host)", flush=True)
        args.configs = [c for c in args.configs if c not in on_host]
    print(
        "launch-bound loop, 1 torch thread; ~10 ms blocks of A (plain), B (otel_train), N (no-op API), "
        f"C (plain: A/A control) in random order; {args.seconds:.0f} s measured per row; CI: bootstrap 95% "
        "over block pairs; threads: otel_train's threads' CPU / B time; bound: B/A - 1 + threads"
    )
    print(HEADER, flush=True)
    results = []
    for step_ms in args.step_ms:
        for config in args.configs:
            if config == "fr-own":
                result = fr_own(step_ms, args.seconds, args.seed, args.resamples)
            else:
                child = ["--one", str(step_ms), config, "--seconds", str(args.seconds)]
                child += ["--keeping"] if args.keeping else []
                child += ["--device", args.device]
                result = run_child([*child, "--resamples", str(args.resamples), "--seed", str(args.seed)])
            if isinstance(result, str):
                print(f"{step_ms:>5.0f} ms {config:<12} FAILED: {result}", flush=True)
                continue
            results.append(result)
            print(report(result), flush=True)
            b_med, c_med = result["b_vs_a"]["median"], result["c_vs_a"]["median"]
            print(f"{'':>17}median of the block pairs' own ratios: B/A - 1 {b_med:+.2f}%, A/A {c_med:+.2f}%")
            floors = (("k", "K, the cheapest keeping API"), ("f", "F, an all-C API keeping nothing"))
            for loop, label in floors if result.get("k_vs_a") is not None else ():
                floor, above = result[f"{loop}_vs_a"], result[f"b_vs_{loop}"]
                print(
                    f"{'':>17}{label}: {loop.upper()}/A - 1 {_pct(floor)}; B/{loop.upper()} - 1 {_pct(above)}"
                )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
