"""Ranks that disagree at init, with real gloo ranks: a different log_interval on one rank is
warned about (log and event) and every rank flushes at rank 0's steps; a rank that calls
ot.init() later than collective_timeout_s says that it splits the job into its own run directory,
naming the setting."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

import otel_train as ot

pytestmark = pytest.mark.multirank


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = run_dir / f"events.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _flush_steps(run_dir: Path, rank: int) -> list[int]:
    lines = (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def _own_interval_target(rank: int, world: int, out: str) -> dict[str, Any]:
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    session = ot.init(
        output_dir=out, run_name="mixed", prometheus_port=0, verbosity=0, hardware=False,
        log_interval=10 if rank == 0 else 7, collective_timeout_s=20.0,
    )  # fmt: skip
    for i in range(40):
        with ot.step(i):
            time.sleep(0.001)
    ot.shutdown()
    return {"run_dir": str(session.run_dir), "warnings": warnings.messages}


def test_a_different_log_interval_is_warned_and_rank0s_is_kept(tmp_path: Path) -> None:
    results = run_ranks(2, _own_interval_target, (str(tmp_path),), timeout=120)
    run_dir = Path(results[0]["run_dir"])
    assert results[1]["run_dir"] == str(run_dir)
    (mismatch,) = [e for e in _events(run_dir, 1) if e["event"] == "settings_mismatch"]
    assert "rank 1 asked for 7 steps, rank 0 for 10 steps" in mismatch["message"]
    assert any("log_interval differs across ranks" in m for m in results[1]["warnings"])
    assert not [e for e in _events(run_dir, 0) if e["event"] == "settings_mismatch"]
    # the same flush steps on both ranks (the shutdown flush carries no step: no row of its own)
    assert _flush_steps(run_dir, 0) == _flush_steps(run_dir, 1) == [9, 19, 29, 39]


def _late_target(rank: int, world: int, out: str, timeout_s: float) -> dict[str, Any]:
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    if rank == 1:
        time.sleep(timeout_s + 2.0)  # ot.init() later than collective_timeout_s after rank 0's
    session = ot.init(
        output_dir=out, prometheus_port=0, verbosity=0, hardware=False, log_interval=5,
        collective_timeout_s=timeout_s,
    )  # fmt: skip
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
        (split,) = [e for e in _events(run_dir, rank) if e["event"] == "run_split"]
        assert "collective_timeout_s=1 s" in split["message"] and str(run_dir) in split["message"]
        assert any("collective_timeout_s=1 s" in m for m in result["warnings"])


def _independent_target(rank: int, world: int, out: str, cross_rank: bool) -> dict[str, Any]:
    """Rank 0 steps every 5 ms; rank 1 (an evaluator, say) idles 3 s after init, then steps every
    50 ms. Rank 0 counts its steps in 1.5 s without telemetry calls, then in 1.5 s of ot.step."""
    warnings = _Warnings()
    logging.getLogger("otel_train").addHandler(warnings)
    session = ot.init(
        output_dir=out, run_name=f"independent-{cross_rank}", prometheus_port=0, verbosity=0,
        hardware=False, log_interval=10, cross_rank=cross_rank, collective_timeout_s=8.0,
    )  # fmt: skip
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
    """cross_rank=False: the idle, then slower rank 1 costs rank 0 nothing (in lockstep the
    telemetry held rank 0 at rank 1's pace: about a third of its steps here, frozen while rank 1
    idled). In lockstep, such a wait is warned about, naming the setting."""
    results = run_ranks(2, _independent_target, (str(tmp_path), cross_rank), timeout=120)
    rank0 = results[0]
    named = [m for m in rank0["warnings"] if "cross_rank=False" in m]
    if cross_rank:
        assert named, rank0["warnings"]
        return
    assert rank0["steps"] >= 0.8 * rank0["baseline"], rank0
    assert rank0["longest"] < 1.0, rank0  # rank 1 idled 3 s
    assert not named
    run_dir = Path(rank0["run_dir"])
    assert _flush_steps(run_dir, 0)[:3] == [9, 19, 29]  # its own log_interval, at its own pace
    assert _flush_steps(run_dir, 1) == [9, 19]
