"""A requeued job racing its still-running zombie (same run id, same run name, two live processes):
the second never appends to the first's files; it warns and writes a directory of its own. Once
the first has exited, the same run id resumes in place as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TRAINER = """
import sys
import otel_train as ot
ot.init(output_dir=sys.argv[1], run_name="job", run_id="slurm-4242", prometheus_port=0,
                  verbosity=0, hardware=False, log_interval=1)
session = ot.current_session()
for step in range(int(sys.argv[2])):
    with ot.step(step):
        ot.record("loss", 1.0)
print(session.run_dir, flush=True)
sys.stdin.readline()  # alive until the test says so
ot.shutdown()
"""


def _start(tmp_path: Path, steps: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path), str(steps)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str]) -> str:
    _, stderr = proc.communicate("stop\n", timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    return stderr


def _steps(run_dir: Path) -> tuple[list[int], int]:
    """(the step of each row, steps counted): a row may hold several steps (log_interval=1 is a
    flush per step unless the worker is behind)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/steps" in r]
    return [r["step"] for r in rows], int(sum(r["train/steps"] for r in rows))


def _events(run_dir: Path) -> list[str]:
    path = run_dir / "events.rank0.jsonl"
    return [json.loads(line)["event"] for line in path.read_text().splitlines()] if path.exists() else []


def test_a_live_owner_is_never_appended_to(tmp_path: Path) -> None:
    first = _start(tmp_path, 30)
    second = None
    try:
        assert first.stdout is not None
        owned = Path(first.stdout.readline().strip())
        assert owned == tmp_path / "job"
        second = _start(tmp_path, 30)  # the requeue, while the first is still alive
        assert second.stdout is not None
        diverted = Path(second.stdout.readline().strip())
        assert diverted == tmp_path / f"job-{second.pid}"
        stderr = _finish(second)
        assert str(owned) in stderr and "OTEL_TRAIN_RUN_NAME" in stderr and str(first.pid) in stderr
        _finish(first)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    steps, counted = _steps(owned)
    assert steps == sorted(set(steps)) and steps[-1] == 29 and counted == 30  # no step written twice
    assert "restart" not in _events(owned)  # the owner was alive: not a restart
    assert _steps(diverted)[1] == 30
    # The first has exited: the same run id resumes in place, as a restart.
    third = _start(tmp_path, 5)
    assert third.stdout is not None and Path(third.stdout.readline().strip()) == owned
    _finish(third)
    assert _events(owned).count("restart") == 1
    steps, counted = _steps(owned)
    assert counted == 35 and steps[-1] == 4
