"""Cost model of the telemetry exchange at one flush, per rank, as a function of the job size N.

Bytes are exact: payload (fixed-size rows: 64 timer slots whether a job runs 4 timers or 64, so
the timer count only enters through `max_timers`) plus gloo's framing per message, `FRAME_BYTES`,
measured. CPU is this process's CPU time (every thread: Python and gloo's), fitted on real gloo
ranks by bench/bench_exchange.py, which prints its own fit beside these constants:

    star, rank 0:    N-1 rows in, N-1 answers out     cpu = a_root + c_root (N-1)
    star, rank r>0:  one row out, one answer in       cpu = a_leaf                     (O(1))
    all_gather:      gloo's ring, N-1 rows in and     cpu = a_ring + c_ring (N-1)
                     out on every rank (before #18)

Latency across hosts adds the network, at an ASSUMED `NETWORK_BYTES_PER_S` per NIC and `HOP_S`
per message (not measured here: the VM has loopback only):

    rank 0:    its cpu + (N-1) rows / bandwidth + 2 hops
    rank r>0:  rank 0's latency + 1 hop (it waits for rank 0's answer, sent after every row)
    all_gather: its cpu + (N-1) x (hop + row / bandwidth): N-1 steps around the ring

Rank 0 is a flat root: its bytes, messages and time grow with N, and a rank r>0 waits for it; what
a rank r>0 sends, receives and computes does not grow. Per-node leaders would cut rank 0's message
count to (nodes + ranks per node), not its bytes (the straggler model needs every rank's row), and
add a hop to every answer, so the exchange keeps one root.

The wall times the bench measures on this 2-core VM (N processes share 2 cores) are dominated by
CPU contention, so they are printed, not fitted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from otel_train.crossrank.down_row import DOWN_LEN
from otel_train.crossrank.up_row import MAX_TIMERS, pack_len

# gloo tcp framing per message beyond the payload (measured with /proc/self/io; the ring's messages
# carry more of it than the star's)
FRAME_BYTES = 144
RING_FRAME_BYTES = 287
NETWORK_BYTES_PER_S = 1.25e9  # assumed: 10 Gb/s per rank
HOP_S = 25e-6  # assumed: one message's latency between hosts

# CPU seconds per flush, fitted by bench/bench_exchange.py on this project's 2-core VM (2 to 16
# ranks, 30 flushes each). Per peer, rank 0 pays one gloo receive and one send with their thread
# wake-ups (~0.2 ms here), about what every rank paid per peer in the all_gather ring.
A_ROOT, C_ROOT = 0.19e-3, 0.209e-3
A_LEAF = 0.45e-3
A_RING, C_RING = 1.00e-3, 0.238e-3


@dataclass(frozen=True)
class Cost:
    sent_bytes: int
    received_bytes: int
    messages: int  # messages sent + received
    cpu_s: float  # this rank's CPU time
    seconds: float  # latency across hosts (assumed network)


def up_bytes(max_timers: int = MAX_TIMERS) -> int:
    return 8 * pack_len(max_timers)


def down_bytes() -> int:
    return 8 * DOWN_LEN


def star_root(ranks: int, max_timers: int = MAX_TIMERS) -> Cost:
    peers = ranks - 1
    received = peers * (up_bytes(max_timers) + FRAME_BYTES)
    cpu = A_ROOT + C_ROOT * peers
    return Cost(
        peers * (down_bytes() + FRAME_BYTES),
        received,
        2 * peers,
        cpu,
        cpu + received / NETWORK_BYTES_PER_S + 2 * HOP_S,
    )


def star_leaf(ranks: int, max_timers: int = MAX_TIMERS) -> Cost:
    return Cost(
        up_bytes(max_timers) + FRAME_BYTES,
        down_bytes() + FRAME_BYTES,
        2,
        A_LEAF,
        star_root(ranks, max_timers).seconds + HOP_S,
    )


def all_gather(ranks: int, max_timers: int = MAX_TIMERS) -> Cost:
    peers = ranks - 1
    row = up_bytes(max_timers) + RING_FRAME_BYTES
    cpu = A_RING + C_RING * peers
    return Cost(peers * row, peers * row, 2 * peers, cpu, cpu + peers * (HOP_S + row / NETWORK_BYTES_PER_S))


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = a + c * (N-1) over (ranks, seconds) points."""
    xs = [float(n - 1) for n, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - c * mx, c


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _cell(cost: Cost) -> str:
    return (
        f"{_mb(cost.sent_bytes):>8} out {_mb(cost.received_bytes):>8} in, "
        f"cpu {cost.cpu_s * 1e3:>6.1f} ms, latency {cost.seconds * 1e3:>6.1f} ms"
    )


def predictions(ranks: tuple[int, ...] = (1_000, 10_000)) -> str:
    """The README's table: per flush and rank, at large job sizes."""
    lines = []
    for n in ranks:
        lines.append(f"{n:>6} ranks, rank 0 (star):        {_cell(star_root(n))}")
        lines.append(f"{n:>6} ranks, rank r>0 (star):      {_cell(star_leaf(n))}")
        lines.append(f"{n:>6} ranks, every rank (all_gather): {_cell(all_gather(n))}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(predictions())
