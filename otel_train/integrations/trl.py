"""TRL integration: `otel_train.integrations.trl.instrument(trainer)` before `trainer.train()`.

Adds the Hugging Face callback, TRL's own profiled blocks as timers (`generation`, `rewards`,
`loss`, ...) and GRPO's completions as samples.
How it works: docs/design/integrations.md#trl.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from trl.extras.profiling import ProfilingContext

import otel_train as ot
from otel_train import adapters
from otel_train.integrations._common import ending_on_error, settings_from_kwargs
from otel_train.integrations.transformers import OtelTrainCallback

__all__ = ["OtelTrainTrlCallback", "disable_profiling", "enable_profiling", "instrument", "phase_name"]

# TRL's profiled block names (after the "<TrainerClass>." prefix) onto otel_train phase names.
_PHASES = {
    "transformers.generate": "generation",
    "transformers.generate_batch": "generation",
    "vLLM.generate": "generation",
    "_calculate_rewards": "rewards",
    "compute_loss": "loss",
    "_get_per_token_logps_and_entropies": "logprobs",
    "_prepare_inputs": "prepare_inputs",
}
_TIMER_ATTR = "_otel_train_timer"  # the otel_train timer a ProfilingContext instance runs
_original: tuple[Any, Any] | None = None  # ProfilingContext's own __enter__/__exit__ while patched
_reward_names: frozenset[str] = frozenset()
_ENDING = "_otel_train_trl_wrapped"  # marks a trainer.train that ends the run on error (instrument)


def phase_name(profiled: str) -> str:
    """otel_train's phase for a TRL profiling name such as `GRPOTrainer._calculate_rewards`."""
    block = profiled.split(".", 1)[1] if "." in profiled else profiled
    return f"reward.{block}" if block in _reward_names else _PHASES.get(block, block.lstrip("_") or block)


def enable_profiling(reward_names: Iterable[str] = ()) -> None:
    """Time every `ProfilingContext` block as an otel_train timer (idempotent; `reward_names`: the
    trainer's reward functions, reported as `reward.<name>`). Undo with `disable_profiling()`."""
    global _original, _reward_names
    _reward_names = frozenset(reward_names)
    if _original is not None:
        return
    enter, exit_ = ProfilingContext.__enter__, ProfilingContext.__exit__

    def __enter__(self: ProfilingContext) -> Any:
        result = enter(self)
        setattr(self, _TIMER_ATTR, ot.timer(phase_name(self.name)).start())
        return result

    def __exit__(self: ProfilingContext, exc_type: Any, exc: Any, tb: Any) -> Any:
        timer = self.__dict__.pop(_TIMER_ATTR, None)
        if timer is not None:
            timer.stop(exc_type)
        adapters.heartbeat()  # a block of the step done: a step of many (GRPO's) is no stall
        return exit_(self, exc_type, exc, tb)

    _original = (enter, exit_)
    ProfilingContext.__enter__ = __enter__  # type: ignore[method-assign]
    ProfilingContext.__exit__ = __exit__  # type: ignore[method-assign]


def disable_profiling() -> None:
    """Restore TRL's own `ProfilingContext` (idempotent)."""
    global _original
    if _original is not None:
        ProfilingContext.__enter__, ProfilingContext.__exit__ = _original  # type: ignore[method-assign]
        _original = None


class OtelTrainTrlCallback(TrainerCallback):
    """TRL's profiled phases and GRPO's completions for one trainer (docs/design/integrations.md#trl)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._samples_step = -1  # the step whose completions were last sent
        self._sent: list[Any] = []  # those completions (held: compared by identity)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        enable_profiling(getattr(self._trainer, "reward_func_names", ()))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        disable_profiling()

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # The step the log follows (HF calls on_log after on_step_end): index global_step - 1.
        step = state.global_step - 1
        if not state.is_world_process_zero or step < 0 or step == self._samples_step:
            return
        # GRPO keeps the latest generation batch's prompts and completions in `_logs` (gathered
        # from every rank) for its own console table; TRL has no public accessor for them.
        logs = getattr(self._trainer, "_logs", None)
        if not isinstance(logs, dict) or not logs.get("completion"):
            return
        completions = list(logs["completion"])
        if len(completions) == len(self._sent) and all(map(operator.is_, completions, self._sent)):
            return  # the batch already sent: TRL keeps it until the next generation (steps_per_generation)
        self._samples_step, self._sent = step, completions
        rows = list(zip(logs.get("prompt", ()), completions, strict=False))
        ot.log_samples([(_text(p), _text(c)) for p, c in rows], step=step, name="completions")


def _text(value: Any) -> str:
    """A prompt or completion: a string, or a conversation (a list of {"role", "content"})."""
    if isinstance(value, list):
        return "\n".join(
            f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in value
        )
    return str(value)


def instrument(trainer: Trainer, **settings: Any) -> Trainer:
    """Telemetry for a TRL trainer (docs/design/integrations.md#trl); keyword arguments are `ot.init()` settings
    (`Config` fields) for the session the HF callback starts. Returns the trainer."""
    settings = settings_from_kwargs(None, settings, "instrument")
    callbacks = trainer.callback_handler.callbacks
    hf = next((cb for cb in callbacks if isinstance(cb, OtelTrainCallback)), None)
    if hf is None:
        hf = OtelTrainCallback(settings)
        trainer.add_callback(hf)
        # As if passed to Trainer(callbacks=...): no reporter has begun a run yet, so the Trainer's
        # reporter for a backend otel_train bridges to comes off here (one run there, not two).
        hf.attach(trainer)
    if not any(isinstance(cb, OtelTrainTrlCallback) for cb in callbacks):
        trainer.add_callback(OtelTrainTrlCallback(trainer))
    if not getattr(trainer.train, _ENDING, False):
        # If train() raises, no on_train_end comes: TRL's ProfilingContext is restored and the HF
        # callback's run ended (idempotent: its own wrapper may end it too, but it wraps `train`
        # only at its first on_train_begin when added with add_callback, too late for that call).
        ending = ending_on_error(trainer.train, _ENDING, disable_profiling, lambda: hf.close(failed=True))
        trainer.train = ending  # type: ignore[method-assign]
    return trainer
