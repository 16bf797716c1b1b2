"""A requeued job racing its still-running zombie (same run id, same run name, two live processes):
the second never appends to the first's files; it warns and writes a directory of its own. Once
the first has exited, the same run id resumes in place as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.events import run_events

REPO = Path(__file__).resolve().parents[2]

TRAINER = """
import sys
import otel_train as ot
from otel_train.testing import current_session
ot.init(output_dir=sys.argv[1], run_name="job", run_id="slurm-4242", prometheus_port=0,
                  verbosity=0, hardware=False, log_interval=1)
session = current_session()
for step in range(int(sys.argv[2])):
    with ot.step(step):
        ot.record("loss", 1.0)
print(session.run_dir, flush=True)
sys.stdin.readline()  # alive until the test says so
ot.shutdown()
"""


def _start(tmp_path: Path, steps: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path), str(steps)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str]) -> str:
    _, stderr = proc.communicate("stop\n", timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    return stderr


def _steps(run_dir: Path) -> tuple[list[int], int]:
    """(the step of each row, steps counted): a row may hold several steps (log_interval=1 is a
    flush per step unless the worker is behind)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/steps" in r]
    return [r["step"] for r in rows], int(sum(r["train/steps"] for r in rows))


def _events(run_dir: Path) -> list[str]:
    return [e["event"] for e in run_events(run_dir)]


def test_a_live_owner_is_never_appended_to(tmp_path: Path) -> None:
    first = _start(tmp_path, 30)
    second = None
    try:
        assert first.stdout is not None
        owned = Path(first.stdout.readline().strip())
        assert owned == tmp_path / "job"
        second = _start(tmp_path, 30)  # the requeue, while the first is still alive
        assert second.stdout is not None
        diverted = Path(second.stdout.readline().strip())
        assert diverted == tmp_path / f"job-{second.pid}"
        stderr = _finish(second)
        assert str(owned) in stderr and "OTEL_TRAIN_RUN_ID" in stderr and str(first.pid) in stderr
        assert "role=" in stderr  # a second process of its own shares the first one's series
        _finish(first)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    steps, counted = _steps(owned)
    assert steps == sorted(set(steps)) and steps[-1] == 29 and counted == 30  # no step written twice
    assert "restart" not in _events(owned)  # the owner was alive: not a restart
    assert _steps(diverted)[1] == 30
    # The first has exited: the same run id resumes in place, as a restart.
    third = _start(tmp_path, 5)
    assert third.stdout is not None and Path(third.stdout.readline().strip()) == owned
    _finish(third)
    assert _events(owned).count("restart") == 1
    steps, counted = _steps(owned)
    assert counted == 35 and steps[-1] == 4


@pytest.mark.parametrize("damage", ["empty", "truncated", "empty_object"])
def test_a_damaged_owner_file_is_set_aside_and_the_same_run_resumes(damage: str, tmp_path: Path) -> None:
    """The requeued job (same run id and name) finds its owner file damaged by a node that died
    while writing it: it resumes in place, warning once and keeping the damaged file aside."""
    _finish(_start(tmp_path, 5))
    owner = tmp_path / "job" / ".owner.rank0.json"
    whole = owner.read_bytes()
    owner.write_bytes({"empty": b"", "truncated": whole[:17], "empty_object": b"{}"}[damage])
    damaged = owner.read_bytes()
    stderr = _finish(_start(tmp_path, 5))
    assert "already holds rank 0's files" not in stderr
    assert f"{owner} is damaged" in stderr and "slurm-4242 takes rank 0's files over" in stderr, stderr
    assert (tmp_path / "job" / ".owner.rank0.json.corrupt").read_bytes() == damaged
    assert json.loads(owner.read_text())["run_id"] == "slurm-4242"  # whole again, for the next restart
    steps, counted = _steps(tmp_path / "job")
    assert counted == 10 and steps[-1] == 4  # appended: both processes' steps in the one file
    assert _events(tmp_path / "job").count("restart") == 1
    assert not [p for p in tmp_path.iterdir() if p.name != "job"]  # no second run directory


def test_a_damaged_owner_file_of_another_run_is_still_refused(tmp_path: Path) -> None:
    """The damaged file is no way in for a different run: this rank's goodput file still names the
    run that wrote the files, and the claim refuses as it does with a whole owner file."""
    _finish(_start(tmp_path, 3))
    owner = tmp_path / "job" / ".owner.rank0.json"
    owner.write_bytes(b"")
    goodput = tmp_path / "job" / "goodput.rank0.json"
    assert json.loads(goodput.read_text())["run_id"] == "slurm-4242"
    goodput.write_text(goodput.read_text().replace("slurm-4242", "slurm-1111"))
    proc = _start(tmp_path, 3)
    _, stderr = proc.communicate("stop\n", timeout=60)
    assert proc.returncode != 0
    assert (
        "already holds rank 0's files from another run (run_id slurm-1111; this one is slurm-4242)" in stderr
    )
    assert owner.read_bytes() == b"" and not (tmp_path / "job" / ".owner.rank0.json.corrupt").exists()


def test_owner_records_reach_the_disk_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_train import run_directory

    calls: list[str] = []
    real_fsync, real_replace = os.fsync, Path.replace

    def fsync(fd: int) -> None:
        calls.append("fsync " + os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1])
        real_fsync(fd)

    def replace(self: Path, target: Path) -> Path:
        calls.append(f"rename {Path(target).name}")
        return real_replace(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "replace", replace)
    assert run_directory.claim_run_dir(tmp_path, 0, "job-1", "exp") is False
    tmp = f"..owner.rank0.json.{os.getpid()}-{threading.get_ident()}.tmp"  # the writer's own
    assert calls == [f"fsync {tmp}", "rename .owner.rank0.json", f"fsync {tmp_path.name}"]
