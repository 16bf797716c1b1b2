"""The one table of bridges: what turns each on, where its sink class lives, what it is built with
and which package it needs. Its users, and how to add a bridge: docs/design/bridges.md#table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train.bridges.framing import plain
from otel_train.config import Config, config_as_dict
from otel_train.run_directory import RunFiles

BridgeSpec = tuple[str, str, dict[str, Any]]  # (module, sink class, plain keyword arguments)


@dataclass(frozen=True)
class BridgePlace:
    """Where this process's bridges write and what they call the run."""

    run_dir: Path
    run_name: str
    run_id: str
    rank: int  # this process's rank (its RunFiles)
    role: str = ""
    every_rank: bool = False  # bridge_all_ranks: each rank writes its own, named with its rank

    def with_role(self, name: str) -> str:
        return f"{name}-{self.role}" if self.role else name


@dataclass(frozen=True)
class Bridge:
    name: str  # the backend, as messages name it
    module: str
    sink_class: str
    enabled: Callable[[Config], bool]
    settings: Callable[[Config, BridgePlace], dict[str, Any]]  # the sink's keyword arguments
    extra: str  # pip install 'otel-train[<extra>]'
    distribution: str  # the PyPI distribution whose version env.json records
    import_names: tuple[str, ...]  # the modules `otel-train doctor` looks for


def _tensorboard(config: Config, place: BridgePlace) -> dict[str, Any]:
    return {"log_dir": str(RunFiles(place.run_dir, place.rank, place.role).tensorboard)}  # it names the run


def _wandb(config: Config, place: BridgePlace) -> dict[str, Any]:
    return {
        "run_dir": str(place.run_dir),
        # the run id the ranks agreed at init (the config's is None unless the user set one)
        "config_dict": plain({"otel_train": {**config_as_dict(config), "run_id": place.run_id}}),
        "project": config.wandb_project,
        "entity": config.wandb_entity,
        # with a role, its own W&B run (id and name carry the role), grouped under the run name
        "group": config.wandb_group or (place.run_name if place.role else None),
        "tags": list(config.wandb_tags),
        "mode": config.wandb_mode,
        "run_name": place.with_role(place.run_name),
        "run_id": place.with_role(place.run_id),
        "rank": place.rank if place.every_rank else None,
        "role": place.role,
    }


def _mlflow(config: Config, place: BridgePlace) -> dict[str, Any]:
    rank = f"-rank{place.rank}" if place.every_rank else ""
    return {
        "run_dir": str(place.run_dir),
        "tracking_uri": config.mlflow_tracking_uri,
        "experiment": config.mlflow_experiment,
        "run_name": place.with_role(place.run_name) + rank,
        # the MLflow run is tagged with it, and a resume of the same run id continues that run
        "run_key": place.with_role(place.run_id) + rank,
    }


BRIDGES: tuple[Bridge, ...] = (
    Bridge(
        "TensorBoard", "otel_train.bridges.tensorboard", "TensorBoardSink", lambda c: c.tensorboard,
        _tensorboard, "tensorboard", "tensorboard", ("tensorboard", "torch"),
    ),
    Bridge(
        "W&B", "otel_train.bridges.wandb", "WandbSink", lambda c: c.wandb,
        _wandb, "wandb", "wandb", ("wandb", "numpy"),
    ),
    Bridge(
        "MLflow", "otel_train.bridges.mlflow", "MlflowSink", lambda c: c.mlflow,
        _mlflow, "mlflow", "mlflow", ("mlflow",),
    ),
)  # fmt: skip


def specs(config: Config, place: BridgePlace) -> list[BridgeSpec]:
    """The switched-on bridges as the bridge process builds them, in table order."""
    return [(b.module, b.sink_class, b.settings(config, place)) for b in BRIDGES if b.enabled(config)]
