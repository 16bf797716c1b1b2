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
