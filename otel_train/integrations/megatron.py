"""Megatron-Core timers and Megatron Bridge: `pretrain(cfg, forward_step, callbacks=[OtelTrainCallback()])`.

Three pieces, usable alone: `instrument(timers)` (every Megatron-Core timer is also a phase),
`OtelTrainCallback` (a Megatron Bridge callback) and `settings_from_logger_config(logger)`.
How it works: docs/design/integrations.md#megatron.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from time import perf_counter_ns
from typing import Any

import otel_train as ot
from otel_train import adapters, semconv
from otel_train.integrations._common import end_training, rank_share, start_session, with_adopted

__all__ = ["OtelTrainCallback", "instrument", "settings_from_logger_config"]

# Timers that are not phases: Bridge's cross-step iteration clock (started once, read by elapsed()).
DEFAULT_SKIP = frozenset({"interval-time"})
_MEGATRON_DEFAULT_LEVEL = 2  # what Megatron gives a timer created without a log_level
_ANY_LEVEL = 0  # kept at every timing_log_level: for a timer Megatron's own level already enabled


class _Tracker:
    """State of one instrumented `Timers` (training thread only)."""

    __slots__ = ("depth", "level_set", "levels", "marks", "pending", "reading", "skip", "timer_classes")

    def __init__(self, skip: Iterable[str]) -> None:
        self.skip = frozenset(skip)
        self.levels: dict[str, int] = {}  # name -> the log_level Megatron code passed
        self.marks: dict[str, float] = {}  # running timer -> its active_time() at start
        self.depth = 0  # running instrumented timers
        # Inner timers' latest end in the running outermost timer: name -> (start ns, end ns, level)
        self.pending: dict[str, tuple[int, int, int]] = {}
        self.reading = False  # inside elapsed()
        self.timer_classes: dict[type, type] = {}
        # Whether the user set otel_train's `timing_log_level` (else Megatron's level already chose
        # the real timers); read as an outermost timer starts, shared by the timers nested in it.
        self.level_set = False

    def started(self, name: str, active: float) -> None:
        if self.reading or name in self.skip:
            return
        if "checkpoint" in name:  # save-checkpoint: a long save is no stall (checkpoint_timeout_s)
            adapters.saving_checkpoint()
        if self.depth == 0:
            info = ot.run_info()
            self.level_set = info is not None and info.timing_log_level is not None
        self.depth += 1
        self.marks[name] = active

    def stopped(self, name: str, active: float) -> None:
        if self.reading:
            return
        mark = self.marks.pop(name, None)
        if mark is None:  # started before instrument(), or skipped
            return
        end = perf_counter_ns()
        start = end - int(max(active - mark, 0.0) * 1e9)  # Megatron's own duration, ending now
        level = self.levels.get(name, _MEGATRON_DEFAULT_LEVEL) if self.level_set else _ANY_LEVEL
        self.depth = max(self.depth - 1, 0)
        if "checkpoint" in name:
            ot.span(name).start(at_ns=start).stop()
        elif self.depth == 0:  # an outermost timer: its inner timers' last ends, then its own
            self.flush()
            ot.timer(name, level).start(at_ns=start).stop(at_ns=end)
        else:
            earlier = self.pending.get(name)
            if earlier is not None:  # an earlier micro-batch: its duration, no arrival
                adapters.phase(name, (earlier[1] - earlier[0]) * 1e-9, earlier[2])
            self.pending[name] = (start, end, level)

    def flush(self) -> None:
        """The pending inner ends become timers that arrive where they ended."""
        for name, (start, end, level) in self.pending.items():
            ot.timer(name, level).start(at_ns=start).stop(at_ns=end)
        self.pending.clear()

    def dropped(self, name: str) -> None:
        """reset() of a running timer: Megatron forgets it; so do we."""
        if not self.reading and self.marks.pop(name, None) is not None:
            self.depth = max(self.depth - 1, 0)
            if self.depth == 0:
                self.flush()


def _timer_class(cls: Any, tracker: _Tracker) -> type:
    """A subclass of a Megatron `Timer` class: Megatron's method first, then the phase. (Single
    inheritance: `__class__` assignment refuses a mixin in front of an ABC-derived class.)"""

    def start(self: Any, barrier: bool = False) -> None:
        cls.start(self, barrier=barrier)
        tracker.started(self.name, self.active_time())

    def stop(self: Any, barrier: bool = False) -> None:
        cls.stop(self, barrier=barrier)
        tracker.stopped(self.name, self.active_time())

    def reset(self: Any) -> None:
        cls.reset(self)
        tracker.dropped(self.name)

    def elapsed(self: Any, reset: bool = True, barrier: bool = False) -> Any:
        outer, tracker.reading = tracker.reading, True
        try:
            return cls.elapsed(self, reset=reset, barrier=barrier)
        finally:
            tracker.reading = outer

    methods = {"start": start, "stop": stop, "reset": reset, "elapsed": elapsed}
    return type(cls.__name__, (cls,), {**methods, "_otel": tracker, "__module__": cls.__module__})


def _timers_class(cls: Any, tracker: _Tracker, dummy: type) -> type:
    """A subclass of a Megatron `Timers` class whose `__call__` instruments every real timer it
    hands out (not the shared `DummyTimer` of a disabled level)."""

    def __call__(self: Any, name: str, log_level: int | None = None) -> Any:
        timer = cls.__call__(self, name, log_level)
        kind = type(timer)
        if kind is dummy or getattr(kind, "_otel", None) is tracker:
            return timer
        if log_level is not None:  # Megatron asserts it equals the level the timer was created with
            tracker.levels[name] = int(log_level)
        sub = tracker.timer_classes.get(kind)
        if sub is None:
            sub = tracker.timer_classes[kind] = _timer_class(kind, tracker)
        timer.__class__ = sub
        return timer

    return type(cls.__name__, (cls,), {"__call__": __call__, "_otel": tracker, "__module__": cls.__module__})


def instrument(timers: Any, skip: Iterable[str] = DEFAULT_SKIP) -> Any:
    """Make every start->stop of `timers` (a `megatron.core.timers.Timers`) an otel_train phase as
    well; returns the same object. Idempotent. Timers already running are reported from their
    next start. Before `ot.init()` the phases are no-ops, so instrumenting early is fine."""
    if isinstance(getattr(type(timers), "_otel", None), _Tracker):
        return timers
    from megatron.core.timers import DummyTimer

    timers.__class__ = _timers_class(type(timers), _Tracker(skip), DummyTimer)
    return timers


# --- Megatron Bridge callback --------------------------------------------------------------------


class OtelTrainCallback:
    """Telemetry for Megatron Bridge: `pretrain(cfg, forward_step, callbacks=[OtelTrainCallback()])`.

    `settings`: `ot.init()` settings, applied over those `settings_from_logger_config(cfg.logger)`
    gives (`logger_config=False` skips that) when the callback starts the session; a session you
    started with `ot.init()` is used as it is. `timers=False` leaves `GlobalState.timers` alone;
    `hyperparams=False` skips logging the config (secret-looking keys are redacted)."""

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        *,
        logger_config: bool = True,
        timers: bool = True,
        hyperparams: bool = True,
    ) -> None:
        self._settings = dict(settings or {})
        self._logger_config = logger_config
        self._timers = timers
        self._hyperparams = hyperparams
        self._owns_session = False
        self._tokens: int | None = None  # this rank's share of global batch x sequence length
        self._samples: int | None = None
        self._skips: Any = None
        self._span: Any = None  # the running eval / test span

    def on_train_start(self, context: Any) -> None:
        state = context.state
        cfg: Any = getattr(state, "cfg", None)
        logger = getattr(cfg, "logger", None)
        adopted: dict[str, Any] = {}
        if self._logger_config and logger is not None:
            adopted.update(settings_from_logger_config(logger))
        train_iters = _get(getattr(cfg, "train", None), "train_iters")
        if isinstance(train_iters, int) and train_iters > 0:
            adopted["total_steps"] = train_iters
        self._owns_session = start_session(with_adopted(self._settings, adopted))
        if self._hyperparams and cfg is not None:
            ot.log_hyperparams(_hparams(cfg))
        if self._timers:
            instrument(state.timers)
        self._skips = semconv.SKIPPED_STEPS.create(ot.get_meter())
        self._tokens, self._samples = _rank_shares(cfg)

    def on_train_step_start(self, context: Any) -> None:
        # Bridge increments train_state.step after on_train_step_end: this is the step running now.
        adapters.begin_step(context.state.train_state.step)

    def on_train_step_end(self, context: Any) -> None:
        for key, value in (context.loss_dict or {}).items():  # reduced tensors: stay on device
            ot.record(_loss_name(key), value)
        if context.grad_norm is not None:
            ot.record("grad_norm", context.grad_norm)
        lr = _learning_rate(context.optimizer)
        if lr is not None:
            ot.record("learning_rate", lr)
        if context.skipped_iter and self._skips is not None:
            self._skips.add(1)
        adapters.end_step(tokens=self._tokens, samples=self._samples)

    def on_eval_start(self, context: Any) -> None:
        self._span = ot.span("eval", {"train.step": context.state.train_state.step}).start()

    def on_test_start(self, context: Any) -> None:
        self._span = ot.span("test", {"train.step": context.state.train_state.step}).start()

    def on_eval_step_end(self, context: Any) -> None:
        adapters.heartbeat()  # an eval batch: a long evaluation is no stall

    on_test_step_end = on_eval_step_end

    def on_eval_end(self, context: Any) -> None:
        self._close_span("eval", context)

    def on_test_end(self, context: Any) -> None:
        self._close_span("test", context)

    def _close_span(self, name: str, context: Any) -> None:
        """End the eval/test span; its losses (`total_loss_dict`, tensors) as `<name>/<loss>`."""
        if self._span is not None:
            self._span.stop()
            self._span = None
        losses = context.total_loss_dict or {}
        ot.log_metrics({f"{name}/{_loss_name(k)}": v for k, v in losses.items() if isinstance(k, str)})

    def on_train_end(self, context: Any) -> None:
        owns_session, self._owns_session = self._owns_session, False
        end_training(owns_session)


def _loss_name(key: Any) -> str:
    """Bridge's loss_dict keys as record names: `lm loss` -> `loss`, `mtp_1 loss` -> `mtp_1_loss`."""
    name = str(key).strip()
    return "loss" if name == "lm loss" else name.replace(" ", "_")


def _learning_rate(optimizer: Any) -> float | None:
    """The learning rate Bridge logs: the last param group's that is not a decoupled one."""
    lr = None
    for group in getattr(optimizer, "param_groups", None) or ():
        if isinstance(group, Mapping) and not group.get("is_decoupled_lr", False) and "lr" in group:
            lr = group["lr"]
    return lr


def _rank_shares(cfg: Any) -> tuple[int | None, int | None]:
    """This rank's even share of the job's tokens (global batch x sequence length) and samples per
    step, so that summing `train.tokens` over ranks gives the job's total."""
    batch = _get(getattr(cfg, "train", None), "global_batch_size")
    seq = _get(getattr(cfg, "model", None), "seq_length")
    info = ot.run_info()
    rank, world = (info.rank, max(info.world_size, 1)) if info is not None else (0, 1)

    def share(total: Any) -> int | None:
        return rank_share(total, rank, world) if isinstance(total, int) and total > 0 else None

    return share(batch * seq if isinstance(batch, int) and isinstance(seq, int) else None), share(batch)


def _hparams(cfg: Any) -> dict[str, Any]:
    """Bridge's ConfigContainer as plain values (its own `to_dict()` when it works)."""
    try:
        raw = cfg.to_dict()
    except Exception:  # Megatron Bridge's own to_dict()
        raw = cfg
    plain = _plain(raw, 0)
    return plain if isinstance(plain, dict) else {"config": plain}


def _plain(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth >= 4:
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return str(value)


# --- Bridge LoggerConfig -> otel_train settings ----------------------------------------------------


def _get(source: Any, name: str) -> Any:
    if source is None:
        return None
    if isinstance(source, Mapping):
        return source.get(name)
    return getattr(source, name, None)


def settings_from_logger_config(logger: Any) -> dict[str, Any]:
    """`ot.init()` settings from a Bridge `LoggerConfig` (or the `logger:` mapping of a Bridge YAML).
    Only options that are set appear; see the README's Megatron section for the full mapping."""

    def get(name: str) -> Any:
        return _get(logger, name)

    out: dict[str, Any] = {}
    if isinstance(get("log_interval"), int) and get("log_interval") > 0:
        out["log_interval"] = get("log_interval")
    if get("timing_log_level") is not None:  # Bridge's -1 (no timers): 0, step time only
        out["timing_log_level"] = min(max(int(get("timing_log_level")), 0), 2)
    if get("timing_log_option") is not None:
        out["timing_log_option"] = get("timing_log_option")
    if get("tensorboard_dir"):
        # otel_train writes <output_dir>/<run>/tensorboard: `tensorboard --logdir <tensorboard_dir>` still works
        out.update(tensorboard=True, output_dir=str(get("tensorboard_dir")))
    run_name = None
    if get("wandb_project"):
        out.update(wandb=True, wandb_project=get("wandb_project"))
        if get("wandb_entity"):
            out["wandb_entity"] = get("wandb_entity")
        run_name = get("wandb_exp_name") or None
    if get("mlflow_experiment"):
        out.update(mlflow=True, mlflow_experiment=get("mlflow_experiment"))
        run_name = run_name or get("mlflow_run_name") or None
    if get("mlflow_tracking_uri"):
        out["mlflow_tracking_uri"] = get("mlflow_tracking_uri")
    if run_name:
        out["run_name"] = str(run_name)
    if get("log_memory_to_tensorboard") or get("log_energy"):
        out["hardware"] = True  # otel_train samples memory, power and energy with `hardware` (default on)
    return out
