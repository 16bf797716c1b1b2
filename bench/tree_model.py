"""Cost model of the tree exchange (otel_train/crossrank/tree_exchange.py) at one flush, per rank,
beside the star's (bench/exchange_model.py).

Every message is a fixed size: up, a bundle (merge.bundle_len: K_EXACT whole rows and LEVELS
summary rows); down, the tree's answer (down_row.TREE_DOWN_LEN). A rank with c children receives
c bundles and sends c answers, and sends one bundle and receives one answer from its parent, so

    cpu(c)  = A_NODE + C_CHILD x c          (fitted by bench/bench_tree.py over the ranks other than
                                             rank 0: the flush listener's thread time. Rank 0 has
                                             one child, its deputy (tree.layout), and draws the
                                             verdicts: its own figure is measured, the same at any N)
    bytes   = (c + 1) x (bundle + answer + 2 frames)
    depth   = tree.layout(N, fanin, ranks per node).depth()   (O(log_fanin N) + 1 per node + 1 deputy)
    wall    = depth x (cpu(fan-in) + 2 hops + fan-in x bundle / bandwidth)   (an answer reaches the
                                             deepest rank after every level merged and answered)

The largest c is the fan-in, 2 x fan-in for a node leader (its node's ranks and other leaders).
Network figures are ASSUMED as in exchange_model (loopback only here).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exchange_model import FRAME_BYTES, HOP_S, NETWORK_BYTES_PER_S

from otel_train.crossrank.arrival_block import BLOCK_LEN
from otel_train.crossrank.down_row import TREE_DOWN_LEN
from otel_train.crossrank.merge import bundle_len
from otel_train.crossrank.replicas import EXT_LEN
from otel_train.crossrank.tree import layout
from otel_train.crossrank.up_row import pack_len

# Thread CPU seconds per flush, fitted by bench/bench_tree.py on this project's 2-core VM.
A_NODE, C_CHILD = 1.73e-3, 0.61e-3  # 2 to 32 ranks but rank 0, fan-in 4, 20 flushes each (2026-11-25)


@dataclass(frozen=True)
class TreeCost:
    children: int
    bytes: int  # sent + received
    cpu_s: float
    depth: int
    wall_s: float


def bundle_bytes() -> int:
    return 8 * bundle_len(pack_len() + EXT_LEN + BLOCK_LEN, pack_len())


def answer_bytes() -> int:
    return 8 * TREE_DOWN_LEN


def worst_rank(ranks: int, fanin: int, per_node: int | None = 8) -> TreeCost:
    """The rank with the most children (the costliest) in a job of `ranks`."""
    shape = layout(ranks, fanin, per_node)
    children = max(len(c) for c in shape.children)
    message = bundle_bytes() + answer_bytes() + 2 * FRAME_BYTES
    cpu = A_NODE + C_CHILD * children
    depth = shape.depth()
    level = A_NODE + C_CHILD * fanin + 2 * HOP_S + fanin * bundle_bytes() / NETWORK_BYTES_PER_S
    return TreeCost(children, (children + 1) * message, cpu, depth, depth * level)


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = a + c x children."""
    xs, ys = [float(c) for c, _ in points], [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - c * mx, c


def predictions(ranks: tuple[int, ...] = (10_000, 100_000), fanins: tuple[int, ...] = (4, 16)) -> str:
    lines = []
    for n in ranks:
        for f in fanins:
            cost = worst_rank(n, f)
            lines.append(
                f"{n:>7} ranks, fan-in {f:>2} (8 per node): busiest rank {cost.children:>2} children, "
                f"{cost.bytes / 1e3:6.0f} kB, cpu {cost.cpu_s * 1e3:5.1f} ms; depth {cost.depth}, "
                f"answer to the deepest rank {cost.wall_s * 1e3:5.1f} ms"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(predictions())
