"""The tree exchange realigns after one late flush (real gloo ranks, exchange_fanin=2 so that 4
ranks form a tree: rank 0 heads ranks 1 and 3, rank 1 heads rank 2; `tree.layout`).

A stall on rank 0's background worker merges several of its flushes into one: rank 0 flushes
(19, 38] where every other rank flushed (19, 24] and then (24, 39]. Rank 0 takes both of a child's
bundles at that flush, the second reaching past it; from its next flush on, every rank's rows
cover the same steps again, so the cross-rank view must come back whole (docs/reliability.md),
and each rank's job block still counts once. An inner rank whose own flush came late is the same
case one level down: it is driven here flush by flush (`TreeExchange._gather`), with its child's
bundles as `StarExchange.gather` takes them. So is an inner rank whose own steps are behind its
children's for good: a child whose bundle came one flush late must catch up with its sibling, and
when the loop begins again the rank reaches for its own steps again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.late_flush import LATE_STEPS, PEER_STEPS, flush_through, interval
from helpers.multirank import run_ranks

from otel_train.crossrank import job_block, wire
from otel_train.crossrank.exchange import Exchanged
from otel_train.crossrank.merge import HEAD, HEAD_LEN, Bundle, merge
from otel_train.crossrank.tree import layout
from otel_train.crossrank.tree_exchange import TreeExchange
from otel_train.crossrank.up_row import row_steps

WORLD = 4


def stalled_root_target(rank: int, world: int) -> dict[str, Any]:
    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import detect_identity

    # A grace long enough that every rank takes its children's next bundles at the late flush
    # however slow the machine (the ranks here flush back to back; a real job's flushes are
    # seconds apart).
    config = Config(collective_timeout_s=30.0, exchange_grace_s=10.0, exchange_fanin=2)
    reducer = CrossRankReducer(detect_identity(None), None, None, config)
    assert isinstance(reducer.exchange, TreeExchange)
    tokens = []  # rank 0: the job blocks' tokens that each flush brought

    def publish(blocks: Any, names: Any, elapsed_s: float) -> None:
        tokens.append(job_block.decode(job_block.combine(blocks.reshape(-1, blocks.shape[-1]))).tokens)

    reducer.job.publish = publish  # type: ignore[method-assign]
    ranks_seen = flush_through(reducer, rank)  # rank 0: at each flush, the ranks it pairs
    return {"ranks": ranks_seen, "tokens": sum(tokens), "left_out": reducer.pairing.left_out_rows}


@pytest.mark.multirank
def test_the_tree_view_comes_back_after_one_late_flush_on_rank_0() -> None:
    result = run_ranks(WORLD, stalled_root_target, timeout=180)[0]
    ranks_seen = result["ranks"]
    assert ranks_seen[:4] == [WORLD] * 4, ranks_seen  # in lockstep before the stall
    # The late flush (19, 38] and the next, (38, 39], match no child's bundle; then all pair again.
    assert ranks_seen[6:] == [WORLD] * 4, ranks_seen
    assert result["left_out"] <= 2 * 3, result  # at most the three other ranks' two rows of the stall
    assert result["tokens"] == WORLD * (PEER_STEPS[-1] + 1), result  # every rank's steps, once each


class _Children:
    """`StarExchange.gather` over some children, as it takes rows: of each child, the messages that
    came (the caller moves `come` along with the child's flushes), in order, up to the first that
    reaches the flush; for an expected child without one, its next message when `within_grace`
    (the flushes here are closer together than the grace)."""

    def __init__(self, messages: dict[int, list[Any]], within_grace: bool = True) -> None:
        self.messages, self.within_grace = messages, within_grace
        self.come = dict.fromkeys(messages, 0)
        self.taken: dict[int, list[tuple[int, int]]] = {child: [] for child in messages}  # steps, in order
        self.reached: list[bool] = []  # of each message taken, whether it reached the flush

    def gather(self, up: Any, answers: Any, expect: Any, current: Any, defer: bool = False) -> Exchanged:
        got: list[Any] = []
        ranks = [1]
        for child, messages in self.messages.items():
            waited = self.within_grace and (expect is None or child in expect)
            while messages and (self.come[child] > 0 or waited):
                got.append(messages.pop(0))
                ranks.append(child)
                self.come[child] = max(self.come[child] - 1, 0)
                self.taken[child].append(row_steps(got[-1][HEAD_LEN:]))
                self.reached.append(current(got[-1]))
                if self.reached[-1]:
                    break
        return Exchanged([up, *got], None, ranks)


def _bundle(exchange: TreeExchange, rank: int, steps: tuple[int, int]) -> Any:
    from otel_train.crossrank.up_row import TimerTable, pack
    from otel_train.distributed import Identity

    flushed = interval(0, steps[1], steps[1] - steps[0])
    identity = Identity("job", rank=rank, world_size=exchange.layout.world)
    row = pack(flushed, identity, TimerTable(), from_step=steps[0])
    row = torch.cat([row, torch.zeros(exchange.row_len - row.numel(), dtype=torch.float64)])
    message = exchange._encode(Bundle.of_row(row.tolist(), rank, row), rank)
    assert message[HEAD.at("version")].item() == wire.VERSION
    return row, message


def test_an_inner_rank_forwards_its_childs_bundle_of_its_own_steps_after_its_late_flush() -> None:
    shape = layout(WORLD, 2)
    assert shape.children[1] == (2,) and shape.parent[1] == 0
    exchange = TreeExchange(None, 1, shape, timeout_s=30.0, grace_s=1.0)
    ends = list(zip([-1, *PEER_STEPS], PEER_STEPS, strict=False))
    # Rank 2 flushes PEER_STEPS; rank 1 flushes LATE_STEPS, its late flush (19, 38] just after
    # rank 2's flush of (24, 39] and just before its own of (38, 39].
    child = _Children({2: [_bundle(exchange, 2, steps)[1] for steps in ends]})
    exchange.below = child  # type: ignore[assignment]
    come = [1, 1, 1, 1, 2, 0, 1, 1, 1, 1]  # rank 2's bundles come before each of rank 1's flushes
    forwarded = []  # at each of rank 1's flushes, how many ranks' rows of its own steps it sends up
    previous = -1
    for index, step in enumerate(LATE_STEPS):
        child.come[2] += come[index]
        own_row, _ = _bundle(exchange, 1, (previous, step))
        own = Bundle.of_row(own_row.tolist(), 1, own_row)
        parts, _, _ = exchange._gather(own_row, own, (previous, step), None, [])
        forwarded.append(sum(row_steps(p.exact[0]) == (previous, step) for p in parts))
        previous = step
    assert child.taken[2] == ends, child.taken  # each bundle once, in order
    # From the flush after the late one's next on, each flush sends rank 2's row up with its own.
    assert forwarded[:4] == [2] * 4, forwarded
    assert forwarded[6:] == [2] * 4, (forwarded, child.taken)


def _subtree_bundle(exchange: TreeExchange, head: int, steps: tuple[int, int]) -> Any:
    """The bundle rank `head` sends up for its whole subtree, every rank of it at `steps`."""
    lo, hi = exchange.layout.span[head]
    rows = [_bundle(exchange, rank, steps)[0] for rank in range(lo, hi)]
    merged = merge(
        [Bundle.of_row(row.tolist(), rank, row) for rank, row in zip(range(lo, hi), rows, strict=True)]
    )
    return exchange._encode(merged, head)


def test_an_inner_rank_behind_for_good_keeps_its_children_in_step_after_one_comes_late() -> None:
    """Rank 1 of 8 (fan-in 2) heads ranks 2 and 5, each the head of 3 ranks; its own steps are
    behind theirs for good (a paused deputy), so it forwards its children's bundles as they come.
    Rank 5's bundle of one flush comes after the grace, with its next one: from then on rank 1
    must still forward both children's bundles of the same steps (6 ranks), not one child's a
    flush behind the other's for good (left out every flush)."""
    shape = layout(8, 2)
    assert shape.children[1] == (2, 5) and shape.span[2] == (2, 5) and shape.span[5] == (5, 8)
    exchange = TreeExchange(None, 1, shape, timeout_s=30.0, grace_s=1.0)
    flushes = 10
    theirs = [(1000 + 10 * i, 1009 + 10 * i) for i in range(flushes)]
    children = _Children({head: [_subtree_bundle(exchange, head, at) for at in theirs] for head in (2, 5)})
    children.within_grace = False  # each message is taken only once it came (`come`)
    exchange.below = children  # type: ignore[assignment]
    late = 3  # rank 5's bundle of this flush comes with its next one
    forwarded = []  # at each flush of rank 1, the ranks of its children's rows it sends up
    for index in range(flushes):
        children.come[2] += 1
        children.come[5] += 0 if index == late else 2 if index == late + 1 else 1
        mine = (10 * index, 10 * index + 9)
        own_row, _ = _bundle(exchange, 1, mine)
        own = Bundle.of_row(own_row.tolist(), 1, own_row)
        parts, _, _ = exchange._gather(own_row, own, mine, None, [])
        forwarded.append(sum(part.ranks for part in parts if row_steps(part.exact[0]) != mine))
    assert forwarded[:late] == [6] * late, forwarded
    assert forwarded[late] == 3, forwarded  # rank 5's bundle did not come
    assert forwarded[late + 1 :] == [6] * (flushes - late - 1), (forwarded, children.taken)


def test_an_inner_rank_whose_steps_begin_again_reaches_for_its_new_steps() -> None:
    """Rank 1 behind its children for good, then the whole job's loop begins again at step 0 (a
    retried `train()`): the children's bundles of its new steps reach its flush at once (no wait
    for bundles of steps past those it sent up before), and both are forwarded with its own row."""
    shape = layout(8, 2)
    exchange = TreeExchange(None, 1, shape, timeout_s=30.0, grace_s=1.0)
    theirs = [(1000 + 10 * i, 1009 + 10 * i) for i in range(3)] + [(10 * i, 10 * i + 9) for i in range(3)]
    children = _Children({head: [_subtree_bundle(exchange, head, at) for at in theirs] for head in (2, 5)})
    children.within_grace = False
    exchange.below = children  # type: ignore[assignment]
    mine = [(10 * i, 10 * i + 9) for i in range(3)] * 2  # behind, then the loop begins again
    forwarded = []
    for steps in mine:
        children.come[2] += 1
        children.come[5] += 1
        own_row, _ = _bundle(exchange, 1, steps)
        own = Bundle.of_row(own_row.tolist(), 1, own_row)
        parts, _, _ = exchange._gather(own_row, own, steps, None, [])
        forwarded.append(sum(part.ranks for part in parts))
    assert children.reached == [True] * 12, children.reached
    assert forwarded == [6, 6, 6, 7, 7, 7], forwarded  # its own row with them once in step again
