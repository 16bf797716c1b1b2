"""Ray Train (issue #25, part 3), real: Ray 2.60 on CPU, a TorchTrainer with 2 gloo workers and
the controller callback, all in one run told apart by role. One worker fails once (Ray Train
restarts the worker group, FailureConfig(max_failures=1)): the failure is an event on the
controller, the restart one on the worker. About a minute on 2 shared cores."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.train")

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import otel_train.integrations.ray as otr
from otel_train.run_directory import RunFiles


def _train_fn(config: dict[str, Any]) -> None:
    import ray.train

    import otel_train as ot
    import otel_train.integrations.ray as otr

    otr.init_worker(log_interval=1)
    rank = ray.train.get_context().get_world_rank()
    marker = Path(config["out"]) / f"failed.{rank}"
    for step in range(3):
        with ot.step(step, tokens=8), ot.timer("forward"):
            ot.record("loss", 1.0 + step)
        if step == 1 and rank == 1 and not marker.exists():  # fails once, at its second step
            marker.touch()
            ot.shutdown()
            raise RuntimeError("worker boom")
        ray.train.report({"loss": 1.0 + step + rank})
    ot.shutdown()


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Any:
    settings = {
        "OTEL_TRAIN_PROMETHEUS_PORT": "0",
        "OTEL_TRAIN_VERBOSITY": "0",
        "OTEL_TRAIN_HARDWARE": "false",
    }
    os.environ["OTEL_TRAIN_OUTPUT_DIR"] = str(tmp_path)
    try:
        # the workers unpickle _train_fn by module name: this directory on their path
        path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
        env = otr.runtime_env("worker", {"env_vars": {**settings, "PYTHONPATH": path}})
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=env, log_to_driver=False)
        yield env
    finally:
        ray.shutdown()
        os.environ.pop("OTEL_TRAIN_OUTPUT_DIR", None)
        otr._driver_run.clear()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_torch_trainer_controller_and_workers_share_one_run(ray_cluster: Any, tmp_path: Path) -> None:
    env_vars = ray_cluster["env_vars"]
    run_id, run_name = env_vars["OTEL_TRAIN_RUN_ID"], env_vars["OTEL_TRAIN_RUN_NAME"]
    assert env_vars["OTEL_TRAIN_ROLE"] == "worker"
    callback = otr.ControllerCallback(prometheus_port=0, verbosity=0, hardware=False)
    trainer = TorchTrainer(
        _train_fn,
        train_loop_config={"out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name="rt",
            storage_path=str(tmp_path / "ray_results"),
            callbacks=[callback],
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    trainer.fit()
    run_dir = tmp_path / run_name
    controller = RunFiles(run_dir, 0, "controller")
    workers = [RunFiles(run_dir, rank, "worker") for rank in (0, 1)]
    names = sorted(p.name for p in run_dir.iterdir())
    for files in (controller, *workers):
        assert files.metrics.exists(), names
        assert json.loads(files.config.read_text())["run_id"] == run_id  # one run id
    assert "metrics.rank0.jsonl" not in names  # no role-less file: nothing collides
    # the controller: one step per report, the workers' values reduced over workers
    rows = _rows(controller.metrics)
    assert rows and all("ray_train/loss/mean" in r and "ray_train/loss/max" in r for r in rows)
    assert rows[0]["step"] == 0  # the first report (a step index, as the console's `step N` reads it)
    assert max(r["ray_train/loss/max"] for r in rows) == 4.0  # worker 1's last report: 1 + 2 + 1
    # every report a step, also the one after the restart (step 0, the failure, steps 0 to 2 again)
    assert sum(r.get("train/steps", 0) for r in rows) == 4, rows
    assert not any("otel_train/dropped/nested_step" in r for r in rows), rows
    # the workers: one process group, cross-rank keys on worker rank 0
    worker0 = _rows(workers[0].metrics)
    assert any("timers/step/ranks_max" in r for r in worker0)
    assert {r["step"] for r in worker0} >= {0, 1, 2}
    # the failure: an event on the controller, a restart on the worker that failed
    events = [json.loads(line) for line in controller.events.read_text().splitlines()]
    failures = [e for e in events if e["event"] == "worker_failure"]
    assert failures and failures[0]["worker.rank"] == 1 and failures[0]["error.type"] == "RuntimeError"
    assert "worker boom" in failures[0]["message"]
    assert any(e["event"] == "worker_group_restart" for e in events)
    # the restart is badput, not inside a productive step
    restart_s = sum(r.get("timers/ray_train_restart/total", 0.0) for r in rows)
    account = json.loads(controller.goodput.read_text())
    assert restart_s > 0 and account["badput"]["other"] >= 0.9 * restart_s, (restart_s, account)
    restarted = [json.loads(line)["event"] for line in workers[1].events.read_text().splitlines()]
    assert "restart" in restarted


RAY_STEPS = 24
SLOW_FORWARD_S = 0.03


def _ddp_train_fn(config: dict[str, Any]) -> None:
    """A Ray Train loop as its docs write it (`prepare_model`: DDP over Ray's gloo group), timed
    with otel_train; worker 1's forward 30 ms slower. The model is big enough that DDP's all-reduce
    comes most of a millisecond after the forward ends: the collective is placed in a timer by its
    time in the step, known to tens of microseconds."""
    import time

    import ray.train
    import ray.train.torch
    import torch

    import otel_train as ot
    import otel_train.integrations.ray as otr

    otr.init_worker(log_interval=4, collective_timeout_s=60.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
    if ray.train.get_context().get_world_rank() == 1:
        model.register_forward_pre_hook(lambda module, args: time.sleep(SLOW_FORWARD_S))
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 512), torch.randn(16, 1)
    for step in range(RAY_STEPS):
        with ot.step(step, samples=len(x)):
            with ot.timer("forward"):
                loss = torch.nn.functional.mse_loss(model(x), y)
            with ot.timer("backward"):
                loss.backward()
            with ot.timer("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        if step % 8 == 7:
            ray.train.report({"loss": loss.item()})
    ot.shutdown()


@pytest.mark.multirank
def test_a_slow_worker_is_named_where_ddp_waits_for_it(ray_cluster: Any, tmp_path: Path) -> None:
    """Ray Train's own process group and DDP, torch's default Flight Recorder: worker 1 is named,
    slow in `forward`, with worker 0 waiting for it at DDP's all-reduce in `backward`."""
    trainer = TorchTrainer(
        _ddp_train_fn,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="rt-ddp", storage_path=str(tmp_path / "ray_results")),
    )
    trainer.fit()
    run_dir = tmp_path / ray_cluster["env_vars"]["OTEL_TRAIN_RUN_NAME"]
    events = [RunFiles(run_dir, rank, "worker").events for rank in (0, 1)]
    stragglers = [[e for e in _rows(p) if e["event"] == "straggler"] if p.exists() else [] for p in events]
    assert stragglers[1] == []  # the report is worker 0's (the reducer's)
    (first,) = stragglers[0]  # once, while worker 1 stays slow
    assert (first["rank"], first["train.phase"], first["category"]) == (1, "forward", "compute"), first
    assert (first["sync_phase"], first["waiting_ranks"]) == ("backward", "0"), first
    assert first["collective"] == "all_reduce #1 in 'backward' (default_pg)", first
    assert first["lateness_ms"] == pytest.approx(SLOW_FORWARD_S * 1e3, rel=0.35), first
    assert first["wait_ms"] == pytest.approx(SLOW_FORWARD_S * 1e3, rel=0.35), first
    for rank in (0, 1):
        rows = _rows(RunFiles(run_dir, rank, "worker").metrics)
        assert sum(r.get("train/steps", 0) for r in rows) == RAY_STEPS


TUNE_STEPS = 3


def _tune_train_fn(config: dict[str, Any]) -> None:
    import ray.train

    import otel_train as ot
    import otel_train.integrations.ray as otr

    otr.init_worker(log_interval=1)
    for step in range(TUNE_STEPS):
        with ot.step(step, samples=4):
            ot.record("loss", config["lr"] * step)
        ray.train.report({"loss": config["lr"] * step})
    ot.shutdown()


def _tune_trial(config: dict[str, Any]) -> None:
    """A Tune trial as Ray's docs write one: a TorchTrainer run inside it."""
    from ray import tune

    trainer = TorchTrainer(
        _tune_train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(
            storage_path=config["storage"],
            callbacks=[otr.ControllerCallback(prometheus_port=0, verbosity=0, hardware=False)],
        ),
    )
    trainer.fit()
    tune.report({"done": 1})


def test_each_tune_trial_is_a_run_of_its_own(ray_cluster: Any, tmp_path: Path) -> None:
    """Two trials, one after the other, with the driver's runtime_env: each trial's controller and
    worker share the trial's run, and the second trial is not taken for a restart of the first."""
    from ray import tune

    storage = str(tmp_path / "ray_results")
    tuner = tune.Tuner(
        _tune_trial,
        param_space={"lr": tune.grid_search([1.0, 2.0]), "storage": storage},
        tune_config=tune.TuneConfig(max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=storage, name="tune"),
    )
    assert not tuner.fit().errors
    job_run_id = ray_cluster["env_vars"]["OTEL_TRAIN_RUN_ID"]
    run_dirs = sorted(p for p in tmp_path.iterdir() if (p / "config.controller.json").exists())
    assert len(run_dirs) == 2, sorted(p.name for p in tmp_path.iterdir())
    run_ids = set()
    for run_dir in run_dirs:
        files = [RunFiles(run_dir, 0, role) for role in ("controller", "worker")]
        (run_id,) = {json.loads(f.config.read_text())["run_id"] for f in files}  # one run per trial
        assert run_id.startswith(f"{job_run_id}-"), run_id
        run_ids.add(run_id)
        for f in files:
            rows = _rows(f.metrics)
            assert sum(r.get("train/steps", 0) for r in rows) == TUNE_STEPS, (f.metrics, rows)
            assert [r["step"] for r in rows if "train/steps" in r] == list(range(TUNE_STEPS))
            events = [e["event"] for e in _rows(f.events)] if f.events.exists() else []
            assert "restart" not in events, (f.events, events)
    assert len(run_ids) == 2


def test_runtime_env_carries_the_running_session(tmp_path: Path) -> None:
    import otel_train as ot

    ot.init(run_id="drv-1", run_name="drv", output_dir=str(tmp_path), otlp_endpoint="http://127.0.0.1:1",
            prometheus_port=0, verbosity=0, hardware=False)  # fmt: skip
    try:
        env = otr.runtime_env("policy", {"pip": ["x"], "env_vars": {"A": "1"}})
    finally:
        ot.shutdown()
    assert env["pip"] == ["x"]
    assert env["env_vars"] == {
        "A": "1",
        "OTEL_TRAIN_RUN_ID": "drv-1",
        "OTEL_TRAIN_RUN_NAME": "drv",
        "OTEL_TRAIN_OUTPUT_DIR": str(tmp_path),
        "OTEL_TRAIN_OTLP_ENDPOINT": "http://127.0.0.1:1",
        "OTEL_TRAIN_SERVICE_NAME": "otel-train",
        "OTEL_TRAIN_ROLE": "policy",
    }


def test_without_a_session_the_driver_makes_one_run_for_every_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also for a session the driver starts afterwards (NeMo RL makes its Logger after init_ray)."""
    import otel_train as ot

    monkeypatch.setenv("OTEL_TRAIN_OUTPUT_DIR", str(tmp_path))
    try:
        policy, generation = otr.job_settings("policy"), otr.job_settings("generation")
        driver = ot.init(role="controller", prometheus_port=0, verbosity=0, hardware=False)
        assert (driver.run_id, driver.run_name) == (policy["run_id"], policy["run_name"])
    finally:
        ot.shutdown()
        otr._driver_run.clear()
    assert policy["run_id"] == generation["run_id"] and policy["run_name"] == generation["run_name"]
    assert (policy["role"], generation["role"]) == ("policy", "generation")
    assert policy["output_dir"] == str(tmp_path)
    assert "otlp_endpoint" not in policy  # nothing to copy: unset settings stay unset
    assert policy["service_name"] == "otel-train"


def test_an_endpoint_with_credentials_never_travels_in_the_runtime_env(tmp_path: Path, caplog) -> None:
    import otel_train as ot

    secret_endpoint = "http://trainer:S3CR3T-ray@127.0.0.1:1"
    ot.init(run_id="drv-2", run_name="drv", output_dir=str(tmp_path), otlp_endpoint=secret_endpoint,
            prometheus_port=0, verbosity=0, hardware=False)  # fmt: skip
    try:
        info = ot.run_info()
        env = otr.runtime_env("policy")
        settings = otr.job_settings("policy")
    finally:
        ot.shutdown()
    assert info is not None and info.otlp_endpoint == "http://***@127.0.0.1:1"
    assert "S3CR3T-ray" not in repr(env) and "S3CR3T-ray" not in repr(settings)
    assert "OTEL_TRAIN_OTLP_ENDPOINT" not in env["env_vars"]
    assert "otlp_endpoint carries credentials" in caplog.text and "S3CR3T-ray" not in caplog.text
