"""Instructions a step of bench_launch.py's loop executes, counted exactly by valgrind's callgrind:
A (plain), B (otel_train), N (an API doing nothing), K (the cheapest API that keeps the data).

    .venv/bin/python bench/bench_instructions.py [--steps 200] [--passes 6]

Each loop runs in its own process under `valgrind --tool=callgrind`, collecting only inside
`itertools.starmap`'s step calls (`--toggle-collect=starmap_next`), after 50 warm-up steps; no
flush happens (log_interval beyond the steps) and no hardware sampler runs. Counts do not depend
on the machine's load, unlike times; they differ between runs by glibc malloc's paths (a few
thousand instructions a step). What they showed (README, Performance, seventeenth session):
otel_train's step costs about as many instructions as an API doing nothing, ~0.25 % of the
loop's, against ~2 % of its time: the cost is how slowly those instructions run between torch's
calls, not how many there are. Needs valgrind (Debian: `apt-get install valgrind`); ~3 min a loop.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOOPS = ("A", "B", "N", "K")


def run_loop(kind: str, steps: int, passes: int) -> None:
    """In the child under callgrind: 50 warm-up steps, then `steps` inside starmap (counted)."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import torch
    from bench_launch import NULL_API, KeepingApi, LaunchBoundModel

    import otel_train as ot

    torch.set_num_threads(1)
    model = LaunchBoundModel(300, 0)
    model.passes = passes
    keeping = KeepingApi(10**9)
    loops = {
        "A": lambda i: model.plain(),
        "B": lambda i: model.instrumented(ot, i),
        "N": lambda i: model.instrumented(NULL_API, 0),
        "K": lambda i: model.instrumented(keeping, 0),
    }
    with tempfile.TemporaryDirectory() as out:
        if kind == "B":
            ot.init(run_name="instructions", output_dir=out, prometheus_port=0, verbosity=0,
                    progress_bar=False, log_interval=10**9, hardware=False)  # fmt: skip
        for i in range(50):
            loops[kind](i)
        for _ in itertools.starmap(loops[kind], ((i,) for i in range(50, 50 + steps))):
            pass
        ot.shutdown()


def count(kind: str, steps: int, passes: int) -> int:
    """Instructions callgrind counted inside the `steps` steps of loop `kind`."""
    with tempfile.TemporaryDirectory() as out:
        result = Path(out) / "callgrind.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=starmap_next",
             f"--callgrind-out-file={result}", sys.executable, __file__, "--child", kind,
             "--steps", str(steps), "--passes", str(passes)],
            check=True, capture_output=True,
        )  # fmt: skip
        totals = re.search(r"^summary:\s+(\d+)", result.read_text(), re.MULTILINE)
        if totals is None:
            raise SystemExit(f"no summary line in callgrind's output for loop {kind}")
        return int(totals.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--passes", type=int, default=6, help="passes over the 8 layers (~50 ops each)")
    parser.add_argument("--child", choices=LOOPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_loop(args.child, args.steps, args.passes)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    per_step = {}
    for kind in LOOPS:
        per_step[kind] = count(kind, args.steps, args.passes) / args.steps
        print(f"{kind}: {per_step[kind]:,.0f} instructions a step", flush=True)
    for kind in ("B", "N", "K"):
        extra = per_step[kind] - per_step["A"]
        print(f"{kind} - A: {extra:+,.0f} a step ({100 * extra / per_step['A']:+.2f} % of A's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
