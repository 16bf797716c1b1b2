"""Rank 0's pairing realigns after one late flush of its own (real gloo ranks, the star).

A stall on rank 0's background worker merges several of its flushes into one: rank 0 flushes
(19, 38] where its peers flushed (19, 24] and then (24, 39]. Rank 0 takes both of a peer's rows at
that flush, the second reaching past it; from its next flush on, every rank's rows cover the same
steps again, so the cross-rank stats and verdicts must come back (docs/reliability.md).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers.multirank import run_ranks

pytestmark = pytest.mark.multirank

STEP_S = 0.02
# The flushes' last steps: every 5 steps, except that rank 0's worker stalled over 24..34
PEER_STEPS = [4, 9, 14, 19, 24, 39, 44, 49, 54, 59]
ROOT_STEPS = [4, 9, 14, 19, 38, 39, 44, 49, 54, 59]


def _interval(seq: int, step: int, steps: int) -> Any:
    from otel_train.core.buffer import Interval

    return Interval(
        seq=seq,
        step=step,
        wall_time=time.time(),
        elapsed_s=steps * STEP_S,
        steps=steps,
        tokens=0,
        samples=0,
        step_durations=[STEP_S] * steps,
        phases={"forward": [STEP_S / 2] * steps},
        arrivals={"forward": [STEP_S / 2] * steps},
    )


def stalled_root_target(rank: int, world: int) -> list[int]:
    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import detect_identity

    # A grace long enough that rank 0 takes a peer's next row at the late flush however slow the
    # machine (the ranks here flush back to back; a real job's flushes are seconds apart).
    config = Config(collective_timeout_s=30.0, exchange_grace_s=10.0)
    reducer = CrossRankReducer(detect_identity(None), None, None, config)
    ranks_seen = []  # rank 0: at each flush, how many ranks its step statistics are over
    previous = -1
    for seq, step in enumerate(ROOT_STEPS if rank == 0 else PEER_STEPS):
        reducer.on_flush(_interval(seq, step, step - previous))
        previous = step
        ranks_seen.append(reducer.last_reductions["step"].n)
    assert reducer.disabled_reason is None
    return ranks_seen


def test_cross_rank_stats_come_back_after_one_late_flush_on_rank_0() -> None:
    ranks_seen = run_ranks(3, stalled_root_target, timeout=120)[0]
    assert ranks_seen[:4] == [3] * 4  # in lockstep before the stall
    # The late flush (19, 38] and the next, (38, 39], match no peer's row; then all pair again.
    assert ranks_seen[6:] == [3] * 4, ranks_seen
