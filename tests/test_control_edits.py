"""Edits of the stamped control file by a person, read by rank 0's `ControlFile.poll` directly (no
session, no threads): each edit that asks for settings is one new change with one `control` event."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from otel_train.control import ControlFile
from otel_train.run_directory import claim_run_dir


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def emit(
        self, event: str, message: str, attributes: Mapping[str, Any] | None = None, severity: str = "WARNING"
    ) -> None:
        self.seen.append((event, message))


def _write_and_schedule(control: ControlFile, text: str, step: int) -> None:
    control.path.write_text(text)
    control.schedule(last_step=step, seconds_per_step=0.01)


def test_every_edit_of_the_stamped_file_is_a_change_with_an_event(tmp_path: Path) -> None:
    events = _Events()
    control = ControlFile(tmp_path, rank=0, events=events)
    _write_and_schedule(control, json.dumps({"trace_every": 10}), step=100)
    first = control.path.read_text()
    assert json.loads(first)["version"] == 1

    edited = {**json.loads(first), "trace_every": 20}  # a value changed, the stamp fields kept
    _write_and_schedule(control, json.dumps(edited, indent=1), step=200)
    assert json.loads(control.path.read_text())["version"] == 2

    _write_and_schedule(control, first, step=300)  # the editor's undo: v1's stamped text back
    restamped = json.loads(control.path.read_text())
    assert restamped["version"] == 3 and restamped["trace_every"] == 10

    changes = [c for c in control.take_due(10**6)]
    assert [(c.version, dict(c.settings)) for c in changes] == [
        (1, {"trace_every": 10}),
        (2, {"trace_every": 20}),
        (3, {"trace_every": 10}),
    ]
    assert [e for e, _ in events.seen] == ["control"] * 3


def test_a_rank_other_than_zero_applies_an_old_stamp_once_and_never_restamps(tmp_path: Path) -> None:
    events = _Events()
    rank0 = ControlFile(tmp_path, rank=0, events=_Events())
    _write_and_schedule(rank0, json.dumps({"trace_every": 10}), step=100)
    stamped = rank0.path.read_text()
    rank1 = ControlFile(tmp_path, rank=1, events=events)
    rank1.schedule(last_step=100, seconds_per_step=0.01)
    rank1.path.write_text(stamped + "\n")  # the same stamp again (other bytes): nothing new
    rank1.schedule(last_step=101, seconds_per_step=0.01)
    assert [c.version for c in rank1.take_due(10**6)] == [1]
    assert rank1.path.read_text() == stamped + "\n"  # rank 1 never writes the file
    assert [e for e, _ in events.seen] == ["control"]


def test_a_resume_keeps_the_settings_and_never_reruns_a_profile_window(tmp_path: Path) -> None:
    claim_run_dir(tmp_path, 0, "job-1", "ctl")  # rank 0's first process
    before = ControlFile(tmp_path, rank=0, events=_Events())
    asked = {"trace_every": 10, "profile": {"wait": 0, "warmup": 0, "active": 1}}
    _write_and_schedule(before, json.dumps(asked), step=100)
    _write_and_schedule(before, json.dumps({"verbosity": 0}), step=200)
    assert [c.version for c in before.take_due(10**6)] == [1, 2]

    assert claim_run_dir(tmp_path, 0, "job-1", "ctl")  # the job restarted: rank 0's new process
    events0, events1 = _Events(), _Events()
    rank0 = ControlFile(tmp_path, rank=0, events=events0)
    rank1 = ControlFile(tmp_path, rank=1, events=events1, world_size=2)
    rank1.schedule(last_step=0, seconds_per_step=None)  # reads the earlier process's stamp first
    rank0.schedule(last_step=0, seconds_per_step=None)
    rank1.schedule(last_step=1, seconds_per_step=None)
    lasting = {"trace_every": 10, "verbosity": 0}  # the settings stay; the window ran already
    for rank in (rank0, rank1):
        assert [(c.version, dict(c.settings)) for c in rank.take_due(10**6)] == [(1, lasting)]
    assert [e for e, _ in events0.seen + events1.seen] == ["control", "control"]
    assert json.loads(rank0.path.read_text())["earlier"] == []


def test_a_plan_shorter_than_the_run_so_far_and_a_yaml_file_are_refused_with_the_fix(tmp_path: Path) -> None:
    events = _Events()
    control = ControlFile(tmp_path, rank=0, events=events)
    _write_and_schedule(control, json.dumps({"total_steps": 10}), step=520)
    _write_and_schedule(control, "verbosity: 1\n", step=521)  # the config file's format, not this one's
    _write_and_schedule(control, json.dumps({"total_steps": 2000}), step=522)
    assert [e for e, _ in events.seen] == ["control_rejected", "control_rejected", "control"]
    assert "total_steps=10: the run is at step 520 already; plan more steps" in events.seen[0][1]
    assert 'write one JSON object, e.g. {"log_interval": 50}' in events.seen[1][1]
    assert [dict(c.settings) for c in control.take_due(10**6)] == [{"total_steps": 2000}]
