"""Shared pieces of the Lightning suites under tests/integrations/upstream/ (written for this repo).

Lightning's own suites take their helpers from `tests_pytorch` (a conftest that swaps W&B, MLflow
and Comet for mocks, `RunIf`). Here the upstream loggers run on their real, installed backends
instead: TensorBoard and CSV files, an MLflow file store and W&B in offline mode, each one under
the test's tmp_path, beside OtelTrainLogger writing its run directory there too. The readers of
what each one wrote are in tests/helpers/readback.py (TensorBoard, W&B) and below (otel_train).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger

from otel_train.integrations.lightning import OtelTrainLogger

posix_only = pytest.mark.skipif(
    sys.platform == "win32", reason="ddp_spawn over gloo is run on POSIX only here"
)

# No pull endpoint, console lines or hardware sampling from otel_train; the MLflow control may
# use a local file store (the installed mlflow refuses one without this switch).
QUIET_ENV = {
    "OTEL_TRAIN_PROMETHEUS_PORT": "0",
    "OTEL_TRAIN_VERBOSITY": "0",
    "OTEL_TRAIN_HARDWARE": "false",
    "MLFLOW_ALLOW_FILE_STORE": "true",
}


def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in QUIET_ENV.items():
        monkeypatch.setenv(key, value)


def logger_under(cls: type[Logger], where: Path, **overrides: Any) -> Logger:
    """A `cls` logger whose files all land under `where`, with nothing sent over the network."""
    base: dict[str, Any]
    if issubclass(cls, OtelTrainLogger):
        base = {"output_dir": str(where)}
    elif issubclass(cls, MLFlowLogger):
        base = {"save_dir": str(where / "mlruns")}  # a file store: file:<where>/mlruns
    elif issubclass(cls, WandbLogger):
        base = {"save_dir": str(where), "offline": True}
    else:
        base = {"save_dir": str(where)}
    return cls(**{**base, **overrides})


def short_trainer(root: Path, logger: Any, **extra: Any) -> Trainer:
    """A Trainer that runs a step or two of BoringModel on the CPU, silently."""
    options: dict[str, Any] = {
        "default_root_dir": str(root),
        "logger": logger,
        "accelerator": "cpu",
        "devices": 1,
    }
    options.update(max_steps=1, limit_val_batches=1, limit_test_batches=1, num_sanity_val_steps=0)
    options.update(enable_progress_bar=False, enable_model_summary=False)
    options.update(extra)
    return Trainer(**options)


def as_dir_name(version: int | str | None) -> str:
    """How ModelCheckpoint turns a logger's version into a folder name: an int n is version_n."""
    return version if isinstance(version, str) else f"version_{version}"


def run_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows otel_train wrote to a run directory's metrics.rank0.jsonl, in order."""
    lines = (Path(run_dir) / "metrics.rank0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def run_hparams(run_dir: str | Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((Path(run_dir) / "hparams.json").read_text())
    return loaded


def first_filed(rows: list[dict[str, Any]], key: str) -> tuple[int, Any] | None:
    """(step, value) of the first row holding `key` (later rows repeat a gauge's latest value)."""
    for row in rows:
        if key in row:
            return int(row["step"]), row[key]
    return None
