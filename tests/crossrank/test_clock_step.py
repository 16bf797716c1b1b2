"""A host clock that steps (chrony's makestep, a VM migration) is not a straggler: the offset
estimator follows the step, and a lateness longer than a step is the clocks', never a rank's."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

from otel_train.crossrank.collective_lateness import ClockEstimator, judge

STEP_S = 0.3  # rank 3's clock steps this far ahead


def test_a_sample_disjoint_from_the_aged_best_starts_over() -> None:
    est = ClockEstimator()
    est.add(100.0, 100.0001, 100.0002, 100.0003)  # offset 0, +-0.15 ms: a tight one
    assert est.estimate(100.0003)[0] == pytest.approx(0.0, abs=1e-6)
    # 10 s later the leaf's clock has stepped +300 ms: offset -0.3, looser (a 2 ms round trip)
    t1 = 110.0 + STEP_S
    est.add(t1, 110.001, 110.001, t1 + 0.002)
    offset, bound = est.estimate(t1 + 0.002)
    assert offset == pytest.approx(-STEP_S, abs=0.002) and bound == pytest.approx(0.001)
    # an overlapping looser sample still leaves the tighter one in place
    est.add(t1 + 1, 111.0005, 111.0025, t1 + 1.005)
    assert est.estimate(t1 + 1.005)[1] < 0.0011


def test_lateness_longer_than_a_step_abstains_naming_the_clocks() -> None:
    from crossrank.test_collective_lateness import _arrivals, _rows

    bounds = dict.fromkeys(range(4), 0.0002)
    stale = dict.fromkeys(range(4), 0.0)  # rank 3's clock stepped +300 ms, its offset not yet re-measured
    rows = _rows(_arrivals(3, 0.0, {3: STEP_S}), stale, bounds)
    assert judge(rows, 4).culprit == 3  # type: ignore[union-attr]  # (without the step time: blamed)
    verdict = judge(rows, 4, step_s=0.010)
    assert verdict is not None and verdict.culprit == -1 and verdict.abstain is not None
    assert "rank 3" in verdict.abstain and "clock" in verdict.abstain, verdict.abstain
    # a real straggler, 12 ms late per collective with 100 ms steps, is still named
    real = judge(_rows(_arrivals(2, 0.012, {}), stale, bounds), 4, step_s=0.1)
    assert real is not None and real.culprit == 2 and real.abstain is None


def _rank(rank: int, world: int, out: str) -> dict[str, Any]:
    import socket

    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.diagnostics import collectives
    from otel_train.testing import current_session

    collectives.MAX_READ_SHARE = 0.02  # a verdict within seconds (as test_collective_lateness)
    if rank == 3:
        socket.gethostname = lambda: "nodeB"  # another host: its own clock, its offset estimated
    ot.init(output_dir=out, run_name="clockstep", verbosity=0, log_interval=5, hardware=False,
            collective_timeout_s=60.0)  # fmt: skip
    session = current_session()
    assert session is not None
    events: list[dict[str, Any]] = []
    session.events.add_callback(lambda e, m, a: events.append({"event": e, "message": m, **a}))
    lateness = session.reducer.lateness
    tensor = torch.ones(16)
    offsets = []
    for step in range(400):
        if rank == 3 and step == 150:
            offsets.append(lateness.estimator.estimate(lateness.clock())[0])
            lateness.skew_s = STEP_S  # this host's clock steps: the recorder's stamps and the exchange's
        with ot.step(step):
            time.sleep(0.01)
            dist.all_reduce(tensor)
    if rank == 3:
        offsets.append(lateness.estimator.estimate(lateness.clock())[0])
    reducer = session.reducer
    ot.shutdown()
    verdict = reducer.lateness.verdict
    return {
        "stragglers": [e for e in events if e["event"] == "straggler"],
        "matched": verdict.matched if verdict else 0,
        "offsets": offsets,
    }


@pytest.mark.multirank
def test_a_clock_step_on_one_host_names_no_straggler(tmp_path: Path) -> None:
    """4 gloo ranks in lockstep (10 ms steps), rank 3 on host nodeB, whose clock steps +300 ms at
    step 150: no straggler event names rank 3 for the step (it was "rank 3 is chronically 299.8 ms
    late per step"), and rank 3's offset follows the step."""
    env = {"TORCH_FR_BUFFER_SIZE": "200"}
    results = run_ranks(4, _rank, (str(tmp_path),), timeout=300, env=env)
    assert results[0]["matched"] > 0, results[0]  # collective arrivals were compared
    # A rank the scheduler holds back on a loaded machine is really late, by a few ms per step, and
    # may be named; a clock step taken for lateness is of the step's size (30 of these steps).
    clocks = [e for e in results[0]["stragglers"] if e["rank"] == 3 and e["lateness_ms"] >= STEP_S * 1e3 / 2]
    assert clocks == [], results[0]["stragglers"]
    before, after = results[3]["offsets"]
    assert abs(before) < 0.05 and after == pytest.approx(-STEP_S, abs=0.05), (before, after)
    assert math.isfinite(after)
