"""Goodput: wall time split into productive steps and badput causes, continued across restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import otel_train as ot
from otel_train.goodput import CAUSES, span_cause


def _account(run_dir: Path, rank: int = 0) -> dict[str, float]:
    state = json.loads((run_dir / f"goodput.rank{rank}.json").read_text())
    return {"wall_s": state["wall_s"], "productive_s": state["productive_s"], **state["badput"]}


def _assert_sums_to_wall(account: dict[str, float]) -> None:
    parts = account["productive_s"] + sum(account[c] for c in CAUSES)
    assert abs(parts - account["wall_s"]) <= 0.02 * account["wall_s"], account


def test_span_causes() -> None:
    assert [span_cause(n) for n in ("eval", "validation", "generate", "checkpoint", "save", "ema")] == [
        "eval", "eval", "eval", "checkpoint", "checkpoint", "other",
    ]  # fmt: skip


def test_account_of_one_process(tmp_path: Path) -> None:
    session = ot.init(run_name="gp", stall_timeout_s=0.3, prometheus_port=0, verbosity=0, hardware=False)
    time.sleep(0.2)  # start-up: model loading, say
    for step in range(4):
        with ot.step(step):
            time.sleep(0.05)
    with ot.span("eval"):
        time.sleep(0.2)
    with ot.span("checkpoint"):
        time.sleep(0.1)
    time.sleep(0.6)  # a stall (longer than stall_timeout_s, no span in it)
    with ot.step(4):
        time.sleep(0.05)
        with ot.span("eval"):  # an eval inside a step is eval, not productive time
            time.sleep(0.1)
    with ot.step(5):
        time.sleep(0.05)
    ot.shutdown()
    account = _account(session.run_dir)
    _assert_sums_to_wall(account)
    assert account["startup"] >= 0.2
    assert 0.3 <= account["eval"] < 0.8
    assert 0.1 <= account["checkpoint"] < 0.5
    assert 0.6 <= account["stall"] < 1.2
    assert account["restart"] == 0
    assert 0.3 <= account["productive_s"] < 0.9  # 6 x 50 ms of step work (the nested eval excluded)
    progress = (session.run_dir / "progress.txt").read_text()
    assert "end of process | goodput" in progress and "stall" in progress


_DEMO = [sys.executable, "-m", "otel_train.cli", "demo", "--steps", "12", "--batch-size", "4",
         "--context", "32", "--layers", "1", "--d-model", "32", "--eval-interval", "6",
         "--eval-batches", "2", "--sample-interval", "1000", "--log-interval", "3",
         "--prometheus-port", "0", "--watch-every", "0", "--no-tensorboard", "--no-wandb",
         "--no-mlflow", "--quiet", "--max-chars", "20000"]  # fmt: skip


def test_restart_of_the_same_run_id_continues_the_account(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRAIN_RUN_ID="job-7", OTEL_TRAIN_HARDWARE="false")
    args = [*_DEMO, "--run-name", "restarted", "--output-dir", str(tmp_path / "runs")]
    subprocess.run(args, env=env, check=True, timeout=300)
    run_dir = tmp_path / "runs" / "restarted"
    first = _account(run_dir)
    _assert_sums_to_wall(first)
    assert first["eval"] > 0 and first["checkpoint"] > 0
    time.sleep(1.5)  # the scheduler's restart gap
    subprocess.run(args, env=env, check=True, timeout=300)
    second = _account(run_dir)
    _assert_sums_to_wall(second)
    assert second["restart"] >= 1.5  # the gap, plus the second process's time before init
    assert second["wall_s"] > first["wall_s"] + 1.5
    assert second["productive_s"] > first["productive_s"]
    progress = (run_dir / "progress.txt").read_text()
    assert progress.count("end of process | goodput") == 2  # one progress file across the restart


_ONE_PROCESS = """
import sys, time
import otel_train as ot
ot.init(run_name="restarted", run_id="job-8", output_dir=sys.argv[1], prometheus_port=0, verbosity=0,
        hardware=False, log_interval=2)
for step in range(6):
    with ot.step(step):
        time.sleep(0.02)
ot.shutdown()
"""


def _busy_loop(seconds: float) -> subprocess.Popen[bytes]:
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass"
    return subprocess.Popen([sys.executable, "-c", code])


def test_restart_gap_and_wall_time_are_exact_under_load(tmp_path: Path) -> None:
    """Two processes on one run id, 2.0 s apart, while busy loops load every core: the restart
    badput is the measured gap (the first process's last record to the second's start) and the
    account's wall time the real elapsed time. A start time off by a fraction of a second (psutil's
    create_time() rests on /proc/stat's whole-second btime) lost part of the gap and counted it
    twice in the wall time."""
    script = tmp_path / "one_process.py"
    script.write_text(_ONE_PROCESS)
    args = [sys.executable, str(script), str(tmp_path / "runs")]
    run_dir = tmp_path / "runs" / "restarted"
    load = [_busy_loop(60) for _ in range(os.cpu_count() or 1)]
    try:
        first_spawn = time.time()
        subprocess.run(args, check=True, timeout=120)
        first_record = json.loads((run_dir / "goodput.rank0.json").read_text())["updated"]
        time.sleep(2.0)
        second_spawn = time.time()
        subprocess.run(args, check=True, timeout=120)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    state = json.loads((run_dir / "goodput.rank0.json").read_text())
    gap = second_spawn - first_record
    elapsed = state["updated"] - first_spawn
    assert gap >= 2.0
    assert abs(state["badput"]["restart"] - gap) <= 0.1, (state, gap)
    assert abs(state["wall_s"] - elapsed) <= 0.2, (state, elapsed)
