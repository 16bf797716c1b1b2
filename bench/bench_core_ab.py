"""Hot-path figures of two revisions side by side: this tree against `--base` (a git revision),
run alternately in one session so that both see the same machine state.

    .venv/bin/python bench/bench_core_ab.py --base eaeb667 [--rounds 8] [--n 40000]

Each round runs `bench_core.bench_measurements(n)` and `bench_core.bench_full_step(n // 4)` once in
each tree (a fresh process each, the base tree checked out as a temporary git worktree). The
result is the paired after/before ratio per figure: its median and range over the rounds. The
direct OTel SDK loop is unchanged code in both trees, so its ratio shows the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run inside each tree: its bench_core, its otel_train (checked), one JSON line out.
_ONE_PASS = """
import json, sys
from pathlib import Path
tree = Path(sys.argv[1])
sys.path.insert(0, str(tree / "bench"))
import bench_core
import otel_train
assert Path(otel_train.__file__).resolve().is_relative_to(tree.resolve()), otel_train.__file__
n = int(sys.argv[2])
rows = bench_core.bench_measurements(n)
ours, sdk, _ = bench_core.bench_full_step(n // 4)
out = {label: value for label, value, _ in rows}
out["full step (otel_train)"] = ours
out["full step (OTel SDK, reference)"] = sdk
print(json.dumps(out))
"""


def one_pass(tree: Path, n: int, output_dir: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'tests'}"}
    env["OTEL_TRAIN_OUTPUT_DIR"] = str(output_dir)
    out = subprocess.run(
        [sys.executable, "-c", _ONE_PASS, str(tree), str(n)],
        cwd=tree, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against (e.g. eaeb667)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--n", type=int, default=40_000, help="measurements per figure and pass")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="otel_train_base_") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(base), args.base],
                       check=True)  # fmt: skip
        try:
            before: list[dict[str, float]] = []
            after: list[dict[str, float]] = []
            for i in range(args.rounds):
                before.append(one_pass(base, args.n, Path(tmp) / "runs"))
                after.append(one_pass(REPO, args.n, Path(tmp) / "runs"))
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    print(f"## µs, median of {args.rounds} rounds: {args.base} (before) vs this tree (after)")
    print(f"{'figure':<34}{'before':>10}{'after':>10}   after/before paired median [range]")
    for key in after[0]:
        b = [r[key] for r in before]
        a = [r[key] for r in after]
        ratios = [y / x for x, y in zip(b, a, strict=True)]
        print(
            f"{key:<34}{statistics.median(b):>10.3f}{statistics.median(a):>10.3f}   "
            f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
