"""A deadlock across process groups: rank 0 calls all_reduce on group A then B, rank 1 on B then A.
Each group alone shows a victim and a culprit; together their waits close a cycle, and the one
`hang` event names both ranks and both groups (never "rank 1 never reached ..." alone)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.events import every_rank_events
from helpers.multirank import RankError, run_ranks

from otel_train.diagnostics.hang_attribution import Deadlock, Verdict, attribute

FR_ON = {"TORCH_FR_BUFFER_SIZE": "500"}
STALL_S = 1.5
SETTLE_S = 4.0  # after the first hang event, how long the ranks stay up for any other rank's event


def _summary(rank: int, groups: dict[str, tuple[int, int]]) -> dict[str, Any]:
    return {
        "rank": rank, "host": f"node{rank}", "stacks": f"stacks.rank{rank}.0.txt",
        "groups": {
            name: {"label": f"pg{name}", "last_enqueued": enq, "last_completed": done,
                   "ops": {str(enq): "all_reduce"}}
            for name, (enq, done) in groups.items()
        },
    }  # fmt: skip


def test_waits_that_close_a_cycle_across_groups_are_one_deadlock_naming_both() -> None:
    summaries = {
        0: _summary(0, {"0": (9, 9), "1": (51, 50), "2": (50, 50)}),  # in A's #51, B's #51 not reached
        1: _summary(1, {"0": (9, 9), "1": (50, 50), "2": (51, 50)}),  # in B's #51, A's #51 not reached
    }
    a = Verdict("pg1", "all_reduce", 51, (1,), (0,), ())
    b = Verdict("pg2", "all_reduce", 51, (0,), (1,), ())
    assert attribute(summaries, 2) == [Deadlock.of(((0, a), (1, b))), a, b]
    deadlock = attribute(summaries, 2)[0]
    text = deadlock.describe(summaries)
    assert "rank 0 (node0) waits in all_reduce #51 of process group pg1 for rank 1" in text, text
    assert "rank 1 (node1) waits in all_reduce #51 of process group pg2 for rank 0" in text, text
    attrs = deadlock.attributes(summaries)
    assert attrs["missing_ranks"] == attrs["waiting_ranks"] == "0,1" and attrs["process_group"] == "pg1,pg2"
    # a third rank waiting in A for rank 1 is a victim, not part of the cycle
    summaries[2] = _summary(2, {"0": (9, 9), "1": (51, 50)})
    [first, *_] = attribute(summaries, 3)
    assert isinstance(first, Deadlock) and first.missing == (0, 1) and first.waiting == (0, 1, 2)
    # no cycle (rank 1 simply never came): the plain verdict, as before
    del summaries[2]
    summaries[1] = _summary(1, {"0": (9, 9), "1": (50, 50), "2": (50, 50)})
    assert attribute(summaries, 2) == [a]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [e for events in every_rank_events(run_dir, "hang").values() for e in events]


def _leave_after_the_verdict(run_dir: Path) -> None:
    """Both ranks are blocked for good: end the process once a hang event is out and settled."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _events(run_dir):
        time.sleep(0.2)
    time.sleep(SETTLE_S)
    os._exit(0)


def _crossed_rank(rank: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.testing import current_session

    ot.init(run_name="crossed", stall_timeout_s=STALL_S, prometheus_port=0, verbosity=0, hardware=False,
            log_interval=2, output_dir=out)  # fmt: skip
    session = current_session()
    assert session is not None and session.run_dir is not None
    group_a, group_b = dist.new_group([0, 1]), dist.new_group([0, 1])
    if rank == 0:  # how the Flight Recorder names them (otel_train's own group is one more)
        (Path(out) / "groups.json").write_text(json.dumps([f"pg{g.group_name}" for g in (group_a, group_b)]))
    tensor = torch.ones(4)
    for step in range(50):
        with ot.step(step):
            if step == 6:
                threading.Thread(
                    target=_leave_after_the_verdict, args=(session.run_dir,), daemon=True
                ).start()
                first, second = (group_a, group_b) if rank == 0 else (group_b, group_a)
            else:
                first, second = group_a, group_b
            dist.all_reduce(tensor, group=first)
            dist.all_reduce(tensor, group=second)


@pytest.mark.multirank
def test_a_cross_group_deadlock_names_both_ranks_and_groups(tmp_path: Path) -> None:
    with pytest.raises((RankError, TimeoutError)) as raised:
        run_ranks(2, _crossed_rank, (str(tmp_path),), timeout=150, env=FR_ON)
    hangs = _events(tmp_path / "crossed")
    assert len(hangs) == 1, (str(raised.value), hangs)
    [event] = hangs
    assert event["rank"] == 0 and event["missing_ranks"] == "0,1" and event["waiting_ranks"] == "0,1"
    group_a, group_b = json.loads((tmp_path / "groups.json").read_text())
    assert sorted(event["process_group"].split(",")) == sorted([group_a, group_b]), event
    message = event["message"]
    assert message.startswith("deadlock across process groups"), message
    # rank 0 waits in A (its first) for rank 1, rank 1 in B (its first) for rank 0
    assert f"of process group {group_a} for rank 1" in message, message
    assert f"of process group {group_b} for rank 0" in message, message
    assert "never reached" not in message
