"""`ot.step` inside an open `ot.step` (a decorated train step under a framework's step marks, or two
decorated layers): one step counted once, as the outer one; the nested ones dropped, counted and
warned about."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import otel_train as ot


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("log_interval", [1, 3, 100])  # 1: every inner step's end flushes alone
def test_a_step_inside_a_step_counts_once(tmp_path: Path, log_interval: int, caplog: Any) -> None:
    ot.init(prometheus_port=0, verbosity=0, hardware=False, log_interval=log_interval,
            output_dir=str(tmp_path), run_name="n")  # fmt: skip

    @ot.step
    def train_step() -> None:
        ot.record("loss", 1.0)

    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for i in range(10):
            with ot.step(i, tokens=100):
                train_step()
        ot.shutdown()
    rows = _rows(tmp_path / "n")
    assert sum(r.get("train/steps", 0) for r in rows) == 10
    assert sum(r.get("throughput/tokens", 0) for r in rows) == 1000
    assert sum(r.get("otel_train/dropped/nested_step", 0) for r in rows) == 10
    warnings = [r.message for r in caplog.records if "nested_step" in r.message]
    assert len(warnings) == 1 and "ot.timer" in warnings[0]


def test_the_inner_steps_counts_stand_where_the_outer_gave_none(tmp_path: Path) -> None:
    ot.init(prometheus_port=0, verbosity=0, hardware=False, log_interval=100, output_dir=str(tmp_path),
            run_name="n")  # fmt: skip
    for _ in range(4):
        with ot.step(), ot.step(tokens=8, samples=2):
            pass
    ot.shutdown()
    rows = _rows(tmp_path / "n")
    assert sum(r.get("train/steps", 0) for r in rows) == 4
    assert sum(r.get("throughput/tokens", 0) for r in rows) == 32
    assert sum(r.get("throughput/samples", 0) for r in rows) == 8


def test_steps_one_after_another_are_not_nested(tmp_path: Path) -> None:
    ot.init(prometheus_port=0, verbosity=0, hardware=False, log_interval=1, output_dir=str(tmp_path),
            run_name="n")  # fmt: skip
    for i in range(6):
        with ot.step(i):
            pass
    ot.shutdown()
    rows = _rows(tmp_path / "n")
    assert sum(r.get("train/steps", 0) for r in rows) == 6
    assert not any("otel_train/dropped/nested_step" in r for r in rows)


def test_a_nested_step_leaves_the_flush_cadence_to_the_outer_one(tmp_path: Path) -> None:
    """Flushes come every `log_interval` outer steps, at an outer step's end, as without the inner
    steps."""
    ot.init(prometheus_port=0, verbosity=0, hardware=False, log_interval=5, output_dir=str(tmp_path),
            run_name="n")  # fmt: skip
    for i in range(20):
        with ot.step(i, tokens=10):
            with ot.step():
                ot.record("loss", 1.0)
            with ot.timer("after_inner"):  # the outer step's own phase, after the inner one ended
                pass
    ot.shutdown()
    rows = [r for r in _rows(tmp_path / "n") if "train/steps" in r]
    assert [(r["step"], r["train/steps"]) for r in rows] == [(4, 5), (9, 5), (14, 5), (19, 5)]
    assert [r["throughput/tokens"] for r in rows] == [50] * 4
    assert sum(r["timers/after_inner/count"] for r in rows) == 20


def test_a_framework_step_that_outlives_the_step_around_it_leaves_no_step_open(tmp_path: Path) -> None:
    """`adapters.begin_step` inside a `with ot.step` whose block ends first: the later steps are
    steps of their own (not nested in the ended one), each flushed at its log_interval."""
    from otel_train import adapters
    from otel_train.testing import current_session

    ot.init(prometheus_port=0, verbosity=0, hardware=False, log_interval=1, output_dir=str(tmp_path),
            run_name="n")  # fmt: skip
    with ot.step(0):
        adapters.begin_step(1)
    adapters.end_step()
    assert current_session().step_start_ns == 0  # no step is open
    for i in range(2, 6):
        with ot.step(i):
            pass
    ot.shutdown()
    rows = [r for r in _rows(tmp_path / "n") if r.get("train/steps")]
    assert [r["step"] for r in rows][-4:] == [2, 3, 4, 5]
