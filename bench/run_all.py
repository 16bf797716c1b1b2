"""Run every benchmark in turn (`make bench`; `python bench/run_all.py --quick` for a short pass)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICK = "--quick" in sys.argv[1:]

for script, args in (
    ("bench_core.py", []),
    ("bench_hardware.py", []),
    ("bench_reduce.py", []),
    ("bench_exchange.py", ["--flushes", "10"] if QUICK else []),
    ("bench_tree.py", ["--flushes", "5", "--ranks", "2", "4", "8"] if QUICK else []),
    ("bench_watch.py", []),
    ("bench_e2e.py", []),
    ("bench_launch.py", ["--quick"] if QUICK else []),
    ("bench_demo.py", []),
):
    print(f"\n===== {script} {' '.join(args)} =====", flush=True)
    subprocess.run([sys.executable, str(HERE / script), *args], check=False)
