"""The exchange's tree (crossrank/tree) and what travels up it (crossrank/merge), without processes:
real packed rows of many ranks merged level by level as the tree's ranks merge them, and the
verdicts rank 0 draws from the merged bundle compared with the star's (every row exact)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from otel_train.core.buffer import Interval
from otel_train.crossrank.merge import (
    K_EXACT,
    LEVELS,
    Bundle,
    bundle_len,
    decode,
    encode,
    join,
    merge,
    unpacked,
    widen_waiting,
)
from otel_train.crossrank.tree import layout
from otel_train.crossrank.up_row import TimerTable, pack, pack_len, unpack
from otel_train.crossrank.verdicts import RankView, Settings, assess
from otel_train.distributed import Identity

STEP = 0.25
BASE = {"data": 0.002, "forward": 0.030, "backward": 0.060, "optimizer": 0.005}


@pytest.mark.parametrize("world", [2, 4, 5, 16, 17, 100, 1000])
@pytest.mark.parametrize("fanin", [2, 4, 16])
def test_layout_is_a_tree_of_contiguous_subtrees_with_bounded_fanin(world: int, fanin: int) -> None:
    shape = layout(world, fanin)
    assert shape.parent[0] == -1 and shape.span[0] == (0, world)
    for rank in range(1, world):
        up = shape.parent[rank]
        assert 0 <= up < rank and rank in shape.children[up]
        lo, hi = shape.span[rank]
        assert lo == rank and shape.span[up][0] < lo and hi <= shape.span[up][1]
    for rank in range(world):  # the children's spans tile the rest of the subtree
        covered = [rank] + [r for c in shape.children[rank] for r in range(*shape.span[c])]
        assert sorted(covered) == list(range(*shape.span[rank]))
        assert len(shape.children[rank]) <= fanin
    assert shape.star == (fanin >= world - 1)
    deputy = world > K_EXACT and not shape.star  # rank 0 draws the verdicts and merges nothing
    if deputy:
        assert shape.children[0] == (1,) and shape.span[1] == (1, world)
    levels = 0
    while fanin**levels < world - deputy:  # the deputy's subtree is one level below rank 0
        levels += 1
    assert shape.depth() <= max(levels + deputy, 1)


def test_layout_groups_ranks_per_node_first() -> None:
    shape = layout(16, 2, local_world=4)  # 4 nodes of 4 ranks
    for rank in range(16):
        if rank % 4:  # a rank's parent is on its node, unless it leads the node
            assert shape.parent[rank] // 4 == rank // 4
        elif rank:  # a leader's parent is a leader, or rank 0's deputy (rank 1, on node 0)
            assert shape.parent[rank] % 4 == 0 or shape.parent[rank] == 1
    assert all(len(c) <= 2 * 2 for c in shape.children)
    assert layout(16, 4, local_world=5).parent == layout(16, 4).parent  # does not divide: ignored


def test_a_fanin_reaching_every_rank_is_the_star() -> None:
    assert layout(4, 4).star and layout(4, 3).star and not layout(4, 2).star
    assert layout(16, 15).children[0] == tuple(range(1, 16))


def _interval(rank: int, culprit: int) -> Interval:
    jitter = 1.0 + 0.01 * ((rank * 7) % 5 - 2)
    phases = {name: value * jitter for name, value in BASE.items()}
    if rank == culprit:
        phases["forward"] *= 2.0
    phases["allreduce"] = STEP - sum(phases.values())
    arrivals, elapsed = {}, 0.0
    for name, value in phases.items():
        elapsed += value
        arrivals[name] = [elapsed] * 10
    return Interval(
        seq=3,
        step=39,
        wall_time=time.time(),
        elapsed_s=10 * STEP,
        steps=10,
        tokens=0,
        samples=0,
        step_durations=[STEP] * 10,
        phases={name: [value] * 10 for name, value in phases.items()},
        arrivals=arrivals,
    )


def _rows(world: int, culprit: int) -> list[list[float]]:
    out = []
    for rank in range(world):
        identity = Identity("run", rank=rank, world_size=world, host=f"h{rank}")
        out.append(pack(_interval(rank, culprit), identity, TimerTable(), from_step=29).tolist())
    return out


def _merge_up(rows: list[list[float]], fanin: int) -> Bundle:
    """Merge as the tree does: deepest ranks first, each rank its own row and its children's
    bundles, through the wire format; rank 0 joins its deputy's bundle (`tree_exchange`)."""
    shape = layout(len(rows), fanin)
    base = pack_len()
    done: dict[int, Any] = {}
    for rank in sorted(range(len(rows)), key=lambda r: -_depth(shape.parent, r)):
        own = torch.tensor(rows[rank], dtype=torch.float64)
        parts = [Bundle.of_row(rows[rank], rank, own)] + [
            decode(done[c], base, base) for c in shape.children[rank]
        ]
        if rank == 0:
            return join(*parts) if len(parts) == 2 else merge(parts)
        done[rank] = encode(merge(parts), base, base)
        assert done[rank].numel() == bundle_len(base, base)  # bounded, whatever the subtree
    raise AssertionError("rank 0 is the shallowest rank")


def _depth(parent: tuple[int, ...], rank: int) -> int:
    hops = 0
    while parent[rank] >= 0:
        hops, rank = hops + 1, parent[rank]
    return hops


def _views(records: list[Any], weight: float = 1.0) -> list[RankView]:
    names = {ident: name for r in records for ident, name in r.announced.items()}
    return [
        RankView(
            r.rank,
            r.host,
            r.local_rank,
            r.step_stats,
            {n: t.arrival for n, t in r.named_timers(names).items()},
            weight if r.rank < 0 else 1.0,
        )
        for r in records
    ]


def test_a_small_job_travels_whole_through_the_tree() -> None:
    rows = _rows(K_EXACT, culprit=2)
    bundle = _merge_up(rows, fanin=2)
    assert sorted(bundle.exact) == sorted(rows) and bundle.summary == [] and bundle.ranks == K_EXACT


@pytest.mark.parametrize("fanin", [2, 4])
def test_the_tree_names_the_stars_culprit_and_its_waiting_ranks(fanin: int) -> None:
    world, culprit = 32, 13
    rows = _rows(world, culprit)
    star = assess(_views(unpack(_tensor(rows))), Settings())
    late = max(star, key=lambda a: a.chronic.seconds)
    assert late.rank == culprit and late.waiting_ranks == tuple(r for r in range(world) if r != culprit)

    bundle = _merge_up(rows, fanin)
    tree = unpacked(bundle, pack_len())
    # the whole rows come as the tensors they travelled in, the same as the rows parsed
    assert bundle.tensor is not None and torch.equal(
        tree.rows, torch.tensor(bundle.exact, dtype=torch.float64)
    )
    # rank 0's own row and its deputy's bundle as it came: one exact row more than a bundle holds
    assert len(tree.exact) == K_EXACT + 1 and len(tree.summary) == LEVELS and tree.ranks == world
    assert tree.weight * LEVELS + K_EXACT + 1 == pytest.approx(world)
    assert culprit in {r.rank for r in tree.exact}  # the rank that strays most stays whole
    found = widen_waiting(assess(_views(tree.exact + tree.summary, tree.weight), Settings()), tree)
    worst = max(found, key=lambda a: a.chronic.seconds)
    assert worst.rank == culprit and worst.chronic.late_in == "forward"
    assert worst.chronic.sync_phase == late.chronic.sync_phase is not None
    assert worst.chronic.seconds == pytest.approx(late.chronic.seconds, rel=0.05)
    assert worst.waiting_ranks == late.waiting_ranks
    by_rank = {a.rank: a for a in star}  # every rank kept whole is judged as in the star
    assert all(a.chronic.seconds == pytest.approx(by_rank[a.rank].chronic.seconds, abs=1e-4) for a in found)


def test_the_summary_median_is_within_its_documented_bound() -> None:
    """LEVELS quantile rows per fold: after d folds the summary's median lies between the true
    quantiles 1/2 -+ d / (2 LEVELS) of the summarized ranks (merge module doc)."""
    world = 256
    rows = _rows(world, culprit=-1)
    shape = layout(world, 4)
    tree = unpacked(_merge_up(rows, 4), pack_len())
    exact = {r.rank for r in tree.exact}
    forward = sorted(r.step_stats.median for r in unpack(_tensor(rows)) if r.rank not in exact)
    truth = sorted(
        t.arrival.median
        for r in unpack(_tensor(rows))
        if r.rank not in exact
        for t in r.timers.values()
        if t.count and abs(t.mean - BASE["forward"]) < 0.01
    )
    summary = [
        t.arrival.median
        for r in tree.summary
        for t in r.timers.values()
        if abs(t.mean - BASE["forward"]) < 0.01
    ]
    middle = sorted(summary)[len(summary) // 2]
    folds = shape.depth() - 1  # every rank with children folds, but rank 0 (it joins)
    lo = truth[max(0, int((0.5 - folds / (2 * LEVELS)) * len(truth)) - 1)]
    hi = truth[min(len(truth) - 1, int((0.5 + folds / (2 * LEVELS)) * len(truth)))]
    assert lo <= middle <= hi and forward  # step medians are all STEP


def _tensor(rows: list[list[float]]) -> Any:
    return torch.tensor(rows, dtype=torch.float64)
