"""The dump signal and stall dumps under abuse: a flood of SIGUSR1, SIGUSR1 after shutdown, and a
C call that holds the GIL (no Python thread can run, the watchdog neither)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.events import run_events
from helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def _spawn(script: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


FLOOD = """
import sys, time
import otel_train as ot
from otel_train.diagnostics.hang import SIGNAL_DUMP_INTERVAL_S
ot.init(output_dir=sys.argv[1], run_name="flood", prometheus_port=0, verbosity=0, hardware=False)
print("ready", flush=True)
step = 0
sys.stdin.readline()  # the parent sent its signals
deadline = time.monotonic() + SIGNAL_DUMP_INTERVAL_S + 3  # the coalesced requests' dump comes
while time.monotonic() < deadline:
    with ot.step(step):
        time.sleep(0.01)
    step += 1
ot.shutdown()
print("shut down", flush=True)
sys.stdin.readline()  # the parent sent one more SIGUSR1
time.sleep(0.5)
print("alive", flush=True)
"""


def test_a_flood_of_dump_signals_is_coalesced_and_a_late_one_is_harmless(tmp_path: Path) -> None:
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    proc = _spawn(script, str(tmp_path))
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(100):  # 100 requests in about a second
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.01)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "shut down"
        proc.send_signal(signal.SIGUSR1)  # after ot.shutdown(): it used to terminate the process
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "alive"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    run_dir = tmp_path / "flood"
    assert 1 <= len(list(run_dir.glob("stacks.rank0.*.txt"))) <= 2
    dumps = run_events(run_dir, event="stack_dump")
    assert 1 <= len(dumps) <= 2
    # Requests after the first dump are counted into the next event (a burst may merge a few
    # signals in the kernel before the handler runs: most, not all, are seen).
    assert 50 < sum(d["requests"] for d in dumps) <= 100, dumps


GIL_HOLDER = """
import ctypes, sys, time
import otel_train as ot
ot.init(output_dir=sys.argv[1], run_name="gil", stall_timeout_s=1.0, prometheus_port=0, verbosity=0,
        hardware=False)
step, start = 0, time.monotonic()
while time.monotonic() - start < 1.5:  # training runs for a while, then ...
    with ot.step(step):
        time.sleep(0.01)
    step += 1
libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL; no Python thread runs until it returns
print("holding", flush=True)
with ot.step(step):
    libc.sleep(12)
print("released", flush=True)
time.sleep(2)  # the watchdog runs again: it reports what it missed, and answers the signal
ot.shutdown()
"""


def test_a_c_call_holding_the_gil_still_gets_stall_and_signal_dumps(tmp_path: Path) -> None:
    script = tmp_path / "gil_holder.py"
    script.write_text(GIL_HOLDER)
    proc = _spawn(script, str(tmp_path))
    assert proc.stdout is not None
    raw = tmp_path / "gil" / "faulthandler.rank0.txt"

    def dumps() -> int:
        return raw.read_text().count("gil_holder.py") if raw.exists() else 0

    try:
        assert proc.stdout.readline().strip() == "holding"
        # The backstop timer (stall_timeout_s + a margin without a watchdog wake-up) fires from C.
        wait_for(lambda: dumps() >= 1, 9, "faulthandler's stall backstop")
        assert proc.poll() is None  # still inside the C call
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: dumps() >= 2, 5, "faulthandler's dump on SIGUSR1")
        assert proc.poll() is None  # still inside the C call: both came while the GIL was held
        line = next(n for n, text in enumerate(GIL_HOLDER.splitlines(), 1) if "libc.sleep" in text)
        assert f"line {line} in <module>" in raw.read_text()  # the frame inside the C call
        assert proc.stdout.readline().strip() == "released"
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    run_dir = tmp_path / "gil"
    stalls = [e for e in run_events(run_dir, event="stall") if "could not run" in e["message"]]
    assert stalls and stalls[0]["file"] == str(raw)
    assert run_events(run_dir, event="stack_dump")  # the Python-level dump once the GIL came back
