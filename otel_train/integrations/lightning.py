"""PyTorch Lightning integration: a `Logger` and a `Callback`, usable together or alone.

    trainer = Trainer(logger=OtelTrainLogger(), callbacks=[OtelTrainCallback()])

`OtelTrainLogger` sends what `self.log(...)` logs into otel_train. `OtelTrainCallback` makes one
`ot.step` per optimizer step (micro-batches of `accumulate_grad_batches` are not steps) with the
phases Lightning's hooks expose:

    data       end of the previous batch (or validation) -> `on_train_batch_start`
    forward    `on_train_batch_start` -> `on_before_backward` (training_step)
    backward   `on_before_backward` -> `on_after_backward`
    optimizer  `on_before_optimizer_step` -> the end of the batch that stepped
    eval       a span (and phase) around each validation run (the sanity check is skipped)

`tokens=lambda batch: batch["input_ids"].numel()` counts tokens per micro-batch (a shape read, no
device sync) into `train.tokens`. With `watch_every > 0` it calls `ot.watch(model, every=watch_every)` at fit start: per-layer
gradient and parameter norms read at the end of the optimizer step (gradients are unscaled by then).
Without an `OtelTrainLogger` on the Trainer, the callback forwards `trainer.logged_metrics` (still
tensors: no host sync) when each step ends. On an exception the open step ends as failed and a
session the integration started is shut down (final flush).

Set `OTEL_TRAIN_LIGHTNING=1` to add the callback to every Trainer of an unmodified script through
the `lightning.pytorch.callbacks_factory` entry point; without the variable the entry point adds
nothing. Either piece starts the session lazily on every rank unless `ot.init()` already ran.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Callable, Mapping
from time import perf_counter_ns
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger

import otel_train as ot
from otel_train.integrations._common import end_phase, scalar_logs, start_session

__all__ = ["OtelTrainCallback", "OtelTrainLogger", "callbacks_factory"]

ENV_SWITCH = "OTEL_TRAIN_LIGHTNING"
# Lightning's conventional names onto otel_train's catalogue.
_RENAMES = {"train_loss": "loss", "val_loss": "eval_loss"}
_SKIPPED = frozenset({"epoch", "step"})


def _lightning_scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    renamed = {_RENAMES.get(k, k): v for k, v in metrics.items() if isinstance(k, str)}
    renamed = {(f"eval_{k[4:]}" if k.startswith("val_") else k): v for k, v in renamed.items()}
    return scalar_logs(renamed, _SKIPPED)


class OtelTrainLogger(Logger):
    """`Trainer(logger=OtelTrainLogger())`: logged values become otel_train scalars on every rank."""

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._settings = dict(settings or {})
        self._owns_session = False

    @property
    def name(self) -> str:
        return "otel_train"

    @property
    def version(self) -> str | None:
        session = ot.current_session()
        return session.run_name if session is not None else None

    def _ensure_session(self) -> None:
        if ot.current_session() is None:
            self._owns_session = start_session(self._settings)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._ensure_session()
        ot.log_metrics(_lightning_scalars(metrics))

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        self._ensure_session()
        ot.log_hyperparams(vars(params) if isinstance(params, Namespace) else dict(params))

    def finalize(self, status: str) -> None:
        if self._owns_session:
            self._owns_session = False
            ot.shutdown()


class OtelTrainCallback(Callback):
    """Steps, phase timers, eval spans and (opt-in) `ot.watch` for a Lightning `Trainer`."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        watch_every: int = 0,
        tokens: Callable[[Any], int] | None = None,
    ) -> None:
        self._settings = dict(settings or {})
        self._watch_every = watch_every
        self._tokens_of = tokens
        self._tokens = 0
        self._owns_session = False
        self._forward_logged = False
        self._step: int | None = None
        self._step_global = 0  # trainer.global_step when the open step began
        self._step_start_ns = 0
        self._phase_start_ns = 0
        self._mark_ns: int | None = None
        self._eval_start_ns: int | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        settings = dict(self._settings)
        if trainer.max_steps and trainer.max_steps > 0:
            settings.setdefault("total_steps", trainer.max_steps)
        self._owns_session = start_session(settings)
        self._forward_logged = not any(isinstance(lg, OtelTrainLogger) for lg in trainer.loggers)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._watch_every > 0:
            ot.watch(pl_module, every=self._watch_every)
        self._mark_ns = perf_counter_ns()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._owns_session:
            self._owns_session = False
            ot.shutdown()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        session = ot.current_session()
        if session is not None and self._step is not None:
            session.end_step(self._step, self._step_start_ns, perf_counter_ns(), None, None, True)
            self._step = None
        if self._owns_session:
            self._owns_session = False
            ot.shutdown()

    # --- one optimizer step (one or more micro-batches) ------------------------------------------
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        session = ot.current_session()
        if session is None:
            return
        now = perf_counter_ns()
        start = self._mark_ns if self._mark_ns is not None else now
        if self._step is None:
            self._step = session.begin_step(trainer.global_step)
            self._step_global = trainer.global_step
            self._step_start_ns = start
            self._tokens = 0
        if self._tokens_of is not None:
            self._tokens += int(self._tokens_of(batch))
        if start < now:
            session.end_timer("data", start, now, None)
        self._phase_start_ns = now

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self._end_phase("forward")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_phase("backward")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._phase_start_ns = perf_counter_ns()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        session = ot.current_session()
        now = perf_counter_ns()
        self._mark_ns = now
        if session is None or self._step is None or trainer.global_step == self._step_global:
            return  # a micro-batch that accumulated gradients: the step goes on
        session.end_timer("optimizer", self._phase_start_ns, now, None)
        if self._forward_logged:
            ot.log_metrics(_lightning_scalars(trainer.logged_metrics))
        session.end_step(self._step, self._step_start_ns, now, self._tokens or None, None, False)
        self._step = None

    def _end_phase(self, name: str) -> None:
        if self._step is not None:
            self._phase_start_ns = end_phase(name, self._phase_start_ns)

    # --- validation ------------------------------------------------------------------------------
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_start_ns = None if trainer.sanity_checking else perf_counter_ns()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        session = ot.current_session()
        if session is None or self._eval_start_ns is None:
            return
        now = perf_counter_ns()
        session.end_mark("eval", self._eval_start_ns, now, None, {"train.step": trainer.global_step})
        self._eval_start_ns = None
        self._mark_ns = now


def callbacks_factory() -> list[Callback]:
    """Entry point `lightning.pytorch.callbacks_factory`: the callback when OTEL_TRAIN_LIGHTNING is
    set to 1/true/yes, nothing otherwise (installing otel_train alone changes no Trainer)."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on"):
        return [OtelTrainCallback()]
    return []
