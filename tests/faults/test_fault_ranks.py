"""Ranks that disagree at init, or do not keep pace, with real gloo ranks: a different log_interval
on one rank is warned about (log and event) and every rank flushes at rank 0's steps; a rank that
calls ot.init() later than collective_timeout_s says that it splits the job into its own run
directory, naming the setting; a rank that idles after init, or steps at its own pace, never holds
rank 0's training, and rank 0 never pairs rows of different steps."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.events import run_events
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train import adapters
from otel_train.testing import current_session

pytestmark = pytest.mark.multirank


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _flush_steps(run_dir: Path, rank: int) -> list[int]:
    lines = (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _own_interval_target(rank: int, world: int, out: str) -> dict[str, Any]:
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    ot.init(
        output_dir=out, run_name="mixed", prometheus_port=0, verbosity=0, hardware=False,
        log_interval=10 if rank == 0 else 7, collective_timeout_s=20.0,
    )  # fmt: skip
    session = current_session()
    for i in range(40):
        with ot.step(i):
            time.sleep(0.001)
    ot.shutdown()
    return {"run_dir": str(session.run_dir), "warnings": warnings.messages}


def test_a_different_log_interval_is_warned_and_rank0s_is_kept(tmp_path: Path) -> None:
    results = run_ranks(2, _own_interval_target, (str(tmp_path),), timeout=120)
    run_dir = Path(results[0]["run_dir"])
    assert results[1]["run_dir"] == str(run_dir)
    (mismatch,) = run_events(run_dir, 1, event="settings_mismatch")
    assert "rank 1 asked for 7 steps, rank 0 for 10 steps" in mismatch["message"]
    assert any("log_interval differs across ranks" in m for m in results[1]["warnings"])
    assert not run_events(run_dir, 0, event="settings_mismatch")
    # the same flush steps on both ranks (the shutdown flush carries no step: no row of its own)
    assert _flush_steps(run_dir, 0) == _flush_steps(run_dir, 1) == [9, 19, 29, 39]


def _late_target(rank: int, world: int, out: str, timeout_s: float) -> dict[str, Any]:
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    if rank == 1:
        time.sleep(timeout_s + 2.0)  # ot.init() later than collective_timeout_s after rank 0's
    ot.init(
        output_dir=out, prometheus_port=0, verbosity=0, hardware=False, log_interval=5,
        collective_timeout_s=timeout_s,
    )  # fmt: skip
    session = current_session()
    for i in range(10):
        with ot.step(i):
            pass
    ot.shutdown()
    return {"run_dir": str(session.run_dir), "warnings": warnings.messages}


def test_a_late_init_says_it_splits_the_job_and_names_the_setting(tmp_path: Path) -> None:
    timeout_s = 1.0
    results = run_ranks(2, _late_target, (str(tmp_path), timeout_s), timeout=120)
    for rank, result in enumerate(results):
        run_dir = Path(result["run_dir"])
        (split,) = run_events(run_dir, rank, event="run_split")
        assert "collective_timeout_s=1 s" in split["message"] and str(run_dir) in split["message"]
        assert any("collective_timeout_s=1 s" in m for m in result["warnings"])


def _only_rank_0_target(rank: int, world: int, out: str, timeout_s: float) -> dict[str, Any]:
    """Rank 0 calls ot.init(); rank 1 never does (it only trains)."""
    if rank != 0:
        time.sleep(3 * timeout_s + 2.0)
        return {}
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    ot.init(output_dir=out, prometheus_port=0, verbosity=0, hardware=False, collective_timeout_s=timeout_s)
    session = current_session()
    for i in range(3):
        with ot.step(i):
            pass
    ot.shutdown()
    return {"warnings": warnings.messages, "cross_rank": session.config.cross_rank}


def test_a_rank_that_never_calls_init_makes_the_other_wait_for_the_group_once(tmp_path: Path) -> None:
    """Rank 0 gives up on the telemetry group after collective_timeout_s, says why (a rank that
    never called ot.init() among the causes) and keeps to itself: no exchange, so no second
    collective group creation that would wait as long again (and pair with the training's own
    new_group calls on the other rank)."""
    [result, _] = run_ranks(2, _only_rank_0_target, (str(tmp_path), 1.0), timeout=120)
    failures = [m for m in result["warnings"] if "cannot create the gloo telemetry group" in m]
    assert len(failures) == 1, result["warnings"]
    assert any("later than another or never" in m for m in result["warnings"])
    assert result["cross_rank"] is False


def _independent_target(rank: int, world: int, out: str, cross_rank: bool) -> dict[str, Any]:
    """Rank 0 steps every 5 ms; rank 1 (an evaluator, say) idles 3 s after init, then steps every
    50 ms. Rank 0 counts its steps in 1.5 s without telemetry calls, then in 1.5 s of ot.step."""
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    ot.init(
        output_dir=out, run_name=f"independent-{cross_rank}", prometheus_port=0, verbosity=0,
        hardware=False, log_interval=10, cross_rank=cross_rank, collective_timeout_s=8.0,
    )  # fmt: skip
    session = current_session()
    result: dict[str, Any] = {"run_dir": str(session.run_dir)}
    if rank == 0:
        baseline, end = 0, time.monotonic() + 1.5
        while time.monotonic() < end:
            time.sleep(0.005)
            baseline += 1
        steps, longest, end = 0, 0.0, time.monotonic() + 1.5
        while time.monotonic() < end:
            started = time.monotonic()
            with ot.step(steps):
                time.sleep(0.005)
            steps += 1
            longest = max(longest, time.monotonic() - started)
        result.update(baseline=baseline, steps=steps, longest=longest)
    else:
        time.sleep(3.0)
        for i in range(20):
            with ot.step(i):
                time.sleep(0.05)
    ot.shutdown()
    result["warnings"] = warnings.messages
    return result


@pytest.mark.parametrize("cross_rank", [False, True])
def test_independent_ranks_never_wait_for_each_other(tmp_path: Path, cross_rank: bool) -> None:
    """The idle, then slower rank 1 costs rank 0 nothing, with the exchange off (cross_rank=False)
    or on (the default: rank 0 waits for rank 1's rows only on its worker, within the grace, and
    then goes on without them; before, the exchange held rank 0 at rank 1's pace: about a third of
    its steps here, frozen while rank 1 idled)."""
    results = run_ranks(2, _independent_target, (str(tmp_path), cross_rank), timeout=120)
    rank0 = results[0]
    assert rank0["steps"] >= 0.8 * rank0["baseline"], rank0
    assert rank0["longest"] < 1.0, rank0  # rank 1 idled 3 s
    run_dir = Path(rank0["run_dir"])
    assert _flush_steps(run_dir, 0)[:3] == [9, 19, 29]  # its own log_interval, at its own pace
    assert _flush_steps(run_dir, 1) == [9, 19]


def _idle_rank_target(rank: int, world: int, out: str, grace_s: float) -> dict[str, Any]:
    """Rank 1 calls ot.init() and then does not step while rank 0 trains alone for at least three
    graces (it waits for rank 0's file, so it cannot step before rank 0 is through); then both
    train in lockstep (an all_reduce per step, as DDP), from rank 0's next step on."""
    import torch
    import torch.distributed as dist

    ot.init(
        output_dir=out, run_name="idle", prometheus_port=0, verbosity=0, hardware=False, log_interval=10,
        exchange_grace_s=grace_s, collective_timeout_s=30.0,
    )  # fmt: skip
    session = current_session()
    reducer = session.reducer
    alone = Path(out) / "rank0_alone"
    result: dict[str, Any] = {"run_dir": str(session.run_dir)}
    if rank == 0:
        first, step = time.monotonic(), 0
        while time.monotonic() - first < 3 * grace_s or step % 10:
            with ot.step(step):
                time.sleep(0.001)
            step += 1
        result["alone"] = (step, reducer.partial_flushes, reducer.disabled_reason)
        alone.write_text(str(step))
    else:
        deadline = time.monotonic() + 60.0
        while not alone.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        step = int(alone.read_text())
    grad = torch.zeros(4)
    deferred = session.deferred_flushes
    for i in range(step, step + 60):
        with ot.step(i):
            time.sleep(0.01)
            dist.all_reduce(grad)
    result["end"] = (reducer.last_reductions["step"].n, reducer.disabled_reason, reducer.left_out_rows)
    result["deferred"] = (deferred, session.deferred_flushes)
    ot.shutdown()
    return result


def test_a_rank_idle_after_init_never_holds_rank0_and_the_cross_rank_view_resumes(tmp_path: Path) -> None:
    grace_s = 0.3
    rank0, rank1 = run_ranks(2, _idle_rank_target, (str(tmp_path), grace_s), timeout=120)
    steps, partial, disabled = rank0["alone"]
    # Rank 0 went through its steps and flushes while rank 1 had not stepped at all (it could not:
    # it waited for rank 0's file), so rank 0's training never waited for rank 1; the flushes
    # without rank 1's row are counted, and the exchange stayed on (before: rank 0 froze in its
    # flushes until collective_timeout_s, then the exchange went off for good).
    assert disabled is None and partial >= 1 and steps >= 30
    flushed = [s for s in _flush_steps(Path(rank0["run_dir"]), 0) if s < steps]
    assert len(flushed) >= 3 and steps - 1 in flushed, flushed
    # Once rank 1 steps, in lockstep, rank 0 pairs its rows again (its first rows cover other steps)
    n, disabled, left_out = rank0["end"]
    assert n == 2 and disabled is None and left_out >= 1, rank0
    assert rank1["end"][1] is None


def _pause_target(rank: int, world: int, out: str) -> dict[str, Any]:
    """Both ranks train 5 steps in lockstep (log_interval=10), pause on purpose (`adapters.idle`,
    as the Lightning logger does after a fit), then train 15 more."""
    import torch
    import torch.distributed as dist

    ot.init(
        output_dir=out, run_name="pause", prometheus_port=0, verbosity=0, hardware=False, log_interval=10,
        collective_timeout_s=30.0,
    )  # fmt: skip
    session = current_session()
    grad = torch.zeros(4)
    for i in range(5):
        with ot.step(i):
            dist.all_reduce(grad)
    adapters.idle()
    deadline = time.monotonic() + 60  # liveness bound: the worker takes the pause's flush
    while session.worker.flushes < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    paused = session.reducer.last_reductions["step"].n if rank == 0 else None
    for i in range(5, 20):
        with ot.step(i):
            dist.all_reduce(grad)
    left_out = session.reducer.left_out_rows
    ot.shutdown()
    return {"run_dir": str(session.run_dir), "paused": paused, "left_out": left_out}


def test_a_pause_flushes_on_every_rank_alike_and_the_schedule_holds(tmp_path: Path) -> None:
    """The pause's flush comes after the same step on every rank in lockstep, so rank 0 pairs
    both rows; the next flush is at the step the schedule had (9), not 10 steps after the pause."""
    rank0 = run_ranks(2, _pause_target, (str(tmp_path),), timeout=120)[0]
    run_dir = Path(rank0["run_dir"])
    assert _flush_steps(run_dir, 0) == _flush_steps(run_dir, 1) == [4, 9, 19]
    assert rank0["paused"] == 2 and rank0["left_out"] == 0, rank0


def _paced_target(rank: int, world: int, out: str) -> dict[str, Any]:
    """No collective of the job's own: rank 0 steps every 1 ms, rank 1 every 20 ms until rank 0 is
    done. Rank 0 records the steps of the rows it paired in each flush's cross-rank view."""
    ot.init(
        output_dir=out, run_name="paced", prometheus_port=0, verbosity=0, hardware=False, log_interval=10,
        exchange_grace_s=0.1, collective_timeout_s=30.0,
    )  # fmt: skip
    session = current_session()
    reducer = session.reducer
    done = Path(out) / "rank0_done"
    paired: list[list[tuple[int, int]]] = []
    result: dict[str, Any] = {}
    if rank == 0:
        reduce = reducer._reduce

        def spy(interval: Any, records: Any) -> None:
            paired.append([(r.from_step, r.step) for r in records])
            reduce(interval, records)

        reducer._reduce = spy  # type: ignore[method-assign]
        for i in range(300):
            with ot.step(i):
                time.sleep(0.001)
        done.write_text("1")
    else:
        i, deadline = 0, time.monotonic() + 60.0
        while not done.exists() and time.monotonic() < deadline:
            with ot.step(i):
                time.sleep(0.02)
            i += 1
        result["steps"] = i
    ot.shutdown()
    result.update(paired=paired, left_out=reducer.left_out_rows, disabled=reducer.disabled_reason)
    return result


def test_independent_ranks_at_different_paces_never_hold_rank0_nor_mix_steps(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(2, _paced_target, (str(tmp_path),), timeout=120)
    # Rank 0 was not held at rank 1's pace: before, each of its flushes waited for rank 1's row of
    # the same flush (up to 8 flushes queued), so rank 1 had done at least 300 - 90 steps by then.
    assert rank1["steps"] < 200, rank1
    assert rank0["disabled"] is None and rank1["disabled"] is None
    # Rank 1's rows came for other steps than rank 0's flushes: left out and counted, and every
    # cross-rank view rank 0 made paired rows of exactly the same steps.
    assert rank0["left_out"] >= 1, rank0
    assert all(len(set(ranges)) == 1 for ranges in rank0["paired"]), rank0["paired"]


def _wait_for(path: Path, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _idle_then_dead_target(rank: int, world: int, out: str, timeout_s: float) -> dict[str, Any]:
    """Rank 1 calls ot.init() and never steps (an evaluator, a data worker). Rank 0 and rank 2 step
    at their own pace for three collective_timeout_s; then rank 2 dies (its process exits) and rank
    0 steps on until its exchange turns off."""
    ot.init(
        output_dir=out, run_name="idle-dead", prometheus_port=0, verbosity=0, hardware=False,
        log_interval=10, exchange_grace_s=0.2, collective_timeout_s=timeout_s,
    )  # fmt: skip
    session = current_session()
    reducer = session.reducer
    done, heard = Path(out) / "done", Path(out) / "heard"
    result: dict[str, Any] = {"run_dir": str(session.run_dir)}
    if rank == 1:
        _wait_for(done)
        deadline = time.monotonic() + 5.0  # the ABORT reaches it with its next keep-alive's answer
        while reducer.disabled_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        heard.write_text("1")
    else:
        step, start = 0, time.monotonic()
        while time.monotonic() - start < 3 * timeout_s:
            with ot.step(step):
                time.sleep(0.005)
            step += 1
        result["idled"] = reducer.disabled_reason
        if rank == 2:
            return result  # dies: no shutdown, its connections close when its process exits
        deadline = time.monotonic() + 2 * timeout_s + 5.0
        while reducer.disabled_reason is None and time.monotonic() < deadline:
            with ot.step(step):
                time.sleep(0.005)
            step += 1
        done.write_text("1")
        _wait_for(heard, 10.0)  # alive until rank 1 took the ABORT it posted (else: rank 0 is gone)
    result["disabled"] = reducer.disabled_reason
    ot.shutdown()
    return result


def test_an_idle_rank_is_not_gone_and_a_dead_one_is_an_event(tmp_path: Path) -> None:
    """A rank that is alive but does not step for longer than collective_timeout_s keeps the
    exchange on (its worker sends keep-alive rows); a rank that dies still turns it off, naming
    that rank, and each rank says so in its events file."""
    timeout_s = 2.0
    rank0, rank1, _ = run_ranks(3, _idle_then_dead_target, (str(tmp_path), timeout_s), timeout=120)
    assert rank0["idled"] is None, rank0  # rank 1 idled three timeouts: not gone
    assert rank0["disabled"] is not None and rank0["disabled"].endswith("rank 2 is gone"), rank0
    assert rank1["disabled"] is not None and rank1["disabled"].endswith("rank 2 is gone"), rank1
    run_dir = Path(rank0["run_dir"])
    for rank in (0, 1):
        (event,) = run_events(run_dir, rank, event="cross_rank_disabled")
        assert event["gone_rank"] == 2 and "rank 2 is gone" in event["message"], event
