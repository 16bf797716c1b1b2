"""The flush cadence: an explicit log_interval keeps its meaning; the default adapts to about one
flush per log_interval_min_s, and in a multi-rank run every rank flushes at the same steps."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import pytest
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train.cadence import ADAPTIVE_BASE_STEPS, Cadence, nice_interval

NICE = {10, 20, 50, 100, 200, 500, 1000, 2000, 5000}


def _flush_steps(run_dir: Path, rank: int = 0) -> list[int]:
    lines = (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_nice_interval_rounds_up_to_a_readable_step_count() -> None:
    assert nice_interval(0.010, 1.0, 30.0) == 100  # 10 ms steps: one flush a second
    assert nice_interval(0.005, 1.0, 30.0) == 200
    assert nice_interval(0.030, 1.0, 30.0) == 50  # 34 steps needed -> 50
    assert nice_interval(0.136, 1.0, 30.0) == 10  # the demo: never below the base
    assert nice_interval(5.0, 1.0, 30.0) == ADAPTIVE_BASE_STEPS
    assert nice_interval(0.001, 1.0, 0.5) == 500  # capped by the longest interval (log_interval_s)
    assert nice_interval(float("nan"), 1.0, 30.0) == ADAPTIVE_BASE_STEPS


def test_coordinated_cadence_applies_rank0_decision_one_flush_later() -> None:
    cadence = Cadence(None, 1.0, 30.0, coordinated=True, wait_timeout_s=5.0)
    assert cadence.threshold == 10
    cadence.flushed(0, 100)  # flush 0: the interval to flush 1 is the base
    assert cadence.threshold == 10 and cadence.due(10)
    cadence.adopt(0, 100)  # flush 0's collective carried rank 0's 100
    cadence.flushed(1, 50)
    assert cadence.threshold == 100  # flush 0's decision sets the interval to flush 2
    started = time.monotonic()
    assert not cadence.due(99) and cadence.due(100)
    assert time.monotonic() - started < 4.0  # a decision already adopted is never waited for
    # flush 1's decision arrives late: the training thread waits for it, then uses it
    cadence.flushed(2, 50)
    assert cadence.threshold == 10
    timer = threading.Timer(0.2, cadence.adopt, (1, 50))
    timer.start()
    assert not cadence.due(10)  # waited for rank 0's 50
    assert cadence.threshold == 50 and cadence.due(50)
    timer.join()
    # no collective ran (reducer disabled): every rank keeps the last agreed interval
    cadence.adopt(2, 0)
    cadence.flushed(3, 200)
    assert cadence.threshold == 50


def test_explicit_log_interval_is_honoured(tmp_path: Path) -> None:
    session = ot.init(output_dir=str(tmp_path), run_name="explicit", prometheus_port=0, verbosity=0,
                      hardware=False, log_interval=3, log_interval_min_s=10.0)  # fmt: skip
    for step in range(20):
        with ot.step(step):
            time.sleep(0.001)  # an adaptive cadence would flush every 10000 steps here
    ot.shutdown()
    assert session.run_dir is not None
    assert _flush_steps(session.run_dir) == [2, 5, 8, 11, 14, 17, 19]  # + the final partial interval


def test_default_cadence_adapts_to_fast_steps(tmp_path: Path) -> None:
    session = ot.init(output_dir=str(tmp_path), run_name="adaptive", prometheus_port=0, verbosity=0,
                      hardware=False, log_interval_min_s=0.2)  # fmt: skip
    for step in range(400):
        with ot.step(step):
            time.sleep(0.001)
    ot.shutdown()
    assert session.run_dir is not None
    steps = _flush_steps(session.run_dir)
    assert steps[0] == ADAPTIVE_BASE_STEPS - 1
    gaps = [b - a for a, b in itertools.pairwise(steps[:-1])]  # the final flush is partial
    assert gaps and all(gap in NICE for gap in gaps), steps
    assert max(gaps) >= 20, steps  # steps of >= 1 ms: 0.2 s is at least 20 of them
    assert len(steps) < 400 // ADAPTIVE_BASE_STEPS


STEPS = 240


def _rank_with_own_pace(rank: int, world: int, out_dir: str) -> dict:
    import otel_train as ot

    session = ot.init(output_dir=out_dir, run_name="cadence", prometheus_port=0, verbosity=0, hardware=False,
                      log_interval_min_s=0.1, trace_first=0)  # fmt: skip
    for step in range(STEPS):
        with ot.step(step):
            time.sleep(0.001 * (1 + 3 * rank))  # 1, 4, 7, 10 ms: each rank would pick its own interval
    ot.shutdown()
    return {"collectives": session.reducer.collectives, "disabled": session.reducer.disabled_reason}


@pytest.mark.multirank
def test_adaptive_cadence_keeps_every_rank_on_the_same_flush_steps(tmp_path: Path) -> None:
    results = run_ranks(4, _rank_with_own_pace, (str(tmp_path),), timeout=240)
    assert all(r["disabled"] is None for r in results), results
    per_rank = [_flush_steps(tmp_path / "cadence", rank) for rank in range(4)]
    assert all(steps == per_rank[0] for steps in per_rank), per_rank
    steps = per_rank[0]
    gaps = [b - a for a, b in itertools.pairwise(steps[:-1])]
    # rank 0's ~1 ms steps set the pace (>= 20 steps per 0.1 s); rank 3 alone would have kept 10
    assert max(gaps) >= 20 and all(gap in NICE for gap in gaps), steps
    assert results[0]["collectives"] == len(steps) - 1  # one per aligned flush, none at shutdown
