"""Which rows rank 0 pairs at a flush: only rows that cover exactly its own steps (every row
carries the steps it covers), so a late or misaligned row is never compared with other steps. The
rest are left out of that flush's stats and verdicts, counted (`left_out_rows`, `partial_flushes`)
and warned about once. Also whether a tree's rows let rank 0 judge arrivals at collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from otel_train.crossrank.merge import TreeView
from otel_train.crossrank.up_row import RankRecord

logger = logging.getLogger("otel_train")


class RowPairing:
    """Rank 0's count of the rows it left out (each flush's rows are paired by their steps)."""

    def __init__(self) -> None:
        self.left_out_rows = 0  # rows taken that covered other steps than rank 0's own
        self.partial_flushes = 0  # flushes whose cross-rank view lacked a rank
        self._warned = False

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
