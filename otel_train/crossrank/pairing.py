"""Which rows rank 0 pairs at a flush: only rows that cover exactly its own steps (every row
carries the steps it covers), so a late or misaligned row is never compared with other steps. The
rest are left out of that flush's stats and verdicts, counted (`left_out_rows`, `partial_flushes`)
and warned about once. A star row that reaches past rank 0's flush (rank 0's worker flushed late)
is held for the flush that reaches its steps, so the pairing realigns there. Also whether a tree's
rows let rank 0 judge arrivals at collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from otel_train.crossrank.merge import TreeView
from otel_train.crossrank.up_row import RankRecord

logger = logging.getLogger("otel_train")

# Rows of one peer held for a later flush of rank 0: a peer ahead by more flushes than this (not in
# lockstep) could never be paired anyway, and holding them all would grow with its lead.
MAX_HELD = 2


class RowPairing:
    """Rank 0's count of the rows it left out (each flush's rows are paired by their steps)."""

    def __init__(self) -> None:
        self.left_out_rows = 0  # rows taken that covered other steps than rank 0's own
        self.partial_flushes = 0  # flushes whose cross-rank view lacked a rank
        self._warned = False
        # Star rows taken before rank 0's flush reached their last step (a [n, row] tensor, or
        # None) and the (rank, last step) of each: rank 0 takes each peer's rows in order up to the
        # first that reaches its flush, so after one late flush of its own (a stalled worker) a
        # peer's row may cover steps up to rank 0's NEXT flush. Held and paired there, instead of
        # left out, the peer's next rows meet rank 0's again.
        self._held: Any = None
        self._held_steps: list[tuple[int, int]] = []

    def ready(self, step: int) -> set[int]:
        """The peers whose held row already reaches `step`: rank 0 need not wait for them."""
        return {rank for rank, last in self._held_steps if last >= step}

    def with_held(self, rows: Any) -> Any:
        """Rank 0 (star): this flush's rows with the rows held for it, after its own row (so each
        peer's rows stay in the order they came)."""
        import torch

        return rows if self._held is None else torch.cat([rows[:1], self._held, rows[1:]])

    def hold(self, rows: Any, records: Sequence[RankRecord], step: int) -> tuple[Any, list[RankRecord]]:
        """Rank 0 (star): of `rows` (`with_held`'s) and their `records`, hold the peers' rows that
        end after `step` for a later flush; returns the others (this flush's), rank 0's first."""
        kept, later, held = [], [], dict[int, int]()
        for i, record in enumerate(records):
            if i == 0 or record.step <= step:
                kept.append(i)
            elif held.get(record.rank, 0) < MAX_HELD:
                held[record.rank] = held.get(record.rank, 0) + 1
                later.append(i)
            else:  # a peer this far ahead is not in lockstep with rank 0: never paired
                self.left_out_rows += 1
        self._held = rows[later].clone() if later else None
        self._held_steps = [(records[i].rank, records[i].step) for i in later]
        return rows[kept], [records[i] for i in kept]

    def forget_held(self) -> None:
        self._held, self._held_steps = None, []

    def same_steps(self, records: Sequence[RankRecord], from_step: int, step: int, world: int) -> list[int]:
        """The indexes of the rows that cover exactly (from_step, step]; the others are counted."""
        same = [i for i, r in enumerate(records) if (r.from_step, r.step) == (from_step, step)]
        self.note([r for i, r in enumerate(records) if i not in same], len(same), world, from_step, step)
        return same

    def note(
        self, left_out: Sequence[RankRecord], paired: int, world: int, from_step: int, step: int
    ) -> None:
        """Count the rows left out of a flush (and the flush, when it lacked a rank); warn once."""
        self.left_out_rows += len(left_out)
        if paired < world:
            self.partial_flushes += 1
        if left_out and not self._warned:
            self._warned = True
            logger.warning(
                "otel_train: rank(s) %s sent rows for other steps than rank 0's (after step %d up to %d; "
                "theirs: %s); a row is left out of a flush's cross-rank stats unless it covers the same "
                "steps (ranks not in lockstep, or a flush that came late)",
                [r.rank for r in left_out],
                from_step,
                step,
                [(r.from_step, r.step) for r in left_out],
            )


def unjudged(tree: TreeView, exchange: Any, host: str) -> str | None:
    """Why a tree's rows do not let rank 0 judge arrivals at collectives (None: they do). That
    needs every rank's row whole, and each one's clock offset to rank 0 (rank 0's host reads its
    clock; elsewhere a rank's offset is to its parent, so that parent must be rank 0)."""
    world, fanin = exchange.layout.world, exchange.layout.fanin
    keep = f"an exchange_fanin of at least {world - 1} keeps the exact star (every rank answers to rank 0)"
    if tree.summary:
        return (
            f"arrivals at collectives cannot be judged: rank 0 has {len(tree.exact)} of {world} ranks' "
            f"rows whole (the tree of exchange_fanin={fanin} summarizes the rest); {keep}"
        )
    parent = exchange.layout.parent
    far = sorted(r.rank for r in tree.exact if r.host != host and parent[r.rank] != 0)
    if not far:
        return None
    names = f"rank {far[0]}" if len(far) == 1 else f"ranks {', '.join(str(r) for r in far)}"
    return (
        f"arrivals at collectives cannot be judged: {names}, on another host than rank 0, answer(s) to "
        f"rank(s) {sorted({parent[r] for r in far})} in the tree of exchange_fanin={fanin}, so "
        f"{'its' if len(far) == 1 else 'their'} clock offset is known to that rank, not to rank 0; {keep}"
    )
