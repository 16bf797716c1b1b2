"""Per-rank CPU, bytes and wall of one flush's telemetry exchange in a tree (crossrank/tree_exchange)
and in the star, on real gloo ranks; fits bench/tree_model.py and predicts 10k and 100k ranks.

    .venv/bin/python bench/bench_tree.py [--ranks 2 4 8 16] [--fanin 4] [--flushes 20]

Each rank runs `--flushes` flushes of a 6-timer interval through `CrossRankReducer.on_flush`, all
ranks meeting in a barrier on the default group before each. CPU: the thread time of the thread
that runs the flush listener (in a job, otel_train's worker thread; gloo's own I/O threads are not
in it). Bytes: the exchange's payload sent + received (trailers included, gloo's framing not).
Wall: the whole on_flush. Medians over flushes. Rank 0 also publishes the job-level series
(`crossrank/job_outputs`) where the reducer has them, as in a job. Acceptance (issue #28): rank 0's CPU at 16 ranks
with fan-in 4 within 1.3x of the 4-rank figure.

`--processes N` holds the host's load the same for every size: each job runs N processes, of which
ranks [0, size) exchange as the job measured and the other N - size run the same flushes in an
exchange of their own (on a 2-core machine, 16 processes make every thread's CPU time grow, so a
4-process job and a 16-process job differ in more than the exchange's size).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import tree_model as model  # noqa: E402
from bench_reduce import _interval, _meter  # noqa: E402
from helpers.multirank import run_ranks  # noqa: E402

WARMUP = 3


def rank_target(rank: int, processes: int, flushes: int, fanin: int, world: int) -> dict[str, Any]:
    """One process of a job of `world` ranks (ranks [0, world)) among `processes` (module doc)."""
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.crossrank.tree import layout
    from otel_train.distributed import detect_identity

    # Rank 0 publishes the job-level series (crossrank/job_outputs) on a meter of their own, as in a
    # job; a reducer without them (an older tree, for a before/after run) is measured as it is.
    job = {"job_meter": _meter()} if "job_meter" in inspect.signature(CrossRankReducer).parameters else {}
    reducer = CrossRankReducer(detect_identity(None), _meter(), None, Config(exchange_fanin=fanin), **job)
    if world < processes:  # two exchanges side by side: the job's, and the rest's (same load)
        groups = [dist.new_group(list(range(world))), dist.new_group(list(range(world, processes)))]
        reducer.reform(groups[rank >= world])
        rank, world = (rank, world) if rank < world else (rank - world, processes - world)
    cpu, wall, moved = [], [], []
    for seq in range(WARMUP + flushes):
        interval = _interval(seq, rank)
        dist.barrier()
        before = reducer.exchange.sent_bytes + reducer.exchange.received_bytes
        c0, w0 = time.thread_time(), time.perf_counter()
        reducer.on_flush(interval)
        if seq >= WARMUP:
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
            moved.append(reducer.exchange.sent_bytes + reducer.exchange.received_bytes - before)
    assert reducer.disabled_reason is None, reducer.disabled_reason
    children = len(layout(world, fanin).children[rank]) if world > 1 else 0
    return {"children": children, "cpu": statistics.median(cpu), "wall": statistics.median(wall),
            "bytes": statistics.median(moved)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--fanin", type=int, default=4)
    parser.add_argument("--flushes", type=int, default=20)
    parser.add_argument("--star-at", type=int, nargs="*", default=[16], help="also the star at these sizes")
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="processes per job, whatever its size (module doc; 0: its size)",
    )
    args = parser.parse_args()
    for world in [*args.ranks, *args.star_at]:
        if world < args.processes and min(world, args.processes - world) < 2:
            parser.error(
                f"--processes {args.processes} with a job of {world}: each side needs 2 ranks or more"
            )
    print(
        f"bundle {model.bundle_bytes()} B up, answer {model.answer_bytes()} B down; cpu_count={os.cpu_count()}"
        + (f"; every job runs {args.processes} processes" if args.processes else "")
    )
    points: list[tuple[int, float]] = []
    root_cpu: dict[int, float] = {}
    print(
        "ranks fan-in | rank 0: children cpu ms wall ms kB | busiest other: children cpu ms wall ms kB | depth"
    )
    runs = [(world, args.fanin) for world in args.ranks] + [(world, world) for world in args.star_at]
    for world, fanin in runs:
        processes = max(world, args.processes)
        results = run_ranks(processes, rank_target, (args.flushes, fanin, world), timeout=600)[:world]
        if fanin == args.fanin:
            points += [(r["children"], r["cpu"]) for r in results[1:]]  # rank 0 draws the verdicts too
        root, others = results[0], results[1:]
        busiest = max(others, key=lambda r: (r["children"], r["cpu"]))
        if fanin == args.fanin:
            root_cpu[world] = root["cpu"]
        depth = model.layout(world, fanin).depth()
        print(
            f"{world:>5} {fanin:>6} | {root['children']:>8} {root['cpu'] * 1e3:6.2f} {root['wall'] * 1e3:7.2f} "
            f"{root['bytes'] / 1e3:6.1f} | {busiest['children']:>8} {busiest['cpu'] * 1e3:6.2f} "
            f"{busiest['wall'] * 1e3:7.2f} {busiest['bytes'] / 1e3:6.1f} | {depth}",
            flush=True,
        )
    if 4 in root_cpu and 16 in root_cpu:
        print(f"rank 0 cpu at 16 ranks / at 4 ranks: {root_cpu[16] / root_cpu[4]:.2f} (acceptance: <= 1.3)")
    model.A_NODE, model.C_CHILD = model.fit_line(points)
    print(f"fit: cpu = {model.A_NODE * 1e3:.3f} ms + {model.C_CHILD * 1e3:.3f} ms x children")
    print(model.predictions())


if __name__ == "__main__":
    main()
