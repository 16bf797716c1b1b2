"""The goodput file of an earlier process never crashes a restart: whatever it holds, `ot.init()`
of the same run id warns once naming the file, keeps it aside as `<name>.corrupt` and starts the
account over; values out of range (negative, NaN, a goodput above 100 %) are refused, not added."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fake_time import FakeTime

import otel_train as ot
from otel_train import goodput
from otel_train.goodput import CAUSES, process_start_perf_s
from otel_train.testing import current_session

_FIRST_PROCESS = """
import sys
import otel_train as ot
ot.init(run_name="requeued", run_id="job-9", output_dir=sys.argv[1], prometheus_port=0, verbosity=0,
        hardware=False, log_interval=2)
for step in range(4):
    with ot.step(step):
        pass
ot.shutdown()
"""


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory a real first process of run id job-9 left behind."""
    root = tmp_path_factory.mktemp("first")
    script = root / "first.py"
    script.write_text(_FIRST_PROCESS)
    subprocess.run([sys.executable, str(script), str(root / "runs")], check=True, timeout=120)
    return root / "runs" / "requeued"


def _valid(first_run: Path) -> dict:
    return json.loads((first_run / "goodput.rank0.json").read_text())


def _with(first_run: Path, **changes: object) -> str:
    return json.dumps({**_valid(first_run), **changes})


def _without(first_run: Path, key: str) -> str:
    state = _valid(first_run)
    del state[key]
    return json.dumps(state)


_DAMAGED: dict[str, Callable[[Path], str | bytes]] = {
    "a list": lambda run: "[]",
    "null": lambda run: "null",
    "empty": lambda run: "",
    "truncated": lambda run: _valid_text(run)[:40],
    "not utf-8": lambda run: b"\xff\xfe\x00{",
    "badput a list": lambda run: _with(run, badput=[]),
    "no updated": lambda run: _without(run, "updated"),
    "no run_id": lambda run: _without(run, "run_id"),
    "wall_s a string": lambda run: _with(run, wall_s="x"),
    "wall_s negative": lambda run: _with(run, wall_s=-997.0),
    "wall_s NaN": lambda run: _valid_text(run).replace('"wall_s": ', '"wall_s": NaN, "was": '),
    "wall_s Infinity": lambda run: _valid_text(run).replace('"wall_s": ', '"wall_s": Infinity, "was": '),
    "wall_s huge": lambda run: _with(run, wall_s=1e300),
    "wall_s a bool": lambda run: _with(run, wall_s=True),
    "goodput 28,000 %": lambda run: _with(run, productive_s=280 * _valid(run)["wall_s"]),
    "a cause negative": lambda run: _with(run, badput={**_valid(run)["badput"], "stall": -5.0}),
    "a cause a string": lambda run: _with(run, badput={**_valid(run)["badput"], "eval": "1"}),
    "updated in the far future": lambda run: _with(run, updated=time.time() + 10 * 86400),
    "100 kB": lambda run: _valid_text(run) + " " * 100_000,
    "last_step a float": lambda run: _with(run, last_step=3.5),
    "interruptions negative": lambda run: _with(run, interruptions=-1),
}


def _valid_text(first_run: Path) -> str:
    return (first_run / "goodput.rank0.json").read_text()


def _restart(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ot.Session:
    """The same run id started again on `run_dir` (the restart path of `ot.init()`), a few steps
    of 10 ms on a hand-moved clock. In this process, as a later run of it: its account begins at
    this `ot.init()` (`goodput.run_start_perf_s`), whichever test runs first."""
    monkeypatch.setattr(goodput, "_process_has_run", True)
    ot.init(run_name=run_dir.name, run_id="job-9", output_dir=str(run_dir.parent), prometheus_port=0,
                      verbosity=0, hardware=False, log_interval=2)  # fmt: skip
    session = current_session()
    clock = FakeTime().install(session, monkeypatch)
    for step in range(4, 8):
        with ot.step(step):
            clock.advance(0.01)
    ot.shutdown()
    return session


@pytest.mark.parametrize("case", list(_DAMAGED))
def test_a_damaged_goodput_file_is_set_aside_and_the_account_starts_over(
    case: str,
    first_run: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_dir = tmp_path / "requeued"
    shutil.copytree(first_run, run_dir)
    damaged = _DAMAGED[case](first_run)
    data = damaged if isinstance(damaged, bytes) else damaged.encode()
    state_file = run_dir / "goodput.rank0.json"
    state_file.write_bytes(data)
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)  # must not raise
    warnings = [r.getMessage() for r in caplog.records if "goodput file" in r.getMessage()]
    assert len(warnings) == 1 and str(state_file) in warnings[0], warnings
    assert (run_dir / "goodput.rank0.json.corrupt").read_bytes() == data
    fresh = json.loads(state_file.read_text())
    assert fresh["run_id"] == "job-9" and fresh["badput"]["restart"] == 0.0
    assert 0 < fresh["productive_s"] <= fresh["wall_s"]
    assert all(0 <= fresh["badput"][cause] <= fresh["wall_s"] for cause in CAUSES)


@pytest.mark.timeout(60)  # the FIFO read as a file would wait for a writer forever
def test_a_fifo_in_place_of_the_goodput_file_is_set_aside_not_waited_on(
    first_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "requeued"
    shutil.copytree(first_run, run_dir)
    state_file = run_dir / "goodput.rank0.json"
    state_file.unlink()
    os.mkfifo(state_file)
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)
    warnings = [r.getMessage() for r in caplog.records if "goodput file" in r.getMessage()]
    assert len(warnings) == 1 and "not a regular file" in warnings[0], warnings
    assert stat.S_ISFIFO((run_dir / "goodput.rank0.json.corrupt").lstat().st_mode)
    assert json.loads(state_file.read_text())["badput"]["restart"] == 0.0


def test_a_file_from_an_older_version_is_continued(
    first_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shape before data / wasted progress / save-vs-restore and the interruption count: one
    `checkpoint` cause (read as checkpoint_save), no last_step, no interruptions."""
    run_dir = tmp_path / "requeued"
    shutil.copytree(first_run, run_dir)
    before = _valid(first_run)
    old_causes = ("startup", "eval", "stall", "restart", "other")
    older = {
        "run_id": before["run_id"], "updated": before["updated"], "wall_s": before["wall_s"],
        "productive_s": before["productive_s"],
        "badput": {**{c: before["badput"][c] for c in old_causes}, "checkpoint": 0.25 * before["wall_s"]},
    }  # fmt: skip
    (run_dir / "goodput.rank0.json").write_text(json.dumps(older))
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)
    assert not [r for r in caplog.records if "goodput file" in r.getMessage()]
    assert not (run_dir / "goodput.rank0.json.corrupt").exists()
    after = json.loads((run_dir / "goodput.rank0.json").read_text())
    assert after["productive_s"] > before["productive_s"]
    assert after["badput"]["startup"] >= before["badput"]["startup"]
    assert after["badput"]["checkpoint_save"] == 0.25 * before["wall_s"]
    assert after["interruptions"] == 1 and after["last_step"] == 7


# --- restart gaps the clocks cannot vouch for ---------------------------------------------------------

_BEHIND_S = 7200.0  # the first process's host clock is 2 h behind (stepped right later: chrony, a VM move)


@pytest.fixture(scope="module")
def behind_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory a first process of run id job-9 left while its wall clock read 2 h behind."""
    root = tmp_path_factory.mktemp("behind")
    script = root / "first.py"
    skewed = f"import time\n_real = time.time\ntime.time = lambda: _real() - {_BEHIND_S}\n"
    script.write_text(skewed + _FIRST_PROCESS)
    subprocess.run([sys.executable, str(script), str(root / "runs")], check=True, timeout=120)
    return root / "runs" / "requeued"


def _no_gap_booked(before: dict[str, float]) -> float:
    """The most wall time a restart that books no gap may add: this process's own lifetime (more
    than the in-process restart's, which counts from its `ot.init()`) plus a margin, far below the
    2 h or 56 years a wrong gap would add."""
    return before["wall_s"] + (time.perf_counter() - process_start_perf_s()) + 300.0


def _gap_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "restart gap" in r.getMessage()]


def test_a_clock_hours_behind_on_the_same_boot_books_the_real_gap(
    behind_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file says `updated` 2 h ago; the host's boot clock says seconds: the gap is the seconds."""
    run_dir = tmp_path / "requeued"
    shutil.copytree(behind_run, run_dir)
    before = _valid(behind_run)
    assert time.time() - before["updated"] > _BEHIND_S  # what the old account booked as restart time
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)
    after = _valid(run_dir)
    # (the in-process restart begins seconds after the first process's last record)
    assert 0.0 <= after["badput"]["restart"] < 120.0, after
    assert after["wall_s"] < _no_gap_booked(before), after
    assert not _gap_warnings(caplog) and not (run_dir / "goodput.rank0.json.corrupt").exists()


def test_a_clock_hours_behind_on_another_host_leaves_the_gap_unknown(
    behind_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written on another boot (another host): `updated` disagrees with the file's own time by 2 h,
    so the gap is unknown: nothing booked for it, one warning naming the file; the account goes on."""
    run_dir = tmp_path / "requeued"
    shutil.copytree(behind_run, run_dir)
    state_file = run_dir / "goodput.rank0.json"
    before = _valid(behind_run)
    written = state_file.stat().st_mtime
    state_file.write_text(json.dumps({**before, "boot_id": "another-host-boot"}))
    os.utime(state_file, (written, written))  # as the first process left it
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)
    after = _valid(run_dir)
    assert after["badput"]["restart"] == before["badput"]["restart"] == 0.0, after
    assert before["productive_s"] < after["productive_s"] <= after["wall_s"] < _no_gap_booked(before)
    assert after["interruptions"] == 1
    [warning] = _gap_warnings(caplog)
    assert str(state_file) in warning and "off the file system's" in warning, warning


def test_updated_zero_leaves_the_gap_unknown_not_56_years(
    first_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`updated: 0` (the epoch) in a file from another host: no 56-year restart, one warning."""
    run_dir = tmp_path / "requeued"
    shutil.copytree(first_run, run_dir)
    before = {k: v for k, v in _valid(first_run).items() if k not in ("boot_id", "boottime")}
    (run_dir / "goodput.rank0.json").write_text(json.dumps({**before, "updated": 0}))
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)
    after = _valid(run_dir)
    assert after["badput"]["restart"] == 0.0 and after["wall_s"] < _no_gap_booked(before), after
    assert after["productive_s"] > before["productive_s"]
    [warning] = _gap_warnings(caplog)
    assert "before 1600000000" in warning, warning


def test_a_restart_on_another_host_with_clocks_in_sync_books_its_gap(
    first_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another boot, `updated` agreeing with the file's time: the gap comes from `updated`."""
    run_dir = tmp_path / "requeued"
    shutil.copytree(first_run, run_dir)
    state_file = run_dir / "goodput.rank0.json"
    # 30 s before the restart's account begins (its ot.init(), in _restart just below)
    updated = time.time() - 30.0
    state_file.write_text(
        json.dumps({**_valid(first_run), "boot_id": "another-host-boot", "updated": updated})
    )
    os.utime(state_file, (updated, updated))
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)
    assert _valid(run_dir)["badput"]["restart"] == pytest.approx(30.0, abs=1.0)
    assert not _gap_warnings(caplog)


def test_a_reader_clock_stepped_back_two_days_keeps_the_account(
    first_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restarted process's clock is two days behind the one that wrote the file (and its
    mtime): the account is no damaged file, and goes on (its restart gap alone is unknown)."""
    run_dir = tmp_path / "requeued"
    shutil.copytree(first_run, run_dir)
    state_file = run_dir / "goodput.rank0.json"
    before = json.loads(state_file.read_text())
    ahead = time.time() + 2 * 86400  # the writer's clock, and the file system's, as this one sees them
    state_file.write_text(json.dumps({**before, "updated": ahead}))
    os.utime(state_file, (ahead, ahead))
    caplog.set_level(logging.WARNING, logger="otel_train")
    _restart(run_dir, monkeypatch)
    assert not (run_dir / "goodput.rank0.json.corrupt").exists()
    assert not [r for r in caplog.records if "ignoring the goodput file" in r.getMessage()]
    after = json.loads(state_file.read_text())
    assert (
        after["productive_s"] > before["productive_s"]
        and after["interruptions"] == before["interruptions"] + 1
    )
