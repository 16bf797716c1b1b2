"""PyTorch Lightning integration: a `Logger` and a `Callback`, usable together or alone.

    trainer = Trainer(logger=OtelTrainLogger(), callbacks=[OtelTrainCallback()])

`OtelTrainLogger` sends what `self.log(...)` logs into otel_train at Lightning's step (alone, it
also marks those steps: see its doc). `OtelTrainCallback` makes one step per optimizer step
(micro-batches of `accumulate_grad_batches` are not steps), begun at the end of the previous batch
so that the data wait is part of it (and straggler arrivals are measured from there), with the
phases Lightning's hooks expose:

    data       end of the previous batch (or validation) -> `on_train_batch_start`
    forward    `on_train_batch_start` -> `on_before_backward` (training_step)
    backward   `on_before_backward` -> `on_after_backward`
    optimizer  `on_before_optimizer_step` -> the end of the batch that stepped
    eval       a span (and phase) around each validation run (the sanity check is skipped)

`tokens=lambda batch: batch["input_ids"].numel()` counts tokens per micro-batch (a shape read, no
device sync) into `train.tokens`. With `watch_every > 0` it calls
`ot.watch(model, every=watch_every)` at fit start: per-layer gradient and parameter norms read at
the end of the optimizer step (gradients are unscaled by then), the checks on them (`no_gradient`,
`gradient_explosion`/`gradient_vanishing`, and under DDP `replica_divergence`), and on watched
steps a fingerprint of the batch `on_train_batch_start` receives (`ot.watch_batch`; the first
micro-batch of an accumulated step) for `data_not_sharded`.
Without an `OtelTrainLogger` on the Trainer, the callback forwards the values in
`trainer.logged_metrics` that changed (still tensors: no host sync) when each step ends, and a
validation's values when it ends (flushed under the step it followed). On an exception the open step ends as failed and a
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
from otel_train.integrations._common import (
    end_phase,
    scalar_logs,
    settings_from_kwargs,
    start_session,
    with_precision,
)

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
    """`Trainer(logger=OtelTrainLogger(run_name="x"))`: every `self.log` value reaches otel_train at
    Lightning's step, on every rank. Keyword arguments are `ot.init()` settings (`Config` fields;
    the older `settings={...}` mapping still works), used when the logger starts the session.

    Alone (no `OtelTrainCallback` on the Trainer) the logger also marks the steps: one otel_train
    step per distinct step Lightning logs at, numbered as Lightning numbers it and lasting from the
    previous logged step (or fit start) to this one, so goodput is the time spent between logs
    (training and validation) over wall time. `train/steps` then counts logged steps, not optimizer
    steps, and step time is the time per logging interval: add `OtelTrainCallback` for one step per
    optimizer step with phases, eval spans and straggler detection (the logger then only logs)."""

    def __init__(self, settings: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self._settings = settings_from_kwargs(settings, kwargs, type(self).__name__)
        self._owns_session = False
        self.marks_steps = True  # OtelTrainCallback on the same Trainer turns it off: it marks them
        self._last_step: int | None = None
        self._mark_ns: int | None = None  # where the next logged step starts

    @property
    def name(self) -> str:
        return "otel_train"

    @property
    def version(self) -> str | None:
        info = ot.run_info()
        return info.run_name if info is not None else None

    def _ensure_session(self) -> None:
        if ot.current_session() is None:
            self._owns_session = start_session(self._settings)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        # Lightning calls this on every logger once at fit start: the first logged step starts here.
        self._ensure_session()
        self._mark_ns = perf_counter_ns()

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._ensure_session()
        values = _lightning_scalars(metrics)
        if step is not None and self.marks_steps and (self._last_step is None or step > self._last_step):
            ot.begin_step(step, start_ns=self._mark_ns)
            ot.log_metrics(values)  # inside the step: they leave with its flush
            ot.end_step()
            self._mark_ns = perf_counter_ns()
            values = {}
        if step is not None:
            self._last_step = step if self._last_step is None else max(step, self._last_step)
        # With a step: flushed now, filed under that step (see ot.log_metrics).
        ot.log_metrics(values, step=step)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        self._ensure_session()
        ot.log_hyperparams(vars(params) if isinstance(params, Namespace) else dict(params))

    def finalize(self, status: str) -> None:
        if self._owns_session:
            self._owns_session = False
            ot.shutdown()


class OtelTrainCallback(Callback):
    """Steps, phase timers, eval spans and (opt-in) `ot.watch` for a Lightning `Trainer`. Keyword
    arguments besides `watch_every`/`tokens` are `ot.init()` settings (`Config` fields)."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        watch_every: int = 0,
        tokens: Callable[[Any], int] | None = None,
        **kwargs: Any,
    ) -> None:
        self._settings = settings_from_kwargs(settings, kwargs, type(self).__name__)
        self._watch_every = watch_every
        self._tokens_of = tokens
        self._tokens = 0
        self._owns_session = False
        self._forwards_logged = False
        self._forwarded: dict[str, Any] = {}  # the logged values already sent, by name
        self._step: int | None = None
        self._step_global = 0  # trainer.global_step when the open step began
        self._phase_start_ns = 0
        self._mark_ns: int | None = None  # end of the previous batch (or validation): data starts
        self._eval: Any = None  # the open eval span

    # --- lifecycle -----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        settings = dict(self._settings)
        if trainer.max_steps and trainer.max_steps > 0:
            settings.setdefault("total_steps", trainer.max_steps)
        self._owns_session = start_session(with_precision(settings, getattr(trainer, "precision", None)))
        ours = [lg for lg in trainer.loggers if isinstance(lg, OtelTrainLogger)]
        for logger in ours:
            logger.marks_steps = False  # the steps are ours; the logger only logs values
        self._forwards_logged = not ours

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._watch_every > 0:
            ot.watch(pl_module, every=self._watch_every)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark_ns = perf_counter_ns()  # after the sanity check: it is not the first step's data

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._owns_session:
            self._owns_session = False
            ot.shutdown()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._step is not None:
            ot.end_step(failed=True)
            self._step = None
        if self._owns_session:
            self._owns_session = False
            ot.shutdown()

    # --- one optimizer step (one or more micro-batches) ------------------------------------------
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if ot.current_session() is None:
            return
        now = perf_counter_ns()
        start = self._mark_ns if self._mark_ns is not None else now
        if self._step is None:
            # Backdated to the previous batch's end: the data wait belongs to this step, and the
            # arrivals are measured from there (a rank slow to load arrives late at the backward
            # all-reduce: that makes it the straggler, not the ranks that wait for it).
            self._step = ot.begin_step(trainer.global_step, start_ns=start)
            self._step_global = trainer.global_step
            self._tokens = 0
            # unsharded data (watched steps only): training_step need not pass the batch to forward
            ot.watch_batch(batch)
        if self._tokens_of is not None:
            self._tokens += int(self._tokens_of(batch))
        if start < now:
            ot.timer("data").start(at_ns=start).stop()
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
        if self._step is None or trainer.global_step == self._step_global:
            self._mark_ns = perf_counter_ns()
            return  # a micro-batch that accumulated gradients: the step goes on
        self._end_phase("optimizer")
        self._forward_logged(trainer, None)  # this step's values (the trainer computes them now)
        ot.end_step(tokens=self._tokens or None)
        self._step = None
        self._mark_ns = perf_counter_ns()

    def _end_phase(self, name: str) -> None:
        if self._step is not None:
            self._phase_start_ns = end_phase(name, self._phase_start_ns)

    def _forward_logged(self, trainer: Trainer, step: int | None) -> None:
        """Without an OtelTrainLogger: send what the trainer's loggers get. Only values that changed
        since the last call (new objects; tensors stay on device) so that a validation value is
        not re-sent at every later step."""
        if not self._forwards_logged or ot.current_session() is None:
            return
        fresh = {k: v for k, v in trainer.logged_metrics.items() if self._forwarded.get(k) is not v}
        if fresh:
            self._forwarded.update(fresh)
            ot.log_metrics(_lightning_scalars(fresh), step=step)

    # --- validation ------------------------------------------------------------------------------
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and ot.current_session() is not None:
            self._eval = ot.span("eval", {"train.step": trainer.global_step}).start()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._eval is None:
            return
        self._eval.stop()
        self._eval = None
        # The validation's values, now (flushed under the step it followed): also the final
        # validation's, after which no training step ends to carry them.
        self._forward_logged(trainer, trainer.global_step)
        self._mark_ns = perf_counter_ns()


def callbacks_factory() -> list[Callback]:
    """Entry point `lightning.pytorch.callbacks_factory`: the callback when OTEL_TRAIN_LIGHTNING is
    set to 1/true/yes, nothing otherwise (installing otel_train alone changes no Trainer)."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on"):
        return [OtelTrainCallback()]
    return []
