"""Lightning Trainer + OtelTrainLogger / OtelTrainCallback / the callbacks_factory entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from argparse import Namespace
from dataclasses import dataclass, field
from enum import Enum
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import urllib.request

import torch
from helpers.events import SlowStretches, log_messages, run_events
from helpers.ports import free_port
from helpers.readback import read_tensorboard
from helpers.waiting import wait_for
from lightning.pytorch import Callback, LightningModule, Trainer
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train import adapters
from otel_train.integrations.lightning import (
    ENV_SWITCH,
    OtelTrainCallback,
    OtelTrainLogger,
    callbacks_factory,
)
from otel_train.testing import current_session

MAX_STEPS = 6
ACCUMULATE = 2


class TinyRegression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"hidden": 8, "lr": 0.05})
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(rows: int) -> Any:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _trainer(root: Path, **extra: Any) -> Trainer:
    return Trainer(
        max_steps=MAX_STEPS,
        accumulate_grad_batches=ACCUMULATE,
        val_check_interval=4,
        num_sanity_val_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        default_root_dir=str(root),
        **extra,
    )


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]


def _progress_lines(run_dir: Path) -> list[str]:
    """progress.txt's step lines (not its end-of-process goodput line)."""
    return [line for line in (run_dir / "progress.txt").read_text().splitlines() if "| step " in line]


QUIET_LOGGER = {"prometheus_port": 0, "verbosity": 0, "hardware": False}


def _total(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r.get(key) or 0 for r in rows)


def test_logger_and_callback_together(tmp_path: Path) -> None:
    settings = {"run_name": "pl", "prometheus_port": 0, "verbosity": 0, "log_interval": 2, "hardware": False}
    trainer = _trainer(tmp_path, logger=OtelTrainLogger(settings), callbacks=[OtelTrainCallback(settings)])
    trainer.fit(TinyRegression(), _loader(64), _loader(8))
    assert current_session() is not None  # the run lasts past the fit (a test() may follow)
    ot.shutdown()  # ... until process exit, a failure or the next logger's run: here, now

    rows = _rows(tmp_path / "runs" / "pl")
    assert trainer.global_step == MAX_STEPS
    assert _total(rows, "train/steps") == MAX_STEPS  # optimizer steps, not micro-batches
    assert _total(rows, "timers/forward/count") == MAX_STEPS * ACCUMULATE
    assert _total(rows, "timers/backward/count") == MAX_STEPS * ACCUMULATE
    assert _total(rows, "timers/optimizer/count") == MAX_STEPS
    assert _total(rows, "timers/eval/count") >= 2  # every 4 batches; the sanity check is not counted
    keys = set().union(*rows)
    assert {"train/loss", "eval/loss", "timers/step/mean"} <= keys
    hparams = json.loads((tmp_path / "runs" / "pl" / "hparams.json").read_text())
    assert hparams["hidden"] == 8


def test_callback_alone_counts_steps_tokens_and_watches(tmp_path: Path) -> None:
    ot.init(run_name="cb", prometheus_port=0, verbosity=0, log_interval=2, hardware=False)
    session = current_session()
    assert session is not None
    callback = OtelTrainCallback(watch_every=2, tokens=lambda batch: batch[0].shape[0] * 10)
    trainer = _trainer(tmp_path, logger=False, callbacks=[callback])
    trainer.fit(TinyRegression(), _loader(64))
    assert current_session() is session  # the user's own session stays up
    ot.shutdown()
    rows = _rows(session.run_dir)
    assert _total(rows, "train/steps") == MAX_STEPS
    assert any(k.startswith("grad_norm/") for r in rows for k in r)  # ot.watch per-layer norms
    # 4 rows per micro-batch x 10 "tokens" per row, 2 micro-batches per optimizer step
    assert _total(rows, "throughput/tokens") == MAX_STEPS * ACCUMULATE * 4 * 10


def test_callback_with_a_decorated_training_step_counts_each_step_once(tmp_path: Path) -> None:
    """The callback marks the optimizer steps; a user's `@ot.step` on `training_step` (one per
    micro-batch) runs inside them: counted once, as the callback's steps, and warned about."""

    class DecoratedStep(TinyRegression):
        @ot.step
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx)

    ot.init(run_name="cb", prometheus_port=0, verbosity=0, log_interval=2, hardware=False)
    session = current_session()
    assert session is not None
    trainer = _trainer(tmp_path, logger=False, callbacks=[OtelTrainCallback()])
    trainer.fit(DecoratedStep(), _loader(64))
    ot.shutdown()
    rows = _rows(session.run_dir)
    assert _total(rows, "train/steps") == MAX_STEPS
    assert _total(rows, "otel_train/dropped/nested_step") == MAX_STEPS * ACCUMULATE


def test_logger_alone_starts_a_session_on_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "logger-only")
    trainer = _trainer(tmp_path, logger=OtelTrainLogger({"verbosity": 0, "hardware": False}))
    trainer.fit(TinyRegression(), _loader(64), _loader(8))
    ot.shutdown()
    keys = set().union(*_rows(tmp_path / "runs" / "logger-only"))
    assert {"train/loss", "eval/loss"} <= keys


def test_logger_alone_records_every_logged_value_at_its_step(tmp_path: Path) -> None:
    """Issue #23: `self.log` every 5 of 40 steps with only the logger: each value at its step, in
    the run dir, a bridge (TensorBoard, read back with its own reader) and /metrics."""
    port = free_port()
    logger = OtelTrainLogger(run_name="alone", output_dir=str(tmp_path / "runs"), prometheus_port=port,
                             verbosity=0, hardware=False, tensorboard=True)  # fmt: skip
    trainer = Trainer(
        max_steps=40, log_every_n_steps=5, val_check_interval=20, num_sanity_val_steps=0, logger=logger,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(TinyRegression(), _loader(160), _loader(8))
    # fit's end is a pause (Logger.finalize): it flushes what was logged since the last flush, the
    # last eval included. /metrics shows what the background worker has recorded: the last
    # flushes may still be queued behind it on a busy host.
    session = current_session()
    assert session is not None
    wait_for(lambda: session.worker.pending_batches() == 0, 60, "the worker to take every flush")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    scraped = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    ot.shutdown()
    # shutdown() waits shutdown_timeout_s for the bridges; on a busy host they finish later
    assert session.bridges is not None and session.bridges.wait(120)
    assert scraped["train_loss"] > 0 and scraped["eval_loss"] > 0 and scraped["train_steps_total"] == 40
    tb = read_tensorboard(tmp_path / "runs" / "alone" / "tensorboard")
    assert sorted({step for step, _ in tb.scalars["train/loss"]}) == list(range(4, 40, 5))
    rows = _rows(tmp_path / "runs" / "alone")
    losses = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert sorted(losses) == list(range(4, 40, 5))  # Lightning's steps, one logged value each
    assert len(set(losses.values())) == len(losses)  # each its own value, not one repeated
    assert _total(rows, "train/steps") == 40  # every optimizer step: the callback the logger added
    evals = [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
    first_seen = {value: step for step, value in reversed(evals)}
    assert sorted(first_seen.values()) == [19, 39]  # both validations, each at the step it followed
    assert 0 < [r for r in rows if "train/goodput" in r][-1]["train/goodput"] < 1  # the last flush's


def test_keyword_settings_and_unknown_names(tmp_path: Path) -> None:
    logger = OtelTrainLogger({"verbosity": 0}, run_name="kw", hardware=False)
    callback = OtelTrainCallback(watch_every=0, log_interval=3, settings={"run_name": "old"})
    assert logger._settings == {"verbosity": 0, "run_name": "kw", "hardware": False}
    assert callback._settings == {"run_name": "old", "log_interval": 3}
    with pytest.raises(ot.ConfigError, match=r"OtelTrainLogger.*'run_nmae'.*'run_name'"):
        OtelTrainLogger(run_nmae="x")
    with pytest.raises(ot.ConfigError, match=r"OtelTrainCallback.*'log_intervall'.*'log_interval'"):
        OtelTrainCallback(settings={"log_intervall": 2})


def test_factory_is_gated_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert callbacks_factory() == []
    monkeypatch.setenv(ENV_SWITCH, "1")
    callbacks = callbacks_factory()
    assert len(callbacks) == 1 and isinstance(callbacks[0], OtelTrainCallback)


_UNMODIFIED_SCRIPT = """
import sys
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

class M(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
x = torch.randn(32, 4)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
# A validation after step 2 and a final one after the last step (5).
Trainer(max_steps=6, val_check_interval=3, num_sanity_val_steps=0, accelerator="cpu", devices=1,
        enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=1,
        logger=CSVLogger(sys.argv[1], name="csv", version=0), default_root_dir=sys.argv[1]).fit(M(), data, data)
"""


def test_unmodified_script_exports_only_with_the_switch(tmp_path: Path) -> None:
    names = {ep.value for ep in entry_points(group="lightning.pytorch.callbacks_factory")}
    assert "otel_train.integrations.lightning:callbacks_factory" in names, (
        "the entry point is not installed: reinstall the package (pip install -e .) so its "
        "pyproject entry points are registered"
    )
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_UNMODIFIED_SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_TRAIN_OUTPUT_DIR=str(tmp_path / "runs"),
        OTEL_TRAIN_RUN_NAME="unmodified",
        OTEL_TRAIN_PROMETHEUS_PORT="0",
        OTEL_TRAIN_VERBOSITY="0",
        OTEL_TRAIN_HARDWARE="false",
    )
    subprocess.run([sys.executable, str(script), str(tmp_path / "off")], env=env, check=True, timeout=180)
    assert not (tmp_path / "runs").exists()  # installed but switched off: nothing changes

    env[ENV_SWITCH] = "1"
    subprocess.run([sys.executable, str(script), str(tmp_path / "on")], env=env, check=True, timeout=180)
    rows = _rows(tmp_path / "runs" / "unmodified")
    assert _total(rows, "train/steps") == 6
    assert "train/loss" in set().union(*rows)  # from the logger's logged_metrics
    # Issue #29: each validation's val_loss at the step Lightning's own logger files it under,
    # the final one included (it used to be lost, the others one step late).
    csv = (tmp_path / "on" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = csv[0].split(",")
    expected = {}
    for line in csv[1:]:
        cells = dict(zip(header, line.split(","), strict=True))
        if cells.get("val_loss"):
            expected[int(cells["step"])] = float(cells["val_loss"])
    assert sorted(expected) == [2, 5]
    got = {}
    for r in rows:
        if "eval/loss" in r:
            got.setdefault(r["eval/loss"], r["step"])  # the first row that carries this value
    assert {step: pytest.approx(value, rel=1e-6) for value, step in got.items()} == expected


# --- Lightning's logger contract: names, directories, one run per logger (issue #43) ----------------
def _quick_trainer(logger: Any, **extra: Any) -> Trainer:
    extra.setdefault("max_steps", 1)
    return Trainer(
        logger=logger, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        limit_val_batches=1, limit_test_batches=2, **extra,
    )  # fmt: skip


def _boring() -> LightningModule:
    from lightning.pytorch.demos.boring_classes import BoringModel

    return BoringModel()


def _quiet(**settings: Any) -> OtelTrainLogger:
    return OtelTrainLogger(verbosity=0, hardware=False, prometheus_port=0, **settings)


def _run_id(run_dir: Path) -> str:
    return str(json.loads((run_dir / "config.json").read_text())["run_id"])


def test_each_logger_names_its_own_run_and_checkpoint_dir(tmp_path: Path) -> None:
    """Two loggers one after the other: each run's checkpoints in its own run dir (they shared
    otel_train/version_None/checkpoints, the second as -v1), and the names stay after finalize."""
    runs = tmp_path / "runs"  # OTEL_TRAIN_OUTPUT_DIR (conftest)
    seen = {}
    for run_name in ("first", "second"):
        logger = _quiet(run_name=run_name)
        trainer = _quick_trainer(logger)
        trainer.fit(_boring())
        session = current_session()
        assert session is not None and session.run_dir == runs / run_name
        assert trainer.checkpoint_callback is not None
        assert Path(trainer.checkpoint_callback.dirpath) == runs / run_name / "checkpoints"
        assert sorted(p.name for p in (runs / run_name / "checkpoints").iterdir()) == ["epoch=0-step=1.ckpt"]
        # Stable after finalize, the same as Lightning's directory contract computes them
        assert (logger.name, logger.version) == ("", run_name)
        assert Path(logger.save_dir) == runs and Path(logger.root_dir) == runs
        assert Path(logger.log_dir) == runs / run_name
        assert trainer.log_dir is not None and Path(trainer.log_dir) == runs  # save_dir, as for any logger
        seen[run_name] = logger
    ot.shutdown()
    assert _run_id(runs / "first") != _run_id(runs / "second")
    assert not (tmp_path / "otel_train").exists()


def test_default_names_adopt_default_root_dir_and_never_shadow_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_TRAIN_OUTPUT_DIR")
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "root"
    versions = []
    for _ in range(2):
        logger = _quiet()
        trainer = _quick_trainer(logger, default_root_dir=str(root))
        trainer.fit(_boring())
        session = current_session()
        assert session is not None
        assert session.run_dir is not None and session.run_dir.resolve() == Path(logger.log_dir).resolve()
        assert (
            Path(trainer.checkpoint_callback.dirpath).resolve() == session.run_dir.resolve() / "checkpoints"
        )  # type: ignore[union-attr]
        versions.append(logger.version)
    assert versions == ["version_0", "version_1"]  # Lightning's automatic versioning, in default_root_dir
    # Lightning's own default root (the working directory): otel_train's "runs" below it
    logger = _quiet()
    _quick_trainer(logger).fit(_boring())
    assert (
        Path(logger.log_dir) == Path("runs") / "version_0"
        and (tmp_path / "runs" / "version_0" / "checkpoints").is_dir()
    )
    ot.shutdown()
    # Nothing in the working directory a later script there would import instead of otel_train
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root", "runs"]
    probe = "import otel_train, sys; sys.exit(0 if hasattr(otel_train, 'init') else 3)"
    subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True, timeout=120)


def test_an_output_dir_named_in_the_config_file_wins_over_default_root_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config file is one of the places the user chooses `output_dir`, also when it names
    otel_train's own default ("runs"): the Trainer's default_root_dir is not used then."""
    monkeypatch.delenv("OTEL_TRAIN_OUTPUT_DIR")
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "otel_train.yaml"
    config.write_text("output_dir: runs\n")
    monkeypatch.setenv("OTEL_TRAIN_CONFIG", str(config))
    logger = _quiet(run_name="from-file")
    _quick_trainer(logger, default_root_dir=str(tmp_path / "root")).fit(_boring())
    ot.shutdown()
    assert Path(logger.log_dir) == Path("runs") / "from-file"
    assert (tmp_path / "runs" / "from-file" / "checkpoints" / "epoch=0-step=1.ckpt").is_file()
    assert not (tmp_path / "root").exists()


def test_explicit_otel_train_settings_win_over_lightning_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # name= and version= as TensorBoardLogger/CSVLogger take them
    logger = _quiet(name="exp", version=3)
    trainer = _quick_trainer(logger, default_root_dir=str(tmp_path / "root"))
    trainer.fit(_boring())
    runs = tmp_path / "runs"  # OTEL_TRAIN_OUTPUT_DIR beats default_root_dir
    assert (logger.name, logger.version) == ("exp", "version_3")
    assert Path(trainer.checkpoint_callback.dirpath) == runs / "exp" / "version_3" / "checkpoints"  # type: ignore[union-attr]
    assert ot.run_info() is not None and ot.run_info().run_dir == str(runs / "exp" / "version_3")  # type: ignore[union-attr]
    ot.shutdown()
    # run_name (here from the environment) beats version=; the output_dir keyword beats the environment
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "from-env")
    logger = _quiet(version=7, output_dir=str(tmp_path / "kw"))
    _quick_trainer(logger, default_root_dir=str(tmp_path / "root")).fit(_boring())
    assert Path(logger.log_dir) == tmp_path / "kw" / "from-env"
    assert (tmp_path / "kw" / "from-env" / "checkpoints" / "epoch=0-step=1.ckpt").is_file()
    assert not (tmp_path / "root").exists()
    with pytest.raises(ot.ConfigError, match=r"version='a/b'.*letters, digits"):
        OtelTrainLogger(version="a/b")


def test_the_trainers_max_steps_is_adopted_unless_the_user_chose_total_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for run_name, variable, expected in (("adopted", None, 3), ("chosen", "100", 100)):
        if variable is not None:
            monkeypatch.setenv("OTEL_TRAIN_TOTAL_STEPS", variable)
        _quick_trainer(_quiet(run_name=run_name), max_steps=3).fit(_boring())
        session = current_session()
        assert session is not None and session.config.total_steps == expected
        ot.shutdown()


@pytest.mark.parametrize(
    ("limits", "planned"),
    [({"max_steps": 100, "max_epochs": 1}, 5), ({"max_steps": -1, "max_epochs": 2}, 10)],
    ids=["epochs-end-first", "epochs-only"],
)
def test_the_plan_is_the_steps_the_epochs_allow(tmp_path: Path, limits: dict[str, int], planned: int) -> None:
    """`max_epochs` ends the fit before `max_steps`, or sets the only limit: the plan is Lightning's
    estimate of the optimizer steps (5 batches an epoch here), and the run ends at "step N/N"."""
    _quick_trainer(_quiet(run_name="epochs"), limit_train_batches=5, **limits).fit(_boring())
    session = current_session()
    assert session is not None and session.config.total_steps == planned
    ot.shutdown()
    assert f"step {planned}/{planned}" in _progress_lines(tmp_path / "runs" / "epochs")[-1]


def test_a_second_fit_on_the_logger_plans_its_own_max_steps(tmp_path: Path) -> None:
    logger = _quiet(run_name="refit", log_interval=1)
    _quick_trainer(logger, max_steps=2, enable_checkpointing=False).fit(_boring())
    _quick_trainer(logger, max_steps=5, enable_checkpointing=False).fit(_boring())
    ot.shutdown()
    planned = [r["train/steps_planned"] for r in _rows(tmp_path / "runs" / "refit") if "train/steps" in r]
    assert planned == [2, 2, 5, 5, 5, 5, 5]
    assert "step 5/5" in _progress_lines(tmp_path / "runs" / "refit")[-1]


def test_early_stopping_makes_the_steps_run_the_plan(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import EarlyStopping

    # min_delta so large that the second epoch never improves: stops after 2 epochs of 4 batches
    stop = EarlyStopping(monitor="train_loss", min_delta=1e6, patience=1, check_on_train_epoch_end=True)
    logger = _quiet(run_name="early", log_interval=1000)
    trainer = _quick_trainer(logger, max_steps=100, callbacks=[stop], enable_checkpointing=False)
    trainer.fit(TinyRegression(), _loader(16))
    ot.shutdown()
    assert trainer.global_step == 8
    last = _rows(tmp_path / "runs" / "early")[-1]  # the plan changed after the last step's row
    assert last["train/steps_planned"] == 8 and last["progress/eta_s"] == 0
    assert "step 8/8" in _progress_lines(tmp_path / "runs" / "early")[-1]


def test_fit_then_test_is_one_run_and_the_next_logger_ends_it(tmp_path: Path) -> None:
    class Logs(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    runs = tmp_path / "runs"
    first = _quiet(run_name="first")
    trainer = _quick_trainer(first, max_steps=3, log_every_n_steps=1, enable_checkpointing=False)
    model = Logs()
    trainer.fit(model, _loader(16))
    session = current_session()
    assert session is not None  # a fit's end is not the run's
    trainer.test(model, _loader(8))
    assert current_session() is session
    assert not session.shutdown_done.is_set()

    second = _quiet(run_name="second")
    _quick_trainer(second, max_steps=2, enable_checkpointing=False).fit(Logs(), _loader(16))
    # The second logger's run began: the first's ended with its final flush, not at process exit
    assert session.shutdown_done.is_set() and current_session() is not session
    ot.shutdown()
    assert sorted(p.name for p in runs.iterdir()) == ["first", "second"]
    rows = _rows(runs / "first")
    keys = set().union(*rows)
    assert {"train/loss", "test/loss"} <= keys  # fit and test in one run's file
    assert len({r.get("run_id") for r in rows if "run_id" in r} | {_run_id(runs / "first")}) == 1

    # The first logger used again later: its own run, appended to (same run id), not a third one
    trainer = _quick_trainer(first, enable_checkpointing=False)
    trainer.test(model, _loader(8))
    assert ot.run_info() is not None and ot.run_info().run_name == "first"  # type: ignore[union-attr]
    ot.shutdown()
    assert sorted(p.name for p in runs.iterdir()) == ["first", "second"]
    assert _run_id(runs / "first") == _run_id(runs / "first")
    assert len(_rows(runs / "first")) > len(rows)


def test_the_callback_alone_keeps_its_run_for_the_test_after_the_fit(tmp_path: Path) -> None:
    """`OtelTrainCallback` alone (what OTEL_TRAIN_LIGHTNING=1 adds to an unmodified script): the
    `test` after the `fit` is still its run; a new Trainer's callback, or a logger, starts its own."""

    class Tested(TinyRegression):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def trainer() -> Trainer:
        return _quick_trainer(False, callbacks=[OtelTrainCallback(**QUIET_LOGGER)], max_steps=3,
                              log_every_n_steps=1, enable_checkpointing=False)  # fmt: skip

    first = trainer()
    first.fit(Tested(), _loader(16))
    session = current_session()
    assert session is not None  # idle after the fit
    first.test(Tested(), _loader(8))
    assert current_session() is session
    trainer().fit(Tested(), _loader(16))  # another callback: its own run
    second = current_session()
    assert second is not session and session.shutdown_done.is_set()
    _quick_trainer(_quiet(run_name="logged"), max_steps=1).fit(_boring())  # a logger: its own run too
    assert current_session() is not second and second is not None and second.shutdown_done.is_set()
    ot.shutdown()
    keys = set().union(*_rows(session.run_dir))
    assert {"train/loss", "test/loss"} <= keys


def test_the_run_idles_between_fit_and_test_without_a_stall(tmp_path: Path) -> None:
    """The run stays open after a successful fit (for the test that follows): the stall watchdog
    must not take the pause for a hung step, and the next fit's steps arm it again."""
    from otel_train.integrations.lightning import OtelTrainCallback

    logger = _quiet(run_name="idle", stall_timeout_s=0.5)
    trainer = _quick_trainer(logger, max_steps=3, callbacks=[OtelTrainCallback()], enable_checkpointing=False)
    trainer.fit(_boring())
    session = current_session()
    assert session is not None
    step, _ = session.last_step()
    time.sleep(2.0)  # four stall timeouts of idling: a watchdog still armed reports a stall
    assert session.last_step() == (step, None)
    adapters.begin_step(step + 1)
    adapters.end_step()
    assert session.last_step()[1] is not None  # a step after the pause arms it again
    ot.shutdown()
    events_file = tmp_path / "runs" / "idle" / "events.rank0.jsonl"  # written with the first event
    assert (tmp_path / "runs" / "idle" / "metrics.rank0.jsonl").exists()
    lines = events_file.read_text().splitlines() if events_file.exists() else []
    assert "stall" not in [json.loads(line)["event"] for line in lines]


@pytest.mark.parametrize("slow_part", ["batches", "epoch_end"])
def test_a_validation_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path, slow_part: str) -> None:
    """Under stall_timeout_s=1, no stall event for a validation between steps that takes longer:
    - "batches": 8 batches of 0.2 s, each telling the watchdog the loop is alive (the callback's
      `on_validation_batch_end`);
    - "epoch_end": a 2.5 s `on_validation_epoch_end` after the last batch (gathering predictions,
      a corpus metric), with no batch marking progress: the callback's eval span is still open, so
      the watchdog waits eval_timeout_s."""
    from otel_train.integrations.lightning import OtelTrainCallback

    slow = SlowStretches()

    class SlowValidation(TinyRegression):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if slow_part == "batches":
                slow.sleep(0.2)
            super().validation_step(batch, batch_idx)

        def on_validation_epoch_end(self) -> None:
            if slow_part == "epoch_end":
                slow.sleep(2.5)

    logger = _quiet(run_name="longval", stall_timeout_s=1.0)
    trainer = Trainer(
        logger=logger, callbacks=[OtelTrainCallback()], max_steps=3, val_check_interval=2,
        limit_val_batches=8 if slow_part == "batches" else 2, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(SlowValidation(), _loader(32), _loader(32))
    ot.shutdown()
    run_dir = tmp_path / "runs" / "longval"
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(r.get("timers/eval/count", 0) for r in rows) >= 1  # the validation ran
    assert len(slow.spans) == (8 if slow_part == "batches" else 1)
    assert slow.stalls_inside(run_dir) == []


def test_a_step_that_accumulates_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path) -> None:
    """Each micro-batch of a step that accumulates gradients tells the stall watchdog the loop is
    alive (the callback's `on_train_batch_end`): steps of 4 micro-batches of 0.3 s under
    stall_timeout_s=1 raise no stall event."""
    from otel_train.integrations.lightning import OtelTrainCallback

    slow = SlowStretches()

    class SlowMicroBatches(TinyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            slow.sleep(0.3)
            return super().training_step(batch, batch_idx)

    logger = _quiet(run_name="accumulating", stall_timeout_s=1.0)
    trainer = Trainer(
        logger=logger, callbacks=[OtelTrainCallback()], max_steps=2, accumulate_grad_batches=4,
        limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(SlowMicroBatches(), _loader(64))
    ot.shutdown()
    run_dir = tmp_path / "runs" / "accumulating"
    assert _total(_rows(run_dir), "train/steps") == 2
    assert len(slow.spans) == 8  # 2 steps of 4 micro-batches, each step longer than the timeout
    assert slow.stalls_inside(run_dir) == []


def _slow_storage(slow: SlowStretches, seconds: float) -> Any:
    """Lightning's checkpoint writer, each file `seconds` slower (a slow file system)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class SlowStorage(TorchCheckpointIO):
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            slow.sleep(seconds)
            super().save_checkpoint(*args, **kwargs)

    return SlowStorage()


def test_a_checkpoint_save_longer_than_the_stall_timeout_is_no_stall(tmp_path: Path) -> None:
    """The callback's `on_save_checkpoint` comes before the file is written: the watchdog then
    waits checkpoint_timeout_s, so saves of 1.5 s under stall_timeout_s=0.5 raise no stall."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from otel_train.integrations.lightning import OtelTrainCallback

    slow = SlowStretches()

    logger = _quiet(run_name="longsave", stall_timeout_s=0.5)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = Trainer(
        logger=logger, callbacks=[OtelTrainCallback(), saves], plugins=[_slow_storage(slow, 1.5)], max_steps=2,
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        devices=1,
    )  # fmt: skip
    trainer.fit(TinyRegression(), _loader(32))
    ot.shutdown()
    run_dir = tmp_path / "runs" / "longsave"
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 2  # both saves ran
    assert len(slow.spans) == 2
    assert slow.stalls_inside(run_dir) == []


def test_the_logger_alone_sees_every_batch_so_slow_intervals_validations_and_saves_are_no_stall(
    tmp_path: Path,
) -> None:
    """Lightning hands a logger only the steps it logs at: with `log_every_n_steps=5` and 0.3 s
    batches, a logger that marked only those would see 1.5 s without progress at every interval,
    and a validation or a save longer still, each a stall under stall_timeout_s=1. The logger adds
    the callback, whose batch hooks count every optimizer step and keep the watchdog fed."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    slow = SlowStretches()

    class SlowModel(TinyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            slow.sleep(0.3)
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            slow.sleep(0.3)
            super().validation_step(batch, batch_idx)

    logger = _quiet(run_name="alone-slow", stall_timeout_s=1.0)
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    trainer = Trainer(
        logger=logger, callbacks=[saves], plugins=[_slow_storage(slow, 1.5)], max_steps=12, log_every_n_steps=5,
        val_check_interval=6, limit_val_batches=5, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(SlowModel(), _loader(64), _loader(32))
    ot.shutdown()
    run_dir = tmp_path / "runs" / "alone-slow"
    rows = _rows(run_dir)
    assert _total(rows, "train/steps") == 12
    assert _total(rows, "timers/forward/count") == 12 and _total(rows, "timers/eval/count") == 2
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 2
    assert len(slow.spans) == 12 + 2 * 5 + 2
    assert slow.stalls_inside(run_dir) == []


def test_the_logger_adds_one_callback_before_the_checkpoint_callbacks(tmp_path: Path) -> None:
    """Where Lightning orders a callback the user passes (a step ends before its save), once per
    Trainer across fit and test; a Trainer that has one keeps only its own."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    trainer = _quick_trainer(_quiet(run_name="added"), max_steps=2, callbacks=[saves])
    trainer.fit(_boring())
    trainer.test(_boring())
    ot.shutdown()
    added = [i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, OtelTrainCallback)]
    assert len(added) == 1 and added[0] < trainer.callbacks.index(saves)

    own = OtelTrainCallback()
    trainer = _quick_trainer(_quiet(run_name="own"), max_steps=2, callbacks=[own])
    trainer.fit(_boring())
    ot.shutdown()
    assert [cb for cb in trainer.callbacks if isinstance(cb, OtelTrainCallback)] == [own]


def test_a_failed_fit_ends_the_run(tmp_path: Path) -> None:
    class Fails(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 1:
                raise RuntimeError("boom")
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    started: list[Any] = []

    class Keep(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            started.append(current_session())

    logger = _quiet(run_name="fails")
    trainer = _quick_trainer(logger, max_steps=4, enable_checkpointing=False, callbacks=[Keep()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Fails(), _loader(16))
    assert current_session() is None
    assert started[0] is not None and started[0].shutdown_done.is_set()  # the final flush ran
    assert logger.version == "fails"
    assert "| end of process (failed) |" in (Path(logger.log_dir) / "progress.txt").read_text()
    [failed] = run_events(Path(logger.log_dir), event="run_failed")
    assert failed["message"].startswith("the training ended by RuntimeError at step 1: boom"), failed


def test_two_loggers_on_one_trainer_count_each_step_once(tmp_path: Path) -> None:
    totals, versions = {}, {}
    for count in (1, 2):
        loggers = [_quiet(run_name=f"x{count}") for _ in range(count)]
        trainer = Trainer(
            max_steps=12, log_every_n_steps=3, logger=loggers, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        )  # fmt: skip
        torch.manual_seed(0)  # the same model both times: the same losses
        trainer.fit(TinyRegression(), _loader(64))
        ot.shutdown()
        rows = _rows(tmp_path / "runs" / f"x{count}")
        totals[count] = (_total(rows, "train/steps"), [r["train/loss"] for r in rows if "train/loss" in r])
        versions[count] = [lg.version for lg in loggers]
        assert sum(isinstance(cb, OtelTrainCallback) for cb in trainer.callbacks) == 1
    assert totals[1][0] == 12  # every optimizer step (the callback the first logger added)
    assert totals[2] == totals[1]  # the same steps and values, not twice
    assert versions[2] == ["x2", "x2"]  # the second shares the first one's run
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["x1", "x2"]


class _Flavour(Enum):
    SALTY = "salty"


@dataclass
class _Opts:
    depth: int = 2
    inner: dict[str, Any] = field(default_factory=lambda: {"a": 1})


def test_hyperparameters_of_every_type_reach_hparams_json(tmp_path: Path) -> None:
    import numpy as np

    logger = _quiet(run_name="hp")
    params = {
        "float": 0.3, "int": 1, "string": "abc", "bool": True, "none": None, "list": [1, 2, 3],
        "tuple": (1, "a"), "nested": {"a": {"b": 2}}, "namespace": Namespace(foo=Namespace(bar="x")),
        "tensor": torch.tensor([1.5, 2.0]), "scalar_tensor": torch.tensor(3), "np_array": np.arange(3),
        "np_float": np.float32(0.5), "enum": _Flavour.SALTY, "dataclass": _Opts(), "callable": torch.nn.ReLU,
        "layer": torch.nn.Linear(1, 1), "set": {1, 2},
        "nested_callables": {"act": torch.relu, "loss": Namespace(fn=torch.nn.functional.mse_loss)},
    }  # fmt: skip
    logger.log_hyperparams(Namespace(**params))
    logger.log_hyperparams(params)
    ot.shutdown()
    written = json.loads((tmp_path / "runs" / "hp" / "hparams.json").read_text())
    assert written["float"] == 0.3 and written["string"] == "abc" and written["bool"] is True
    assert written["namespace"] == {"foo": {"bar": "x"}}  # nested Namespaces as mappings
    assert written["callable"] == "ReLU"  # a callable by its name, as Lightning's loggers write it
    # nested ones too (Lightning's loggers flatten, then sanitize): no "<function ... at 0x...>"
    assert written["nested_callables"] == {"act": "relu", "loss": {"fn": "mse_loss"}}
    assert {"tensor", "np_array", "enum", "dataclass", "layer", "set"} <= set(written)


def _ddp_versions(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """One DDP rank: its own default_root_dir (as nodes that share no file system see it), rank 0's
    holding version_0 already. No run name given: rank 0's choice must be every rank's."""
    import os

    from lightning.pytorch.demos.boring_classes import BoringModel

    import otel_train as ot
    from otel_train.integrations.lightning import OtelTrainLogger

    root = Path(out_dir) / f"node{rank}"
    if rank == 0:
        (root / "version_0").mkdir(parents=True)
    os.environ.pop("OTEL_TRAIN_OUTPUT_DIR", None)
    logger = OtelTrainLogger(verbosity=0, hardware=False, prometheus_port=0, collective_timeout_s=60.0)
    trainer = Trainer(
        max_steps=2, accelerator="cpu", devices=world, strategy="ddp", logger=logger,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
    )  # fmt: skip
    trainer.fit(BoringModel())
    run = ot.run_info()
    ot.shutdown()
    assert trainer.checkpoint_callback is not None
    return {
        "version": logger.version, "log_dir": logger.log_dir, "run_name": run.run_name if run else None,
        "run_dir": run.run_dir if run else None, "ckpt_dir": trainer.checkpoint_callback.dirpath,
    }  # fmt: skip


@pytest.mark.multirank
def test_ddp_ranks_agree_on_the_version(tmp_path: Path) -> None:
    from helpers.multirank import run_ranks

    results = run_ranks(2, _ddp_versions, (str(tmp_path),), timeout=240)
    assert [r["version"] for r in results] == ["version_1", "version_1"]  # rank 0's, on rank 1 too
    assert [r["run_name"] for r in results] == ["version_1", "version_1"]
    assert [Path(r["log_dir"]) for r in results] == [Path(r["run_dir"]) for r in results]
    node0 = tmp_path / "node0" / "version_1"
    assert {Path(r["ckpt_dir"]) for r in results} == {node0 / "checkpoints"}  # Lightning broadcasts rank 0's
    assert sorted(p.name for p in (node0 / "checkpoints").iterdir()) == ["epoch=0-step=2.ckpt"]


class _EpochLogged(TinyRegression):
    """Logs its loss as an epoch mean only (`on_step=False, on_epoch=True`)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        self.log("lr_like", float(batch_idx))  # a per-step value beside it
        return loss


def test_the_callback_alone_sends_what_the_loggers_get_at_their_steps(tmp_path: Path) -> None:
    """No OtelTrainLogger: the callback sends otel_train what the Trainer's own CSVLogger gets, the
    same values at the same steps: per-step values and each epoch's mean at its epoch's last
    step, the last epoch's too (not a running mean sent again at every later batch)."""
    from lightning.pytorch.loggers import CSVLogger

    ot.init(
        run_name="cb",
        prometheus_port=0,
        verbosity=0,
        log_interval=1,
        hardware=False,
        output_dir=str(tmp_path),
    )
    session = current_session()
    csv = CSVLogger(str(tmp_path / "csv"))
    trainer = Trainer(
        max_epochs=3, logger=csv, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu", devices=1, callbacks=[OtelTrainCallback()],
    )  # fmt: skip
    trainer.fit(_EpochLogged(), _loader(12))  # 3 batches an epoch
    ot.shutdown()
    import csv as csv_module

    with open(Path(csv.log_dir) / "metrics.csv") as f:
        logged = list(csv_module.DictReader(f))
    lightning_epochs = [(int(r["step"]), float(r["train_loss"])) for r in logged if r["train_loss"]]
    lightning_steps = [(int(r["step"]), float(r["lr_like"])) for r in logged if r["lr_like"]]
    rows = _rows(session.run_dir)
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == lightning_epochs
    assert [(r["step"], r["train/lr_like"]) for r in rows if "train/lr_like" in r] == lightning_steps
    assert [step for step, _ in lightning_epochs] == [2, 5, 8]
    assert _total(rows, "train/steps") == 9


class _TwoOptimizers(TinyRegression):
    """Manual optimization stepping two optimizers per batch, as a GAN does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        first, second = self.optimizers()  # type: ignore[misc]
        for optimizer, layer in ((first, self.layer), (second, self.other)):
            loss = torch.nn.functional.mse_loss(layer(x), y)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("batch", float(batch_idx))

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.layer.parameters(), lr=0.05),
            torch.optim.SGD(self.other.parameters(), lr=0.05),
        ]


def test_manual_optimization_with_two_optimizers_numbers_steps_as_lightning_logs_them(tmp_path: Path) -> None:
    """A GAN's batch steps two optimizers: `global_step` moves by 2 and `max_steps=8` ends after 4
    batches. otel_train's steps are the batches, numbered as Lightning's loggers number them, so
    each logged value is filed under its own step; `max_steps` is not taken as the step count."""
    logger = _quiet(run_name="gan", log_interval=1)
    trainer = _quick_trainer(logger, max_steps=8, log_every_n_steps=1, default_root_dir=str(tmp_path))
    trainer.fit(_TwoOptimizers(), _loader(64))
    ot.shutdown()
    assert trainer.global_step == 8
    rows = _rows(Path(logger.log_dir))
    assert [r["step"] for r in rows if "train/steps" in r] == [0, 1, 2, 3]
    assert [(r["step"], r["train/batch"]) for r in rows if "train/batch" in r] == [
        (i, float(i)) for i in range(4)
    ]
    assert json.loads((Path(logger.log_dir) / "config.json").read_text())["total_steps"] is None


class _SlowSGD(torch.optim.SGD):
    """An update that takes a while, as a large model's does."""

    def step(self, closure: Any = None) -> Any:
        result = super().step(closure)
        time.sleep(0.02)
        return result


def test_manual_optimization_times_each_optimizer_step_and_ends_a_step_per_batch(tmp_path: Path) -> None:
    """A GAN's first optimizer step was timed as the second one's forward (no Lightning hook
    follows a step), and a batch that stepped no optimizer (manual accumulation) merged into the
    next one's step, the last left open after fit()."""

    class Gan(_TwoOptimizers):
        def configure_optimizers(self) -> Any:
            return [_SlowSGD(self.layer.parameters(), lr=0.05), _SlowSGD(self.other.parameters(), lr=0.05)]

    class Accumulating(TinyRegression):  # Lightning's documented manual accumulation
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.manual_backward(torch.nn.functional.mse_loss(self.layer(x), y) / 4)
            if (batch_idx + 1) % 4 == 0:
                self.optimizers().step()  # type: ignore[union-attr]
                self.optimizers().zero_grad()  # type: ignore[union-attr]

    logger = _quiet(run_name="gan-phases", log_interval=100)
    _quick_trainer(logger, max_epochs=1, max_steps=-1, default_root_dir=str(tmp_path)).fit(Gan(), _loader(16))
    ot.shutdown()
    rows = _rows(Path(logger.log_dir))
    assert _total(rows, "timers/step/count") == 4 and _total(rows, "timers/optimizer/count") == 8  # 2 a batch
    assert _total(rows, "timers/forward/count") == 8 and _total(rows, "timers/optimizer/total") >= 8 * 0.02
    logger = _quiet(run_name="accumulating", log_interval=100)
    trainer = _quick_trainer(logger, max_epochs=1, max_steps=-1, default_root_dir=str(tmp_path))
    trainer.fit(Accumulating(), _loader(4 * 18))
    assert ot.run_info().open_step is None
    ot.shutdown()
    rows = _rows(Path(logger.log_dir))
    assert _total(rows, "train/steps") == 18 and _total(rows, "timers/optimizer/count") == 4


def test_an_eval_span_names_the_step_its_metrics_are_logged_at(tmp_path: Path) -> None:
    """A GAN's validation: its eval span's `train.step` is the step Lightning's loggers file its
    `val_loss` at, not `global_step` (twice that, with two optimizers)."""
    from helpers.otlp_receiver import attributes, http_receiver

    class Validated(_TwoOptimizers):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    with http_receiver() as (endpoint, received):
        logger = _quiet(run_name="ganval", otlp_endpoint=endpoint, otlp_protocol="http/protobuf")
        trainer = _quick_trainer(
            logger, max_steps=8, val_check_interval=2, num_sanity_val_steps=0, default_root_dir=str(tmp_path)
        )
        trainer.fit(Validated(), _loader(64), _loader(8))
        ot.shutdown()
        wait_for(lambda: any(s.name == "eval" for _, s in received.spans()), 10, "the eval spans")
    rows = _rows(Path(logger.log_dir))
    logged = [r["step"] for r in rows if "eval/loss" in r]
    spans = [attributes(span.attributes)["train.step"] for _, span in received.spans() if span.name == "eval"]
    assert logged == [1, 3] and sorted(spans) == logged


def test_validate_or_test_without_fit_marks_no_training_steps(tmp_path: Path) -> None:
    """`trainer.validate()` / `trainer.test()` alone: their per-batch logs are no training steps,
    and their time is no productive time."""

    class Evaluated(TinyRegression):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", torch.nn.functional.mse_loss(self.layer(x), y), on_step=True)

    logger = OtelTrainLogger(run_name="eval-only", output_dir=str(tmp_path / "runs"), **QUIET_LOGGER)
    trainer = _trainer(tmp_path, logger=logger)
    trainer.validate(Evaluated(), _loader(16))
    trainer.test(Evaluated(), _loader(16))
    ot.shutdown()
    rows = _rows(tmp_path / "runs" / "eval-only")
    assert _total(rows, "train/steps") == 0
    assert _total(rows, "train/productive") == 0
    assert any("eval/loss" in r for r in rows) and any("test/loss_step" in r for r in rows)


def test_fabric_logs_each_value_once_at_its_step_beside_the_loops_steps_or_alone(tmp_path: Path) -> None:
    """Fabric with `OtelTrainLogger`: alone, each `fabric.log` is a step (one without `step=` the
    next one), a nested `log_dict` flattened, a bool counted and warned; with `ot.step` in the
    loop the logger marks none (each step counted once)."""
    from lightning.fabric import Fabric

    warned = log_messages()
    alone = OtelTrainLogger(run_name="fabric-alone", output_dir=str(tmp_path / "runs"), **QUIET_LOGGER)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[alone])
    for i in range(6):
        fabric.log("loss", float(i))  # no step: the next one
    fabric.log_dict({"losses": {"a": 1.0, "b": 2.0}, "flag": True}, step=6)
    ot.shutdown()
    rows = _rows(tmp_path / "runs" / "fabric-alone")
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == [
        (i, float(i)) for i in range(6)
    ]
    assert [(r["step"], r["losses/a"], r["losses/b"]) for r in rows if "losses/a" in r] == [(6, 1.0, 2.0)]
    assert _total(rows, "otel_train/dropped/invalid_type") == 1 and any("flag" in m for m in warned), warned
    assert _total(rows, "train/steps") == 7

    beside = OtelTrainLogger(run_name="fabric-steps", output_dir=str(tmp_path / "runs"), log_interval=5,
                             **QUIET_LOGGER)  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[beside])
    for i in range(10):
        with ot.step(i):
            fabric.log("loss", float(i), step=i)
    ot.shutdown()
    rows = _rows(tmp_path / "runs" / "fabric-steps")
    assert _total(rows, "train/steps") == 10
    assert [r["step"] for r in rows if r.get("train/steps")] == [4, 9]  # flushed every 5 steps


@pytest.mark.parametrize("fails", [False, True], ids=["fit-ends", "fit-raises"])
def test_the_users_own_run_idles_after_the_fit_with_the_callback_alone(tmp_path: Path, fails: bool) -> None:
    """`ot.init()` first, the callback alone: when the fit ends (or raises, the user handling it)
    the run idles, its last steps flushed: no stall however long the pause after it."""

    class FailsAt3(TinyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if fails and self.global_step == 3:
                raise RuntimeError("planted")
            return super().training_step(batch, batch_idx)

    ot.init(run_name="mine", output_dir=str(tmp_path / "runs"), stall_timeout_s=0.5, **QUIET_LOGGER)
    session = current_session()
    trainer = _trainer(tmp_path, logger=False, callbacks=[OtelTrainCallback()])
    try:
        trainer.fit(FailsAt3(), _loader(64))
    except RuntimeError:
        assert fails
    assert current_session() is session
    assert session.last_step()[1] is None  # idle: the watchdog judges nothing until the next step
    time.sleep(1.5)  # three stall timeouts
    ot.shutdown()
    assert run_events(tmp_path / "runs" / "mine", event="stall") == []


def test_lightnings_step_and_epoch_suffixes_and_slash_names_reach_the_catalogue(tmp_path: Path) -> None:
    """`self.log("train_loss", on_step=True, on_epoch=True)` logs `train_loss_step` and
    `train_loss_epoch`: the per-step one is the loss (its NaN raises `nonfinite`); `val/loss` is the
    eval loss, as `val_loss` is."""

    class Suffixed(TinyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            shown = torch.tensor(float("nan")) if self.global_step == 3 else loss.detach()
            self.log("train_loss", shown, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y))

    logger = OtelTrainLogger(run_name="suffixes", output_dir=str(tmp_path / "runs"), **QUIET_LOGGER)
    trainer = _trainer(tmp_path, logger=logger)
    trainer.fit(Suffixed(), _loader(32), _loader(8))  # epochs of 4 steps: an epoch mean at 3
    ot.shutdown()
    run_dir = tmp_path / "runs" / "suffixes"
    keys = set().union(*_rows(run_dir))
    assert {"train/loss", "train/train_loss_epoch", "eval/loss"} <= keys
    assert "train/train_loss_step" not in keys and "val/loss" not in keys
    assert run_events(run_dir, event="nonfinite")  # the health checks read the per-step loss


def test_a_callbacks_run_name_beside_a_logger_is_said_to_go_unused(tmp_path: Path) -> None:
    """The logger names the run and its directory: a callback's `run_name`/`output_dir` would be
    dropped silently, so a warning says where to give them."""
    warned = log_messages()
    callback = OtelTrainCallback(run_name="cbname", output_dir=str(tmp_path / "cbdir"))
    _quick_trainer(_quiet(run_name="logged"), callbacks=[callback]).fit(_boring())
    ot.shutdown()
    assert (tmp_path / "runs" / "logged").is_dir() and not (tmp_path / "cbdir").exists()
    said = [m for m in warned if "OtelTrainCallback(output_dir=..., run_name=...) is not used" in m]
    assert len(said) == 1 and "Give output_dir and run_name to OtelTrainLogger" in said[0], warned
