"""Lightning Trainer + OtelTrainLogger / OtelTrainCallback / the callbacks_factory entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import urllib.request

import torch
from helpers.ports import free_port
from helpers.readback import read_tensorboard
from lightning.pytorch import Callback, LightningModule, Trainer
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train.integrations.lightning import (
    ENV_SWITCH,
    OtelTrainCallback,
    OtelTrainLogger,
    callbacks_factory,
)

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


def _total(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r.get(key) or 0 for r in rows)


def test_logger_and_callback_together(tmp_path: Path) -> None:
    settings = {"run_name": "pl", "prometheus_port": 0, "verbosity": 0, "log_interval": 2, "hardware": False}
    trainer = _trainer(tmp_path, logger=OtelTrainLogger(settings), callbacks=[OtelTrainCallback(settings)])
    trainer.fit(TinyRegression(), _loader(64), _loader(8))
    assert ot.current_session() is None  # the integration started the session and ended it

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
    session = ot.current_session()
    assert session is not None
    callback = OtelTrainCallback(watch_every=2, tokens=lambda batch: batch[0].shape[0] * 10)
    trainer = _trainer(tmp_path, logger=False, callbacks=[callback])
    trainer.fit(TinyRegression(), _loader(64))
    assert ot.current_session() is session  # the user's own session stays up
    ot.shutdown()
    rows = _rows(session.run_dir)
    assert _total(rows, "train/steps") == MAX_STEPS
    assert any(k.startswith("grad_norm/") for r in rows for k in r)  # ot.watch per-layer norms
    # 4 rows per micro-batch x 10 "tokens" per row, 2 micro-batches per optimizer step
    assert _total(rows, "throughput/tokens") == MAX_STEPS * ACCUMULATE * 4 * 10


def test_logger_alone_starts_a_session_on_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "logger-only")
    trainer = _trainer(tmp_path, logger=OtelTrainLogger({"verbosity": 0, "hardware": False}))
    trainer.fit(TinyRegression(), _loader(64), _loader(8))
    assert ot.current_session() is None
    keys = set().union(*_rows(tmp_path / "runs" / "logger-only"))
    assert {"train/loss", "eval/loss"} <= keys


def test_logger_alone_records_every_logged_value_at_its_step(tmp_path: Path) -> None:
    """Issue #23: `self.log` every 5 of 40 steps with only the logger: each value at its step, in
    the run dir, a bridge (TensorBoard, read back with its own reader) and /metrics."""
    port = free_port()
    logger = OtelTrainLogger(run_name="alone", output_dir=str(tmp_path / "runs"), prometheus_port=port,
                             verbosity=0, hardware=False, tensorboard=True)  # fmt: skip
    scraped: dict[str, float] = {}

    class Scrape(Callback):  # the session is still up at train end; the logger ends it later
        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            scraped.update({s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples})

    trainer = Trainer(
        max_steps=40, log_every_n_steps=5, val_check_interval=20, num_sanity_val_steps=0, logger=logger,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1, default_root_dir=str(tmp_path), callbacks=[Scrape()],
    )  # fmt: skip
    trainer.fit(TinyRegression(), _loader(160), _loader(8))
    assert ot.current_session() is None
    assert scraped["train_loss"] > 0 and scraped["eval_loss"] > 0 and scraped["train_steps_total"] == 8
    tb = read_tensorboard(tmp_path / "runs" / "alone" / "tensorboard")
    assert sorted({step for step, _ in tb.scalars["train/loss"]}) == list(range(4, 40, 5))
    rows = _rows(tmp_path / "runs" / "alone")
    losses = {r["step"]: r["train/loss"] for r in rows if r.get("train/steps")}
    assert sorted(losses) == list(range(4, 40, 5))  # Lightning's steps, one logged step each
    assert len(set(losses.values())) == len(losses)  # each its own value, not one repeated
    assert _total(rows, "train/steps") == 8  # alone, the logger counts the logged steps
    evals = [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
    first_seen = {value: step for step, value in reversed(evals)}
    assert sorted(first_seen.values()) == [19, 39]  # both validations, each at the step it followed
    assert 0 < rows[-1]["train/goodput"] < 1


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
