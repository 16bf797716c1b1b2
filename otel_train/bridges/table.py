"""The one table of bridges: what turns each on, where its sink class lives, what it is built with
and which package it needs. Its users, and how to add a bridge: docs/design/bridges.md#table.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train.bridges.framing import plain
from otel_train.config import DEFAULT_PROJECT, Config, config_as_dict, wandb_project_from_env
from otel_train.run_directory import RunFiles

logger = logging.getLogger("otel_train")

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
    # W&B's own variables are adopted where otel_train has no setting of that name the user set
    # (an explicit wandb.init argument beats W&B's variable, as W&B documents; otel_train's defaults
    # must not). WANDB_RESUME=must is kept; any other value resumes by id ("allow"), since a
    # restarted bridge process must resume its own run.
    wandb_dir = os.environ.get("WANDB_DIR", "").strip()
    user_id = os.environ.get("WANDB_RUN_ID", "").strip()
    must = os.environ.get("WANDB_RESUME", "").strip().lower() == "must"
    return {
        "run_dir": str(place.run_dir),
        "wandb_dir": str(Path(wandb_dir).expanduser()) if wandb_dir else None,
        # the run id the ranks agreed at init (the config's is None unless the user set one)
        "config_dict": plain({"otel_train": {**config_as_dict(config), "run_id": place.run_id}}),
        "project": config.wandb_project or wandb_project_from_env(),
        "entity": config.wandb_entity,
        # with a role, its own W&B run (id and name carry the role), grouped under the run name
        "group": config.wandb_group or (place.run_name if place.role else None),
        "tags": list(config.wandb_tags),
        "mode": config.wandb_mode,
        "run_name": place.with_role(place.run_name),
        "run_id": place.with_role(user_id or place.run_id),
        "resume": "must" if must else "allow",
        "rank": place.rank if place.every_rank else None,
        "role": place.role,
    }


def _mlflow(config: Config, place: BridgePlace) -> dict[str, Any]:
    rank = f"-rank{place.rank}" if place.every_rank else ""
    # MLflow's own variables where the user set no mlflow_experiment, in MLflow's order (the name first)
    env_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip()
    env_id = os.environ.get("MLFLOW_EXPERIMENT_ID", "").strip()
    experiment: dict[str, str | None] = {"experiment": DEFAULT_PROJECT, "experiment_id": None}
    if config.mlflow_experiment:
        experiment["experiment"] = config.mlflow_experiment
    elif env_name:
        experiment["experiment"] = env_name
    elif env_id:
        experiment = {"experiment": None, "experiment_id": env_id}
    user_run = os.environ.get("MLFLOW_RUN_ID", "").strip()
    if user_run and (place.role or place.every_rank):
        # MLflow names its runs itself: one run id cannot be the several runs of roles or ranks
        logger.warning(
            "otel_train: MLFLOW_RUN_ID=%s is not used: with %s each has an MLflow run of its own.",
            user_run, "a role" if place.role else "bridge_all_ranks",
        )  # fmt: skip
        user_run = ""
    return {
        "run_dir": str(place.run_dir),
        "tracking_uri": config.mlflow_tracking_uri,
        **experiment,
        "user_run_id": user_run or None,
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
