"""SIGTERM and exceptions: the final flush lands in the run dir and the exit status is preserved."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import otel_train as ot
    ot.init(output_dir=sys.argv[1], run_name="r", prometheus_port=0, verbosity=0, log_interval=1000)
    print("ready", flush=True)
    step = 0
    while True:
        with ot.step(step, tokens=1):
            ot.record("loss", 1.0)
        step += 1
        if sys.argv[2] == "raise" and step == 50:
            raise RuntimeError("training bug")
        if sys.argv[2] == "exit" and step == 50:
            with ot.step(step):
                sys.exit(3)
        if sys.argv[2] == "exit0" and step == 50:
            with ot.step(step):
                sys.exit(0)
        time.sleep(0.001)
    """
)


def _run(tmp_path: Path, mode: str) -> tuple[int, list[dict], float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path), mode], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    if mode == "term":
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    elapsed = time.monotonic() - started
    path = tmp_path / "r" / "metrics.rank0.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return code, rows, elapsed


def _events(tmp_path: Path) -> list[dict]:
    path = tmp_path / "r" / "events.rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_final_flush_and_exit_status(tmp_path) -> None:
    code, rows, _ = _run(tmp_path, "term")
    assert code == -signal.SIGTERM  # still "terminated by SIGTERM" for the scheduler
    assert rows and rows[-1]["train/steps"] > 0  # the partial interval (< log_interval) was flushed
    # a preempted run does not read as a clean finish: its events say when the signal came
    (terminated,) = [e for e in _events(tmp_path) if e["event"] == "terminated"]
    assert "SIGTERM at step" in terminated["message"] and terminated["step"] >= 0


def test_sys_exit_with_a_code_out_of_a_step_ends_the_run_failed(tmp_path) -> None:
    """sys.exit(3) leaves no sys.last_value (as an uncaught exception does): the step it left
    tells atexit the run failed. sys.exit(0) is a clean end."""
    code, _, _ = _run(tmp_path, "exit")
    assert code == 3
    (failed,) = [e for e in _events(tmp_path) if e["event"] == "run_failed"]
    assert "sys.exit" in failed["message"] and failed["error.type"] == "SystemExit" and failed["step"] == 50
    assert "end of process (failed)" in (tmp_path / "r" / "progress.txt").read_text()


def test_sys_exit_0_out_of_a_step_is_a_clean_end(tmp_path) -> None:
    code, _, _ = _run(tmp_path, "exit0")
    assert code == 0
    assert not [e for e in _events(tmp_path) if e["event"] == "run_failed"]


def test_exception_final_flush_and_exit_code(tmp_path) -> None:
    code, rows, _ = _run(tmp_path, "raise")
    assert code == 1
    assert sum(r.get("train/steps", 0) for r in rows) == 50


KEEPS_TRAINING = textwrap.dedent(
    """
    import json, signal, sys
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # checkpoint and go on
    import otel_train as ot
    ot.init(output_dir=sys.argv[1], run_name="k", prometheus_port=0, verbosity=0, log_interval=10, hardware=False)
    print("ready", flush=True)
    step = 0
    while not stop:
        with ot.step(step, tokens=1):
            ot.record("loss", 1.0)
        step += 1
    for _ in range(100):  # the steps a preempted job still runs (a checkpoint, the epoch's end)
        with ot.step(step, tokens=1):
            ot.record("loss", 1.0)
        step += 1
    print(json.dumps({"steps": step, "handled": len(stop)}), flush=True)
    """
)


def test_a_handler_of_the_trainings_own_that_trains_on_keeps_its_telemetry(tmp_path) -> None:
    """SIGTERM with the training's own handler installed: the handler runs and nothing shuts down;
    the steps after the signal are recorded, and the exit (here the script's end) shuts down."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KEEPS_TRAINING, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    done = json.loads(proc.stdout.readline())
    assert done["handled"] == 1
    rows = [json.loads(line) for line in (tmp_path / "k" / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(r.get("train/steps", 0) for r in rows) == done["steps"]
