"""The bridge process at the edges of its life: a trainer that is PID 1 of its container still gets
its W&B and MLflow data written at exit, a bridge process killed mid-run loses no frame written after
its death and its restarted successor gets the hyperparameters and continues the same MLflow run.
Read back from the real backends (W&B offline, the MLflow store, TensorBoard's event files)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers.readback import iter_wandb_records, read_mlflow, read_tensorboard, read_wandb_offline
from helpers.waiting import process_gone

import otel_train as ot
from otel_train.testing import current_session

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def _env() -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )


def _files_closed(pid: int) -> bool:
    """Killed and its files closed: a zombie whose other threads are gone too (the leader shows
    as a zombie while its other threads, which share its open files, are still exiting)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE and os.listdir(f"/proc/{pid}/task") == [
            str(pid)
        ]
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True


def _until(condition: object, guard_s: float) -> None:
    """Poll `condition` (a callable) until true; the guard only ends a wait that never would."""
    deadline = time.monotonic() + guard_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)


def _tb_steps(log_dir: Path) -> list[int]:
    return sorted({s for s, _ in read_tensorboard(log_dir).scalars.get("train/loss", [])})


def _new_pid_namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and probe.stdout.strip() == "1"


CONTAINER_TRAINER = textwrap.dedent(
    """
    import os, sys
    import otel_train as ot

    assert os.getpid() == 1, os.getpid()
    ot.init(output_dir=sys.argv[1], run_name="pid1", wandb=True, wandb_mode="offline", mlflow=True,
            prometheus_port=0, verbosity=0, log_interval=5, hardware=False)
    ot.log_hyperparams({"lr": 0.1})
    for step in range(50):
        with ot.step(step):
            ot.record("loss", float(step))
    ot.shutdown()
    """
)


def test_a_trainer_that_is_pid_1_of_its_container_still_gets_wandb_and_mlflow_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container without an init the trainer is PID 1: when it exits the kernel kills every
    process of its PID namespace, the bridge process and W&B's service with it. Its shutdown waits
    for them, so W&B's log and the MLflow run are complete."""
    if not _new_pid_namespace_works():
        message = "needs `unshare --pid --fork --mount-proc` (util-linux; root or user namespaces)"
        if os.environ.get("CI"):
            pytest.fail(f"CI requires it: {message}")
        pytest.skip(message)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from otel_train.bridges.mlflow import default_tracking_uri

    script = tmp_path / "trainer.py"
    script.write_text(CONTAINER_TRAINER)
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "pid1"
    lines = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in lines if "train/loss" in row]
    assert len(steps) >= 9, steps
    wandb_run = read_wandb_offline(run_dir, wait_for_exit_s=0)  # all written before the trainer exited
    assert wandb_run.exited and wandb_run.config["lr"] == 0.1
    assert [s for s, _ in wandb_run.series("train/loss")] == steps
    mlflow_run = read_mlflow(default_tracking_uri(run_dir), "otel-train")
    assert mlflow_run.status == "FINISHED" and mlflow_run.params == {"lr": "0.1"}
    assert [s for s, _ in mlflow_run.metrics["train/loss"]] == steps
    assert "finishes on its own" not in done.stderr, done.stderr[-3000:]  # it cannot, there


def test_flushes_written_after_the_bridge_process_died_reach_its_successor(tmp_path: Path) -> None:
    """W&B's service (a grandchild) must not hold the frame pipe: while it did, the trainer's writes
    after the bridge process's death went into a pipe nobody read, and those flushes vanished,
    neither counted nor sent to the restarted bridge process. Here W&B's service is held stopped
    past the bridge process's death, so it keeps whatever it inherited for as long as it takes."""
    ot.init(output_dir=str(tmp_path), run_name="lost", tensorboard=True, wandb=True, wandb_mode="offline",
            prometheus_port=0, verbosity=0, log_interval=1, hardware=False)  # fmt: skip
    session = current_session()
    assert session is not None and session.bridges is not None
    bridges = session.bridges
    log_dir = tmp_path / "lost" / "tensorboard"
    for step in range(4):
        with ot.step(step):
            ot.record("loss", float(step))
    _until(lambda: _tb_steps(log_dir) == [0, 1, 2, 3], 120)
    assert bridges.pid is not None
    host = psutil.Process(bridges.pid)

    def services() -> list[psutil.Process]:
        """W&B's service, once it runs wandb-core (before its exec the fork holds every fd)."""
        with contextlib.suppress(psutil.Error):
            return [p for p in host.children(recursive=True) if p.name() == "wandb-core"]
        return []

    _until(services, 120)  # wandb.init runs at W&B's first write
    stopped = services()
    assert stopped, "W&B's service is not running"
    for service in stopped:
        service.suspend()
    try:
        host.kill()
        _until(lambda: _files_closed(host.pid), 30)
        assert _files_closed(host.pid)  # the frame pipe's read end is closed, where nothing else holds it
        for step in range(4, 7):
            with ot.step(step):
                ot.record("loss", float(step))
        # every flush handed to the pipe: written (into the void, were the pipe still held) or
        # waiting for the restarted bridge process
        _until(
            lambda: (
                session.worker.flushes >= 7 - session.deferred_flushes
                and (bridges.queued == 0 or bridges.restarts > 0)
            ),
            60,
        )
    finally:
        for service in stopped:
            with contextlib.suppress(psutil.NoSuchProcess):
                service.resume()
    _until(lambda: bridges.restarts == 1 and bridges.pid != host.pid, 60)
    for step in range(7, 10):
        with ot.step(step):
            ot.record("loss", float(step))
    ot.shutdown()
    assert bridges.wait(120)
    assert bridges.restarts == 1
    assert _tb_steps(log_dir) == list(range(10))


def test_a_restarted_bridge_process_gets_the_hyperparameters_and_continues_the_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OOM killer takes the bridge process: its successor gets every hyperparameter logged
    so far (merged) and logs into the same MLflow run, which ends FINISHED (not one run left
    RUNNING for ever and a second one without params)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from otel_train.bridges.mlflow import default_tracking_uri

    ot.init(output_dir=str(tmp_path), run_name="mlkill", mlflow=True, wandb=True, wandb_mode="offline",
            prometheus_port=0, verbosity=0, log_interval=1, hardware=False)  # fmt: skip
    session = current_session()
    assert session is not None and session.bridges is not None
    bridges = session.bridges
    run_dir = tmp_path / "mlkill"
    uri = default_tracking_uri(run_dir)
    ot.log_hyperparams({"optim": {"lr": 0.1, "betas": [0.9, 0.95]}, "batch_size": 32})
    for step in range(5):
        with ot.step(step):
            ot.record("loss", float(step))
    ot.log_hyperparams({"optim": {"warmup": 100}})

    def mlflow_steps() -> list[int]:
        if not (run_dir / "mlflow" / "mlflow.db").exists():  # the sink creates it (whole, at once)
            return []
        try:
            return [s for s, _ in read_mlflow(uri, "otel-train").metrics.get("train/loss", [])]
        except AssertionError:  # no experiment or run yet
            return []

    _until(lambda: mlflow_steps() == [0, 1, 2, 3, 4], 120)
    first_pid = bridges.pid
    assert first_pid is not None
    psutil.Process(first_pid).kill()
    assert process_gone(first_pid, 30)
    step = 5
    while bridges.restarts == 0 or step < 10:  # steps until the successor runs
        with ot.step(step):
            ot.record("loss", float(step))
        step += 1
        time.sleep(0.05)
        if step > 2000:
            break
    _until(lambda: bridges.pid != first_pid, 60)
    for last in range(step, step + 5):
        with ot.step(last):
            ot.record("loss", float(last))
    ot.shutdown()
    assert bridges.wait(120) and bridges.restarts == 1
    run = read_mlflow(uri, "otel-train")  # one run: the successor continued it
    assert run.status == "FINISHED"
    assert run.params == {
        "optim.lr": "0.1", "optim.betas": "[0.9, 0.95]", "optim.warmup": "100", "batch_size": "32"
    }  # fmt: skip
    steps = [s for s, _ in run.metrics["train/loss"]]
    assert steps[:5] == [0, 1, 2, 3, 4] and steps[-1] == last
    # W&B: the successor's run (a second offline directory of the same id) has them too
    runs = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*")))
    assert len(runs) == 2, runs
    (log,) = glob.glob(os.path.join(runs[1], "run-*.wandb"))
    _until(lambda: "exit" in [r.WhichOneof("record_type") for r in iter_wandb_records(log)], 30)
    config: dict[str, object] = {}
    for record in iter_wandb_records(log):
        if record.WhichOneof("record_type") == "config":
            config.update((i.key, json.loads(i.value_json)) for i in record.config.update)
    assert config["optim"] == {"lr": 0.1, "betas": [0.9, 0.95], "warmup": 100}
    assert config["batch_size"] == 32
