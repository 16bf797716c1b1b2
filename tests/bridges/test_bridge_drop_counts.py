"""Updates the bridges drop are counted in otel_train.dropped while the run goes on: those dropped
inside the bridge process as they happen (so the run's own metrics show a bridge falling behind),
those its close reports after shutdown stopped waiting, and those handed on after the close."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.bridges.process import BridgeProcess
from otel_train.core import assemble
from otel_train.core.assemble import RunPlace
from otel_train.testing import current_session

TESTS = Path(__file__).resolve().parents[1]
SLOW = ("helpers.bridge_fixtures", "Slow", {"seconds": 3.0})  # its first write takes 3 s


@pytest.fixture(autouse=True)
def fixtures_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bridge process imports tests/helpers/bridge_fixtures.py (tests/ on its PYTHONPATH)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    )


def _until(condition: object, guard_s: float) -> None:
    """Poll `condition` (a callable) until true; the guard only ends a wait that never would."""
    deadline = time.monotonic() + guard_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)


def test_a_bridge_falling_behind_shows_in_the_runs_metrics_during_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = assemble.bridge_specs

    def with_slow(config: ot.Config, place: RunPlace) -> list:
        return [*specs(config, place), SLOW]

    monkeypatch.setattr(assemble, "bridge_specs", with_slow)
    ot.init(output_dir=str(tmp_path), run_name="slow", tensorboard=True, bridge_queue_size=2,
            prometheus_port=0, verbosity=0, hardware=False, log_interval=1)  # fmt: skip
    session = current_session()
    assert session is not None and session.bridges is not None
    metrics = session.run_dir / "metrics.rank0.jsonl"

    def slow_drops_in_a_row() -> bool:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return any(json.loads(line).get("otel_train/dropped/bridge_slow") for line in lines)

    step = 0
    deadline = time.monotonic() + 30  # only ends a wait that never would
    while not slow_drops_in_a_row() and time.monotonic() < deadline:
        with ot.step(step):
            ot.record("loss", float(step))
        step += 1
        time.sleep(0.05)
    shown_during_the_run = slow_drops_in_a_row()
    bridges = session.bridges
    ot.shutdown()
    bridges.wait(60)
    assert shown_during_the_run


def test_drops_a_late_close_answer_reports_are_counted_once() -> None:
    drops: list[tuple[str, int]] = []
    bridges = BridgeProcess([SLOW], queue_size=2, count_drop=lambda r, n: drops.append((r, n)))
    for step in range(10):
        bridges.write_scalars(step, 0.0, {"x": float(step)})
        time.sleep(0.05)  # one flush at a time: the pipe keeps up, the slow bridge does not
    bridges.close({}, timeout=0.2)  # gives up before the slow write ends
    assert not bridges.closed_cleanly
    assert bridges.wait(60)
    # one call in the slow write and two queued behind it are written; the other 7 are counted,
    # whenever the bridge process told of them, and never twice
    _until(lambda: sum(n for _, n in drops) >= 7, 30)
    assert sum(n for _, n in drops) == 7 and {r for r, _ in drops} <= {"bridge_queue", "bridge_slow"}
    assert bridges.bridge_stats["slow"]["clean"]


def test_updates_after_the_close_are_counted_under_their_own_reason_and_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    drops: list[tuple[str, int]] = []
    recording = ("helpers.bridge_fixtures", "Recording", {"path": str(tmp_path / "calls.jsonl")})
    bridges = BridgeProcess([recording], queue_size=64, count_drop=lambda r, n: drops.append((r, n)))
    bridges.write_scalars(0, 0.0, {"x": 0.0})
    bridges.close({}, timeout=60)
    assert bridges.wait(30) and bridges.closed_cleanly
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for step in range(1, 4):  # the worker, past the shutdown deadline, hands on its backlog
            bridges.write_histogram("h", [1.0], step)
    assert drops == [("bridge_closed", 1)] * 3 and bridges.dropped == 3
    assert sum("reason=bridge_closed" in r.getMessage() for r in caplog.records) == 1
    calls = [json.loads(line)[0] for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls == ["scalars", "close"]
