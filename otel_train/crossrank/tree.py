"""The shape of the telemetry exchange: which rank sends its row to which (`tree_exchange`).

Every rank heads a CONTIGUOUS range of ranks (its subtree) and splits the rest of its range into at
most `fanin` contiguous blocks, each headed by the block's first rank, recursively. Contiguous
subtrees keep every merged row's set of ranks a few runs (`merge`), and the depth is
ceil(log_fanin(world)) plus one level per node and one for rank 0's deputy (below).

Per node first: where the job's nodes are known (`shape`: runs of consecutive ranks that report
the same host and node rank, as torchrun, SLURM and MPI launchers number them; nodes of any size),
the tree is built over node blocks (each headed by its node's first rank, the node leader), and
each leader heads its own node's ranks with the same fan-in. A leader so has at most 2 x fanin children (its node's and other
leaders'); every other rank at most fanin. Rows inside a node never cross the network.

Rank 0 alone draws the verdicts, so in a tree of more than `merge.K_EXACT` ranks it merges
nothing: its one child, rank 1 (its deputy), heads every other rank, and rank 0 takes that one
bundle as it comes (`merge.join`). So rank 0's CPU per flush is one bundle's and the verdicts',
whatever the job size (issue #28; the depth is one more). A smaller tree travels whole, and its
rank 0 keeps its children, whose clock stamps are then to rank 0 itself (`collective_lateness`).

A fan-in >= world - 1 is the star, whatever the nodes: rank 0 is every other rank's parent
(`exchange.StarExchange`), and it judges every rank's arrivals at collectives itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from otel_train.crossrank.merge import K_EXACT


@dataclass(frozen=True)
class Layout:
    """One job's tree: parent[r] (-1 for rank 0), children[r] (ascending), span[r] = (lo, hi): the
    ranks of r's subtree, lo = r."""

    world: int
    fanin: int
    parent: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    span: tuple[tuple[int, int], ...]

    @property
    def star(self) -> bool:
        return all(p <= 0 for p in self.parent)

    def depth(self) -> int:
        """Edges from the deepest rank up to rank 0."""
        deepest = 0
        for rank in range(self.world):
            hops, at = 0, rank
            while self.parent[at] >= 0:
                hops, at = hops + 1, self.parent[at]
            deepest = max(deepest, hops)
        return deepest


def _blocks(lo: int, hi: int, fanin: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into at most `fanin` contiguous blocks of near-equal size."""
    n = hi - lo
    parts = min(fanin, n)
    out, at = [], lo
    for i in range(parts):
        size = n // parts + (1 if i < n % parts else 0)
        out.append((at, at + size))
        at += size
    return out


def layout(
    world: int, fanin: int, local_world: int | None = None, nodes: Sequence[int] | None = None
) -> Layout:
    """The tree of `world` ranks (module doc). `nodes`: the first rank of each node, ascending (the
    job's, `shape.agree`); else `local_world`: ranks per node, where it divides the world; else one
    node. A fan-in that reaches every rank from rank 0 is the star, whatever the nodes."""
    if fanin < 2:
        raise ValueError("exchange_fanin must be >= 2")
    starts = _node_starts(world, local_world, nodes)
    ends = [*starts[1:], world]
    node_of = [0] * world
    for index, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        node_of[lo:hi] = [index] * (hi - lo)
    parent = [-1] * world
    span = [(r, r + 1) for r in range(world)]

    def head_ranks(lo: int, hi: int) -> None:
        span[lo] = (lo, hi)
        for b_lo, b_hi in _blocks(lo + 1, hi, fanin):
            parent[b_lo] = lo
            head_ranks(b_lo, b_hi)

    def head(lo: int, last_node: int) -> None:
        """Rank lo heads the rest of its node, rank by rank, and the nodes after it up to
        `last_node` (exclusive), block by block, each block headed by its first node's leader."""
        first = node_of[lo]
        span[lo] = (lo, ends[last_node - 1])
        for b_lo, b_hi in _blocks(lo + 1, ends[first], fanin):
            parent[b_lo] = lo
            head_ranks(b_lo, b_hi)
        for n_lo, n_hi in _blocks(first + 1, last_node, fanin):
            parent[starts[n_lo]] = lo
            head(starts[n_lo], n_hi)

    if fanin >= world - 1:  # the exact star: every rank answers to rank 0
        parent[1:] = [0] * (world - 1)
        span[0] = (0, world)
    elif world > K_EXACT:  # rank 0 heads only its deputy, which heads the rest
        parent[1], span[0] = 0, (0, world)
        head(1, len(starts))
    else:
        head(0, len(starts))
    children: list[list[int]] = [[] for _ in range(world)]
    for rank, up in enumerate(parent):
        if up >= 0:
            children[up].append(rank)
    return Layout(world, fanin, tuple(parent), tuple(tuple(c) for c in children), tuple(span))


def _node_starts(world: int, local_world: int | None, nodes: Sequence[int] | None) -> list[int]:
    if nodes:
        starts = sorted({n for n in nodes if 0 < n < world})
        return [0, *starts]
    unit = local_world if local_world and 1 < local_world < world and world % local_world == 0 else 1
    return list(range(0, max(world, 1), unit)) if unit > 1 else list(range(max(world, 1)))
