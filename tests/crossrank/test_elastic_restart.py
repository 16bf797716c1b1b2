"""A job restarted the way torchrun's elastic agent restarts it: every worker killed, then started
again with the same `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT` + 1 and a new process group
(a new rendezvous, here a new port). torchrun's own restart over gloo is flaky on this machine
(`connectFullMesh` timeouts even without otel_train), so the test re-launches the ranks itself, as
the agent does.

What must hold in the second incarnation: one run directory for the whole job, the telemetry
exchange re-formed on the new process group (cross-rank keys again), the interruption counted and
the re-run steps booked as wasted progress."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers.multirank import RankError, run_ranks

pytestmark = [pytest.mark.multirank]

RUN_ID = "elastic-job-7"
CRASH_AT = 23  # the first incarnation dies after this many steps; its last flush covered step 19
RESUME_FROM = 15  # its last checkpoint: steps 15..19 run twice (steps 20..22 were never flushed:
# their time is in the restart gap, which runs from the last saved record to the new start)
END = 45
LOG_INTERVAL = 5


def _incarnation(rank: int, world: int, out_dir: str, first: int, last: int, crash: bool) -> dict:
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.testing import current_session

    ot.init(
        output_dir=out_dir, run_name="elastic", log_interval=LOG_INTERVAL, hardware=False, verbosity=0,
    )  # fmt: skip
    session = current_session()
    from otel_train.goodput import SAVE_EVERY_S

    for step in range(first, last):
        if crash and step == 18:  # the goodput file is saved at most every SAVE_EVERY_S: the flush
            time.sleep(SAVE_EVERY_S + 0.2)  # at step 19 is then saved, as in any run of real length
        with ot.step(step):
            with ot.timer("forward"):
                time.sleep(0.004 * (2 if rank == 1 else 1))
            with ot.timer("allreduce"):
                dist.all_reduce(torch.zeros(1))
    if crash:
        # Let the flush at step 19 finish its exchange, then die the way a killed worker dies: no
        # shutdown, no atexit, files left as they are.
        time.sleep(0.5)
        os._exit(17)
    ot.shutdown()
    return {
        "run_dir": str(session.run_dir),
        "collectives": session.reducer.collectives,
        "disabled": session.reducer.disabled_reason,
        "interruptions": session.goodput.interruptions,
    }


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_elastic_restart_keeps_one_run_directory_and_reforms_the_exchange(tmp_path: Path) -> None:
    env = {"TORCHELASTIC_RUN_ID": RUN_ID, "TORCHELASTIC_RESTART_COUNT": "0"}
    with pytest.raises(RankError, match="exited without a result"):
        run_ranks(2, _incarnation, (str(tmp_path), 0, CRASH_AT, True), timeout=120, env=env)

    env["TORCHELASTIC_RESTART_COUNT"] = "1"
    second = run_ranks(2, _incarnation, (str(tmp_path), RESUME_FROM, END, False), timeout=120, env=env)

    run_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1, f"one job, one run directory: {run_dirs}"
    run_dir = run_dirs[0]
    assert {r["run_dir"] for r in second} == {str(run_dir)}
    for rank, result in enumerate(second):
        assert result["disabled"] is None, f"rank {rank}: {result['disabled']}"
        assert result["collectives"] >= 3, f"rank {rank} exchanged {result['collectives']} times"
        assert result["interruptions"] == 1, f"rank {rank}: {result['interruptions']} interruptions"

    rows = _rows(run_dir / "metrics.rank0.jsonl")
    after = [
        r for r in rows if r.get("step", -1) >= RESUME_FROM + LOG_INTERVAL and r.get("step", 0) < END - 1
    ]
    cross = [k for r in after for k in r if k.startswith("timers/forward/ranks_")]
    assert cross, "no cross-rank timer statistics after the restart: the exchange did not re-form"

    events = _rows(run_dir / "events.rank0.jsonl")
    assert [e["event"] for e in events].count("restart") == 1
    goodput = json.loads((run_dir / "goodput.rank0.json").read_text())
    assert goodput["interruptions"] == 1
    assert goodput["badput"]["wasted_progress"] > 0, goodput["badput"]  # steps 15..19 ran twice
