"""Accelerate's tracker contract, with OtelTrainTracker in the flows.

Follows huggingface/accelerate 1.15.0 (the installed version), tests/test_tracking.py as shipped
in its PyPI sdist: the same cases and what each asserts, written here in our own words (helpers,
trackers and tests are ours, not copies). Every flow runs with upstream's kind of tracker alone
(the control) and with OtelTrainTracker beside it, and must come out the same for upstream's
tracker. What each test here mirrors:

- CustomTrackerTestCase: test_init_trackers -> test_config_reaches_every_tracker; test_log ->
  test_logged_values_reach_every_tracker; test_init_trackers_none_kwargs ->
  test_init_trackers_takes_none_kwargs; test_log_none_kwargs -> test_log_takes_none_kwargs.
- RegisterTrackerClassTest: test_register_and_use_by_name -> test_a_registered_class_is_made_by_name;
  test_register_invalid_class_raises -> test_registering_a_non_tracker_fails;
  test_register_overwrite_warns -> test_registering_a_name_twice_warns;
  test_register_requires_logging_directory -> test_a_tracker_needing_a_directory_needs_project_dir.
- TrackerDeferredInitializationTest: test_tensorboard_deferred_init, test_wandb_deferred_init,
  test_mlflow_deferred_init -> test_making_a_tracker_sets_up_no_distributed_state[tensorboard,
  wandb, mlflow].

Our additions (beside upstream's cases, marked `# otel_train:`): OtelTrainTracker as a second
tracker in the custom-tracker flows, registered by name, without a logging directory, and made
before the Accelerator; what it wrote is read back from its run directory.

Left out: the per-backend suites (TensorBoard/W&B/MLflow/Comet/ClearML/SwanLab/DVCLive logging
details) test those backends, not the tracker contract; Comet, ClearML, SwanLab, DVCLive, Aim and
Trackio are not installed. Upstream gates its whole deferred-initialisation class on DVCLive (for a
mock of it); here that gate is dropped so the TensorBoard, W&B and MLflow cases run.
Nothing here needs a GPU, the Hub or the network (W&B runs offline: tests/conftest.py).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.tracking import (
    LOGGER_TYPE_TO_CLASS,
    GeneralTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    register_tracker_class,
)

import otel_train as ot
from otel_train.integrations.accelerate import OtelTrainTracker
from otel_train.testing import current_session

# otel_train: the two arms of each custom-tracker flow
ARMS = ["upstream", "with_otel_train"]
# otel_train: our tracker's settings here: no pull endpoint, no console, no hardware sampling; its
# run dir goes under the test's tmp dir (OTEL_TRAIN_OUTPUT_DIR, tests/conftest.py)
QUIET = {"prometheus_port": 0, "verbosity": 0, "hardware": False}

# The config and the values upstream's flows send, and the CSV columns its custom tracker writes.
CONFIG = {"num_iterations": 12, "learning_rate": 1e-2, "some_boolean": False, "some_string": "some_value"}
REGISTERED_CONFIG = {"num_iterations": 12, "learning_rate": 0.01}
VALUES = {"total_loss": 0.1, "iteration": 1, "my_text": "some_value"}
COLUMNS = (
    "total_loss",
    "iteration",
    "my_text",
    "learning_rate",
    "num_iterations",
    "some_boolean",
    "some_string",
)


class CsvTracker(GeneralTracker):
    """A user's own tracker: one CSV row per call (the config, then each log), its file opened in
    `start()` as Accelerate's deferred start asks."""

    name = "csv_rows"
    requires_logging_directory: bool = False

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.path = folder / "log.csv"
        self._file: Any = None
        self._rows: csv.DictWriter[str] | None = None

    def start(self) -> None:
        if self._file is not None:
            return
        self._file = self.path.open("w", newline="")
        self._rows = csv.DictWriter(self._file, fieldnames=list(COLUMNS))
        self._rows.writeheader()

    @property
    def tracker(self) -> csv.DictWriter[str] | None:
        return self._rows

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self._write(values)

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        self._write(values)

    def finish(self) -> None:
        self._file.close()

    def _write(self, values: Mapping[str, Any]) -> None:
        assert self._rows is not None, "Accelerate called the tracker before start()"
        self._rows.writerow(dict(values))


def _first_csv_row(path: Path) -> dict[str, str]:
    with path.open(newline="") as fh:
        return next(csv.DictReader(fh))


def _csv_row(**cells: str) -> dict[str, str]:
    """A CSV row as read back: the cells given, every other column empty."""
    return {column: cells.pop(column, "") for column in COLUMNS} | cells


def _trackers(arm: str, folder: Path) -> list[GeneralTracker]:
    folder.mkdir(exist_ok=True)
    trackers: list[GeneralTracker] = [CsvTracker(folder)]
    if arm == "with_otel_train":  # otel_train: ours beside the user's tracker
        trackers.append(OtelTrainTracker(**QUIET))
    return trackers


def _run_dir() -> tuple[list[dict[str, Any]], Any]:
    """otel_train: the one run dir a test wrote, read back: its JSONL rows and hparams.json."""
    (run_dir,) = Path(os.environ["OTEL_TRAIN_OUTPUT_DIR"]).iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    hparams = run_dir / "hparams.json"
    return rows, json.loads(hparams.read_text()) if hparams.exists() else None


# --- a user's own tracker (CustomTrackerTestCase) ----------------------------------------------------
@pytest.mark.parametrize("arm", ARMS)
def test_config_reaches_every_tracker(tmp_path: Path, arm: str) -> None:
    acc = Accelerator(log_with=_trackers(arm, tmp_path / "csv"))
    acc.init_trackers("Some name", dict(CONFIG))
    acc.end_training()
    # the config is the user's tracker's first row (the bool written as "False")
    assert _first_csv_row(tmp_path / "csv" / "log.csv") == _csv_row(
        learning_rate="0.01", num_iterations="12", some_boolean="False", some_string="some_value"
    )
    if arm == "with_otel_train":  # otel_train: the same config as our run's hyperparameters
        assert current_session() is None  # end_training ended the session the tracker started
        assert _run_dir()[1] == CONFIG


@pytest.mark.parametrize("arm", ARMS)
def test_logged_values_reach_every_tracker(tmp_path: Path, arm: str) -> None:
    acc = Accelerator(log_with=_trackers(arm, tmp_path / "csv"))
    acc.init_trackers("Some name")
    acc.log(dict(VALUES), step=0)
    acc.end_training()
    assert _first_csv_row(tmp_path / "csv" / "log.csv") == _csv_row(
        total_loss="0.1", iteration="1", my_text="some_value"
    )
    if arm == "with_otel_train":  # otel_train: the numbers under step 0 in our run dir, the text as text
        (stepped,) = [row for row in _run_dir()[0] if "train/total_loss" in row]
        assert (stepped["step"], stepped["train/total_loss"], stepped["train/iteration"]) == (0, 0.1, 1)
        assert not [key for key in stepped if "my_text" in key]
        (run_dir,) = Path(os.environ["OTEL_TRAIN_OUTPUT_DIR"]).iterdir()
        texts = [json.loads(line) for line in (run_dir / "text.jsonl").read_text().splitlines()]
        assert [(t["key"], t["text"], t["step"]) for t in texts] == [("my_text", "some_value", 0)]


@pytest.mark.parametrize("arm", ARMS)
def test_init_trackers_takes_none_kwargs(tmp_path: Path, arm: str) -> None:
    """`init_trackers(..., init_kwargs=None)` raises nothing."""
    acc = Accelerator(log_with=_trackers(arm, tmp_path / "csv"))
    acc.init_trackers("Some name", init_kwargs=None)
    acc.end_training()
    assert (tmp_path / "csv" / "log.csv").exists()  # the user's tracker was started


@pytest.mark.parametrize("arm", ARMS)
def test_log_takes_none_kwargs(tmp_path: Path, arm: str) -> None:
    """`log(..., log_kwargs=None)` raises nothing."""
    acc = Accelerator(log_with=_trackers(arm, tmp_path / "csv"))
    acc.init_trackers("Some name")
    acc.log({"total_loss": 0.1}, step=0, log_kwargs=None)
    acc.end_training()
    assert _first_csv_row(tmp_path / "csv" / "log.csv")["total_loss"] == "0.1"


# --- trackers registered by name (RegisterTrackerClassTest) ------------------------------------------
class NamedTracker(GeneralTracker):
    """Made by Accelerate as the built-in trackers are, `cls(project_name, **init_kwargs)`; keeps
    what it was given."""

    name = "kept_in_memory"
    requires_logging_directory: bool = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.config: dict[str, Any] = {}
        self.values: dict[str, Any] = {}

    @property
    def tracker(self) -> NamedTracker:
        return self

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.config |= values

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.values |= values


class DirectoryTracker(GeneralTracker):
    """A registered tracker that needs Accelerate's logging directory (`project_dir`)."""

    name = "wants_a_directory"
    requires_logging_directory: bool = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir: str = logging_dir

    @property
    def tracker(self) -> DirectoryTracker:
        return self


@pytest.fixture
def registry() -> Iterator[None]:
    """Accelerate's registry of tracker names as it was before the test (it is process-wide)."""
    before = dict(LOGGER_TYPE_TO_CLASS)
    yield
    for added in LOGGER_TYPE_TO_CLASS.keys() - before.keys():
        del LOGGER_TYPE_TO_CLASS[added]
    LOGGER_TYPE_TO_CLASS.update(before)


def test_a_registered_class_is_made_by_name(registry: None) -> None:
    register_tracker_class(NamedTracker)
    assert LOGGER_TYPE_TO_CLASS[NamedTracker.name] is NamedTracker
    acc = Accelerator(log_with=NamedTracker.name)
    config = dict(REGISTERED_CONFIG)
    acc.init_trackers("some_project", config)
    acc.log({"total_loss": 0.1}, step=0)
    made = acc.get_tracker(NamedTracker.name)
    acc.end_training()
    assert isinstance(made, NamedTracker)
    assert (made.config, made.values) == (config, {"total_loss": 0.1})


def test_otel_train_registered_is_made_by_name(registry: None) -> None:
    """otel_train: the case above with our tracker, configured through init_kwargs."""
    register_tracker_class(OtelTrainTracker)
    assert LOGGER_TYPE_TO_CLASS[OtelTrainTracker.name] is OtelTrainTracker
    acc = Accelerator(log_with=OtelTrainTracker.name)
    config = dict(REGISTERED_CONFIG)
    acc.init_trackers("some_project", config, init_kwargs={"otel_train": QUIET})
    acc.log({"total_loss": 0.1}, step=0)
    made = acc.get_tracker(OtelTrainTracker.name)
    info = ot.run_info()
    acc.end_training()
    assert isinstance(made, OtelTrainTracker) and made.project_name == "some_project"
    assert info is not None and info.run_name.startswith("some_project-")
    rows, hparams = _run_dir()
    assert hparams == config
    assert [(row["step"], row["train/total_loss"]) for row in rows if "train/total_loss" in row] == [(0, 0.1)]


def test_registering_a_non_tracker_fails(registry: None) -> None:
    class NoName(GeneralTracker):
        requires_logging_directory: bool = False

    class NoDirectoryFlag(GeneralTracker):
        name = "without_the_flag"

    for not_a_tracker in (dict, NoName, NoDirectoryFlag):
        with pytest.raises(ValueError):
            register_tracker_class(not_a_tracker)


def test_registering_a_name_twice_warns(registry: None) -> None:
    register_tracker_class(NamedTracker)

    class SameName(GeneralTracker):
        name = NamedTracker.name
        requires_logging_directory: bool = False

    with pytest.warns(UserWarning, match=NamedTracker.name):
        register_tracker_class(SameName)


def test_a_tracker_needing_a_directory_needs_project_dir(tmp_path: Path, registry: None) -> None:
    register_tracker_class(DirectoryTracker)
    with pytest.raises(ValueError):
        Accelerator(log_with=DirectoryTracker.name)  # no project_dir
    acc = Accelerator(log_with=DirectoryTracker.name, project_dir=str(tmp_path))
    acc.init_trackers("dir_project")
    made = acc.get_tracker(DirectoryTracker.name)
    assert isinstance(made, DirectoryTracker)
    assert (made.run_name, made.logging_dir) == ("dir_project", str(tmp_path))
    acc.end_training()


def test_otel_train_needs_no_project_dir(registry: None) -> None:
    """otel_train: the other side of the case above: ours writes to its own run directory."""
    register_tracker_class(OtelTrainTracker)
    acc = Accelerator(log_with=OtelTrainTracker.name)  # no project_dir, no ValueError
    acc.init_trackers("dir_project", init_kwargs={"otel_train": QUIET})
    made = acc.get_tracker(OtelTrainTracker.name)
    assert isinstance(made, OtelTrainTracker) and made.project_name == "dir_project"
    acc.end_training()


# --- making a tracker starts nothing (TrackerDeferredInitializationTest) -----------------------------
def _tensorboard(folder: Path) -> GeneralTracker:
    pytest.importorskip("tensorboard")
    return TensorBoardTracker(run_name="deferred_tb", logging_dir=str(folder))


def _wandb(folder: Path) -> GeneralTracker:
    pytest.importorskip("wandb")
    return WandBTracker(run_name="deferred_wandb")


def _mlflow(folder: Path) -> GeneralTracker:
    pytest.importorskip("mlflow")
    return MLflowTracker(experiment_name="deferred_mlflow", logging_dir=str(folder))


def _otel_train(folder: Path) -> GeneralTracker:  # otel_train
    return OtelTrainTracker("deferred_otel_train", **QUIET)


@pytest.mark.parametrize(
    "make", [_tensorboard, _wandb, _mlflow, _otel_train], ids=["tensorboard", "wandb", "mlflow", "otel_train"]
)
def test_making_a_tracker_sets_up_no_distributed_state(
    tmp_path: Path, make: Callable[[Path], GeneralTracker]
) -> None:
    """A tracker made before the Accelerator leaves Accelerate's process state alone (it would set
    up torch.distributed before the Accelerator's own InitProcessGroupKwargs apply); the
    Accelerator then sets that state up."""
    AcceleratorState._reset_state(reset_partial_state=True)  # as a fresh process has them
    tracker = make(tmp_path)
    assert PartialState._shared_state == {}
    Accelerator(log_with=tracker)
    assert PartialState._shared_state != {}
    if isinstance(tracker, OtelTrainTracker):  # otel_train: nor does ours start a session
        assert current_session() is None
