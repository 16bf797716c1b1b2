"""The layout of the telemetry exchange as a tree: which rank sends its row to which.

Contiguous subtrees of bounded fan-in, per node first; rank 0's one child (its deputy) heads
every other rank. Design: docs/design/crossrank.md#tree; user view: docs/scale.md#the-tree-exchange_fanin.
"""

from __future__ import annotations

import itertools
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
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    return list(itertools.pairwise(itertools.accumulate(sizes, initial=lo)))


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
    return list(range(0, max(world, 1), unit))
