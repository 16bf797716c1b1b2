"""Ray and Ray Train: one run across the driver, the Ray Train controller and the workers.

`runtime_env(role)` carries the run to every actor, `init_worker()` starts a worker's session,
`ControllerCallback` records reports, failures and restarts in the controller.
How it works: docs/design/integrations.md#ray.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import otel_train as ot
from otel_train import adapters
from otel_train.config import env_name
from otel_train.config_loading import load_config
from otel_train.integrations._common import settings_from_kwargs, start_session, with_adopted
from otel_train.integrations.nemo_rl import MANY_NAMES, flatten_numbers, publish_reductions

log = logging.getLogger("otel_train")

try:  # the callback is a UserCallback when Ray Train is installed (Ray Train checks the type)
    from ray.train import UserCallback as _CallbackBase
except ImportError:  # pragma: no cover - ray is an optional extra
    _CallbackBase = object  # type: ignore[assignment,misc]

__all__ = ["ControllerCallback", "init_worker", "job_settings", "runtime_env"]

_ENDPOINTS = ("otlp_endpoint", "otlp_metrics_endpoint", "otlp_traces_endpoint", "otlp_logs_endpoint")
_driver_run: dict[str, str] = {}  # run id and name made once per driver when no session runs


def job_settings(role: str = "") -> dict[str, Any]:
    """The run's shared settings (run id, run name, output dir, OTLP endpoints, service name) and
    `role`: from the running session, else from this process's settings (environment, config file)
    with, in a Ray Tune trial, the trial's run (`_tune_trial_run`), else a run id and name made once
    for this driver (unless those settings name them)."""
    info = ot.run_info()
    if info is not None:
        source: Any = info
        run = {"run_id": info.run_id, "run_name": info.run_name}
    else:
        source = load_config()
        run = _tune_trial_run(source.run_id) or _driver_run_once(source.run_id, source.run_name)
    settings: dict[str, Any] = {
        **run,
        "output_dir": os.path.abspath(source.output_dir),
        **{name: _shareable(getattr(source, name), name) for name in _ENDPOINTS},
        "service_name": source.service_name,
    }
    settings = {k: v for k, v in settings.items() if v is not None}
    return {**settings, "role": role} if role else settings


def _driver_run_once(run_id: str | None, run_name: str | None) -> dict[str, str]:
    """This driver's run: the given id and name, else made at the first call."""
    if not _driver_run:
        _driver_run.update(
            run_id=run_id or uuid.uuid4().hex[:12],
            run_name=run_name or time.strftime("ray-%Y%m%d-%H%M%S"),
        )
        # A session the driver starts later (NeMo RL makes its Logger after init_ray) joins it.
        os.environ.setdefault(env_name("run_id"), _driver_run["run_id"])
        os.environ.setdefault(env_name("run_name"), _driver_run["run_name"])
    return dict(_driver_run)


def _tune_trial_run(job_run_id: str | None) -> dict[str, str] | None:
    """The run of the Ray Tune trial this process runs, None outside one: one run per trial, as
    Tune's own logger callbacks make, so that concurrent trials do not share a run directory and
    a later trial is not taken for a restart of an earlier one. Run id `<job's run id>-<trial id>`
    (a trial id is unique only within its tuning job), run name the trial's name; the same for a
    trial that Tune starts again, which continues its run."""
    if "ray.tune" not in sys.modules:  # a trial has imported Tune; elsewhere it is not worth importing
        return None
    from ray import tune

    with warnings.catch_warnings():  # outside a trial Ray warns that it returns None
        warnings.simplefilter("ignore")
        context = tune.get_context()
        trial_id, trial_name = context.get_trial_id(), context.get_trial_name()
    if not trial_id:
        return None
    # A trial_name_creator may use any characters; a run name is part of a path
    run_name = re.sub(r"[^A-Za-z0-9_.:-]", "_", str(trial_name or trial_id)).lstrip("_.:-")[:128]
    return {
        "run_id": f"{job_run_id}-{trial_id}" if job_run_id else str(trial_id),
        "run_name": run_name or str(trial_id),
    }


# A query parameter named like a credential (`?api_key=`, `&access_token=`; not `tokens=`), in clear
# or already redacted by `ot.run_info()`.
_CREDENTIAL_PARAMETER = re.compile(
    r"(?i)[?&][^=&#]*(key|token(?!s|iz)|secret|passw|auth|credential|cookie)[^=&#]*="
)


def _shareable(url: str | None, setting: str) -> str | None:
    """An endpoint that may travel in a runtime_env (Ray shows runtime_envs in its dashboard and
    job info): not one with credentials in it (`user:password@`, `?api_key=...`), which is left
    out, warned (a redacted copy would reach the actors as a wrong endpoint)."""
    netloc = (url or "").partition("://")[2].partition("/")[0].partition("?")[0]
    if url is None or ("@" not in netloc and _CREDENTIAL_PARAMETER.search(url) is None):
        return url
    log.warning(
        "otel_train: %s carries credentials (user:password@ or a key in its query); it is not copied "
        "into the Ray runtime_env, which Ray shows in its dashboard. Set OTEL_TRAIN_OTLP_ENDPOINT "
        "(and headers) on the workers from a secret instead.",
        setting,
    )
    return None


def runtime_env(role: str, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`base` (a Ray runtime_env, default empty) with `env_vars` carrying `job_settings(role)` as
    OTEL_TRAIN_* variables: every actor or task started with it joins this run in `role`."""
    env = dict(base or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars.update({env_name(k): str(v) for k, v in job_settings(role).items()})
    env["env_vars"] = env_vars
    return env


def init_worker(settings: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """In a Ray Train worker: `ot.init()` with Ray Train's local rank and local world size (Ray
    Train sets no LOCAL_RANK; the rank and world size come from its torch process group). The run
    is the trainer's `ControllerCallback`'s where it has one (in a Ray Tune trial, the trial's run),
    else the environment's (`runtime_env`), as are the endpoints and role, unless given here."""
    from ray import train

    context = train.get_context()
    os.environ.setdefault("LOCAL_RANK", str(context.get_local_rank()))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(context.get_local_world_size()))
    os.environ.setdefault("GROUP_RANK", str(context.get_node_rank()))
    return ot.init(**{**_controller_run(), **settings_from_kwargs(settings, kwargs, "init_worker")})


def _controller_run() -> dict[str, Any]:
    """The run id and name of this Ray Train run's `ControllerCallback`, {} without one. Ray Train
    copies the RunConfig, callbacks included, to every worker; the workers' runtime_env names the
    job's run, which is not the controller's in a Ray Tune trial (`_tune_trial_run`)."""
    try:  # Ray Train v2's internals (Ray pinned; v1, RAY_TRAIN_V2_ENABLED=0, has none of it)
        from ray.train.v2._internal.execution.context import get_train_context

        run_config = get_train_context().train_run_context.run_config
    except (ImportError, AttributeError, RuntimeError) as exc:
        log.debug("otel_train: no ControllerCallback's run read in this worker (%s)", exc)
        return {}
    for callback in run_config.callbacks or []:
        if isinstance(callback, ControllerCallback):
            return {name: callback.settings[name] for name in ("run_id", "run_name")}
    return {}


class ControllerCallback(_CallbackBase):  # type: ignore[misc,valid-type]
    """A `ray.train.UserCallback` for the Ray Train controller (docs/design/integrations.md#ray). Made on
    the driver (or in a Ray Tune trial), where it captures the run (`job_settings`); pickled into the
    controller actor, where it starts a session with role `role` (default `controller`) at its first
    call; `init_worker()` reads its run from the copy Ray Train gives every worker."""

    def __init__(self, settings: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        merged = settings_from_kwargs(settings, kwargs, "ControllerCallback")
        role = str(merged.pop("role", "controller"))
        # A flush per report: reports are few, and the controller actor may end without shutdown.
        self.settings = with_adopted(
            {"log_interval": 1, **job_settings(role), **merged}, {"max_metric_names": MANY_NAMES}
        )
        self._step = -1  # the report's index: steps count from 0, as the console's "step N" expects
        self._last_report_ns: int | None = None
        self._failed_ns: int | None = None

    def _start(self) -> None:
        if adapters.current_run() is None:
            start_session(self.settings)
            self._last_report_ns = time.perf_counter_ns()

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        self._start()
        began = self._last_report_ns
        if self._failed_ns is not None:
            # The restart (failure to this report) is a span between steps, badput "other": a step
            # begun at the last report would hold it, and count it productive.
            ot.span("ray_train_restart").start(at_ns=self._failed_ns).stop()
            ot.event("worker_group_restart", "the worker group reported again after a failure", {})
            self._failed_ns, began = None, time.perf_counter_ns()
        # Read after `began`: the next step begins here, after this one (a step begun at or before
        # another is taken as its outer step, and the inner one dropped).
        now = time.perf_counter_ns()
        self._step += 1
        adapters.begin_step(self._step, start_ns=began)
        per_name: dict[str, list[float]] = {}
        for worker_metrics in metrics:
            for name, value in flatten_numbers(worker_metrics).items():
                per_name.setdefault(name, []).append(value)
        for name, values in per_name.items():
            publish_reductions(f"ray_train/{name}", values)
        if checkpoint is not None:
            ot.log_text("ray_train_checkpoint", str(getattr(checkpoint, "path", checkpoint)), self._step)
        adapters.end_step()
        self._last_report_ns = now

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self._start()
        self._failed_ns = time.perf_counter_ns()
        for rank, exc in sorted(worker_exceptions.items()):
            attributes: dict[str, str | int] = {"worker.rank": int(rank), "error.type": type(exc).__name__}
            ot.event(
                "worker_failure", f"Ray Train worker {rank} failed: {type(exc).__name__}: {exc}", attributes
            )
