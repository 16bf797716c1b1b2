"""The flush cadence: an explicit log_interval keeps its meaning; the default adapts to about one
flush per log_interval_min_s, and in a multi-rank run in lockstep every rank flushes at the same
steps, which rank 0 decides without any rank waiting for another."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
from helpers.fake_time import FakeTime
from helpers.multirank import run_ranks
from helpers.waiting import wait_for

import otel_train as ot
from otel_train.core import session as session_module
from otel_train.core.cadence import ADAPTIVE_BASE_STEPS, Cadence, nice_interval
from otel_train.testing import current_session

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


def test_a_costly_flush_stretches_the_adaptive_interval_up_to_twice() -> None:
    cadence = Cadence(None, 1.0, 30.0, coordinated=False)
    assert cadence.proposal(100, 1.0) == 100  # 10 ms steps, CPU per flush not known yet
    assert cadence.proposal(100, 1.0, flush_cpu_s=0.002) == 100  # 0.2 % of 1 s: within the share
    assert cadence.min_flush_s(0.004) == pytest.approx(1.6)  # 4 ms is 0.25 % of 1.6 s
    assert cadence.proposal(100, 1.0, flush_cpu_s=0.004) == 200
    assert cadence.min_flush_s(1.0) == 2.0  # never more than 2 x log_interval_min_s
    assert cadence.proposal(100, 1.0, flush_cpu_s=1.0) == 200
    assert Cadence(7, 1.0, 30.0, coordinated=False).proposal(100, 1.0, flush_cpu_s=1.0) == 7  # explicit


def test_the_adaptive_interval_never_outgrows_max_values_per_interval() -> None:
    from otel_train.core.cadence import steps_that_fit

    # 1 us steps would want 1,000,000 steps a second; 10,000 values hold 5,000 steps at twice the
    # measured density (one value a step), and 1,000 at three values a step (10,000 / 6 -> 1,000)
    assert steps_that_fit(10_000, 0.0) == 5_000 and steps_that_fit(10_000, 1.0) == 5_000
    assert nice_interval(1e-6, 1.0, 30.0, most_steps=steps_that_fit(10_000, 1.0)) == 5_000
    assert nice_interval(1e-6, 1.0, 30.0, most_steps=steps_that_fit(10_000, 3.0)) == 1_000
    assert nice_interval(1e-6, 1.0, 30.0, most_steps=4) == 4  # below the base: what fits
    assert nice_interval(0.5, 1.0, 30.0, most_steps=5_000) == ADAPTIVE_BASE_STEPS  # slow: unchanged
    cadence = Cadence(None, 1.0, 30.0, coordinated=False)
    assert cadence.proposal(1000, 0.001, most_steps=300) == 200
    assert Cadence(7000, 1.0, 30.0, coordinated=False).proposal(1000, 0.001, most_steps=300) == 7000


def test_fast_steps_flush_before_a_value_recorded_every_step_overflows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ot.init(output_dir=str(tmp_path), run_name="fits", prometheus_port=0, verbosity=0,
            hardware=False, max_values_per_interval=100, traces=False)  # fmt: skip
    session = current_session()
    assert session is not None
    clock = FakeTime().install(session, monkeypatch)
    monkeypatch.setattr(session_module, "time", _SessionTime(clock))
    for step in range(600):
        with ot.step(step):
            clock.advance(0.0001)  # 10,000 steps a second: one flush a second is 10,000 steps
            ot.record("loss", float(step))
        wait_for(lambda: session.worker.pending_batches() == 0, 60, "the worker to take the flush")
    ot.shutdown()
    assert session.run_dir is not None
    lines = (session.run_dir / "metrics.rank0.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert all(row.get("train/steps", 0) <= 100 for row in rows), [r.get("train/steps") for r in rows]
    assert not any(row.get("otel_train/dropped/too_many_values") for row in rows)
    assert sum(row.get("train/steps", 0) for row in rows) == 600
    assert max(row.get("train/steps", 0) for row in rows) == 50  # 100 values / (2 x 1 a step)


def test_an_explicit_log_interval_beyond_max_values_per_interval_is_kept_and_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="otel_train")
    ot.init(output_dir=str(tmp_path), run_name="explicit_big", prometheus_port=0, verbosity=0,
            hardware=False, log_interval=500, max_values_per_interval=100)  # fmt: skip
    session = current_session()
    assert session is not None and session.cadence.interval == 500
    ot.shutdown()
    warnings = [r.getMessage() for r in caplog.records if "log_interval=500" in r.getMessage()]
    assert len(warnings) == 1 and "max_values_per_interval=100" in warnings[0], warnings


class _CpuBurner:
    """A flush listener that spends `cpu_s` of the worker's CPU at every flush."""

    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s

    def on_flush(self, interval: object) -> None:
        until = time.thread_time() + self.cpu_s
        while time.thread_time() < until:
            pass

    def close(self) -> None:
        return None


class _SessionTime:
    """session.py's `time` module with `clock`'s perf_counter: the flush's elapsed time (what the
    cadence divides by the steps) follows the hand-moved clock, not the machine's load."""

    def __init__(self, clock: FakeTime) -> None:
        self._clock = clock

    def perf_counter(self) -> float:
        return self._clock.perf_ns * 1e-9

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def test_the_session_flushes_less_often_when_its_worker_spends_more_per_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ot.init(output_dir=str(tmp_path), run_name="stretch", prometheus_port=0, verbosity=0,
            hardware=False, log_interval_min_s=0.08, traces=False)  # fmt: skip
    session = current_session()
    assert session is not None
    session.worker.add_listener(_CpuBurner(0.03))
    clock = FakeTime().install(session, monkeypatch)
    monkeypatch.setattr(session_module, "time", _SessionTime(clock))
    for step in range(1500):
        with ot.step(step):
            clock.advance(0.001)
        # Each flush reaches the worker before the next is due: its CPU per flush is measured
        # from the first flushes on, and a full queue never moves a flush off the schedule.
        wait_for(lambda: session.worker.pending_batches() == 0, 60, "the worker to take the flush")
    ot.shutdown()
    assert session.run_dir is not None
    gaps = [b - a for a, b in itertools.pairwise(_flush_steps(session.run_dir)[:-1])]
    assert all(gap in NICE for gap in gaps), gaps
    assert session.worker.flush_cpu_s >= 0.03
    # 30 ms a flush is 0.25 % of 12 s, so the most: 2 x 0.08 s of 1 ms steps, 160 -> 200;
    # unstretched, 0.08 s is 80 steps -> 100
    assert max(gaps) >= 200, gaps


def test_rank0_adopts_its_own_decision_at_once_anchored_on_the_next_flush() -> None:
    cadence = Cadence(None, 1.0, 30.0, coordinated=True, decides=True)
    assert cadence.due_step == 9 and not cadence.due(9, 8) and cadence.due(10, 9)
    cadence.flushed(100, 9)  # rank 0 decides 100 steps, from its next scheduled flush (19) on
    assert cadence.decision == (100, 19) and cadence.due_step == 19
    assert not cadence.due(9, 18) and cadence.due(10, 19)
    cadence.flushed(100, 19)
    assert cadence.decision == (100, 19) and cadence.due_step == 119  # no new decision: same proposal
    cadence.flushed(50, 119)
    assert cadence.decision == (50, 219) and cadence.due_step == 219
    cadence.flushed(50, 219)
    assert cadence.due_step == 269
    cadence.adopt(0, -1)  # the exchange turned off: keep the schedule, decide nothing more
    cadence.flushed(200, 269)
    assert cadence.decision == (50, 219) and cadence.due_step == 319


def test_other_ranks_adopt_rank0s_schedule_without_waiting_and_realign_when_late() -> None:
    on_time = Cadence(None, 1.0, 30.0, coordinated=True)
    late = Cadence(None, 1.0, 30.0, coordinated=True)
    for cadence in (on_time, late):
        cadence.flushed(10, 9)  # other ranks' own proposals are never used
        assert cadence.due_step == 19 and cadence.decision == (10, -1)
    on_time.adopt(100, 19)  # rank 0's answer to flush 9, a whole interval before step 19
    assert on_time.due(10, 19)  # flushes at 19 like rank 0, then on rank 0's schedule
    on_time.flushed(10, 19)
    assert on_time.due_step == 119 and on_time.late_decisions == 0
    # the answer reaches `late` only after it flushed at 19 and 29 on the old schedule
    late.flushed(10, 19)
    late.flushed(10, 29)
    late.adopt(100, 19)
    assert not late.due(10, 39)  # not a step of the new schedule: no flush, and no wait either
    assert late.due_step == 119 and late.late_decisions == 1
    assert late.due(90, 119)  # back on the same flush steps as rank 0
    late.flushed(10, 119)
    assert late.due_step == 219


def test_a_resumed_run_flushes_on_the_schedule_from_its_first_step() -> None:
    cadence = Cadence(20, 1.0, 30.0, coordinated=True)  # an explicit log_interval: a fixed schedule
    assert not cadence.due(1, 1000)  # resumed at step 1000: no one-step flush
    assert cadence.due_step == 1019 and cadence.due(20, 1019)


def test_numbering_that_goes_back_falls_back_to_counted_steps() -> None:
    cadence = Cadence(None, 1.0, 30.0, coordinated=True)
    cadence.flushed(10, 9)
    assert cadence.due_step == 19 and cadence.threshold == 20
    assert not cadence.due(19, 3) and cadence.due(20, 4)  # the epoch restarted at step 0


def test_explicit_log_interval_is_honoured(tmp_path: Path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="explicit", prometheus_port=0, verbosity=0,
                      hardware=False, log_interval=3, log_interval_min_s=10.0)  # fmt: skip
    session = current_session()
    for step in range(20):
        with ot.step(step):
            time.sleep(0.001)  # an adaptive cadence would flush every 10000 steps here
    ot.shutdown()
    assert session.run_dir is not None
    assert _flush_steps(session.run_dir) == [2, 5, 8, 11, 14, 17, 19]  # + the final partial interval


def test_default_cadence_adapts_to_fast_steps(tmp_path: Path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="adaptive", prometheus_port=0, verbosity=0,
                      hardware=False, log_interval_min_s=0.2)  # fmt: skip
    session = current_session()
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
    import torch
    import torch.distributed as dist

    import otel_train as ot

    # 0.1, 0.4, 0.7, 1.0 s: each rank alone would pick its own interval
    ot.init(output_dir=out_dir, run_name="cadence", prometheus_port=0, verbosity=0, hardware=False,
                      log_interval_min_s=0.1 * (1 + 3 * rank), trace_first=0)  # fmt: skip
    session = current_session()
    grad = torch.zeros(4)
    for step in range(STEPS):
        with ot.step(step):
            time.sleep(0.001)
            dist.all_reduce(grad)  # the job's own collective keeps the ranks in lockstep, as DDP does
    ot.shutdown()
    reducer = session.reducer
    return {
        "collectives": reducer.collectives,
        "disabled": reducer.disabled_reason,
        "partial": (reducer.left_out_rows, reducer.partial_flushes, reducer.exchange.skipped),
    }


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
    # one exchange per scheduled flush on every rank (none at shutdown, which may coincide with the
    # last scheduled flush), each pairing every rank's row: none late, left out or skipped
    assert len(steps) - 1 <= results[0]["collectives"] <= len(steps), (steps, results)
    assert all(r["collectives"] == results[0]["collectives"] for r in results), results
    assert all(r["partial"] == (0, 0, 0) for r in results), results
