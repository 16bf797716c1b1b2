"""Accelerate integration: `Accelerator(log_with=[OtelTrainTracker()])`.

`accelerator.init_trackers(project, config=...)` logs `config` as hyperparameters and
`accelerator.log({...}, step=...)` records the values. Accelerate calls trackers on the main
process only, so in a multi-process job call `ot.init()` on every rank (after creating the
`Accelerator`): starting a session runs collectives every rank must join, so the tracker never
starts one itself there; it warns once and forwards nothing until a session exists. In a single
process it starts the session lazily (keyword arguments are `ot.init()` settings, `Config` fields:
`OtelTrainTracker(run_name="x")`; the older `settings={...}` mapping still works) and `end_training()`
shuts down a session it started. Steps and timers still come from `ot.step` / `ot.timer` in your
loop: `accelerator.log` carries values, not timing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from accelerate.tracking import GeneralTracker

import otel_train as ot
from otel_train.integrations._common import (
    distributed_world,
    scalar_logs,
    settings_from_kwargs,
    start_session,
)

__all__ = ["OtelTrainTracker"]

log = logging.getLogger("otel_train")


class OtelTrainTracker(GeneralTracker):
    name = "otel_train"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, settings: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self._settings = settings_from_kwargs(settings, kwargs, type(self).__name__)
        self._owns_session = False
        self._warned = False

    @property
    def tracker(self) -> Any:
        """The otel_train session (Accelerate's handle to the underlying tracker)."""
        return ot.current_session()

    def start(self) -> None:
        self._ready()

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        if self._ready():
            ot.log_hyperparams(values)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        # **kwargs: Accelerate passes each tracker its own `log_kwargs` entry; none apply here.
        if self._ready():
            ot.log_metrics(scalar_logs(values))

    def finish(self) -> None:
        if self._owns_session:
            self._owns_session = False
            ot.shutdown()

    def _ready(self) -> bool:
        if ot.current_session() is not None:
            return True
        if distributed_world() > 1:
            if not self._warned:
                self._warned = True
                log.warning(
                    "otel_train: OtelTrainTracker found no session in a %d-process job and records "
                    "nothing: call ot.init() on every rank after creating the Accelerator.",
                    distributed_world(),
                )
            return False
        self._owns_session = start_session(self._settings)
        return True
