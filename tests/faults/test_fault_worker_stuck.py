"""Values and callbacks that stop the background worker: a tensor with no data, a user callback
that hangs. Training goes on with bounded memory, the process exits cleanly, and someone is told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


META_AT_EXIT = """
import sys, torch
import otel_train as ot
ot.init(output_dir=sys.argv[1], run_name="meta", prometheus_port=0, verbosity=0, hardware=False, log_interval=1)
for step in range(3):
    with ot.step(step):
        ot.record("loss", 1.0)
        if step == 2:
            ot.record("loss", torch.empty(1, device="meta"))
            ot.record("other", torch.empty((), device="meta"))
ot.shutdown()
"""


def test_meta_tensor_before_shutdown_is_dropped_and_the_process_exits_cleanly(tmp_path: Path) -> None:
    proc = _python(META_AT_EXIT, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]  # it was -6 (SIGABRT at exit)
    rows = [json.loads(line) for line in (tmp_path / "meta" / "metrics.rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/steps" in r] == [0, 1, 2]  # the last flush is written
    assert max(r.get("otel_train/dropped/no_data_tensor", 0) for r in rows) == 2
    assert proc.stderr.count("no data (a meta or fake tensor)") == 1  # warned once
