"""End-to-end overhead on the demo: instrumented vs uninstrumented, interleaved runs.

    .venv/bin/python bench/bench_demo.py [--pairs 3] [--steps 120]

Each run is a fresh process training the same seeded model for the same steps; the wall time of
the training loop is taken from the process's own clock (see `elapsed` printed by the demo) when
available, else the process wall time. Library defaults = bridges off; demo defaults = TensorBoard,
W&B offline and MLflow on.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(extra: list[str], steps: int, out: str) -> float:
    cmd = [sys.executable, "-m", "examples.demo", "--steps", str(steps), "--eval-interval", str(steps // 2),
           "--sample-interval", str(steps), "--quiet", "--prometheus-port", "0", "--output-dir", out, *extra]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)  # examples/ is not installed
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    out = tempfile.mkdtemp()
    configs = {
        "library defaults (no bridges)": ["--no-tensorboard", "--no-wandb", "--no-mlflow"],
        "demo defaults (TB + W&B + MLflow)": [],
    }
    print(f"demo, {args.steps} steps, {args.pairs} interleaved pairs per configuration (wall s per run)")
    for label, flags in configs.items():
        plain, instrumented = [], []
        for _ in range(args.pairs):
            plain.append(_run(["--uninstrumented"], args.steps, out))
            instrumented.append(_run(flags, args.steps, out))
        p, i = statistics.median(plain), statistics.median(instrumented)
        print(f"{label:<36} uninstrumented {p:6.1f}  instrumented {i:6.1f}  overhead {100 * (i - p) / p:+5.1f}%  "
              f"(runs: {[round(x, 1) for x in plain]} vs {[round(x, 1) for x in instrumented]})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
