"""torch is no dependency of otel_train (README, Install): a single-process run on plain floats
works without it, the cross-rank reducer's local path included (its job block and the individual
straggler score once needed torch, and the first flush logged a traceback instead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` raises ImportError, as where it is not installed
    import otel_train as ot

    ot.init(run_name="notorch", total_steps=40, log_interval=10, prometheus_port=0, hardware=False)
    for i in range(40):
        with ot.step(i, samples=8):
            with ot.timer("forward"):
                pass
            ot.record("loss", 1.0 / (i + 1))
    ot.shutdown()
    print("torch" in sys.modules and sys.modules["torch"] is not None)
    """
)


def test_a_single_process_run_needs_no_torch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRAIN_OUTPUT_DIR=str(tmp_path / "runs"), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False"), "torch was imported after all"
    assert "Traceback" not in result.stderr and "failed" not in result.stderr, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "notorch" / "metrics.rank0.jsonl").open()]
    flushed = [row for row in rows if row.get("step", -1) >= 9]  # every flush's row, the first at step 9
    assert flushed and all("stragglers/individual/all" in row for row in flushed), rows[-1]
