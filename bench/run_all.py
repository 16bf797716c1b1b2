"""Run every benchmark in turn (`make bench`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in (
    "bench_core.py",
    "bench_hardware.py",
    "bench_reduce.py",
    "bench_watch.py",
    "bench_e2e.py",
    "bench_demo.py",
):
    print(f"\n===== {script} =====", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=False)
