"""A peer dies mid-run on REAL gloo ranks: the survivors' exchange turns off (per-rank telemetry goes
on), and when the job forms a new process group among the live ranks, `CrossRankReducer.reform`
re-forms the exchange on it: cross-rank stats of the survivors again, and a `membership_change`
event on each."""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers.multirank import run_ranks

from tests.crossrank.test_reducer_multirank import _Events, _interval, _phases

pytestmark = pytest.mark.multirank


def survivors_target(rank: int, world: int, fanin: int) -> dict[str, Any]:
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    timeout_s = 3.0
    config = Config(collective_timeout_s=timeout_s, exchange_grace_s=0.2, exchange_fanin=fanin)
    events = _Events()
    reducer = CrossRankReducer(
        identity, None, events, config, group=create_telemetry_group(identity, timeout_s)
    )
    reducer.on_flush(_interval(0, _phases(rank, 0, "balanced")))
    assert reducer.disabled_reason is None
    if rank == world - 1:
        return {"rank": rank}  # dies
    seq, deadline = 1, time.monotonic() + 2 * timeout_s + 5
    while reducer.disabled_reason is None and time.monotonic() < deadline:
        time.sleep(0.3)
        reducer.on_flush(_interval(seq, _phases(rank, seq, "balanced")))
        seq += 1
    disabled = reducer.disabled_reason
    # The job goes on among the live ranks: a new group of them (the dead rank takes no part)
    survivors = dist.new_group(list(range(world - 1)), backend="gloo", use_local_synchronization=True)
    reducer.reform(survivors)
    before = reducer.collectives
    for seq in range(100, 104):  # the same steps on every survivor from here on (their first rows
        time.sleep(0.05)  # cover different steps since their own last flush: left out)
        reducer.on_flush(_interval(seq, _phases(rank, seq, "data")))
    step = reducer.last_reductions.get("step")
    return {
        "disabled_before": disabled,
        "disabled_after": reducer.disabled_reason,
        "exchanges_after": reducer.collectives - before,
        "ranks_in_view": step.n if step is not None else 0,
        "membership": [a for e, a in events.events if e == "membership_change"],
        "stragglers": sorted({a["rank"] for e, a in events.events if e == "straggler"}),
    }


@pytest.mark.parametrize("fanin", [16, 2], ids=["star", "fanin2"])
def test_survivors_reform_the_exchange_on_their_new_group(fanin: int) -> None:
    world = 5 if fanin == 2 else 4  # fan-in 2: the survivors' 4 ranks form a tree too
    results = run_ranks(world, survivors_target, (fanin,), timeout=120)
    live = results[:-1]
    for rank, res in enumerate(live):
        assert res["disabled_before"] is not None, res  # the dead peer turned the exchange off
        assert res["disabled_after"] is None and res["exchanges_after"] == 4, res
        assert res["membership"] == [{"rank": rank, "world_size": world - 1, "world_size_before": world}]
    assert live[0]["ranks_in_view"] == world - 1  # rank 0 reduces every survivor's row again
    assert live[0]["stragglers"] == [1]  # and judges them: rank 1 is slow in data ("data" scenario)
