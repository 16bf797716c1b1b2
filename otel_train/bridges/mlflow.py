"""MLflow bridge through `MlflowClient` (no global `mlflow.start_run` state, safe on a worker thread).
Design: docs/design/bridges.md#mlflow."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train.bridges.base import Sink, flatten_params, histogram_bins
from otel_train.bridges.errors import BridgeImportError, ensure_writable_dir, require_packages
from otel_train.redaction import redact_url
from otel_train.run_directory import RunFiles

logger = logging.getLogger("otel_train")

MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
_BAD_CHARS = re.compile(r"[^/\w.\- ]")  # MLflow's set minus ':' (rejected on Windows)
RUN_KEY_TAG = "otel_train.run_id"  # the MLflow run's otel_train run id: the run a resume continues


def warn_if_user_run_active() -> None:
    """In the training process, at init: warn that a user's active MLflow run is not the bridge's,
    unless `MLFLOW_RUN_ID` names it (the bridge then logs into it too). Never imports mlflow."""
    mlflow = sys.modules.get("mlflow")
    active_run = getattr(mlflow, "active_run", None) if mlflow is not None else None
    run = active_run() if active_run is not None else None
    if run is None:
        return
    run_id = run.info.run_id
    if os.environ.get("MLFLOW_RUN_ID", "").strip() == run_id:
        return
    logger.warning(
        "otel_train: an MLflow run is active in this process (%s); otel_train's MLflow bridge logs to "
        "its own run (in the bridge process), not into yours. To log into yours, set MLFLOW_RUN_ID=%s "
        "(and the same MLFLOW_TRACKING_URI) before ot.init; or pass mlflow=False to keep only yours.",
        run_id, run_id,
    )  # fmt: skip


def sanitize_key(key: str) -> str:
    """A key MLflow accepts: allowed characters only, no empty/`.`/`..` path parts, <= 250 chars."""
    key = _BAD_CHARS.sub("_", key)
    parts = [p for p in key.split("/") if p not in ("", ".", "..")]
    return "/".join(parts)[:MAX_KEY_LENGTH].rstrip("/") or "_"


def default_tracking_uri(run_dir: Path) -> str:
    return "sqlite:///" + str((RunFiles(run_dir).mlflow / "mlflow.db").resolve())


def seed_local_store(db_path: Path, artifact_root: Path) -> bool:
    """Start a new local store from a cached, already migrated empty database (design page, #mlflow).
    False if not done: any failure leaves `db_path` absent, and MLflow then migrates it itself."""
    if db_path.exists():
        return False
    import shutil
    import sqlite3
    import threading

    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "otel_train"
    template = cache / f"mlflow-{mlflow.__version__}-empty.db"
    try:
        if not template.is_file():
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            template.parent.mkdir(parents=True, exist_ok=True)
            tmp = template.with_name(f".{template.name}.{os.getpid()}-{threading.get_ident()}.tmp")
            store = SqlAlchemyStore("sqlite:///" + str(tmp), str(template.parent / "unused-artifacts"))
            store.engine.dispose()
            os.replace(tmp, template)  # atomic: concurrent runs see a complete template or none
        partial = db_path.with_name(db_path.name + ".partial")
        shutil.copyfile(template, partial)
        with sqlite3.connect(partial) as conn:  # MLflow's "Default" experiment: artifacts in this run dir
            conn.execute(
                "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                ((artifact_root / "0").resolve().as_uri(),),
            )
        conn.close()
        os.replace(partial, db_path)
        return True
    except Exception as exc:  # MLflow's store (SQLAlchemy and its migrations) and sqlite
        logger.debug("otel_train: MLflow store template not used (%s); MLflow will migrate a new store", exc)
        with contextlib.suppress(OSError):
            db_path.with_name(db_path.name + ".partial").unlink()
        return False


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(
        self,
        run_dir: Path | str,
        tracking_uri: str | None,
        experiment: str | None,
        run_name: str,
        run_key: str | None = None,
        experiment_id: str | None = None,
        user_run_id: str | None = None,
    ) -> None:
        """`experiment` by name, else `experiment_id` (MLFLOW_EXPERIMENT_ID: it must exist);
        `user_run_id` (MLFLOW_RUN_ID): the existing run to log into, in whatever experiment it is."""
        require_packages("MLflow", "mlflow", "mlflow")
        self.run_dir = Path(run_dir)
        self._store = RunFiles(self.run_dir).mlflow  # the local store's, without a tracking URI
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.local_store = not uri
        if self.local_store:
            ensure_writable_dir(self._store, "MLflow")
        self.tracking_uri = uri or default_tracking_uri(self.run_dir)
        if not self.local_store:
            chosen = "mlflow_tracking_uri" if tracking_uri else "MLFLOW_TRACKING_URI"
            self.destination = f"tracking URI {redact_url(uri)}, from {chosen}"
        self.experiment = experiment
        self.experiment_id = experiment_id
        self.user_run_id = user_run_id
        self.run_name = run_name
        self.run_key = run_key  # the RUN_KEY_TAG of the MLflow run a resume continues
        self._logged_params: dict[str, str] = {}
        self._param_keys: dict[str, str] = {}  # MLflow param name -> the first hyperparameter key given it
        self._collisions: set[tuple[str, str]] = set()  # (name, a later key given it), warned once
        self._client: Any = None
        self.run_id: str | None = None
        self._closed = False

    def _ensure_run(self) -> Any:
        if self._client is not None:
            return self._client
        try:
            from mlflow import MlflowClient
        except ImportError as exc:
            raise BridgeImportError("MLflow", "mlflow", exc) from exc
        if self.local_store:
            seed_local_store(self._store / "mlflow.db", self._store / "artifacts")
        client = MlflowClient(tracking_uri=self.tracking_uri)
        if self.user_run_id:
            run = client.get_run(self.user_run_id)  # raises if there is no such run
            experiment_id = run.info.experiment_id
        else:
            experiment_id = self._experiment_id(client)
            run = self._run_to_resume(client, experiment_id)
        if run is not None:
            client.update_run(run.info.run_id, status="RUNNING")  # what mlflow.start_run(run_id) does
            # MLflow refuses to change a logged param: the resumed run's are known as logged.
            self._logged_params = dict(run.data.params)
        else:
            tags = {RUN_KEY_TAG: self.run_key} if self.run_key else None
            run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self._client, self.run_id = client, run.info.run_id
        return client

    def _run_to_resume(self, client: Any, experiment_id: str) -> Any:
        """The latest run of the experiment tagged with this run key, or None."""
        # MLflow's search filter has no escapes: a run id with both quote characters cannot be named
        quote = next((q for q in ("'", '"') if q not in (self.run_key or "")), None)
        if not self.run_key or quote is None:
            return None
        runs = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_KEY_TAG}` = {quote}{self.run_key}{quote}",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if runs and runs[0].data.tags.get(RUN_KEY_TAG) == self.run_key:
            return runs[0]
        return None

    def _experiment_id(self, client: Any) -> str:
        if self.experiment is None:  # MLFLOW_EXPERIMENT_ID, which MLflow too needs to exist
            return str(client.get_experiment(self.experiment_id).experiment_id)
        existing = client.get_experiment_by_name(self.experiment)
        if existing is not None:
            return str(existing.experiment_id)
        artifact_location = (self._store / "artifacts").resolve().as_uri() if self.local_store else None
        from mlflow.exceptions import MlflowException

        try:
            return str(client.create_experiment(self.experiment, artifact_location=artifact_location))
        except MlflowException:
            existing = client.get_experiment_by_name(self.experiment)  # another rank created it
            if existing is None:
                raise
            return str(existing.experiment_id)

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        client = self._ensure_run()
        timestamp = int(wall_time * 1000)
        metrics = [Metric(sanitize_key(k), float(v), timestamp, int(step)) for k, v in scalars.items()]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_BATCH], synchronous=True)

    def write_text(self, key: str, text: str, step: int) -> None:
        client = self._ensure_run()
        client.log_text(self.run_id, text, f"text/{sanitize_key(key)}/step_{step:09d}.md")

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        import numpy as np

        binned = histogram_bins(values)
        if binned is None:
            return
        array, counts, edges = binned
        with np.errstate(over="ignore", invalid="ignore"):  # values near the largest float
            mean, std = float(array.mean()), float(array.std())
        doc = {
            "key": key,
            "step": step,
            "count": int(array.size),
            "min": float(array.min()),
            "max": float(array.max()),
            # null where the sum overflowed: the file stays strict JSON (no Infinity, NaN)
            "mean": mean if math.isfinite(mean) else None,
            "std": std if math.isfinite(std) else None,
            "bin_edges": [float(e) for e in edges],
            "counts": [int(c) for c in counts],
        }
        client = self._ensure_run()
        client.log_dict(self.run_id, doc, f"histograms/{sanitize_key(key)}/step_{step:09d}.json")

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self._ensure_run()
        batch: list[Any] = []
        for key, value in flatten_params(params).items():
            name, text = sanitize_key(key), value[:MAX_PARAM_VALUE_LENGTH]
            previous = self._logged_params.get(name)
            first_key = self._param_keys.setdefault(name, key)
            if previous is None:
                self._logged_params[name] = text
                batch.append(Param(name, text))
            elif first_key != key and previous != text and (name, key) not in self._collisions:
                self._collisions.add((name, key))
                logger.warning(
                    "otel_train: hyperparameters %r and %r are both %r in MLflow (its names allow letters, "
                    "digits, spaces and _-./, up to 250 characters); MLflow keeps %r's value, hparams.json "
                    "has both.",
                    first_key, key, name, first_key,
                )  # fmt: skip
            elif previous != text:  # MLflow refuses to change a logged param
                logger.debug("otel_train: MLflow param %r cannot change; keeping %r", name, previous)
        for i in range(0, len(batch), PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=batch[i : i + PARAMS_PER_BATCH], synchronous=True)

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is None:
            return  # nothing was ever written: do not create an empty run
        status = "FAILED" if failed else "FINISHED"
        self._client.set_terminated(self.run_id, status=status, end_time=int(time.time() * 1000))
