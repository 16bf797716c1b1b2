"""SIGTERM at random points of flush and shutdown: never a hang, the exit status still says
"terminated by SIGTERM", every step completed before the signal is in the JSONL, no torn line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("sigterm_harness.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_sigterm_at_random_points_never_hangs(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Loop until a deadline, and at least 200 tries (the harness forks; a try costs ~0.1-0.2 s).
    proc = subprocess.run(
        [sys.executable, str(HARNESS), str(tmp_path), "30", "200"],
        capture_output=True,
        text=True,
        env=env,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tries"] >= 200
    assert result["hangs"] == 0, result
    assert result["bad_status"] == [], result
    assert result["missing_steps"] == [], result
    assert result["torn"] == [], result
    assert result["during_shutdown"] >= 10, result  # the signal did land inside shutdown() too


GRACEFUL = """
import json, signal, sys
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # the training's own handler
import otel_train as ot
ot.init(output_dir=sys.argv[1], run_name="g", prometheus_port=0, verbosity=0, log_interval=1, hardware=False)
print("ready", flush=True)
step = 0
while not stop:
    with ot.step(step):
        ot.record("loss", 1.0)
    step += 1
print(json.dumps({"steps": step}), flush=True)
sys.exit(7)  # the training decides its exit status
"""


def test_sigterm_runs_the_trainings_own_handler_and_the_shutdown_at_its_exit(tmp_path) -> None:
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-c", GRACEFUL, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    import time

    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code == 7
    completed = json.loads(proc.stdout.readline())["steps"]
    rows = [json.loads(line) for line in (tmp_path / "g" / "metrics.rank0.jsonl").read_text().splitlines()]
    written = sum(r.get("train/steps", 0) for r in rows)
    # The handler ran at once and the loop ended by itself: every step it completed is written.
    assert 0 < written == completed
