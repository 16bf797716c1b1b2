"""MLflow bridge against a real local SQLite store, read back with MlflowClient."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.events import run_events
from helpers.readback import read_mlflow

from otel_train.bridges.errors import BridgeSetupError
from otel_train.bridges.mlflow import MlflowSink, default_tracking_uri, sanitize_key, seed_local_store
from otel_train.config import Config, config_as_dict

pytest.importorskip("mlflow")

MARKER = "SENTINEL-MLFLOW-beef"


@pytest.fixture(autouse=True)
def _no_ambient_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_local_store_round_trip(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "run-m"
    params = config_as_dict(Config(otlp_headers={"authorization": f"Bearer {MARKER}"}, run_name="run-m"))
    params["long"] = "x" * 10_000
    sink = MlflowSink(run_dir, None, "exp-1", "run-m")
    sink.write_hparams(params)
    for step in (10, 20, 30):
        sink.write_scalars(step, time.time(), {"train/loss": 10.0 / step, "timers/forward/mean": 0.25})
    sink.write_text("samples/note", "**bold**", 20)
    sink.write_samples("samples/val", [("2+2=", "4")], 30)
    sink.write_histogram("grad/norm", [1.0, 2.0, 2.0, 3.0, float("nan")], 30)
    sink.write_hparams({"lr": 3e-4, "run_name": "changed"})  # a changed param is skipped, not an error
    sink.close({"train/loss": 1 / 3})

    uri = default_tracking_uri(run_dir)
    assert uri.startswith("sqlite:///") and (run_dir / "mlflow" / "mlflow.db").is_file()
    run = read_mlflow(uri, "exp-1")
    assert run.status == "FINISHED" and run.run_name == "run-m"
    assert run.metrics["train/loss"] == [(10, 1.0), (20, 0.5), (30, pytest.approx(1 / 3))]
    assert run.metrics["timers/forward/mean"] == [(10, 0.25), (20, 0.25), (30, 0.25)]
    assert run.params["lr"] == "0.0003" and run.params["run_name"] == "run-m"
    assert run.params["otlp_headers"] == "***" and run.params["wandb_tags"] == "[]"
    assert len(run.params["long"]) == 6000  # MLflow's param value limit
    assert run.artifacts["text/samples/note/step_000000020.md"] == "**bold**"
    assert "| 2+2= | 4 |" in run.artifacts["text/samples/val/step_000000030.md"]
    hist = json.loads(run.artifacts["histograms/grad/norm/step_000000030.json"])
    assert hist["count"] == 4 and sum(hist["counts"]) == 4 and hist["min"] == 1.0 and hist["max"] == 3.0
    # artifacts stay under the run dir (not ./mlruns in the working directory)
    assert (run_dir / "mlflow" / "artifacts").is_dir()
    assert not Path("mlruns").exists()
    # the store started from the migrated template (or was migrated by MLflow): either way it is
    # never re-seeded once it exists
    assert not seed_local_store(run_dir / "mlflow" / "mlflow.db", run_dir / "mlflow" / "artifacts")
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert MARKER.encode() not in path.read_bytes(), path


def test_keys_are_sanitized() -> None:
    assert sanitize_key("train/loss") == "train/loss"
    assert sanitize_key("eval/acc@1 (top)") == "eval/acc_1 _top_"
    assert sanitize_key("/a//b/./../c/") == "a/b/c"
    assert sanitize_key("k:v") == "k_v"
    assert len(sanitize_key("k" * 300)) == 250


def test_explicit_tracking_uri_shared_by_two_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a user-given URI keeps MLflow's default artifact root (./mlruns)
    # seeded from the cached migrated template (what the default local store does), so this test
    # does not pay for MLflow's schema migrations a second time
    seed_local_store(tmp_path / "shared.db", tmp_path / "artifacts")
    uri = "sqlite:///" + str(tmp_path / "shared.db")
    for name in ("a", "b"):
        sink = MlflowSink(tmp_path / name, uri, "shared", name)
        sink.write_hparams({"name": name})
        sink.write_scalars(1, time.time(), {"train/loss": 1.0})
        sink.close({})
    assert read_mlflow(uri, "shared", "b").params == {"name": "b"}


def test_unwritable_run_dir_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(BridgeSetupError, match=re.escape("file.txt/run/mlflow")):
        MlflowSink(blocker / "run", None, "e", "r")


def test_a_resumed_run_id_continues_its_mlflow_run(tmp_path: Path) -> None:
    """A second process of the same otel_train run id (a preempted job requeued, a restarted bridge
    process) logs into the MLflow run tagged with that id, as W&B resumes its run by id."""
    from mlflow.entities import RunStatus

    run_dir = tmp_path / "runs" / "res"
    first = MlflowSink(run_dir, None, "exp", "res", run_key="job123")
    first.write_hparams({"lr": 0.1, "bs": 32})
    first.write_scalars(0, time.time(), {"train/loss": 1.0})
    first.close({})
    other = MlflowSink(run_dir, None, "exp", "other", run_key="job999")  # another run id: its own run
    other.write_scalars(0, time.time(), {"train/loss": 5.0})
    other.close({})

    second = MlflowSink(run_dir, None, "exp", "res", run_key="job123")
    second.write_scalars(1, time.time(), {"train/loss": 0.5})
    from mlflow import MlflowClient

    client = MlflowClient(default_tracking_uri(run_dir))
    assert client.get_run(first.run_id).info.status == RunStatus.to_string(RunStatus.RUNNING)
    second.write_hparams({"lr": 0.2, "warmup": 10})  # a logged param cannot change: kept, no error
    second.close({})
    assert second.run_id == first.run_id != other.run_id
    run = read_mlflow(default_tracking_uri(run_dir), "exp", "res")
    assert run.status == "FINISHED"
    assert run.metrics["train/loss"] == [(0, 1.0), (1, 0.5)]
    assert run.params == {"lr": "0.1", "bs": "32", "warmup": "10"}
    assert read_mlflow(default_tracking_uri(run_dir), "exp", "other").metrics["train/loss"] == [(0, 5.0)]


_ENDING = """
import os, signal, sys, time
import otel_train as ot
ot.init(output_dir=sys.argv[1], run_name=sys.argv[2], mlflow=True, prometheus_port=0, verbosity=0,
        hardware=False, log_interval=1)
for step in range(3):
    with ot.step(step):
        ot.record("loss", 1.0)
if sys.argv[2] == "raises":
    raise RuntimeError("the loss diverged")
time.sleep(3)  # the bridge process has the rows and the MLflow run
os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer
"""


@pytest.mark.parametrize("ending", ["raises", "killed"])
def test_a_run_that_raises_or_whose_process_is_killed_ends_failed(tmp_path: Path, ending: str) -> None:
    """A script that ends by an uncaught exception, or is killed (the bridge process finishes the
    run alone): the MLflow run ends FAILED, not FINISHED; progress.txt's end line says so."""
    from mlflow import MlflowClient

    script = tmp_path / "train.py"
    script.write_text(_ENDING)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), ending], capture_output=True, timeout=120
    )
    assert done.returncode == (1 if ending == "raises" else -9), done.stderr.decode()
    uri = default_tracking_uri(tmp_path / ending)
    deadline = time.monotonic() + 60  # a killed process's bridge process ends the run on its own

    def status() -> str | None:
        if not (tmp_path / ending / "mlflow" / "mlflow.db").exists():
            return None
        runs = MlflowClient(uri).search_runs(
            [exp.experiment_id for exp in MlflowClient(uri).search_experiments()]
        )
        return runs[0].info.status if runs else None

    while status() in (None, "RUNNING") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status() == "FAILED"
    if ending == "raises":  # the killed process writes no end line, and no event
        assert "| end of process (failed) |" in (tmp_path / ending / "progress.txt").read_text()
        [event] = run_events(tmp_path / ending, event="run_failed")
        assert event["message"] == "the script ended by an uncaught RuntimeError at step 2: the loss diverged"
        assert event["error.type"] == "RuntimeError" and event["step"] == 2


def test_two_hyperparameters_with_one_mlflow_name_are_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "runs" / "run-c"
    sink = MlflowSink(run_dir, None, "exp-c", "run-c")
    with caplog.at_level("WARNING", logger="otel_train"):
        sink.write_hparams({"has:colon": 1, "has_colon": 2, "lr": 0.1})
        sink.write_hparams({"has:colon": 1, "has_colon": 2, "lr": 0.2})  # lr changed: MLflow's rule, quiet
    sink.close({})
    warned = [r.getMessage() for r in caplog.records if "are both" in r.getMessage()]
    assert len(warned) == 1 and "'has:colon' and 'has_colon' are both 'has_colon'" in warned[0], warned
    run = read_mlflow(default_tracking_uri(run_dir), "exp-c")
    assert run.params["has_colon"] == "1" and run.params["lr"] == "0.1"


def _mlflow_sink(config: Config, run_dir: Path, role: str = "") -> MlflowSink:
    """The MLflow sink as the bridge process builds it for `config` (bridges/table.py)."""
    from otel_train.bridges.table import BridgePlace, specs

    place = BridgePlace(run_dir=run_dir, run_name="mfenv", run_id="job-8", rank=0, role=role)
    [kwargs] = [k for _, cls, k in specs(config, place) if cls == "MlflowSink"]
    return MlflowSink(**kwargs)


def test_mlflows_own_variables_name_the_experiment_and_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLFLOW_EXPERIMENT_NAME / MLFLOW_EXPERIMENT_ID are the user's MLflow settings where the user set
    no mlflow_experiment; MLFLOW_RUN_ID names the run to log into, as `mlflow.start_run()` reads it."""
    from mlflow import MlflowClient

    seed_local_store(tmp_path / "user.db", tmp_path / "artifacts")
    uri = "sqlite:///" + str(tmp_path / "user.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    by_id = client.create_experiment("by-id", artifact_location=(tmp_path / "a").as_uri())
    config = Config(mlflow=True)

    def log(sink: MlflowSink, loss: float) -> str:
        sink.write_scalars(1, time.time(), {"train/loss": loss})
        sink.close({})
        return str(sink.run_id)

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "by-name")
    log(_mlflow_sink(config, tmp_path / "r1"), 1.0)
    assert read_mlflow(uri, "by-name").metrics["train/loss"] == [(1, 1.0)]
    log(_mlflow_sink(Config(mlflow=True, mlflow_experiment="mine"), tmp_path / "r2"), 2.0)  # the user's own
    assert read_mlflow(uri, "mine").metrics["train/loss"] == [(1, 2.0)]
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", by_id)
    log(_mlflow_sink(config, tmp_path / "r3"), 3.0)
    assert read_mlflow(uri, "by-id").metrics["train/loss"] == [(1, 3.0)]

    users = client.create_run(by_id, run_name="user_run")
    client.log_metric(users.info.run_id, "train/loss", 9.0, step=0)
    client.set_terminated(users.info.run_id)
    monkeypatch.setenv("MLFLOW_RUN_ID", users.info.run_id)
    assert log(_mlflow_sink(config, tmp_path / "r4"), 4.0) == users.info.run_id
    run = read_mlflow(uri, "by-id", "user_run")
    assert run.status == "FINISHED" and run.metrics["train/loss"] == [(0, 9.0), (1, 4.0)]
    assert len(client.search_runs([by_id])) == 2  # r3's and the user's: none made for r4
    # a role's run is its own: MLflow names runs itself, so one id cannot be several runs
    assert _mlflow_sink(config, tmp_path / "r5", role="actor").user_run_id is None


def test_a_users_active_mlflow_run_gets_a_warning_naming_mlflow_run_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The MLflow bridge runs in the bridge process, so a run the user started with mlflow.start_run
    in the training process is not its run: init() says so once, with how to log into it."""
    import logging

    import mlflow

    import otel_train as ot
    from otel_train.bridges.mlflow import warn_if_user_run_active

    seed_local_store(tmp_path / "user.db", tmp_path / "artifacts")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///" + str(tmp_path / "user.db"))
    user_run = mlflow.start_run(run_name="mine")
    try:
        with caplog.at_level(logging.WARNING, logger="otel_train"):
            ot.init(output_dir=str(tmp_path), run_name="usermf", mlflow=True, prometheus_port=0, verbosity=0,
                    hardware=False)  # fmt: skip
            ot.shutdown()
            warned = [r.getMessage() for r in caplog.records if "MLflow run is active" in r.getMessage()]
            assert len(warned) == 1 and f"MLFLOW_RUN_ID={user_run.info.run_id}" in warned[0], warned
            caplog.clear()
            monkeypatch.setenv("MLFLOW_RUN_ID", user_run.info.run_id)  # the bridge logs into it
            warn_if_user_run_active()
            assert caplog.records == []
    finally:
        mlflow.end_run()
