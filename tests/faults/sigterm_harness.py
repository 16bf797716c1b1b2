"""SIGTERM at random points of flush and shutdown, many times, cheaply.

Run as a script: `python sigterm_harness.py OUT_DIR DEADLINE_S MIN_TRIES`. This process imports
otel_train and the SDK once and never starts a session; each try forks a child that starts one,
runs steps with a flush every step, then shuts down and waits, while this process sends SIGTERM
after a random delay. A child that does not exit within HANG_S is a hang (killed with SIGKILL).
Prints one JSON summary line.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import select
import signal
import struct
import sys
import time
from pathlib import Path

import opentelemetry.sdk.metrics
import opentelemetry.sdk.resources
import opentelemetry.sdk.trace  # noqa: F401
import torch.distributed  # noqa: F401  (init() imports it: 3 s per child otherwise)

import otel_train as ot
import otel_train.bridges.console
import otel_train.core.instruments
import otel_train.core.worker
import otel_train.crossrank.reducer
import otel_train.envinfo
import otel_train.exporters
import otel_train.health

HANG_S = 10.0
DONE = struct.Struct("q")


def child(out: Path, index: int, steps: int, shared: mmap.mmap, ready_fd: int) -> None:
    """Never returns: exits by the signal (the expected way) or os._exit with a failure code."""
    try:
        ot.init(
            output_dir=str(out),
            run_name=f"t{index}",
            prometheus_port=0,
            verbosity=0,
            log_interval=1,
            hardware=False,
            queue_size=2,
        )
        with contextlib.suppress(OSError):  # the parent stopped waiting (a slow init): fine
            os.write(ready_fd, b"R")
        for step in range(steps):
            with ot.step(step, tokens=1):
                ot.record("loss", 1.0)
            shared[0:8] = DONE.pack(step + 1)  # completed steps, before the signal or not
        ot.shutdown()
        shared[8:16] = DONE.pack(1)
        while True:
            time.sleep(0.01)
    except BaseException:
        import traceback

        (out / f"t{index}.error").write_text(traceback.format_exc())
        os._exit(3)
    os._exit(4)


def jsonl_steps(path: Path) -> tuple[int, bool]:
    """(sum of train/steps over the rows, whether every line parses)."""
    if not path.exists():
        return 0, True
    total = 0
    for line in path.read_text().splitlines():
        try:
            total += int(json.loads(line).get("train/steps", 0))
        except ValueError:
            return total, False
    return total, True


def main() -> int:
    out = Path(sys.argv[1])
    deadline = time.monotonic() + float(sys.argv[2])
    min_tries = int(sys.argv[3])
    hard_stop = time.monotonic() + 3 * float(sys.argv[2])
    rng = random.Random(int(os.environ.get("SIGTERM_SEED", "12")))
    shared = mmap.mmap(-1, 16)
    results = {
        "tries": 0,
        "hangs": 0,
        "bad_status": [],
        "missing_steps": [],
        "torn": [],
        "during_shutdown": 0,
    }
    while (time.monotonic() < deadline or results["tries"] < min_tries) and time.monotonic() < hard_stop:
        index = results["tries"]
        results["tries"] += 1
        steps = rng.randint(0, 600)
        shared[0:16] = bytes(16)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            child(out, index, steps, shared, ready_w)
        os.close(ready_w)
        select.select([ready_r], [], [], 3 * HANG_S)  # wait for init() (a signal before it is trivial)
        os.close(ready_r)
        # Over the loop (~0.1 ms a step) and the shutdown (~6 ms): flushes, the final flush, the
        # worker's drain, closing sinks and exporters.
        time.sleep(rng.uniform(0.0, 0.02))
        # Steps completed before the signal (the child keeps stepping while its shutdown runs, and
        # those later steps may be lost with the process: only these must be in the JSONL).
        before_signal = DONE.unpack(shared[0:8])[0]
        in_shutdown = before_signal == steps and not DONE.unpack(shared[8:16])[0]
        os.kill(pid, signal.SIGTERM)
        waited = time.monotonic() + HANG_S
        status = None
        while time.monotonic() < waited:
            done_pid, status = os.waitpid(pid, os.WNOHANG)
            if done_pid:
                break
            status = None
            time.sleep(0.002)
        if status is None:
            results["hangs"] += 1
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            continue
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM):
            error = out / f"t{index}.error"
            results["bad_status"].append((index, status, error.read_text()[-1500:] if error.exists() else ""))
        results["during_shutdown"] += int(in_shutdown)
        written, whole = jsonl_steps(out / f"t{index}" / "metrics.rank0.jsonl")
        if written < before_signal:
            results["missing_steps"].append((index, before_signal, written))
        if not whole:
            results["torn"].append(index)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
