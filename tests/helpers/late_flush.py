"""One late flush on one rank, as a stall of its background worker makes it: the rank flushes
(19, 38] where every other rank flushed (19, 24] and then (24, 39] (tests of the exchange's
realignment, star and tree)."""

from __future__ import annotations

import time
from typing import Any

STEP_S = 0.02
# The flushes' last steps: every 5 steps, except that the late rank's worker stalled over 24..34
PEER_STEPS = [4, 9, 14, 19, 24, 39, 44, 49, 54, 59]
LATE_STEPS = [4, 9, 14, 19, 38, 39, 44, 49, 54, 59]


def interval(seq: int, step: int, steps: int) -> Any:
    """A flush's interval of `steps` steps ending at `step`; its tokens are its steps, so a job's
    tokens are the steps every rank ran, each counted once."""
    from otel_train.core.buffer import Interval

    return Interval(
        seq=seq,
        step=step,
        wall_time=time.time(),
        elapsed_s=steps * STEP_S,
        steps=steps,
        tokens=steps,
        samples=0,
        step_durations=[STEP_S] * steps,
        phases={"forward": [STEP_S / 2] * steps},
        arrivals={"forward": [STEP_S / 2] * steps},
    )


def flush_through(reducer: Any, rank: int) -> list[int]:
    """Run `reducer` through the flushes (rank 0 late, the others not); returns, at each flush,
    how many ranks rank 0's step statistics are over."""
    ranks_seen = []
    previous = -1
    for seq, step in enumerate(LATE_STEPS if rank == 0 else PEER_STEPS):
        reducer.on_flush(interval(seq, step, step - previous))
        previous = step
        ranks_seen.append(reducer.last_reductions["step"].n)
    assert reducer.disabled_reason is None
    return ranks_seen
