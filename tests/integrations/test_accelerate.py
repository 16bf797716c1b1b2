"""Accelerate's `Accelerator(log_with=[OtelTrainTracker()])`."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, register_tracker_class
from helpers.events import SlowStretches, log_messages, run_events
from helpers.multirank import DEFAULT_FR, run_ranks
from helpers.readback import read_tensorboard
from helpers.waiting import wait_for

import otel_train as ot
from otel_train.integrations.accelerate import OtelTrainTracker
from otel_train.testing import current_session


def test_tracker_logs_values_and_config(tmp_path: Path) -> None:
    tracker = OtelTrainTracker(
        {"run_name": "old"}, run_name="acc", prometheus_port=0, verbosity=0, hardware=False
    )
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj", config={"lr": 0.1, "api_key": "PLANTED-SECRET-42"})
    for step in range(4):
        with ot.step(step, tokens=32):
            accelerator.log({"loss": 2.0 - step * 0.25, "accuracy": 0.1 * step, "note": "text"}, step=step)
    run = accelerator.get_tracker("otel_train").tracker  # the public Run, not the internals
    assert isinstance(run, ot.Run) and run.run_name == "acc" and run == ot.init()
    accelerator.end_training()
    assert current_session() is None

    run_dir = tmp_path / "runs" / "acc"
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if r.get("train/loss") is not None]
    assert losses[-1] == pytest.approx((2.0 + 1.75 + 1.5 + 1.25) / 4)  # the interval's mean
    assert [r["train/loss_last"] for r in rows if "train/loss_last" in r][-1] == pytest.approx(1.25)
    assert [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None][-1] == pytest.approx(0.15)
    assert [r["eval/accuracy_last"] for r in rows if "eval/accuracy_last" in r][-1] == pytest.approx(0.3)
    hparams_text = (run_dir / "hparams.json").read_text()
    assert json.loads(hparams_text)["lr"] == 0.1
    assert "PLANTED-SECRET-42" not in hparams_text


def test_end_training_leaves_the_users_run_idle_and_flushed(tmp_path: Path) -> None:
    """A run the user started outlives `end_training()`: its last steps are flushed then, and the
    pause that follows is no stall (`adapters.idle`)."""
    ot.init(run_name="mine", output_dir=str(tmp_path), prometheus_port=0, verbosity=0, hardware=False,
            log_interval=100)  # fmt: skip
    session = current_session()
    accelerator = Accelerator(log_with=[OtelTrainTracker()], cpu=True)
    accelerator.init_trackers("proj")
    for step in range(3):
        with ot.step(step):
            accelerator.log({"loss": 1.0}, step=step)
    accelerator.end_training()
    try:
        assert current_session() is session and session.last_step() == (2, None)  # idle: no stall
        assert session.worker.batches_put == 1  # the three steps, handed over at end_training
    finally:
        ot.shutdown()


def _rank_without_init(rank: int, world_size: int) -> int:
    logging.basicConfig()
    tracker = OtelTrainTracker()
    tracker.log({"loss": 1.0})  # no session on any rank: must not start one (collectives) nor raise
    return int(current_session() is None)


@pytest.mark.multirank
def test_tracker_never_starts_a_session_alone_in_a_multi_process_job() -> None:
    assert run_ranks(2, _rank_without_init, (), timeout=120) == [1, 1]


def test_tracker_rejects_an_unknown_setting_by_name() -> None:
    with pytest.raises(ot.ConfigError, match=r"OtelTrainTracker.*'prometheus_prot'.*'prometheus_port'"):
        OtelTrainTracker(prometheus_prot=0)


QUIET = {"prometheus_port": 0, "verbosity": 0, "hardware": False}
# A flush per step, and room for all of them: with the default queue of 8, a worker slow to start
# (a busy machine) defers flushes and their steps share a row.
EVERY_STEP = {"log_interval": 1, "queue_size": 64}


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]


ACCELERATE_STEPS = 24
SLOW_FORWARD_S = 0.03


def _accelerate_ddp_job(rank: int, world_size: int, out: str, init_first: bool) -> dict[str, Any]:
    """The multi-process job the docs describe: `ot.init()` and `ot.step` on every rank, the
    tracker on the main process (Accelerate logs there only); rank 1's model 30 ms slower per forward."""
    import time

    import torch

    def init() -> None:
        ot.init(output_dir=out, run_name="ddp", log_interval=4, collective_timeout_s=60.0, **QUIET)

    warnings = log_messages()
    if init_first:  # before the Accelerator: it adopts the process group the launcher made
        init()
    accelerator = Accelerator(cpu=True, log_with=[OtelTrainTracker()])
    if not init_first:
        init()
    events: list[dict[str, Any]] = []
    current_session().events.add_callback(
        lambda event, message, attrs: events.append({"event": event, **attrs})
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if rank == 1:
        model.register_forward_pre_hook(lambda module, args: time.sleep(SLOW_FORWARD_S))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    rows = ACCELERATE_STEPS * 4 * world_size
    data = torch.utils.data.TensorDataset(torch.randn(rows, 32), torch.randn(rows, 1))
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, torch.utils.data.DataLoader(data, batch_size=4)
    )
    accelerator.init_trackers("proj", config={"lr": 1e-2})
    for step, (x, y) in enumerate(loader):
        with ot.step(step, samples=len(x)):
            with ot.timer("forward"):
                loss = torch.nn.functional.mse_loss(model(x), y)
            with ot.timer("backward"):
                accelerator.backward(loss)
            with ot.timer("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            accelerator.log({"loss": loss.item(), "epoch": 0}, step=step)
    accelerator.end_training()
    ot.shutdown()
    return {"stragglers": [e for e in events if e["event"] == "straggler"], "warnings": warnings}


@pytest.mark.multirank
@pytest.mark.parametrize("init_first", [False, True], ids=["init_after_accelerator", "init_before"])
def test_a_multi_process_job_names_the_slow_rank_and_files_the_trackers_values(
    tmp_path: Path, init_first: bool
) -> None:
    """2 gloo ranks under the Accelerator, torch's default Flight Recorder: rank 1 is named, slow
    in `forward`, with rank 0 waiting for it at DDP's all-reduce; the main process's logs land
    once at their steps, beside every rank's steps counted once."""
    results = run_ranks(2, _accelerate_ddp_job, (str(tmp_path), init_first), timeout=240, env=DEFAULT_FR)
    (first,) = results[0]["stragglers"]  # named once while it stays a straggler; rank 0 never
    assert (first["rank"], first["train.phase"], first["category"]) == (1, "forward", "compute"), first
    assert (first["sync_phase"], first["waiting_ranks"]) == ("backward", "0"), first
    assert "in 'backward' (default_pg)" in first["collective"], first
    assert first["lateness_ms"] == pytest.approx(SLOW_FORWARD_S * 1e3, rel=0.35), first
    assert first["wait_ms"] == pytest.approx(SLOW_FORWARD_S * 1e3, rel=0.35), first
    assert results[1]["stragglers"] == []
    assert not [m for r in results for m in r["warnings"] if "marks no steps" in m]
    run_dir = tmp_path / "ddp"
    for rank in (0, 1):
        rows = [json.loads(line) for line in (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()]
        assert sum(r.get("train/steps", 0) for r in rows) == ACCELERATE_STEPS
    # the tracker's logs: every step's loss joined its flush (4 steps an interval), on rank 0 only
    flushed = [r for r in _rows(run_dir) if "train/loss_last" in r]
    assert [r["step"] for r in flushed] == list(range(3, ACCELERATE_STEPS, 4))
    assert all(r["train/epoch"] == 0 for r in flushed)
    rank1 = (run_dir / "metrics.rank1.jsonl").read_text()
    assert "train/loss" not in rank1 and "train/epoch" not in rank1
    assert json.loads((run_dir / "hparams.json").read_text()) == {"lr": 1e-2}


@pytest.fixture
def registry() -> Iterator[None]:
    """Accelerate's tracker registry as it was: registering is process-wide."""
    saved = dict(LOGGER_TYPE_TO_CLASS)
    yield
    LOGGER_TYPE_TO_CLASS.clear()
    LOGGER_TYPE_TO_CLASS.update(saved)


def test_tracker_alone_files_each_logged_step_under_its_step(tmp_path: Path) -> None:
    """No ot.step in the loop: `accelerator.log(values, step=N)` every 5 steps; each logged step is
    an otel_train step of its own, numbered as logged, with its own values (run dir and the
    TensorBoard bridge read back), and a second log at the same step is filed under it too."""
    tracker = OtelTrainTracker(run_name="alone", tensorboard=True, **EVERY_STEP, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    logged = list(range(0, 40, 5))
    for step in logged:
        accelerator.log({"loss": 100.0 + step}, step=step)
        if step == 15:
            accelerator.log({"eval_accuracy": 0.5}, step=step)
    accelerator.end_training()

    rows = _rows(tmp_path / "runs" / "alone")
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}  # one row a log
    assert losses == {step: 100.0 + step for step in logged}
    assert sum(r.get("train/steps") or 0 for r in rows) == len(logged)  # one step per logged step
    assert min(r["step"] for r in rows if "eval/accuracy" in r) == 15
    assert 0 < [r["train/goodput"] for r in rows if "train/goodput" in r][-1] <= 1  # logs' gaps: step time
    tb = read_tensorboard(tmp_path / "runs" / "alone" / "tensorboard")
    assert dict(tb.scalars["train/loss"]) == {step: 100.0 + step for step in logged}


def test_tracker_alone_logging_once_an_epoch_sees_no_stall_in_training_eval_or_save(tmp_path: Path) -> None:
    """The tracker hears of the loop only when it logs, here once an epoch: 2 s of 0.25 s batches,
    1.25 s of eval batches and a 1.5 s `save_state` between logs under stall_timeout_s=1. Each
    `accelerator.backward`, `gather_for_metrics` and the save's pre-hook tell the watchdog the
    loop is alive, and once the loop stops it is a stall; after `end_training` the Accelerator's own
    methods are back. Inside each logged step, the evaluation (from its first gather with the model
    in eval mode) and the save (from its pre-hook) are goodput's eval and checkpoint time, not
    training."""
    import torch

    slow = SlowStretches()
    tracker = OtelTrainTracker(run_name="epochs", stall_timeout_s=1.0, **EVERY_STEP, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_save_state_pre_hook(lambda *_: slow.sleep(1.5))  # a slow file system
    step = 0
    for epoch in range(2):
        for _ in range(8):
            slow.sleep(0.25)
            accelerator.backward(model(torch.randn(2, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        model.eval()
        for _ in range(5):
            slow.sleep(0.25)
            accelerator.gather_for_metrics(model(torch.randn(2, 4)))
        model.train()
        accelerator.save_state(str(tmp_path / f"ckpt{epoch}"))
        accelerator.log({"loss": 1.0 / (epoch + 1)}, step=step)
    wait_for(
        lambda: run_events(tmp_path / "runs" / "epochs", event="stall"), 30, "a stall once the loop stops"
    )  # it hangs
    accelerator.end_training()
    assert "backward" not in vars(accelerator) and "gather_for_metrics" not in vars(accelerator)
    assert len(accelerator._save_model_state_pre_hook) == 1  # the user's own, ours removed

    run_dir = tmp_path / "runs" / "epochs"
    assert sum(r.get("train/steps") or 0 for r in _rows(run_dir)) == 2  # one per logged step
    assert len(slow.spans) == 2 * (8 + 5 + 1)
    assert slow.stalls_inside(run_dir) == []
    assert len(run_events(run_dir, event="stall")) == 1
    ot.shutdown()
    badput = json.loads((run_dir / "goodput.rank0.json").read_text())["badput"]
    assert badput["eval"] >= 2 * 4 * 0.25  # the first eval batch's forward runs before its gather
    assert badput["checkpoint_save"] >= 2 * 1.5


@pytest.mark.parametrize("every_step", [False, True], ids=["adaptive", "every-step"])
def test_tracker_beside_the_loops_steps_counts_each_once_and_files_eval_at_its_step(
    tmp_path: Path, every_step: bool
) -> None:
    """The loop marks steps with ot.step and logs inside them; an eval run after step 6 is logged
    with step=6. The tracker marks no step of its own, the eval is filed under step 6 (not at the
    next flush, step 9 at the default cadence), and a value logged inside step N stays with N."""
    cadence = EVERY_STEP if every_step else {}
    tracker = OtelTrainTracker(run_name="loop", **cadence, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    for step in range(10):
        with ot.step(step):
            accelerator.log({"loss": 100.0 + step}, step=step)
        if step == 6:
            accelerator.log({"eval_loss": 0.5}, step=6)
    accelerator.end_training()

    rows = _rows(tmp_path / "runs" / "loop")
    assert sum(r.get("train/steps") or 0 for r in rows) == 10
    assert [r["step"] for r in rows if "eval/loss" in r] == [6]  # a row of its own, only there
    if every_step:  # a row repeats the last value until a new one: where each first appears
        first_seen: dict[float, int] = {}
        for row in rows:
            if "train/loss" in row:
                first_seen.setdefault(row["train/loss"], row["step"])
        assert first_seen == {100.0 + step: step for step in range(10)}


def test_an_eval_logged_after_the_loop_for_an_earlier_step_lands_at_that_step(tmp_path: Path) -> None:
    """The loop marks steps 0-9 with ot.step; an eval is logged afterwards with `step=6`, as a
    delayed evaluation reports its step: the run dir's JSONL and TensorBoard file it under 6 (not
    under 9, the last completed step, nor at the next flush)."""
    tracker = OtelTrainTracker(run_name="late-eval", tensorboard=True, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    for step in range(10):
        with ot.step(step):
            accelerator.log({"loss": 100.0 + step}, step=step)
    accelerator.log({"eval": 0.625}, step=6)
    accelerator.end_training()

    rows = _rows(tmp_path / "runs" / "late-eval")
    evals = [(r["step"], r["train/eval"]) for r in rows if "train/eval" in r]
    assert evals == [(6, 0.625)]
    assert sum(r.get("train/steps") or 0 for r in rows) == 10  # the late eval marked no step
    tb = read_tensorboard(tmp_path / "runs" / "late-eval" / "tensorboard")
    assert tb.scalars["train/eval"] == [(6, 0.625)]


def test_tracker_alone_files_a_late_log_under_its_step_and_reads_step_numbers(tmp_path: Path) -> None:
    """No ot.step: the tracker marks the logged steps. A numpy, a 0-d tensor and an integral float
    step are step numbers; a log for an earlier step (15 after 30) is filed under 15 and marks no
    step; 2.5 is no step: counted as invalid_step, its value kept under the current step."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    tracker = OtelTrainTracker(run_name="alone-late", tensorboard=True, **EVERY_STEP, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    accelerator.log({"loss": 10.0}, step=np.int64(10))
    accelerator.log({"loss": 20.0}, step=torch.tensor(20))
    accelerator.log({"loss": 30.0}, step=30.0)
    accelerator.log({"eval_score": 0.5}, step=15)
    accelerator.log({"odd": 1.0}, step=2.5)  # type: ignore[arg-type]
    accelerator.end_training()

    rows = _rows(tmp_path / "runs" / "alone-late")
    assert {r["step"]: r["train/loss"] for r in rows if "train/loss" in r} == {
        10: 10.0,
        20: 20.0,
        30: 30.0,
    }
    assert sum(r.get("train/steps") or 0 for r in rows) == 3
    assert next((r["step"], r["eval/score"]) for r in rows if "eval/score" in r) == (15, 0.5)
    assert max(r.get("otel_train/dropped/invalid_step") or 0 for r in rows) == 1
    assert next(r["step"] for r in rows if "train/odd" in r) == 30
    tb = read_tensorboard(tmp_path / "runs" / "alone-late" / "tensorboard")
    assert tb.scalars["eval/score"][0] == (15, 0.5)


def test_tracker_stops_marking_once_the_loop_marks_a_step(tmp_path: Path) -> None:
    """ot.step appears only after a few logged steps: from then on the loop's steps are the steps
    (none counted twice), and the tracker's own earlier steps stay counted."""
    tracker = OtelTrainTracker(run_name="late", log_interval=1, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    for step in range(3):
        accelerator.log({"loss": 1.0}, step=step)
    for step in range(3, 6):
        with ot.step(step):
            accelerator.log({"loss": 1.0}, step=step)
    accelerator.log({"loss": 1.0}, step=6)  # after the loop's last step: no step of its own
    accelerator.end_training()
    rows = _rows(tmp_path / "runs" / "late")
    assert sum(r.get("train/steps") or 0 for r in rows) == 6


def test_register_by_name_adopts_project_config_and_init_kwargs(tmp_path: Path, registry: None) -> None:
    """Accelerate's own way: `register_tracker_class` then `log_with="otel_train"`; Accelerate
    creates it as `cls(project_name, **init_kwargs["otel_train"])`."""
    register_tracker_class(OtelTrainTracker)
    accelerator = Accelerator(log_with="otel_train", cpu=True)
    accelerator.init_trackers(
        "my-proj", config={"lr": 0.1}, init_kwargs={"otel_train": {**QUIET, "log_interval": 1}}
    )
    session = current_session()
    assert session is not None
    assert session.run_name.startswith("my-proj-") and session.run_name != "my-proj-"
    assert (session.config.wandb_project, session.config.mlflow_experiment) == ("my-proj", "my-proj")
    assert session.config.log_interval == 1  # init_kwargs are ot.init settings
    tracker = accelerator.get_tracker("otel_train")
    assert isinstance(tracker, OtelTrainTracker) and tracker.tracker == ot.init()  # the running Run
    accelerator.log({"loss": 3.0}, step=0)
    accelerator.end_training()
    assert current_session() is None
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "hparams.json").read_text())["lr"] == 0.1
    assert [r["train/loss"] for r in _rows(run_dir) if "train/loss" in r] == [3.0]


def test_an_explicit_setting_wins_over_the_project(
    tmp_path: Path, registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRAIN_WANDB_PROJECT", "from-env")
    register_tracker_class(OtelTrainTracker)
    accelerator = Accelerator(log_with="otel_train", cpu=True)
    accelerator.init_trackers("my-proj", init_kwargs={"otel_train": {"run_name": "mine", **QUIET}})
    session = current_session()
    assert session is not None
    assert (session.run_name, session.config.wandb_project) == ("mine", "from-env")
    assert session.config.mlflow_experiment == "my-proj"
    accelerator.end_training()


def test_a_config_file_setting_wins_over_the_project_and_the_rest_follow_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`OTEL_TRAIN_CONFIG` names a file setting `wandb_project`: that one is the user's; the
    project still names the MLflow experiment and starts the run's name."""
    (tmp_path / "otel.yaml").write_text("wandb_project: from-file\nverbosity: 0\n")
    monkeypatch.setenv("OTEL_TRAIN_CONFIG", str(tmp_path / "otel.yaml"))
    tracker = OtelTrainTracker("my-proj", prometheus_port=0, hardware=False)
    tracker.start()
    info = ot.run_info()
    session = current_session()
    assert info is not None and session is not None
    assert (session.config.wandb_project, session.config.mlflow_experiment) == ("from-file", "my-proj")
    assert info.run_name.startswith("my-proj-")
    tracker.finish()


def test_a_project_name_with_odd_characters_still_names_the_run(tmp_path: Path) -> None:
    tracker = OtelTrainTracker("org/My Project!", **QUIET)
    tracker.start()
    session = current_session()
    assert session is not None and session.run_name.startswith("org-My-Project-")
    assert session.config.wandb_project == "org/My Project!"
    tracker.finish()


def test_constructor_forms() -> None:
    assert OtelTrainTracker(settings={"run_name": "a"})._settings == {"run_name": "a"}
    assert OtelTrainTracker({"run_name": "a"}, log_interval=2)._settings == {
        "run_name": "a",
        "log_interval": 2,
    }
    named = OtelTrainTracker("proj", settings={"run_name": "a"}, log_interval=2)
    assert (named.project_name, named._settings) == ("proj", {"run_name": "a", "log_interval": 2})
    with pytest.raises(TypeError, match="project name"):
        OtelTrainTracker(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="two settings mappings"):
        OtelTrainTracker({"run_name": "a"}, settings={"run_name": "b"})


def test_tracker_alone_numbers_a_log_without_a_step_after_the_last_logged_step(tmp_path: Path) -> None:
    """`step` is optional in `accelerator.log`: with no ot.step in the loop, each log without one
    is one otel_train step, numbered after the last step logged (with or without a number), with
    its own values in the run dir and TensorBoard; a log for an earlier step still marks none."""
    tracker = OtelTrainTracker(run_name="no-step", tensorboard=True, **EVERY_STEP, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    for i in range(3):
        accelerator.log({"loss": 10.0 + i})  # steps 0, 1, 2
    accelerator.log({"loss": 20.0}, step=20)
    accelerator.log({"loss": 21.0})  # 21
    accelerator.log({"eval_score": 0.5}, step=1)  # filed under 1, marks no step
    accelerator.log({"loss": 22.0})  # 22, not 2
    accelerator.end_training()

    expected = {0: 10.0, 1: 11.0, 2: 12.0, 20: 20.0, 21: 21.0, 22: 22.0}
    rows = _rows(tmp_path / "runs" / "no-step")
    assert {r["step"]: r["train/loss"] for r in rows if "train/loss" in r} == expected
    assert sum(r.get("train/steps") or 0 for r in rows) == len(expected)
    assert next((r["step"], r["eval/score"]) for r in rows if "eval/score" in r) == (1, 0.5)
    assert 0 < [r["train/goodput"] for r in rows if "train/goodput" in r][-1] <= 1  # logs' gaps: step time
    tb = read_tensorboard(tmp_path / "runs" / "no-step" / "tensorboard")
    assert dict(tb.scalars["train/loss"]) == expected


@pytest.mark.parametrize("form", ["instance", "by-name"])
def test_both_forms_take_init_trackers_project_and_init_kwargs_alike(
    tmp_path: Path, registry: None, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """`log_with=[OtelTrainTracker()]` as `log_with="otel_train"`: the project begins the run's name
    and names the W&B project and MLflow experiment unless the user chose them, and
    `init_kwargs["otel_train"]` are ot.init() keywords (so they beat `OTEL_TRAIN_<FIELD>`)."""
    monkeypatch.setenv("OTEL_TRAIN_MLFLOW_EXPERIMENT", "from-env")
    monkeypatch.setenv("OTEL_TRAIN_LOG_INTERVAL", "5")
    register_tracker_class(OtelTrainTracker)
    accelerator = Accelerator(log_with=[OtelTrainTracker()] if form == "instance" else "otel_train", cpu=True)
    accelerator.init_trackers(
        "my-proj",
        config={"lr": 0.1},
        init_kwargs={"otel_train": {**QUIET, "log_interval": 7, "wandb_project": "wp"}},
    )
    session = current_session()
    assert session is not None
    assert session.run_name.startswith("my-proj-") and session.run_name != "my-proj-"
    assert (session.config.wandb_project, session.config.mlflow_experiment) == ("wp", "from-env")
    assert session.config.log_interval == 7
    assert session.config.prometheus_port == 0
    accelerator.end_training()
    assert current_session() is None
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "hparams.json").read_text())["lr"] == 0.1


def test_the_constructors_settings_and_project_win_over_init_trackers(tmp_path: Path) -> None:
    tracker = OtelTrainTracker("mine", log_interval=3, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("other", init_kwargs={"otel_train": {"log_interval": 7, "tensorboard": True}})
    session = current_session()
    assert session is not None
    assert session.run_name.startswith("mine-") and session.config.wandb_project == "mine"
    assert (session.config.log_interval, session.config.tensorboard) == (3, True)
    accelerator.end_training()


@pytest.mark.parametrize("form", ["instance", "by-name"])
def test_a_misspelt_init_kwargs_setting_raises_in_both_forms(registry: None, form: str) -> None:
    register_tracker_class(OtelTrainTracker)
    accelerator = Accelerator(log_with=[OtelTrainTracker()] if form == "instance" else "otel_train", cpu=True)
    with pytest.raises(ot.ConfigError, match=r"'log_intervall'.*'log_interval'"):
        accelerator.init_trackers("proj", init_kwargs={"otel_train": {"log_intervall": 7}})
    assert current_session() is None


def test_a_tracker_given_to_a_second_accelerator_marks_that_runs_steps(tmp_path: Path) -> None:
    """One OtelTrainTracker instance, two Accelerators one after the other (two runs): the second
    run counts its logged steps as the first did, and takes its own project."""
    tracker = OtelTrainTracker(**EVERY_STEP, **QUIET)
    for run in range(2):
        accelerator = Accelerator(log_with=[tracker], cpu=True)
        accelerator.init_trackers(f"proj{run}", config={"run": run})
        for step in range(3):
            accelerator.log({"loss": float(10 * run + step)}, step=step)
        accelerator.end_training()
        assert current_session() is None

    runs = {json.loads((d / "hparams.json").read_text())["run"]: d for d in (tmp_path / "runs").iterdir()}
    for run, run_dir in sorted(runs.items()):
        rows = _rows(run_dir)
        assert sum(r.get("train/steps") or 0 for r in rows) == 3
        assert {r["step"]: r["train/loss"] for r in rows if "train/loss" in r} == {
            step: float(10 * run + step) for step in range(3)
        }
        assert run_dir.name.startswith(f"proj{run}-")


def _job_without_steps(rank: int, world_size: int, out: str, numbered: bool) -> list[str]:
    """`ot.init()` on every rank and the tracker, but no `ot.step` in the loop; the logs with
    `step=` when `numbered`."""
    import torch

    warnings = log_messages()
    accelerator = Accelerator(cpu=True, log_with=[OtelTrainTracker()])
    ot.init(output_dir=out, run_name="unmarked", log_interval=2, **QUIET)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers("proj")
    accelerator.log({"lr": 1e-2}, step=0)  # before training: no sign yet
    for step in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step if numbered else None)
    accelerator.end_training()
    ot.shutdown()
    return warnings


@pytest.mark.multirank
@pytest.mark.parametrize("numbered", [True, False], ids=["step", "no_step"])
def test_a_multi_process_job_that_marks_no_steps_is_told_to_use_ot_step_once(
    tmp_path: Path, numbered: bool
) -> None:
    """Accelerate logs on the main process only, so the tracker cannot mark steps every rank
    agrees on: without `ot.step` the job would have no steps, silently. The main process says so
    once, at the second step logged (a log without `step=` is a new one); numbered values still
    land under their steps."""
    results = run_ranks(2, _job_without_steps, (str(tmp_path), numbered), timeout=120)
    told = [m for m in results[0] if "marks no steps" in m]
    assert len(told) == 1 and "`with ot.step(step):` on every rank" in told[0], results[0]
    assert results[1] == []  # the other rank's tracker is never called
    if numbered:
        rows = _rows(tmp_path / "unmarked")
        assert [r["step"] for r in rows if "train/loss" in r] == [0, 1, 2, 3]


def test_tracker_alone_keeps_each_log_a_point_of_its_own_at_the_default_interval(tmp_path: Path) -> None:
    """Default settings (a flush every ~10 steps): each `accelerator.log(values, step=N)` is still one
    point at step N, as Accelerate's own TensorBoard tracker writes it, not a flush's mean."""
    tracker = OtelTrainTracker(run_name="points", tensorboard=True, **QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    for step in range(25):
        accelerator.log({"loss": float(step)}, step=step)
    accelerator.end_training()
    rows = _rows(tmp_path / "runs" / "points")
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == [
        (s, float(s)) for s in range(25)
    ]
    assert sum(r.get("train/steps") or 0 for r in rows) == 25
    tb = read_tensorboard(tmp_path / "runs" / "points" / "tensorboard")
    assert dict(tb.scalars["train/loss"]) == {s: float(s) for s in range(25)}


def test_nested_values_are_flattened_text_is_text_and_the_rest_is_counted(tmp_path: Path) -> None:
    """As Accelerate's TensorBoard and W&B trackers keep them: a nested dict's numbers as
    `outer/inner`, a string as text; a value that is no number (a list) is dropped, counted and
    warned about, never silently."""
    warned = log_messages()
    tracker = OtelTrainTracker(run_name="kinds", **QUIET, **EVERY_STEP)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj")
    accelerator.log(
        {"nested": {"a": 1.0, "deeper": {"b": 2.0}}, "note": "hello", "hist": [1, 2], "did_eval": True},
        step=0,
    )
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.end_training()
    run_dir = tmp_path / "runs" / "kinds"
    rows = _rows(run_dir)
    (first,) = [r for r in rows if "nested/a" in r]
    assert (first["step"], first["nested/a"], first["nested/deeper/b"]) == (0, 1.0, 2.0)
    assert (
        first["train/did_eval"] == 1
    )  # a bool is an int to Accelerate, as its TensorBoard tracker writes it
    texts = [json.loads(line) for line in (run_dir / "text.jsonl").read_text().splitlines()]
    assert [(t["key"], t["text"], t["step"]) for t in texts] == [("note", "hello", 0)]
    assert sum(r.get("otel_train/dropped/invalid_type") or 0 for r in rows) == 1
    assert any("hist" in message for message in warned), warned


def test_a_log_after_end_training_is_refused_not_a_new_run(tmp_path: Path) -> None:
    """The tracker's run ended with `end_training()`: a later log says so and records nothing, and
    no second (unnamed) run appears; `init_trackers` again starts a new run."""
    warned = log_messages()
    tracker = OtelTrainTracker(**QUIET)
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("first")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    accelerator.log({"loss": 2.0}, step=1)
    assert current_session() is None
    accelerator.end_training()  # again (a `finally` of the user's): still ended
    accelerator.log({"loss": 2.0}, step=2)
    assert current_session() is None
    assert len(list((tmp_path / "runs").iterdir())) == 1
    assert any("after accelerator.end_training()" in m and "init_trackers()" in m for m in warned), warned
    accelerator.init_trackers("second")
    accelerator.log({"loss": 3.0}, step=0)
    accelerator.end_training()
    assert len(list((tmp_path / "runs").iterdir())) == 2


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", "bf16"), ("fp16", "fp16"), ("no", "auto")])
def test_the_accelerators_precision_and_logging_dir_are_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str, dtype: str
) -> None:
    """The session the tracker starts divides MFU by the peak of the precision the Accelerator
    trains in ("no" says nothing of the model's dtype: auto), and puts its run directory in the
    Accelerator's logging_dir, beside its other trackers' files; a setting of the user's wins."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import ProjectConfiguration

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OTEL_TRAIN_OUTPUT_DIR")  # not chosen by the user here
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})  # one precision per process, else
    monkeypatch.setattr(PartialState, "_shared_state", {})
    config = ProjectConfiguration(project_dir="exp", logging_dir="exp/logs")
    accelerator = Accelerator(
        log_with=[OtelTrainTracker(run_name="acc", **QUIET)], cpu=True, mixed_precision=precision,
        project_config=config,
    )  # fmt: skip
    accelerator.init_trackers("proj")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    written = json.loads((tmp_path / "exp" / "logs" / "acc" / "config.json").read_text())
    assert written["compute_dtype"] == dtype
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    monkeypatch.setattr(PartialState, "_shared_state", {})
    chosen = Accelerator(
        log_with=[OtelTrainTracker(run_name="own", compute_dtype="fp32", output_dir="mine", **QUIET)], cpu=True,
        mixed_precision="bf16", project_config=config,
    )  # fmt: skip
    chosen.init_trackers("proj")
    chosen.log({"loss": 1.0}, step=0)
    chosen.end_training()
    assert json.loads((tmp_path / "mine" / "own" / "config.json").read_text())["compute_dtype"] == "fp32"
