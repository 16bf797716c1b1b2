"""Hugging Face `Trainer` integration: `Trainer(..., callbacks=[OtelTrainCallback()])`.

One `ot.step` per optimizer step (gradient accumulation aware: micro-batches are not steps), with
the phases the Trainer lets a callback see:

    data              from the end of the previous step (or its logging / eval / checkpoint) to
                      `on_step_begin`: the Trainer fetches all micro-batches of a step there
    forward_backward  `on_step_begin` -> `on_pre_optimizer_step` (all micro-batches, clipping)
    optimizer         `on_pre_optimizer_step` -> `on_optimizer_step`
    eval, checkpoint  spans (always traced) and phases, from the end of the step's logging to
                      `on_evaluate` / `on_save`

The Trainer's logs (`loss`, `learning_rate`, `grad_norm`, `eval_*`) go through `ot.log_metrics`;
they are Python floats by then, so the callback adds no device sync of its own. Tokens come from
`state.num_input_tokens_seen` (set `include_num_input_tokens_seen`), a job-wide count that is split
evenly across ranks so that summing `train.tokens` over ranks gives the job's total.

The session starts lazily at `on_train_begin` on every rank (with `total_steps=max_steps`) unless
the user already called `ot.init()`; a session the callback started is shut down at `on_train_end`.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter_ns
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import otel_train as ot
from otel_train.integrations._common import distributed_world, end_phase, scalar_logs, start_session

__all__ = ["OtelTrainCallback"]

# Keys of the Trainer's logs that duplicate what otel_train measures itself.
_SKIPPED_LOG_KEYS = frozenset({"num_input_tokens_seen", "train_tokens_per_second"})
_EVAL_PREFIXES = ("eval_", "test_", "predict_")


class OtelTrainCallback(TrainerCallback):
    """Telemetry for `transformers.Trainer`. `settings` are `ot.init()` settings used when the
    callback starts the session itself; `hyperparams=False` skips logging `TrainingArguments`."""

    def __init__(self, settings: Mapping[str, Any] | None = None, hyperparams: bool = True) -> None:
        self._settings = dict(settings or {})
        self._hyperparams = hyperparams
        self._owns_session = False
        self._mark_ns: int | None = None  # end of the last accounted stretch (step, log, eval, save)
        self._step: int | None = None
        self._step_start_ns = 0
        self._phase_start_ns = 0
        self._tokens_seen = 0

    # --- lifecycle -----------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        settings = dict(self._settings)
        if state.max_steps and state.max_steps > 0:
            settings.setdefault("total_steps", state.max_steps)
        self._owns_session = start_session(settings)
        if self._hyperparams:
            ot.log_hyperparams(args.to_dict())
        self._tokens_seen = state.num_input_tokens_seen
        self._mark_ns = perf_counter_ns()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._mark_ns = None
        if self._owns_session:
            self._owns_session = False
            ot.shutdown()

    # --- one optimizer step ----------------------------------------------------------------------
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = ot.current_session()
        if session is None:
            return
        now = perf_counter_ns()
        start = self._mark_ns if self._mark_ns is not None else now
        self._step = session.begin_step(state.global_step)
        self._step_start_ns = start
        if start < now:
            session.end_timer("data", start, now, None)
        self._phase_start_ns = now

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_phase("forward_backward")

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_phase("optimizer")

    def _end_phase(self, name: str) -> None:
        if self._step is not None:
            self._phase_start_ns = end_phase(name, self._phase_start_ns)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = ot.current_session()
        if session is None or self._step is None:
            return
        now = perf_counter_ns()
        tokens = self._rank_tokens(state.num_input_tokens_seen - self._tokens_seen, session.identity.rank)
        self._tokens_seen = state.num_input_tokens_seen
        session.end_step(self._step, self._step_start_ns, now, tokens or None, None, False)
        self._step = None
        self._mark_ns = now

    # --- logs, eval, checkpoints -----------------------------------------------------------------
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs or ot.current_session() is None:
            return
        ot.log_metrics(scalar_logs(logs, _SKIPPED_LOG_KEYS))
        in_eval = any(isinstance(k, str) and k.startswith(_EVAL_PREFIXES) for k in logs)
        if self._mark_ns is not None and not in_eval:
            # The training log (with its loss gather) is not data wait or eval time.
            self._mark_ns = perf_counter_ns()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close_mark("eval", state)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close_mark("checkpoint", state)

    def _close_mark(self, name: str, state: TrainerState) -> None:
        session = ot.current_session()
        if session is None or self._mark_ns is None:
            return  # e.g. trainer.evaluate() outside training: no start point known
        now = perf_counter_ns()
        session.end_mark(name, self._mark_ns, now, None, {"train.step": state.global_step})
        self._mark_ns = now

    @staticmethod
    def _rank_tokens(job_tokens: int, rank: int) -> int:
        """This rank's share of a job-wide token count (shares sum to the total exactly)."""
        world = distributed_world()
        if job_tokens <= 0 or world <= 1:
            return max(job_tokens, 0)
        share, rest = divmod(job_tokens, world)
        return share + (1 if rank < rest else 0)
