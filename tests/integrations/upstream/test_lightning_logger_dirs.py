"""Lightning's file-logger contract (names, versions, directories, finalize, values on disk) on OtelTrainLogger.

Follows the generic cases of github:Lightning-AI/pytorch-lightning tests/tests_pytorch/loggers/
test_tensorboard.py and test_csv.py at tag 2.6.5 (the installed lightning is 2.6.6; its loggers are
unchanged since 2.6.5), rewritten here, not copied. Each case runs on TensorBoardLogger and CSVLogger
(controls, their real files) beside OtelTrainLogger, whose values are read back from its run
directory (metrics.rank0.jsonl, hparams.json). Each docstring names the upstream tests mirrored;
differences are marked `# otel_train:`.

Where OtelTrainLogger differs by design:
- `version` is the otel_train run name, a str: an int n reads as "version_n", the folder name
  ModelCheckpoint makes of it (`as_dir_name`).
- hyperparameters go to hparams.json, never hparams.yaml (one file format for every integration).
- `finalize("success")` ends a stage, not the run (fit then test is one run; see test_lightning.py):
  the flush on finalize is checked with a failure status.
- `Trainer.log_dir` is the logger's log_dir only for Lightning's own TensorBoardLogger/CSVLogger
  (Lightning's code); for any other logger it is the save_dir.
Not mirrored: TensorBoard-only options (sub_dir, log_graph, default_hp_metric, omegaconf hparams),
CSV-only ones (flush_logs_every_n_steps, remote fsspec, column rewrites, overwrite warning).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers.readback import read_tensorboard
from lightning.pytorch import LightningModule
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

import otel_train as ot
from integrations.upstream._lightning_shim import (
    as_dir_name,
    first_filed,
    quiet,
    run_hparams,
    run_rows,
    short_trainer,
)
from otel_train.integrations.lightning import OtelTrainLogger

DIR_LOGGERS: list[type[Logger]] = [TensorBoardLogger, CSVLogger, OtelTrainLogger]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet(monkeypatch)


def _make(cls: type[Logger], save_dir: Path | str, **kwargs: Any) -> Any:
    if cls is OtelTrainLogger:
        return OtelTrainLogger(output_dir=str(save_dir), **kwargs)  # otel_train: its save_dir setting
    return cls(save_dir=str(save_dir), **kwargs)


def _written(logger: Any) -> None:
    """What the logger holds, on disk now (otel_train: its session's final flush)."""
    if isinstance(logger, OtelTrainLogger):
        ot.shutdown()
    else:
        logger.save()


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_next_free_version_is_taken(logger_class: type[Logger], tmp_path: Path) -> None:
    """Mirrors test_tensorboard_automatic_versioning / test_csv's test_automatic_versioning: one past
    the highest version_<n> folder; other folders do not count."""
    for folder in ("version_0", "version_1", "version_nonumber", "other"):
        (tmp_path / "exp" / folder).mkdir(parents=True)
    logger = _make(logger_class, tmp_path, name="exp")
    assert as_dir_name(logger.version) == "version_2"


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_int_version_is_kept(logger_class: type[Logger], tmp_path: Path) -> None:
    """Mirrors test_tensorboard_manual_versioning / test_manual_versioning: an explicit int version
    wins over the next free one."""
    for n in range(3):
        (tmp_path / "exp" / f"version_{n}").mkdir(parents=True)
    logger = _make(logger_class, tmp_path, name="exp", version=1)
    assert as_dir_name(logger.version) == "version_1"
    assert Path(logger.log_dir) == tmp_path / "exp" / "version_1"


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_str_version_names_the_only_folder(logger_class: type[Logger], tmp_path: Path) -> None:
    """Mirrors test_tensorboard_named_version / test_named_version: a string version is the folder
    name as given, the only one under save_dir/name, and holds the logged hyperparameters."""
    label = "2020-02-05-162402"
    (tmp_path / "exp").mkdir()
    logger = _make(logger_class, tmp_path, name="exp", version=label)
    logger.log_hyperparams(dict(a=1, b=2))
    _written(logger)
    assert logger.version == label
    assert os.listdir(tmp_path / "exp") == [label]
    assert os.listdir(tmp_path / "exp" / label)
    if logger_class is OtelTrainLogger:
        assert run_hparams(tmp_path / "exp" / label) == {"a": 1, "b": 2}
    else:
        assert yaml.safe_load((tmp_path / "exp" / label / "hparams.yaml").read_text()) == {"a": 1, "b": 2}


@pytest.mark.parametrize("name", [None, ""])
@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_no_name_means_no_subfolder(logger_class: type[Logger], name: str | None, tmp_path: Path) -> None:
    """Mirrors test_tensorboard_no_name / test_no_name: with name "" or None, root_dir is save_dir
    and the first version's folder sits right in it."""
    logger = _make(logger_class, tmp_path, name=name)
    logger.log_hyperparams({"a": 1})
    _written(logger)
    assert os.path.normpath(logger.root_dir) == str(tmp_path)
    assert any((tmp_path / "version_0").iterdir())


@pytest.mark.parametrize("step", [10, None])
@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_logged_values_are_in_the_files(logger_class: type[Logger], step: int | None, tmp_path: Path) -> None:
    """Mirrors test_tensorboard_log_metrics / test_csv's test_log_metrics: Python numbers and 0-d
    tensors, with and without a step, all readable back from the logger's own files."""
    logger = _make(logger_class, tmp_path)
    values = {"float": 0.3, "int": 1, "FloatTensor": torch.tensor(0.1), "IntTensor": torch.tensor(1)}
    logger.log_metrics(values, step)
    log_dir = logger.log_dir
    _written(logger)
    if logger_class is CSVLogger:
        lines = (Path(log_dir) / "metrics.csv").read_text().splitlines()
        assert len(lines) == 2 and all(key in lines[0] for key in values)
    elif logger_class is TensorBoardLogger:
        # otel_train: upstream only logs here; the event file is read back
        assert set(values) <= set(read_tensorboard(log_dir).scalars)
    else:
        rows = run_rows(log_dir)
        for key, value in values.items():
            filed = first_filed(rows, f"train/{key}")
            assert filed is not None and filed[1] == pytest.approx(float(value))
        if step is not None:
            assert first_filed(rows, "train/float") == (step, 0.3)


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_hyperparameters_of_common_types_are_in_the_files(logger_class: type[Logger], tmp_path: Path) -> None:
    """Mirrors test_tensorboard_log_hyperparams / test_csv's test_log_hyperparams: every name of a
    mixed-type mapping (nested dict, list, a class) is in the written hyperparameters."""
    logger = _make(logger_class, tmp_path)
    params = {
        "float": 0.3,
        "int": 1,
        "string": "abc",
        "bool": True,
        "dict": {"a": {"b": "c"}},  # nested
        "list": [1, 2, 3],
        "layer": torch.nn.BatchNorm1d,  # a class: its name
    }
    logger.log_hyperparams(params=params)
    log_dir = Path(logger.log_dir)
    _written(logger)
    if logger_class is OtelTrainLogger:
        written = run_hparams(log_dir)
        assert written["layer"] == "BatchNorm1d" and written["dict"] == {"a": {"b": "c"}}
    else:
        written = yaml.unsafe_load((log_dir / "hparams.yaml").read_text())
    assert set(params) <= set(written)


@pytest.mark.parametrize("logger_class", [TensorBoardLogger, OtelTrainLogger])
def test_finalize_flushes_only_what_was_started(logger_class: type[Logger], tmp_path: Path) -> None:
    """Mirrors test_tensorboard_finalize: finalize on an unused logger creates nothing; after a
    value was logged, finalize leaves it on disk (upstream: the writer is flushed and closed)."""
    idle = _make(logger_class, tmp_path / "idle")
    idle.finalize("failed")
    assert not (tmp_path / "idle").exists()
    if logger_class is OtelTrainLogger:
        assert ot.run_info() is None  # no session was started for it

    used = _make(logger_class, tmp_path / "used")
    used.log_metrics({"flush_me": 11.1}, step=0)
    used.finalize("failed")  # otel_train: "success" keeps the run open for a later test() (see the docstring)
    if logger_class is OtelTrainLogger:
        assert ot.run_info() is None
        assert first_filed(run_rows(used.log_dir), "train/flush_me") == (0, 11.1)
    else:
        assert read_tensorboard(used.log_dir).scalars["flush_me"] == [(0, pytest.approx(11.1))]


class _WithHyperparameters(BoringModel):
    def __init__(self, b1: float = 0.5, b2: float = 0.999) -> None:
        super().__init__()
        self.save_hyperparameters("b1", "b2")


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_fit_writes_hparams_and_checkpoint_in_log_dir_only(
    logger_class: type[Logger], tmp_path: Path
) -> None:
    """Mirrors test_tensorboard_hparams_reload and test_tensorboard_save_hparams_to_yaml_once: after
    a fit the model's hyperparameters (those two, nothing else) and one checkpoint are in the
    logger's log_dir, and no hyperparameter file lands in save_dir itself."""
    logger = _make(logger_class, tmp_path)
    trainer = short_trainer(tmp_path, logger)
    trainer.fit(_WithHyperparameters())
    log_dir = Path(logger.log_dir)
    if logger_class is OtelTrainLogger:
        # otel_train: Trainer.log_dir follows a logger's log_dir for Lightning's own loggers only
        assert logger.save_dir == trainer.log_dir
        _written(logger)
        assert run_hparams(log_dir) == {"b1": 0.5, "b2": 0.999}
        assert not (tmp_path / "hparams.json").exists()
    else:
        assert trainer.log_dir == str(log_dir)
        assert yaml.safe_load((log_dir / "hparams.yaml").read_text()) == {"b1": 0.5, "b2": 0.999}
    assert not (tmp_path / "hparams.yaml").exists()
    assert len(os.listdir(log_dir / "checkpoints")) == 1


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_relative_symlinked_save_dir_without_name(
    logger_class: type[Logger], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mirrors test_tensorboard_with_symlink: a relative save_dir that is a symlink, with no name,
    still yields a version."""
    (tmp_path / "real_logs").mkdir()
    monkeypatch.chdir(tmp_path)
    os.symlink("real_logs", "linked_logs")
    logger = _make(logger_class, os.path.join(".", "linked_logs"), name="")
    assert as_dir_name(logger.version) == "version_0"


class _LogsTrainAndTest(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx=batch_idx)
        self.log("train_loss", out["loss"])
        return out

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("test_loss", torch.tensor(3.0))
        return None


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_fit_then_test_share_one_version(logger_class: type[Logger], tmp_path: Path) -> None:
    """Mirrors test_csv's test_fit_csv_logger (a fit writes the metrics file), extended to a test
    after the fit: both stages' values land in the one version folder."""
    logger = _make(logger_class, tmp_path)
    model: LightningModule = _LogsTrainAndTest()
    trainer = short_trainer(tmp_path, logger, max_steps=2, log_every_n_steps=1)
    trainer.fit(model)
    trainer.test(model)
    log_dir = logger.log_dir
    _written(logger)
    assert [p.name for p in Path(logger.root_dir).iterdir() if p.name.startswith("version_")] == ["version_0"]
    if logger_class is OtelTrainLogger:
        rows = run_rows(log_dir)
        # Lightning's train_loss / test_loss under otel_train's catalogue names
        assert first_filed(rows, "train/loss") is not None and first_filed(rows, "test/loss") == (2, 3.0)
    elif logger_class is CSVLogger:
        header = (Path(log_dir) / "metrics.csv").read_text().splitlines()[0]
        assert "train_loss" in header and "test_loss" in header
    else:
        assert {"train_loss", "test_loss"} <= set(read_tensorboard(log_dir).scalars)
