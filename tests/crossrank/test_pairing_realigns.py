"""Rank 0's pairing realigns after one late flush of its own (real gloo ranks, the star).

A stall on rank 0's background worker merges several of its flushes into one: rank 0 flushes
(19, 38] where its peers flushed (19, 24] and then (24, 39]. Rank 0 takes both of a peer's rows at
that flush, the second reaching past it; from its next flush on, every rank's rows cover the same
steps again, so the cross-rank stats and verdicts must come back (docs/reliability.md).
"""

from __future__ import annotations

import pytest
from helpers.late_flush import flush_through
from helpers.multirank import run_ranks

pytestmark = pytest.mark.multirank


def stalled_root_target(rank: int, world: int) -> list[int]:
    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import detect_identity

    # A grace long enough that rank 0 takes a peer's next row at the late flush however slow the
    # machine (the ranks here flush back to back; a real job's flushes are seconds apart).
    config = Config(collective_timeout_s=30.0, exchange_grace_s=10.0)
    reducer = CrossRankReducer(detect_identity(None), None, None, config)
    return flush_through(reducer, rank)


def test_cross_rank_stats_come_back_after_one_late_flush_on_rank_0() -> None:
    ranks_seen = run_ranks(3, stalled_root_target, timeout=120)[0]
    assert ranks_seen[:4] == [3] * 4  # in lockstep before the stall
    # The late flush (19, 38] and the next, (38, 39], match no peer's row; then all pair again.
    assert ranks_seen[6:] == [3] * 4, ranks_seen
