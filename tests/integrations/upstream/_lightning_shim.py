"""Test helpers copied from Lightning for the ported Lightning suites (no `tests_pytorch` package here).

From github:Lightning-AI/pytorch-lightning at tag 2.6.5 (the newest tag in the mirror; the installed
lightning 2.6.6's loggers, ModelCheckpoint and Trainer sources are byte-identical to 2.6.5's):
`mlflow_mock`, `wandb_mock`, `comet_mock` from tests/tests_pytorch/loggers/conftest.py,
`_patch_comet_atexit` from tests/tests_pytorch/loggers/test_comet.py, `mock_mlflow_run_creation`
from tests/tests_pytorch/loggers/test_mlflow.py, and a `RunIf` reduced to the `skip_windows` it is used
with here (tests/tests_pytorch/helpers/runif.py). Import the fixtures into a test module to use them.
"""
# ruff: noqa

import sys
from types import ModuleType
from unittest.mock import MagicMock, Mock

import pytest


def RunIf(skip_windows: bool = False):  # otel_train: reduced to the one condition used
    return pytest.mark.skipif(skip_windows and sys.platform == "win32", reason="not on Windows")


def _patch_comet_atexit(monkeypatch):
    """Prevent comet logger from trying to print at exit, since pytest's stdout/stderr redirection breaks it."""
    import atexit

    monkeypatch.setattr(atexit, "register", lambda _: None)


def mock_mlflow_run_creation(logger, experiment_name=None, experiment_id=None, run_id=None):
    """Helper function to simulate mlflow client creating a new (or existing) experiment."""
    run = MagicMock()
    run.info.run_id = run_id
    logger._mlflow_client.get_experiment_by_name = MagicMock(return_value=experiment_name)
    logger._mlflow_client.create_experiment = MagicMock(return_value=experiment_id)
    logger._mlflow_client.create_run = MagicMock(return_value=run)
    return logger


@pytest.fixture
def mlflow_mock(monkeypatch):
    mlflow = ModuleType("mlflow")
    mlflow.set_tracking_uri = Mock()
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)

    mlflow_tracking = ModuleType("tracking")
    mlflow_tracking.MlflowClient = Mock()
    mlflow_tracking.artifact_utils = Mock()
    monkeypatch.setitem(sys.modules, "mlflow.tracking", mlflow_tracking)

    mlflow_entities = ModuleType("entities")
    mlflow_entities.Metric = Mock()
    mlflow_entities.Param = Mock()
    mlflow_entities.time = Mock()
    monkeypatch.setitem(sys.modules, "mlflow.entities", mlflow_entities)

    mlflow.tracking = mlflow_tracking
    mlflow.entities = mlflow_entities

    monkeypatch.setattr("lightning.pytorch.loggers.mlflow._MLFLOW_AVAILABLE", True)
    monkeypatch.setattr("lightning.pytorch.loggers.mlflow._MLFLOW_SYNCHRONOUS_AVAILABLE", True)
    return mlflow


@pytest.fixture
def wandb_mock(monkeypatch):
    class RunType:  # to make isinstance checks pass
        pass

    run_mock = Mock(
        spec=RunType,
        log=Mock(),
        config=Mock(),
        watch=Mock(),
        log_artifact=Mock(),
        use_artifact=Mock(),
        define_metric=Mock(),
        id="run_id",
    )

    wandb = ModuleType("wandb")
    wandb.init = Mock(return_value=run_mock)
    wandb.run = Mock()
    wandb.require = Mock()
    wandb.Api = Mock()
    wandb.Artifact = Mock()
    wandb.Image = Mock()
    wandb.Audio = Mock()
    wandb.Video = Mock()
    wandb.Table = Mock()
    monkeypatch.setitem(sys.modules, "wandb", wandb)

    wandb_sdk = ModuleType("sdk")
    monkeypatch.setitem(sys.modules, "wandb.sdk", wandb_sdk)

    wandb_sdk_lib = ModuleType("lib")
    wandb_sdk_lib.RunDisabled = RunType
    monkeypatch.setitem(sys.modules, "wandb.sdk.lib", wandb_sdk_lib)

    wandb_wandb_run = ModuleType("wandb_run")
    wandb_wandb_run.Run = RunType
    monkeypatch.setitem(sys.modules, "wandb.wandb_run", wandb_wandb_run)

    wandb.sdk = wandb_sdk
    wandb.sdk.lib = wandb_sdk_lib
    wandb.wandb_run = wandb_wandb_run

    monkeypatch.setattr("lightning.pytorch.loggers.wandb._WANDB_AVAILABLE", True)
    return wandb


@pytest.fixture
def comet_mock(monkeypatch):
    comet = ModuleType("comet_ml")
    monkeypatch.setitem(sys.modules, "comet_ml", comet)

    # to support dunder methods calling we will create a special mock
    comet_experiment = MagicMock(name="CommonExperiment")
    setattr(comet_experiment, "__internal_api__set_model_graph__", MagicMock())
    setattr(comet_experiment, "__internal_api__log_metrics__", MagicMock())
    setattr(comet_experiment, "__internal_api__log_parameters__", MagicMock())

    comet.Experiment = MagicMock(name="Experiment", return_value=comet_experiment)
    comet.ExistingExperiment = MagicMock(name="ExistingExperiment", return_value=comet_experiment)
    comet.OfflineExperiment = MagicMock(name="OfflineExperiment", return_value=comet_experiment)

    comet.ExperimentConfig = Mock()
    comet.start = Mock(name="comet_ml.start", return_value=comet.Experiment())
    comet.config = Mock()

    monkeypatch.setattr("lightning.pytorch.loggers.comet._COMET_AVAILABLE", True)
    return comet
