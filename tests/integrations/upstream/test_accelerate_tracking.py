"""Ported from huggingface/accelerate, tests/test_tracking.py at commit 16cb6eb8 (main, version
1.15.0.dev0: the stored mirror has no v1.15.0 tag; the installed accelerate is 1.15.0, whose
tracking.py differs from that commit's only in docstrings and MLflow's nested_run parsing).

Ported: the custom-tracker cases (MyCustomTracker, CustomTrackerTestCase), the register-by-name
cases (MyRegisteredTracker, MyDirRegisteredTracker, RegisterTrackerClassTest) and the deferred
initialisation of the trackers that run here (TensorBoard, W&B offline, MLflow), each with
OtelTrainTracker beside upstream's own tracker. Changes from upstream are marked `# otel_train:`.
Left out: the per-backend suites (TensorBoard/W&B/MLflow/Comet/ClearML/SwanLab/DVCLive/Aim/Trackio
logging details) test those backends, not the tracker contract; Comet, ClearML, SwanLab, DVCLive,
Aim and Trackio are not installed (their deferred-init cases are skipped by upstream's own marks).
"""

from __future__ import annotations

# fmt: off
# ruff: noqa: UP045, SIM115, RUF012
import csv
import json
import logging
import os
import tempfile
import unittest
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip("accelerate")  # otel_train: accelerate is an optional extra here

from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.test_utils.testing import require_mlflow, require_tensorboard, require_wandb
from accelerate.tracking import (
    LOGGER_TYPE_TO_CLASS,
    GeneralTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    register_tracker_class,
)

import otel_train as ot  # otel_train
from otel_train.integrations.accelerate import OtelTrainTracker  # otel_train

logger = logging.getLogger(__name__)

# otel_train: our tracker's settings in these tests: no pull endpoint, no console, no hardware
# sampling; the run dir goes to the test's tmp dir (OTEL_TRAIN_OUTPUT_DIR, tests/conftest.py).
QUIET = {"prometheus_port": 0, "verbosity": 0, "hardware": False}


def _otel_rows() -> list:  # otel_train: the one run dir this test wrote, read back
    (run_dir,) = Path(os.environ["OTEL_TRAIN_OUTPUT_DIR"]).iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    hparams = run_dir / "hparams.json"
    return [rows, json.loads(hparams.read_text()) if hparams.exists() else None]


class MyCustomTracker(GeneralTracker):
    "Basic tracker that writes to a csv for testing"

    _col_names = [
        "total_loss",
        "iteration",
        "my_text",
        "learning_rate",
        "num_iterations",
        "some_boolean",
        "some_string",
    ]

    name = "my_custom_tracker"
    requires_logging_directory = False

    def __init__(self, dir: str, **kwargs):
        super().__init__(**kwargs)
        self.log_dir = dir
        self.f = None
        self.writer = None

    def start(self):
        if self.f is None:
            self.f = open(os.path.join(self.log_dir, "log.csv"), "w+")
            self.writer = csv.DictWriter(self.f, fieldnames=self._col_names)
            self.writer.writeheader()

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values: dict):
        logger.info("Call init")
        self.writer.writerow(values)

    def log(self, values: dict, step: Optional[int] = None):
        logger.info("Call log")
        self.writer.writerow(values)

    def finish(self):
        self.f.close()


@pytest.mark.parametrize("with_otel_train", [False, True], ids=["upstream", "otel_train"])  # otel_train
class TestCustomTracker:  # otel_train: pytest class (was unittest.TestCase) to take the parametrization
    def _trackers(self, d, with_otel_train):  # otel_train: upstream's tracker, ours beside it
        return [MyCustomTracker(d), OtelTrainTracker(**QUIET)] if with_otel_train else MyCustomTracker(d)

    def test_init_trackers(self, with_otel_train):
        with tempfile.TemporaryDirectory() as d:
            tracker = self._trackers(d, with_otel_train)  # otel_train
            accelerator = Accelerator(log_with=tracker)
            config = {"num_iterations": 12, "learning_rate": 1e-2, "some_boolean": False, "some_string": "some_value"}
            accelerator.init_trackers("Some name", config)
            accelerator.end_training()
            with open(f"{d}/log.csv") as f:
                data = csv.DictReader(f)
                data = next(data)
                truth = {
                    "total_loss": "",
                    "iteration": "",
                    "my_text": "",
                    "learning_rate": "0.01",
                    "num_iterations": "12",
                    "some_boolean": "False",
                    "some_string": "some_value",
                }
                assert data == truth
        if with_otel_train:  # otel_train: the same config, as hyperparameters in our run dir
            assert ot.current_session() is None  # end_training ended the session it started
            assert _otel_rows()[1] == config

    def test_log(self, with_otel_train):
        with tempfile.TemporaryDirectory() as d:
            tracker = self._trackers(d, with_otel_train)  # otel_train
            accelerator = Accelerator(log_with=tracker)
            accelerator.init_trackers("Some name")
            values = {"total_loss": 0.1, "iteration": 1, "my_text": "some_value"}
            accelerator.log(values, step=0)
            accelerator.end_training()
            with open(f"{d}/log.csv") as f:
                data = csv.DictReader(f)
                data = next(data)
                truth = {
                    "total_loss": "0.1",
                    "iteration": "1",
                    "my_text": "some_value",
                    "learning_rate": "",
                    "num_iterations": "",
                    "some_boolean": "",
                    "some_string": "",
                }
                assert data == truth
        if with_otel_train:  # otel_train: the numbers at step 0 in our run dir (text is left out)
            (row,) = [r for r in _otel_rows()[0] if r.get("train/steps")]
            assert (row["step"], row["train/total_loss"], row["train/iteration"]) == (0, 0.1, 1)
            assert not [key for key in row if "my_text" in key]

    def test_init_trackers_none_kwargs(self, with_otel_train):
        with tempfile.TemporaryDirectory() as d:
            tracker = self._trackers(d, with_otel_train)  # otel_train
            accelerator = Accelerator(log_with=tracker)
            # Passing init_kwargs=None must not raise AttributeError
            accelerator.init_trackers("Some name", init_kwargs=None)
            accelerator.end_training()

    def test_log_none_kwargs(self, with_otel_train):
        with tempfile.TemporaryDirectory() as d:
            tracker = self._trackers(d, with_otel_train)  # otel_train
            accelerator = Accelerator(log_with=tracker)
            accelerator.init_trackers("Some name")
            values = {"total_loss": 0.1}
            # Passing log_kwargs=None must not raise AttributeError
            accelerator.log(values, step=0, log_kwargs=None)
            accelerator.end_training()


class MyRegisteredTracker(GeneralTracker):
    "Minimal tracker following the built-in `(run_name, **kwargs)` convention, used to test class registration."

    name = "my_registered_tracker"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.config = {}
        self.values = {}

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict):
        self.config.update(values)

    def log(self, values: dict, step: Optional[int] = None, **kwargs):
        self.values.update(values)


class MyDirRegisteredTracker(GeneralTracker):
    "Registered tracker that requires a logging directory, used to test the logging-directory path."

    name = "my_dir_registered_tracker"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.logging_dir = logging_dir

    @property
    def tracker(self):
        return self


class RegisterTrackerClassTest(unittest.TestCase):
    def setUp(self):
        self._registry_snapshot = dict(LOGGER_TYPE_TO_CLASS)
        super().setUp()

    def tearDown(self):
        LOGGER_TYPE_TO_CLASS.clear()
        LOGGER_TYPE_TO_CLASS.update(self._registry_snapshot)
        super().tearDown()

    def test_register_and_use_by_name(self):
        register_tracker_class(MyRegisteredTracker)
        assert MyRegisteredTracker.name in LOGGER_TYPE_TO_CLASS

        accelerator = Accelerator(log_with=MyRegisteredTracker.name)
        config = {"num_iterations": 12, "learning_rate": 1e-2}
        accelerator.init_trackers("some_project", config)
        accelerator.log({"total_loss": 0.1}, step=0)
        tracker = accelerator.get_tracker(MyRegisteredTracker.name)
        accelerator.end_training()

        assert isinstance(tracker, MyRegisteredTracker)
        assert tracker.config == config
        assert tracker.values == {"total_loss": 0.1}

    def test_register_otel_train_and_use_by_name(self):  # otel_train: upstream's case, our tracker
        register_tracker_class(OtelTrainTracker)
        assert OtelTrainTracker.name in LOGGER_TYPE_TO_CLASS

        accelerator = Accelerator(log_with=OtelTrainTracker.name)
        config = {"num_iterations": 12, "learning_rate": 1e-2}
        accelerator.init_trackers("some_project", config, init_kwargs={"otel_train": QUIET})
        accelerator.log({"total_loss": 0.1}, step=0)
        tracker = accelerator.get_tracker(OtelTrainTracker.name)
        run_name = ot.run_info().run_name
        accelerator.end_training()

        assert isinstance(tracker, OtelTrainTracker)
        assert tracker.project_name == "some_project" and run_name.startswith("some_project-")
        rows, hparams = _otel_rows()
        assert hparams == config
        assert [(r["step"], r["train/total_loss"]) for r in rows if r.get("train/steps")] == [(0, 0.1)]

    def test_register_invalid_class_raises(self):
        with self.assertRaises(ValueError):
            register_tracker_class(dict)

        class NamelessTracker(GeneralTracker):
            requires_logging_directory = False

        with self.assertRaises(ValueError):
            register_tracker_class(NamelessTracker)

        class NoFlagTracker(GeneralTracker):
            name = "no_flag_tracker"

        with self.assertRaises(ValueError):
            register_tracker_class(NoFlagTracker)

    def test_register_overwrite_warns(self):
        register_tracker_class(MyRegisteredTracker)

        class ShadowTracker(GeneralTracker):
            name = MyRegisteredTracker.name
            requires_logging_directory = False

        with self.assertWarns(UserWarning) as cm:
            register_tracker_class(ShadowTracker)
        assert MyRegisteredTracker.name in str(cm.warning)

    def test_register_requires_logging_directory(self):
        register_tracker_class(MyDirRegisteredTracker)

        with self.assertRaises(ValueError):
            Accelerator(log_with=MyDirRegisteredTracker.name)

        with tempfile.TemporaryDirectory() as tmpdir:
            accelerator = Accelerator(log_with=MyDirRegisteredTracker.name, project_dir=tmpdir)
            accelerator.init_trackers("dir_project")
            tracker = accelerator.get_tracker(MyDirRegisteredTracker.name)
            assert isinstance(tracker, MyDirRegisteredTracker)
            assert tracker.run_name == "dir_project"
            assert tracker.logging_dir == tmpdir
            accelerator.end_training()

    def test_register_otel_train_needs_no_logging_directory(self):  # otel_train: the other branch
        register_tracker_class(OtelTrainTracker)
        accelerator = Accelerator(log_with=OtelTrainTracker.name)  # no project_dir: no ValueError
        accelerator.init_trackers("dir_project", init_kwargs={"otel_train": QUIET})
        assert accelerator.get_tracker(OtelTrainTracker.name).project_name == "dir_project"
        accelerator.end_training()


class TrackerDeferredInitializationTest(unittest.TestCase):
    """
    Tests tracker's deferred initialization via `start()` method, preventing
    premature `PartialState` access (and `torch.distributed` init) before
    `Accelerator` has configured the distributed environment, especially with
    `InitProcessGroupKwargs`.
    """

    @require_tensorboard
    def test_tensorboard_deferred_init(self):
        """Test that TensorBoard tracker initialization doesn't initialize distributed"""
        with tempfile.TemporaryDirectory() as temp_dir:
            PartialState._reset_state()
            tracker = TensorBoardTracker(run_name="test_tb", logging_dir=temp_dir)
            self.assertEqual(PartialState._shared_state, {})
            _ = Accelerator(log_with=tracker)
            self.assertNotEqual(PartialState._shared_state, {})

    @require_wandb
    def test_wandb_deferred_init(self):
        """Test that WandB tracker initialization doesn't initialize distributed"""
        PartialState._reset_state()
        tracker = WandBTracker(run_name="test_wandb")
        self.assertEqual(PartialState._shared_state, {})
        _ = Accelerator(log_with=tracker)
        self.assertNotEqual(PartialState._shared_state, {})

    @require_mlflow
    def test_mlflow_deferred_init(self):
        """Test that MLflow tracker initialization doesn't initialize distributed"""
        with tempfile.TemporaryDirectory() as temp_dir:
            PartialState._reset_state()
            tracker = MLflowTracker(experiment_name="test_mlflow", logging_dir=temp_dir)
            self.assertEqual(PartialState._shared_state, {})
            _ = Accelerator(log_with=tracker)
            self.assertNotEqual(PartialState._shared_state, {})

    def test_otel_train_deferred_init(self):  # otel_train: the same for ours (no session either)
        """Test that otel_train tracker initialization doesn't initialize distributed"""
        PartialState._reset_state()
        tracker = OtelTrainTracker("test_otel_train", **QUIET)
        self.assertEqual(PartialState._shared_state, {})
        _ = Accelerator(log_with=tracker)
        self.assertNotEqual(PartialState._shared_state, {})
        self.assertIsNone(ot.current_session())  # otel_train: the session starts at init_trackers
