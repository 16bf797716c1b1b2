"""Where ModelCheckpoint puts checkpoints when given no dirpath: from the loggers, with OtelTrainLogger.

Follows the dirpath cases of github:Lightning-AI/pytorch-lightning tests/tests_pytorch/
checkpointing/test_model_checkpoint.py at tag 2.6.5 (the installed lightning is 2.6.6, whose
ModelCheckpoint is unchanged since 2.6.5), rewritten here, not copied; the rule they pin is
ModelCheckpoint's `__resolve_ckpt_dir`: the first logger's save_dir/name/version/checkpoints (an
int version as version_<n>, a save_dir of None as the Trainer's default_root_dir), else
default_root_dir/checkpoints. Each case runs on TensorBoardLogger/CSVLogger (controls) beside
OtelTrainLogger, whose log_dir is its run directory. Differences are marked `# otel_train:`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from integrations.upstream._lightning_shim import as_dir_name, quiet, short_trainer
from otel_train.integrations.lightning import OtelTrainLogger

DIR_LOGGERS: list[type[Logger]] = [TensorBoardLogger, CSVLogger, OtelTrainLogger]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    quiet(monkeypatch)


def _make(cls: type[Logger], save_dir: Path, **kwargs: Any) -> Any:
    if cls is OtelTrainLogger:
        return OtelTrainLogger(output_dir=str(save_dir), **kwargs)  # otel_train: its save_dir setting
    return cls(save_dir=str(save_dir), **kwargs)


def _fit_and_get_dirpath(root: Path, logger: Any) -> str:
    trainer = short_trainer(root, logger)
    trainer.fit(model=BoringModel())
    assert trainer.checkpoint_callback is not None
    dirpath = trainer.checkpoint_callback.dirpath
    assert dirpath is not None
    assert os.listdir(dirpath) == ["epoch=0-step=1.ckpt"]  # the checkpoint is really there
    return str(dirpath)


def test_without_a_logger_checkpoints_go_to_default_root_dir(tmp_path: Path) -> None:
    """Mirrors test_model_checkpoint_with_non_string_input and test_default_checkpoint_behavior
    (logger=False): default_root_dir/checkpoints."""
    assert _fit_and_get_dirpath(tmp_path, False) == str(tmp_path / "checkpoints")


@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_checkpoints_go_to_the_loggers_version_folder(logger_class: type[Logger], tmp_path: Path) -> None:
    """The rule itself: save_dir/name/version/checkpoints, the same folder as the logger's log_dir
    (upstream: test_mlflow/test_wandb's checkpoint dirpath checks, per logger)."""
    logger = _make(logger_class, tmp_path / "logs", name="exp")
    dirpath = _fit_and_get_dirpath(tmp_path, logger)
    assert dirpath == os.path.join(logger.save_dir, logger.name, as_dir_name(logger.version), "checkpoints")
    assert dirpath == os.path.join(logger.log_dir, "checkpoints")
    assert dirpath == str(tmp_path / "logs" / "exp" / as_dir_name(logger.version) / "checkpoints")


@pytest.mark.parametrize(
    ("version", "folder"), [(None, "version_0"), (1, "version_1"), ("awesome", "awesome")]
)
@pytest.mark.parametrize("logger_class", DIR_LOGGERS)
def test_version_folder_of_the_checkpoints(
    logger_class: type[Logger], version: int | str | None, folder: str, tmp_path: Path
) -> None:
    """Mirrors test_model_checkpoint_path: "version_" is prefixed to an int version (or the
    automatic one) and not to a string one."""
    logger = _make(logger_class, tmp_path, version=version)
    assert Path(_fit_and_get_dirpath(tmp_path, logger)).parent.name == folder


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (OtelTrainLogger, TensorBoardLogger),
        (TensorBoardLogger, OtelTrainLogger),
        (CSVLogger, OtelTrainLogger),
    ],
)
def test_first_of_several_loggers_places_the_checkpoints(
    first: type[Logger], second: type[Logger], tmp_path: Path
) -> None:
    """With several loggers, the first one's version folder holds the checkpoints; the second's
    has none."""
    loggers = [_make(first, tmp_path / "one", name="a"), _make(second, tmp_path / "two", name="b")]
    dirpath = _fit_and_get_dirpath(tmp_path, loggers)
    assert dirpath == os.path.join(loggers[0].log_dir, "checkpoints")
    assert not os.path.exists(os.path.join(loggers[1].log_dir, "checkpoints"))


class _NoSaveDirLogger(Logger):
    """A logger that names no save_dir (the base class's None): ModelCheckpoint falls back to
    default_root_dir."""

    @property
    def name(self) -> str:
        return "ctl"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        return None

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None


def test_default_root_dir_stands_in_for_a_missing_save_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logger without a save_dir of its own: checkpoints under default_root_dir/name/version.
    Upstream's rule returns default_root_dir for a save_dir of None (the control); OtelTrainLogger
    without output_dir takes the Trainer's default_root_dir as its save_dir, to the same effect."""
    control = _NoSaveDirLogger()
    assert _fit_and_get_dirpath(tmp_path, control) == str(tmp_path / "ctl" / "version_0" / "checkpoints")

    # otel_train: the suite's conftest names an output dir through the environment; here none is set
    monkeypatch.delenv("OTEL_TRAIN_OUTPUT_DIR", raising=False)
    ours = OtelTrainLogger(name="ours")
    assert _fit_and_get_dirpath(tmp_path, ours) == str(tmp_path / "ours" / "version_0" / "checkpoints")
    assert ours.save_dir == str(tmp_path)
