"""Per-rank bytes and time of the telemetry exchange at one flush, on real gloo ranks, beside the
cost model (bench/exchange_model.py), and the model's prediction for 1,000 and 10,000 ranks.

    .venv/bin/python bench/bench_exchange.py [--ranks 2 4 8 16] [--flushes 30]

For each job size, every rank runs `--flushes` flushes of a 6-timer interval through
`CrossRankReducer.on_flush` (the star exchange: rank 0 gathers, answers), then the same number of
the exchange before issue #18 (pack, `all_gather` of every rank's row on the same gloo group,
unpack), kept here only to compare. Before each measured flush all ranks meet in a barrier on the
default group, so a rank's time is the exchange's, not the other ranks' lateness.

Bytes out: this process's socket writes during the exchange, from /proc/self/io (wchar counts
every byte gloo writes, framing included; gloo reads with recv(), which rchar does not count, so
bytes in follow from the peers' bytes out: rank 0 gets every other rank's, each other rank 1/(N-1)
of rank 0's, and all_gather's ring takes in what it sends). CPU: this process's CPU time during
the exchange (every thread, gloo's included), the model's fitted quantity. Wall: the exchange
alone, and the whole `on_flush` ("flush": on rank 0 it includes reducing every row and the
straggler model). Medians; "other" = every rank but rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import exchange_model as model  # noqa: E402
from bench_reduce import _interval, _meter  # noqa: E402
from helpers.multirank import run_ranks  # noqa: E402

WARMUP = 3


def _io() -> tuple[int, int]:
    """(bytes read, bytes written) by this process so far, sockets included."""
    with open("/proc/self/io") as io:
        fields = dict(line.split(": ") for line in io.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def _star(rank: int, world: int, flushes: int, group: Any) -> dict[str, list[float]]:
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import detect_identity

    reducer = CrossRankReducer(detect_identity(None), _meter(), None, Config(), group=group)
    run = reducer.exchange.run
    exchange_s: list[float] = []

    cpu_s: list[float] = []
    sent: list[float] = []

    def timed(up: Any, answers: Any, *pairing: Any) -> Any:
        (_, w0), cpu, start = _io(), time.process_time(), time.perf_counter()
        try:
            return run(up, answers, *pairing)
        finally:
            exchange_s.append(time.perf_counter() - start)
            cpu_s.append(time.process_time() - cpu)
            sent.append(_io()[1] - w0)

    reducer.exchange.run = timed  # type: ignore[method-assign]
    flush_s: list[float] = []
    for seq in range(WARMUP + flushes):
        interval = _interval(seq, rank)
        dist.barrier()
        start = time.perf_counter()
        reducer.on_flush(interval)
        flush_s.append(time.perf_counter() - start)
    assert reducer.disabled_reason is None and reducer.collectives == WARMUP + flushes
    return {
        "flush": flush_s[WARMUP:],
        "exchange": exchange_s[WARMUP:],
        "cpu": cpu_s[WARMUP:],
        "sent": sent[WARMUP:],
    }


def _all_gather(rank: int, world: int, flushes: int, group: Any) -> dict[str, list[float]]:
    """The exchange before issue #18: every rank's row to every rank."""
    import torch
    import torch.distributed as dist

    from otel_train.crossrank.up_row import TimerTable, pack, unpack
    from otel_train.distributed import detect_identity

    identity, table = detect_identity(None), TimerTable()
    out: dict[str, list[float]] = {"exchange": [], "cpu": [], "sent": []}
    for seq in range(WARMUP + flushes):
        interval = _interval(seq, rank)
        dist.barrier()
        (_, w0), cpu, start = _io(), time.process_time(), time.perf_counter()
        row = pack(interval, identity, table)
        gathered = torch.empty(world * row.numel(), dtype=torch.float64)
        dist.all_gather_single(gathered, row, group=group)
        unpack(gathered)
        took, used, w1 = time.perf_counter() - start, time.process_time() - cpu, _io()[1]
        if seq >= WARMUP:
            out["exchange"].append(took)
            out["cpu"].append(used)
            out["sent"].append(w1 - w0)
    return out


def rank_target(rank: int, world: int, flushes: int) -> dict[str, dict[str, list[float]]]:
    from otel_train.distributed import create_telemetry_group, detect_identity

    group = create_telemetry_group(detect_identity(None), 60.0)
    return {"star": _star(rank, world, flushes, group), "ring": _all_gather(rank, world, flushes, group)}


def _median(results: list[dict[str, Any]], path: str, key: str) -> float:
    return statistics.median(v for r in results for v in r[path][key])


def _measure(ranks: list[int], flushes: int) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for world in ranks:
        results = run_ranks(world, rank_target, (flushes,), timeout=600)
        root, others = results[:1], results[1:]
        row = {f"{who}_{key}": _median(part, "star", key) for who, part in (("root", root), ("leaf", others))
               for key in ("sent", "cpu", "exchange", "flush")}  # fmt: skip
        row |= {f"ring_{key}": _median(results, "ring", key) for key in ("sent", "cpu", "exchange")}
        row["root_received"] = row["leaf_sent"] * (world - 1)  # every byte out is a byte in
        row["leaf_received"] = row["root_sent"] / (world - 1)
        row["ring_received"] = row["ring_sent"]
        rows[world] = row
        print(f"  measured {world} ranks", flush=True)
    return rows


def _fit(rows: dict[int, dict[str, float]]) -> None:
    """Refit the model's constants on this run (printed beside the committed ones)."""
    model.A_ROOT, model.C_ROOT = model.fit_line([(n, r["root_cpu"]) for n, r in rows.items()])
    model.A_LEAF = statistics.mean(r["leaf_cpu"] for r in rows.values())
    model.A_RING, model.C_RING = model.fit_line([(n, r["ring_cpu"]) for n, r in rows.items()])
    model.FRAME_BYTES = round(statistics.median(r["leaf_sent"] - model.up_bytes() for r in rows.values()))
    model.RING_FRAME_BYTES = round(
        statistics.median(r["ring_sent"] / (n - 1) - model.up_bytes() for n, r in rows.items())
    )


def _kb(n: float) -> str:
    return f"{n / 1e3:5.1f}"


def _cell(measured: dict[str, float], who: str, cost: model.Cost, flush: bool) -> str:
    text = (
        f"{_kb(measured[f'{who}_sent'])}/{_kb(measured[f'{who}_received'])} "
        f"[{_kb(cost.sent_bytes)}/{_kb(cost.received_bytes)}] "
        f"{measured[f'{who}_cpu'] * 1e3:4.1f} [{cost.cpu_s * 1e3:4.1f}] {measured[f'{who}_exchange'] * 1e3:5.1f}"
    )
    return text + (f" {measured[f'{who}_flush'] * 1e3:5.1f}" if flush else "")


def _table(rows: dict[int, dict[str, float]]) -> None:
    print(
        "per flush and rank: kB out/in [model], CPU ms [model], wall ms of the exchange"
        " (and of the whole on_flush for the star)"
    )
    head = "kB out/in [model]      cpu [model] wall"
    print(
        f"{'ranks':>5} | rank 0 (star): {head} flush | other ranks (star): {head} flush | all_gather (before): {head}"
    )
    for n, r in rows.items():
        print(
            f"{n:>5} | {_cell(r, 'root', model.star_root(n), True)} | {_cell(r, 'leaf', model.star_leaf(n), True)}"
            f" | {_cell(r, 'ring', model.all_gather(n), False)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--flushes", type=int, default=30)
    args = parser.parse_args()
    print(
        f"telemetry exchange: up row {model.up_bytes()} B, down row {model.down_bytes()} B, "
        f"{args.flushes} flushes per size, cpu_count={os.cpu_count()}",
        flush=True,
    )
    rows = _measure(args.ranks, args.flushes)
    committed = (model.A_ROOT, model.C_ROOT, model.A_LEAF, model.A_RING, model.C_RING)
    frames = (model.FRAME_BYTES, model.RING_FRAME_BYTES)
    print("\nthe model with its committed constants (bench/exchange_model.py):")
    _table(rows)
    _fit(rows)
    print(
        f"\nrefit on this run (CPU): a_root {model.A_ROOT * 1e3:.3f} ms, c_root {model.C_ROOT * 1e3:.4f} ms/peer, "
        f"a_leaf {model.A_LEAF * 1e3:.3f} ms, a_ring {model.A_RING * 1e3:.3f} ms, "
        f"c_ring {model.C_RING * 1e3:.4f} ms/peer; framing star {model.FRAME_BYTES}, ring "
        f"{model.RING_FRAME_BYTES} B/message (committed: {', '.join(f'{c * 1e3:.3f}' for c in committed)} ms;"
        f" {frames[0]}, {frames[1]} B)"
    )
    _table(rows)
    print(
        f"\nprediction per flush (refit constants; latency with an assumed {model.NETWORK_BYTES_PER_S / 1.25e8:.0f} Gb/s"
        f" and {model.HOP_S * 1e6:.0f} µs per hop):"
    )
    print(model.predictions())


if __name__ == "__main__":
    main()
