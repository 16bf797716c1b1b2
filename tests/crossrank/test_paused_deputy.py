"""A paused rank on REAL gloo ranks (8 processes): SIGSTOP longer than the exchange's waits, well
within its timeout, then SIGCONT. The ranks keep their own step counters (independent ranks, as in
an RL or evaluation job), so the paused rank is behind every other rank's steps for the rest of the
run and its rows never pair again. In the star rank 0 so sees 7 of 8 ranks from then on; in a tree
of fan-in 2 the paused rank is rank 1, rank 0's deputy (`tree.layout`), which heads every other
rank, and rank 0 must see the same 7 of 8, not only itself."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from helpers.multirank import run_ranks

from tests.crossrank.test_reducer_multirank import _Events, _interval, _phases

pytestmark = pytest.mark.multirank

WORLD = 8
PERIOD_S = 0.3  # between one rank's flushes
GRACE_S = 0.2  # rank 0 waits this for a row, a rank with a parent twice this for its answer
TIMEOUT_S = 20.0  # collective_timeout_s: the pause stays well within it (else the exchange turns off)
PAUSE_S = 2.5  # many times every wait above
BEFORE, AFTER = 6, 24  # flushes before the pause, and after it on rank 0


def paused_target(rank: int, world: int, fanin: int) -> dict[str, Any]:
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    config = Config(collective_timeout_s=TIMEOUT_S, exchange_grace_s=GRACE_S, exchange_fanin=fanin)
    group = create_telemetry_group(identity, TIMEOUT_S)
    reducer = CrossRankReducer(identity, None, _Events(), config, group=group)
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    paired: list[int] = []  # rank 0: the ranks in each flush's cross-rank view
    note = reducer.pairing.note

    def noted(left_out: Any, ranks: int, *args: Any) -> None:
        paired.append(ranks)
        note(left_out, ranks, *args)

    reducer.pairing.note = noted  # type: ignore[method-assign]
    views: list[int] = []
    resumed = threading.Event()

    def pause_rank_1() -> None:
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(pids[1], signal.SIGCONT)
        resumed.set()

    seq, after, deadline = 0, 0, time.monotonic() + 120
    while after < AFTER and time.monotonic() < deadline:
        time.sleep(PERIOD_S)
        paired.clear()
        reducer.on_flush(_interval(seq, _phases(rank, seq, "balanced")))
        if rank != 0:  # the others flush until rank 0 is done (rank 1 never catches up)
            if seq >= BEFORE + AFTER + 2 * PAUSE_S / PERIOD_S:
                break
            seq += 1
            continue
        views.append(paired[-1] if paired else 0)
        seq += 1
        if seq == BEFORE:
            threading.Thread(target=pause_rank_1, daemon=True).start()
        after += int(resumed.is_set())
    return {"views": views, "disabled": reducer.disabled_reason}


@pytest.mark.parametrize("fanin", [16, 2], ids=["star", "fanin2"])
def test_a_paused_rank_1_costs_rank_0_only_that_ranks_row(fanin: int) -> None:
    results = run_ranks(WORLD, paused_target, (fanin,), timeout=180)
    views = results[0]["views"]
    assert results[0]["disabled"] is None, results[0]
    assert views[:BEFORE] == [WORLD] * BEFORE, views  # every rank in lockstep before the pause
    # After the pause: rank 1's steps are behind for good, every other rank is in rank 0's view
    # again within a few flushes (a flush or two later than its steps, while a bundle catches up).
    recovered = views[-AFTER + 6 :]
    assert max(recovered) == WORLD - 1, views
    assert sum(v == WORLD - 1 for v in recovered) >= 0.75 * len(recovered), views
