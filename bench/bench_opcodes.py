"""Python opcodes and frames otel_train's own code runs in one step of the launch-bound loop.

    .venv/bin/python bench/bench_opcodes.py [--watch]

The loop is `bench_launch.py`'s B step (`ot.step`, 4 timers, the loss tensor and the lr recorded)
with the library's defaults and no flush due. One step is traced with `sys.settrace` and
`f_trace_opcodes`; only frames whose code lives in the otel_train package are counted. Inside a
launch-bound loop a call's cost follows how much code and data it touches, not how fast it runs in
a tight loop (README, Performance), and unlike a timing this count is exact: it is the guide for
changes to the hot path a few microseconds at a time.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import otel_train as ot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_launch import LaunchBoundModel  # a sibling script, not a package

PACKAGE = str(Path(ot.__file__).resolve().parent)


def count_step(watch: bool) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(opcodes, calls) per otel_train function in one traced step, after 50 untraced ones."""
    torch.set_num_threads(1)
    model = LaunchBoundModel(60)
    opcodes: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return None
        frame.f_trace_opcodes = True
        key = f"{path[len(PACKAGE) + 1 :]}:{frame.f_code.co_name}"
        if event == "call":
            calls[key] += 1
        elif event == "opcode":
            opcodes[key] += 1
        return tracer

    with tempfile.TemporaryDirectory() as out:
        settings: dict[str, Any] = dict(
            run_name="opcodes", output_dir=out, prometheus_port=0, verbosity=0, progress_bar=False,
            log_interval=1000,
        )  # fmt: skip
        with ot.init(**settings):
            if watch:
                ot.watch(model.net)
            for index in range(50):
                model.instrumented(ot, index)
            sys.settrace(tracer)
            try:
                model.instrumented(ot, 51)  # not a watched step (every 100)
            finally:
                sys.settrace(None)
    return opcodes, calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watch", action="store_true", help="with ot.watch(model) (an unwatched step)")
    args = parser.parse_args()
    opcodes, calls = count_step(args.watch)
    print(f"{sum(opcodes.values())} opcodes in {sum(calls.values())} frames a step")
    for key, count in opcodes.most_common():
        print(f"{count:6d} {calls[key]:4d}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
