"""Cost of ot.watch(model), side by side in one process.

    .venv/bin/python bench/bench_watch.py [--rounds 30] [--threads 1]

1. Training-thread cost of an *unwatched* step when a watch is registered: empty `ot.step()` bodies
   with no watch vs with `ot.watch(model, every=10**9)` (µs per step; the difference is the check).
2. Cost of a *watched* step on the demo's model (4 layers, d_model 128, batch 32 x 128, CPU):
   the same training step timed in interleaved rounds without a watch, with `watch(every=1)`
   (gradient + parameter norms) and with `watch(every=1, activations=True)`. The added ms per
   watched step, divided by `every`, is the amortized cost; printed for every=50 and every=100.

Ratios and differences are the result; absolute times are context (2-core VM).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The repository root: examples/ is not installed, and a script's sys.path starts at bench/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import otel_train as ot
from examples.demo.data import CharVocab, get_batch, load_text, split
from examples.demo.model import CharTransformer, ModelConfig
from otel_train.testing import current_session


def per_step_us(n: int, repeats: int = 5) -> float:
    samples = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter_ns()
        for _ in range(n):
            with ot.step():
                pass
        samples.append((time.perf_counter_ns() - start) / n / 1000)
    return statistics.median(samples)


def bench_unwatched_step(n: int) -> tuple[float, float]:
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, log_interval=1000, hardware=False)
    without = per_step_us(n)
    ot.watch(model, every=10**9, activations=True)  # registered, but no step in range is watched
    per_step_us(1)  # step 0 is watched (0 % every == 0): keep it out of the measurement
    with_watch = per_step_us(n)
    ot.shutdown()
    return without, with_watch


def training_step(model: CharTransformer, opt: torch.optim.Optimizer, batch: Callable[[], tuple]) -> None:
    x, y = batch()
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    assert loss is not None
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    ot.record("loss", loss.detach())


def bench_watched_step(rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    text = load_text(None, 500_000)
    vocab = CharVocab.from_text(text)
    data, _ = split(vocab.encode(text))
    model = CharTransformer(ModelConfig(vocab_size=vocab.size, context=128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def batch() -> tuple:
        return get_batch(data, 32, 128, gen, torch.device("cpu"))

    ot.init(prometheus_port=0, verbosity=0, run_dir_enabled=False, log_interval=10, hardware=False)
    session = current_session()
    modes: dict[str, Callable[[], None]] = {
        "no watch": lambda: None,
        "grads + params": lambda: ot.watch(model, every=1),
        "grads + params + activations": lambda: ot.watch(model, every=1, activations=True),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(3):  # warm-up
        with ot.step():
            training_step(model, opt, batch)
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            for watch in list(session.watches):
                watch.remove()
            modes[mode]()
            start = time.perf_counter_ns()
            with ot.step():
                training_step(model, opt, batch)
            times[mode].append((time.perf_counter_ns() - start) / 1e6)
    layers = len(ot.watch(model).labels)  # type: ignore[union-attr]
    ot.shutdown()
    out = {mode: statistics.median(values) for mode, values in times.items()}
    out["layers"] = float(layers)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100_000, help="empty steps per repeat in part 1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    without, with_watch = bench_unwatched_step(args.steps)
    print("## Unwatched step with a watch registered (empty step body, µs/step, median of 5)")
    print(f"no watch {without:.3f}   watch registered {with_watch:.3f}   added {with_watch - without:+.3f}")

    result = bench_watched_step(args.rounds)
    base = result["no watch"]
    print(
        f"\n## Watched step on the demo model ({result['layers']:.0f} layers, CPU, torch threads {args.threads}, "
        f"median of {args.rounds} interleaved rounds)"
    )
    print(f"{'mode':<32}{'ms/step':>10}{'added ms':>10}{'every=50':>10}{'every=100':>11}")
    for mode in ("no watch", "grads + params", "grads + params + activations"):
        added = result[mode] - base
        print(
            f"{mode:<32}{result[mode]:>10.2f}{added:>10.2f}"
            f"{100 * added / 50 / base:>9.2f}%{100 * added / 100 / base:>10.2f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
