"""Hugging Face `Trainer` integration: `Trainer(..., callbacks=[OtelTrainCallback()])`.

One step per optimizer step with the phases `data`, `data_sync`, `forward_backward`, `optimizer`
(and `eval`, `checkpoint` spans), the Trainer's logs as metrics, and the DeepSpeed engine
instrumented when the Trainer runs one.
How it works: docs/design/integrations.md#transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from time import perf_counter_ns
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import otel_train as ot
from otel_train import adapters
from otel_train.config import wandb_project_from_env
from otel_train.integrations._common import (
    EVAL_PREFIXES,
    HookStep,
    call_holding,
    chosen,
    distributed_world,
    ending_on_error,
    rank_share,
    scalar_logs,
    settings_from_kwargs,
    start_session,
    with_adopted,
    with_precision,
)

__all__ = ["OtelTrainCallback"]

log = logging.getLogger("otel_train")

_BRIDGES = ("tensorboard", "wandb", "mlflow")
# TRL's collators that batch each preference pair as two rows (the chosen, then the rejected)
_PAIR_COLLATORS = frozenset(
    {"DataCollatorForPreference", "DataCollatorForVisionPreference"}
)  # otel_train bridges that are also `report_to` names
_RUN_DIRS = "_otel_train"  # under the Trainer's output_dir; push_to_hub skips names starting with _

# Keys of the Trainer's logs that duplicate what otel_train measures itself (`step`: TRL's; from
# `global_step` on: Oumi's).
_SKIPPED_LOG_KEYS = frozenset({
    "num_input_tokens_seen", "train_tokens_per_second", "step", "global_step", "total_tokens_seen",
    "global_steps_per_second", "tokens_per_second", "tokens_per_step_per_gpu",
})  # fmt: skip
_WRAPPED = "_otel_train_wrapped"
# What a Trainer resuming from a checkpoint loads before on_train_begin (model, optimizer and
# scheduler, grad scaler), when no run is there yet to time it.
_RESTORE_CALLS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler")

# The run an OtelTrainCallback started: it idles after its train() (an evaluate, a save or a push
# afterwards is still part of it) until process exit, or until the next train() begins a new run.
_owned_run: Any = None


class OtelTrainCallback(TrainerCallback):
    """Telemetry for `transformers.Trainer` (and its subclasses: TRL, Oumi).

    Settings are `ot.init()` settings used when the callback starts the session itself, by keyword
    (`OtelTrainCallback(run_name="x", tensorboard=True)`) or as a `settings` mapping; an unknown
    name raises `ConfigError`. `hyperparams=False` skips logging the `TrainingArguments`.
    `watch_every=N` (> 0) calls `ot.watch(model, every=N)` when training begins."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        hyperparams: bool = True,
        watch_every: int = 0,
        **kwargs: Any,
    ) -> None:
        self._settings = settings_from_kwargs(settings, kwargs, type(self).__name__)
        self._hyperparams = hyperparams
        self._watch_every = watch_every
        self._took_wandb = False  # the Trainer's W&B reporter was taken off for otel_train's bridge
        self._saw_init = False  # given to Trainer(callbacks=...): on_init_end ran, reporters checked
        self._deepspeed = False  # the Trainer trains a DeepSpeed engine (instrumented at train begin)
        self._started = False  # this callback's run began (on_train_begin or a lazy first step)
        self._ran = False  # it began once: a log before any train() starts it, one after does not
        self._idle = False  # its run idles after train(): a later train() starts a new one
        self._session: Any = None  # the session this callback started (and ends), else None
        self._mark_ns: int | None = None  # end of the last accounted stretch (step, log, eval, save)
        self._eval_span: Any = None  # the evaluation's ot.span, from its first batch to on_evaluate
        self._hook_step = HookStep()  # the step this callback began
        self._tokens_seen = 0
        self._steps = 0  # optimizer steps counted here, for trainers that pass no state
        self._rank = 0
        self._world = 1
        self._data_ready_ns = 0  # when the wrapped get_batch_samples last got a micro-batch
        self._batch: Any = None  # the next step's first micro-batch (get_batch_samples)
        self._batch_tokens = 0  # the next step's input tokens, from its micro-batches' shapes
        self._batch_rows = 0  # and its samples (rows)
        self._trainer_counts_tokens = False  # include_num_input_tokens_seen: the Trainer's count
        self._restores: list[tuple[int, int]] = []  # a resume's checkpoint loads (before the run began)
        self._grad_nonfinite = False  # the logged grad_norm is NaN/Inf since a `nonfinite_grad` event

    # --- lifecycle -----------------------------------------------------------------------------
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.attach(_calling_trainer(self))

    def attach(self, trainer: Any) -> None:
        """Take `trainer`'s settings, and its reporters off for the backends otel_train bridges to,
        before any of them began a run (at its `__init__`, or right after, as TRL's instrument)."""
        self._adopt(trainer)
        self._saw_init = True
        if trainer is not None and "wandb" in _drop_duplicate_reporters(trainer, self._settings):
            self._took_wandb = True

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._hook_step.fail()  # a failed attempt of auto_find_batch_size, or a stale step
        trainer = _calling_trainer(self)
        self._adopt(trainer)  # added with add_callback: no on_init_end was seen
        if trainer is not None and not self._saw_init:
            self._saw_init = True
            _warn_duplicate_reporters(trainer, self._settings)
        engine = _deepspeed_engine(trainer)
        self._deepspeed = engine is not None
        self._start(args, state, kwargs.get("model"))
        for start, end in self._restores:  # goodput's checkpoint_restore, not startup
            ot.span("checkpoint_restore").start(at_ns=start).stop(at_ns=end)
        self._restores.clear()
        if engine is not None:  # its step() (in accelerator.backward) is the `optimizer` phase
            from otel_train.integrations import deepspeed

            deepspeed.instrument(engine, steps=False)

    def _adopt(self, trainer: Any) -> None:
        """Wrap the Trainer's `train` and `get_batch_samples` (that instance only, once)."""
        if trainer is None:
            return
        if not getattr(trainer.train, _WRAPPED, False):  # ends the run (failed step, owned session)
            trainer.train = ending_on_error(trainer.train, _WRAPPED, lambda: self.close(failed=True))
        if not getattr(trainer.get_batch_samples, _WRAPPED, False):
            input_name = getattr(trainer.model, "main_input_name", None) or "input_ids"
            trainer.get_batch_samples = _stamping(self, trainer, input_name)
        for name in _RESTORE_CALLS:
            load = getattr(trainer, name, None)
            if load is not None and not getattr(load, _WRAPPED, False):
                setattr(trainer, name, _timing_restore(load, self._restores))

    def _start(self, args: Any, state: TrainerState | None, model: Any) -> None:
        # Began already and its session still runs: the Trainer re-entered its training loop in the
        # same train() (auto_find_batch_size after an out-of-memory error), or an evaluate() before
        # train() began the run. The run goes on.
        global _owned_run
        again = self._session is not None and adapters.current_run() == self._session and not self._idle
        max_steps = state.max_steps if state is not None else getattr(args, "max_steps", None)
        planned = max_steps if isinstance(max_steps, int) and max_steps > 0 else None
        if again and planned is not None and not chosen("total_steps", self._settings):
            adapters.set_total_steps(planned)
        if not again:
            if _owned_run is not None and adapters.current_run() == _owned_run:
                ot.shutdown()  # a callback's run, idle since its train() (this one's or another's)
            adopted = _adopted_settings(args, state)
            if self._took_wandb:
                adopted["wandb_project"] = wandb_project_from_env("huggingface")  # HF's reporter's default
            if planned is not None:
                adopted["total_steps"] = planned
            started = start_session(with_precision(with_adopted(self._settings, adopted), _precision(args)))
            self._session = adapters.current_run() if started else None
            if started:
                _owned_run = self._session
        self._started = self._ran = True
        self._idle = False
        info = ot.run_info()
        self._rank = info.rank if info is not None else 0
        self._world = distributed_world()
        if self._hyperparams and not again:
            params = _hyperparams(args)
            if params:
                ot.log_hyperparams(params)
        self._tokens_seen = state.num_input_tokens_seen if state is not None else 0
        counting = getattr(args, "include_num_input_tokens_seen", "no")
        self._trainer_counts_tokens = counting not in ("no", False)
        self._steps = 0
        if self._watch_every > 0 and model is not None:
            # ZeRO leaves p.grad None by design: parameter statistics only, no "no gradient" verdict
            ot.watch(model, every=self._watch_every, grads=not self._deepspeed)
        self._mark_ns = perf_counter_ns()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        stopped = getattr(control, "should_training_stop", False)  # OumiTrainer passes no control
        if stopped and state is not None and 0 < state.global_step < state.max_steps:
            # Early stopping (or a callback) ended training before its plan: the steps run are the plan.
            adapters.set_total_steps(state.global_step)
        self.close(end_run=False)

    def close(self, end_run: bool = True, failed: bool = False) -> None:
        """End this callback's training (at `on_train_end`, when `train()` raises, at the end of
        `oumi.train`; idempotent): a step still open ends as failed (`OumiTrainer` may begin one and
        find no batch at an epoch's end). After `on_train_end` the run idles: an evaluate, a save or
        a push after train() is still part of it, and it ends at process exit (or when the next
        train() of this or another callback begins a new run). Otherwise (`end_run`) a session the
        callback started ends now."""
        self._hook_step.fail()
        self._started = False
        self._mark_ns = None
        self._eval_span = None
        session = self._session
        if session is not None and adapters.current_run() != session:
            self._session = None  # shut down by someone else
        elif session is not None and end_run:
            self._session = None
            adapters.end_run(failed)
        else:
            self._idle = session is not None
            adapters.idle()

    # --- one optimizer step ----------------------------------------------------------------------
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._hook_step.fail()  # one that never reached on_step_end
        if self._eval_span is not None:  # an evaluation that never reached on_evaluate is over
            self._close_mark("eval", state)
        if not self._started:  # no on_train_begin (OumiTrainer)
            self._start(args, state, kwargs.get("model"))
        now = perf_counter_ns()
        start = self._mark_ns if self._mark_ns is not None else now
        index = state.global_step if state is not None else self._steps
        if not self._hook_step.begin(index, start):
            return  # no session (the user's was shut down)
        batch, self._batch = self._batch, None
        if batch is not None:
            adapters.watch_batch(batch)  # unsharded data: the batch as it left the loader (watched steps)
        if state is not None and start < now:  # OumiTrainer fetches the batch inside the step
            self._time_data(start, now)
        self._hook_step.phase_start_ns = now

    def _time_data(self, start: int, now: int) -> None:
        ready = self._data_ready_ns
        if self._world > 1 and start < ready <= now:
            # Arrival where this rank's batches were ready, before the gather where it may wait.
            ot.timer("data").start(at_ns=start).stop(at_ns=ready)
            ot.timer("data_sync").start(at_ns=ready).stop()
        else:
            ot.timer("data").start(at_ns=start).stop()

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        adapters.heartbeat()  # a micro-batch of a step that accumulates: a long step is no stall

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._ran:  # an evaluate() before any train(): the run begins at its first batch
            self._start(args, state, None)
        adapters.heartbeat()  # an eval batch: a long evaluation is no stall
        if self._eval_span is None and not self._hook_step.open:
            # Open until on_evaluate (compute_metrics is eval time: eval_timeout_s), from the last
            # mark in training, from this first batch outside it (an evaluate() after train()).
            step = state.global_step if state is not None else self._steps
            self._eval_span = ot.span("eval", {"train.step": step}).start(at_ns=self._mark_ns)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._hook_step.end_phase("forward_backward")

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._deepspeed:  # the Trainer's optimizer.step() is a no-op: DeepSpeed's is timed
            self._hook_step.phase_start_ns = perf_counter_ns()
        else:
            self._hook_step.end_phase("optimizer")
        if self._hook_step.open:
            adapters.watch_read()  # the Trainer zeroes the gradients before on_step_end

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._steps += 1
        if not self._hook_step.open:
            return
        tokens = self._batch_tokens or None  # this rank's, as the Trainer's "all" counts them
        samples = self._batch_rows or None
        self._batch_tokens = self._batch_rows = 0
        # The trainer's own job-wide count where it keeps one: the Trainer's with
        # include_num_input_tokens_seen (non_padding, say), or TRL's GRPO/RLOO prompt and completion
        # tokens, whose batches hold text (no input_ids to count).
        if state is not None and (
            self._trainer_counts_tokens or state.num_input_tokens_seen != self._tokens_seen
        ):
            job_tokens = max(state.num_input_tokens_seen - self._tokens_seen, 0)
            tokens = rank_share(job_tokens, self._rank, self._world) or None
            self._tokens_seen = state.num_input_tokens_seen
        self._hook_step.end(tokens=tokens, samples=samples, hold=bool(getattr(control, "should_log", False)))
        self._mark_ns = perf_counter_ns()
        _saving_if_due(control)  # the Trainer saves before the next step (after its log and eval)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        _saving_if_due(control)  # save_strategy="epoch": the save follows

    # --- logs, eval, checkpoints -----------------------------------------------------------------
    def on_predict(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                   metrics: Mapping[str, Any] | None = None, **kwargs: Any) -> None:  # fmt: skip
        self.on_log(args, state, control, logs=metrics)  # predict()'s test_* metrics reach no on_log

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs:
            return
        if not self._ran:  # an evaluate() before any train(): the run begins here
            self._start(args, state, None)
        if ot.run_info() is None:
            return
        # The Trainer logs (and evaluates) after on_step_end, when the step's interval may already
        # be flushed: without an explicit step its values would be filed under the next flush's.
        step = self._ended_step(state)
        ot.log_metrics(scalar_logs(logs, _SKIPPED_LOG_KEYS), step=step)
        self._hook_step.release()  # the step this log follows (held open for it) ends with its values
        _saving_if_due(control)  # a save due next (noted at on_step_end) comes after this step's end
        self._grad_nonfinite = _nonfinite_grad(
            logs.get("grad_norm"), step, self._grad_nonfinite, self._scaler_skipped
        )
        in_eval = any(isinstance(k, str) and k.startswith(EVAL_PREFIXES) for k in logs)
        if self._mark_ns is not None and not in_eval:
            # The training log (with its loss gather) is not data wait or eval time.
            self._mark_ns = perf_counter_ns()

    def _ended_step(self, state: TrainerState | None) -> int | None:
        """The index of the step a log or an evaluation follows: the step that ended last (its
        index is the Trainer's global_step - 1), step 0 before the first one (an evaluation at
        the start). None inside a step (the values leave with that step's flush, filed under it); a
        step held open for its log is one that ended."""
        if self._hook_step.open and not self._hook_step.held:
            return None
        ended = state.global_step if state is not None else self._steps
        return max(ended - 1, 0)

    def _scaler_skipped(self) -> bool:
        """Whether the loss scaler skipped the last optimizer step for inf/NaN gradients (fp16):
        what the scaler handles is no `nonfinite_grad`, as for `ot.watch(scaler=...)`."""
        accelerator = getattr(_calling_trainer(self), "accelerator", None)
        return bool(getattr(accelerator, "optimizer_step_was_skipped", False))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close_mark("eval", state)
        # The save follows the evaluation (whose batches ended `saving`). With save_strategy="best"
        # the Trainer decides only after this hook whether it saves: a save may follow.
        strategy = getattr(args, "save_strategy", None)
        _saving_if_due(control, getattr(strategy, "value", strategy) == "best")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close_mark("checkpoint", state)

    def _close_mark(self, name: str, state: TrainerState | None) -> None:
        if name == "eval" and self._eval_span is not None:  # begun at the evaluation's first batch
            self._eval_span.stop()
            self._eval_span = None
        elif self._mark_ns is None:
            return  # e.g. trainer.evaluate() outside training: no start point known
        else:
            step = state.global_step if state is not None else self._steps
            ot.span(name, {"train.step": step}).start(at_ns=self._mark_ns).stop()
        self._mark_ns = perf_counter_ns()


def _timing_restore(load: Callable[..., Any], restores: list[tuple[int, int]]) -> Callable[..., Any]:
    """`trainer.<load>`, noting in `restores` when it loaded a checkpoint (its first argument)."""

    @functools.wraps(load)
    def wrapper(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter_ns()
        try:
            return load(checkpoint, *args, **kwargs)
        finally:
            if checkpoint is not None:
                restores.append((start, perf_counter_ns()))

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _rows_per_sample(trainer: Any) -> int:
    """2 for TRL's preference trainers, whose collator batches each pair as two rows; else 1."""
    collator = type(getattr(trainer, "data_collator", None))
    return 2 if any(c.__name__ in _PAIR_COLLATORS for c in collator.__mro__) else 1


def _stamping(callback: OtelTrainCallback, trainer: Any, input_name: str) -> Callable[..., Any]:
    """`trainer.get_batch_samples`, noting on `callback` when each micro-batch left the iterator,
    the step's first micro-batch (a reference) and its micro-batches' `input_name` elements and
    samples (their rows; shapes only)."""
    get_batch_samples, rows_per_sample = trainer.get_batch_samples, _rows_per_sample(trainer)

    def stamped(epoch_iterator: Any) -> Iterator[Any]:
        for item in epoch_iterator:  # pulls one item per next(): none is taken ahead
            callback._data_ready_ns = perf_counter_ns()
            yield item

    @functools.wraps(get_batch_samples)
    def wrapper(epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
        result = get_batch_samples(stamped(epoch_iterator), *args, **kwargs)
        samples = result[0] if isinstance(result, tuple) and result else None
        callback._batch = samples[0] if isinstance(samples, list) and samples else None
        if isinstance(samples, list):
            callback._batch_tokens = sum(_elements(batch, input_name) for batch in samples)
            callback._batch_rows = sum(_rows(batch, input_name) for batch in samples) // rows_per_sample
        return result

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _adopted_settings(args: Any, state: TrainerState | None) -> dict[str, Any]:
    """The otel_train settings `TrainingArguments` stand for (docs/design/integrations.md#transformers)."""
    out: dict[str, Any] = {}
    strategy = getattr(args, "logging_strategy", None)
    steps = getattr(args, "logging_steps", None)
    field = getattr(type(args), "__dataclass_fields__", {}).get("logging_steps")
    if getattr(strategy, "value", strategy) != "steps" or field is None or steps == field.default:
        steps = None  # not a logging_steps of the user's (IntervalStrategy is a str enum)
    if isinstance(steps, (int, float)):
        # A ratio of the run (0 < steps < 1) is resolved by the Trainer into state.logging_steps.
        resolved = state.logging_steps if state is not None and steps < 1 else steps
        if isinstance(resolved, (int, float)) and resolved >= 1:
            out["log_interval"] = int(resolved)
    output_dir = getattr(args, "output_dir", None)
    if isinstance(output_dir, str) and output_dir:
        out["output_dir"] = os.path.join(output_dir, _RUN_DIRS)
    return out


def _drop_duplicate_reporters(trainer: Any, settings: Mapping[str, Any]) -> list[str]:
    """Take the Trainer's `report_to` reporter off for each backend an otel_train bridge writes
    to (before any reporter's `on_train_begin` opened a run there); returns those backends."""
    handler = trainer.callback_handler
    dropped = _duplicate_reporters(trainer, settings)
    if not dropped:
        return []
    # A new list, not remove(): the handler is iterating over the old one (this on_init_end).
    handler.callbacks = [c for c in handler.callbacks if c not in dropped]
    names = sorted({_reporter_backend(c) or "" for c in dropped})
    log.warning(
        "otel_train: the Trainer reports to %s and otel_train's bridge does too: the Trainer's %s "
        "is taken off, its logs reach %s through otel_train (one run, not two). To keep the "
        "Trainer's reporter instead, set %s on OtelTrainCallback.",
        ", ".join(names),
        ", ".join(type(c).__name__ for c in dropped),
        ", ".join(names),
        ", ".join(f"{n}=False" for n in names),
    )
    return names


def _duplicate_reporters(trainer: Any, settings: Mapping[str, Any]) -> list[Any]:
    """The Trainer's `report_to` reporters for backends an otel_train bridge writes to."""
    on = _bridges_on(settings)
    return [c for c in trainer.callback_handler.callbacks if _reporter_backend(c) in on]


def _warn_duplicate_reporters(trainer: Any, settings: Mapping[str, Any]) -> None:
    """Added with `trainer.add_callback`, the callback sees the Trainer first at `on_train_begin`,
    after the reporters began their runs: too late to take them off, so say how."""
    late = _duplicate_reporters(trainer, settings)
    if late:
        names = sorted({_reporter_backend(c) or "" for c in late})
        log.warning(
            "otel_train: OtelTrainCallback was added with trainer.add_callback, after the Trainer's "
            "%s began: both write to %s (two runs). Pass it as Trainer(callbacks=[OtelTrainCallback("
            "...)]) and the Trainer's reporter is taken off, or set %s on OtelTrainCallback.",
            ", ".join(type(c).__name__ for c in late),
            ", ".join(names),
            ", ".join(f"{n}=False" for n in names),
        )


def _bridges_on(settings: Mapping[str, Any]) -> set[str]:
    """The otel_train bridges that are on: the running session's, else those a session started
    with `settings` would open."""
    info = ot.run_info()
    if info is not None:
        return set(info.bridges)
    from otel_train.config_loading import load_config

    config = load_config(settings)
    return {name for name in _BRIDGES if getattr(config, name) is True}


def _reporter_backend(callback: Any) -> str | None:
    """The `report_to` name of a Trainer reporter for a backend otel_train also bridges to (its
    exact class: a user's subclass, or DagsHub's MLflow one, is another reporter)."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    for name in _BRIDGES:
        if type(callback) is INTEGRATION_TO_CALLBACK.get(name):
            return name
    return None


def _hyperparams(args: Any) -> dict[str, Any]:
    """`TrainingArguments.to_dict()`, or the fields of another trainer's dataclass arguments."""
    try:
        if hasattr(args, "to_dict"):
            return dict(args.to_dict())
        if dataclasses.is_dataclass(args) and not isinstance(args, type):
            return dataclasses.asdict(args)
    except Exception:  # the trainer's own to_dict()/fields: no hyperparameters, no failure
        pass
    return {}


def _deepspeed_engine(trainer: Any) -> Any:
    """The DeepSpeed engine a Trainer trains (`model_wrapped`, set before `on_train_begin`), else None."""
    if trainer is None or not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    engine = getattr(trainer, "model_wrapped", None)
    return engine if callable(getattr(engine, "zero_optimization_stage", None)) else None


def _nonfinite_grad(
    grad_norm: Any, step: int | None, in_spell: bool, scaler_skipped: Callable[[], bool]
) -> bool:
    """One `nonfinite_grad` event when the logged grad_norm turns NaN/Inf (not each log while it
    stays so: a diverged run logs it at every `logging_steps`); whether it is non-finite now. With
    logging_nan_inf_filter (the default) the Trainer replaces a NaN/Inf loss by the mean of its log
    window's finite ones (0.0 when none is): the gradient norm it logs is then the only sign that
    training went NaN. What the loss scaler skipped is no event, as for `ot.watch(scaler=...)`."""
    if not isinstance(grad_norm, float) or scaler_skipped():
        return in_spell
    if math.isfinite(grad_norm):
        return False
    if not in_spell:
        ot.event(
            "nonfinite_grad",
            f"the Trainer logged grad_norm={grad_norm} at step {step}: non-finite gradients, said once "
            "until it is finite again (no layer named: ot.watch or OtelTrainCallback(watch_every=N) "
            "names them)",
            {"step": step} if step is not None else None,
        )
    return True


def _calling_trainer(callback: OtelTrainCallback) -> Any:
    """The `transformers.Trainer` whose `__init__` or training loop runs this hook (it holds
    `callback`), found on the call stack."""
    from transformers import Trainer

    found = call_holding(Trainer, callback, "callback_handler.callbacks")
    return None if found is None else found[0]


def _elements(batch: Any, name: str) -> int:
    """The number of elements of `batch[name]`, a tensor (0 when there is none)."""
    value = batch.get(name) if isinstance(batch, Mapping) else None
    numel = getattr(value, "numel", None)
    return int(numel()) if callable(numel) else 0


def _rows(batch: Any, name: str) -> int:
    """The rows (samples) of `batch[name]`, a tensor of at least one dimension (0 when there is none)."""
    value = batch.get(name) if isinstance(batch, Mapping) else None
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else 0


def _precision(args: Any) -> str | None:
    """The precision `TrainingArguments` asks for (`bf16`, `fp16`, `tf32`), for MFU's peak."""
    return next((flag for flag in ("bf16", "fp16", "tf32") if getattr(args, flag, None) is True), None)


def _saving_if_due(control: TrainerControl | None, may_save: bool = False) -> None:
    """`adapters.saving_checkpoint()` when the Trainer saves a checkpoint next, or `may_save` (no
    save then only eases the stall timeout until the next step; OumiTrainer calls the hooks without
    a control)."""
    if may_save or (control is not None and control.should_save):
        adapters.saving_checkpoint()
