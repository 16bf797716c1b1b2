"""Runtime control through <run dir>/control.json: same step on every rank, events, validation."""

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
from otel_train.control import validate
from otel_train.testing import current_session


def test_validation_names_the_problem() -> None:
    assert validate({"timing_log_level": 2, "trace_every": 5, "profile": {"active": 2}}) is None
    assert "unknown setting 'nope'" in (validate({"nope": 1}) or "")
    assert "timing_log_level=3" in (validate({"timing_log_level": 3}) or "")
    assert "integer" in (validate({"trace_every": 2.5}) or "")
    assert "profile" in (validate({"profile": {"bogus": 1}}) or "")


def test_single_process_change_and_rejected_file(tmp_path: Path) -> None:
    ot.init(run_name="ctl", prometheus_port=0, verbosity=0, hardware=False, log_interval=5)
    session = current_session()
    control = session.run_dir / "control.json"
    control.write_text("{not json")
    level_at: dict[int, int] = {}
    step = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _rejected(session.run_dir):
        with ot.step(step):
            time.sleep(0.01)
        step += 1
    assert session.timing_level == 1  # a broken file changes nothing
    control.write_text(json.dumps({"timing_log_level": 2, "trace_every": 7, "total_steps": 500}))
    while time.monotonic() < deadline and session.timing_level != 2:
        with ot.step(step):
            level_at[step] = session.timing_level
            time.sleep(0.01)
        step += 1
    assert session.timing_level == 2 and session.config.trace_every == 7
    assert session.worker.total_steps == 500  # the ETA and progress read the new plan
    stamped = json.loads(control.read_text())
    assert stamped["version"] == 1 and stamped["apply_at_step"] > 0
    switched = min(s for s, level in level_at.items() if level == 2) if 2 in level_at.values() else step
    assert switched == stamped["apply_at_step"]
    events = run_events(session.run_dir, event="control")
    assert len(events) == 1 and events[0]["step"] == stamped["apply_at_step"]


def _rejected(run_dir: Path) -> bool:
    return any(e["event"] == "control_rejected" for e in run_events(run_dir))


def _rank_with_control(rank: int, world_size: int, out: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    ot.init(run_name="ctl-ranks", output_dir=out, prometheus_port=0, verbosity=0, hardware=False,
            log_interval=5)  # fmt: skip
    session = current_session()
    assert session is not None
    first_detail: int | None = None
    flag = torch.zeros(1)
    for step in range(100_000):
        with ot.step(step):
            with ot.timer("forward"):
                time.sleep(0.005 * (1 + rank))  # ranks run at different speeds between syncs
            with ot.timer("detail", level=2):
                if first_detail is None and session.timing_level == 2:
                    first_detail = step
            if rank == 0 and step == 30:
                (session.run_dir / "control.json").write_text('{"timing_log_level": 2}')
            with ot.timer("allreduce"):
                flag[0] = 1.0 if first_detail is not None and step >= first_detail + 10 else 0.0
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() > 0 or step > 2000:
            break
    ot.shutdown()
    return {"first_detail": first_detail}


@pytest.mark.multirank
def test_timing_level_flips_at_the_same_step_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(2, _rank_with_control, (str(tmp_path),), timeout=180)
    steps = {r["first_detail"] for r in results}
    assert len(steps) == 1 and None not in steps, results
    run_dir = tmp_path / "ctl-ranks"
    stamped = json.loads((run_dir / "control.json").read_text())
    assert steps == {stamped["apply_at_step"]}
    for rank in (0, 1):
        rows = [json.loads(line) for line in (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()]
        assert any("timers/detail/count" in r for r in rows)  # level-2 timers reach the output


@pytest.mark.parametrize(("start", "new"), [(1, 0), (0, 1)])
def test_verbosity_change_turns_the_health_event_lines_off_and_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, start: int, new: int
) -> None:
    ot.init(run_name=f"ctl-verbosity-{start}{new}", prometheus_port=0, verbosity=start, log_interval=5)
    session = current_session()
    (session.run_dir / "control.json").write_text(json.dumps({"verbosity": new}))
    step = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and session.config.verbosity != new:
        with ot.step(step):
            time.sleep(0.01)
        step += 1
    assert session.config.verbosity == new
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        ot.event("loss_spike", "loss 100.0 is 100x its average")
    echoed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("otel_train loss_spike")]
    assert len(echoed) == new, echoed
    ot.shutdown()


def test_a_profile_change_for_other_ranks_is_not_rejected_by_a_rank_whose_window_runs() -> None:
    """`{"profile": {..., "ranks": [1]}}` is not this rank's business: rank 0, with a window of its
    own running, neither starts one nor rejects the change (it did, with a `control_rejected`)."""
    from otel_train.control import ControlChange, apply_change

    ot.init(run_name="ctl-ranks", prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    assert session is not None and session.identity.rank == 0
    rejected: list[str] = []
    session.events.add_callback(
        lambda event, message, attrs: rejected.append(message) if event == "control_rejected" else None
    )
    assert ot.init().profile(active=50) is True  # rank 0's own window, running
    running = session.profiler
    apply_change(session, ControlChange(2, 0, {"profile": {"active": 2, "ranks": [1]}}), 0)
    assert rejected == [] and session.profiler is running
    apply_change(session, ControlChange(3, 0, {"profile": {"active": 2, "ranks": [0]}}), 0)
    assert len(rejected) == 1 and "a window is still running" in rejected[0]
    ot.shutdown()
