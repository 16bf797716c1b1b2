"""The adapter API: what a framework integration needs that a training loop does not (a step
begun and ended by hooks, phases the framework timed itself, the batch to fingerprint).

Every function here is a no-op before `ot.init()` and never raises into the framework for a bad
value. Example: docs/design/core.md#adapters.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING

# An adapter's hooks run once per step, not per op: `current()` (one call) is cheap here,
# unlike in ot.record/ot.timer, which read the module attribute directly.
from otel_train.core import Run, begin_step, current, end_step, phase, report_failure, shutdown

if TYPE_CHECKING:
    from otel_train.crossrank import StragglerReport

log = logging.getLogger("otel_train")

__all__ = [
    "Run",
    "begin_step",
    "current_run",
    "end_run",
    "end_step",
    "heartbeat",
    "idle",
    "on_straggler",
    "phase",
    "saving_checkpoint",
    "set_total_steps",
    "watch_batch",
    "watch_read",
]


def current_run() -> Run | None:
    """The running run, or None; unlike `ot.init()` it never starts one. Runs compare equal when
    they are the same session: an adapter that started a run checks `current_run() == mine`
    before ending it."""
    session = current()
    return Run(session) if session is not None else None


def idle() -> None:
    """The training loop pauses on purpose and the run stays open (between `fit` and `test`, or
    after training): no `stall` until the next step begins, and the steps since the last flush are
    flushed now. Call it after the last step ends, on the thread that runs the steps."""
    session = current()
    if session is not None:
        session.mark_idle()


def heartbeat() -> None:
    """The loop makes progress that is no step's end (an eval batch; a micro-batch of a step that
    accumulates gradients): the stall watchdog (`stall_timeout_s`) counts from now, so a long
    evaluation is no `stall` and a hung one still is, as is one still running `eval_timeout_s`
    after the last step. Call it once per batch; one clock read."""
    session = current()
    if session is not None:
        session.progress_ns = now = perf_counter_ns()
        if not session.step_start_ns:  # between steps: an evaluation, in goodput's books
            session.clock.eval_batch_ns = now


def end_run(failed: bool = False) -> None:
    """End the run now, as `ot.shutdown()` does (an integration's training is over); `failed`: the
    training raised, so the W&B and MLflow runs end as failed, and the progress file says so; called
    while that exception is handled, a `run_failed` event names it."""
    error = sys.exc_info()[1]
    if failed and error is not None:
        report_failure(error, "the training ended by")
    shutdown(failed)


def saving_checkpoint() -> None:
    """A checkpoint save begins, or comes before the next step: until the next step begins or an
    `ot.span("checkpoint")` ends, the stall watchdog waits `checkpoint_timeout_s` rather than
    `stall_timeout_s`, so a long save is no `stall` and a hung one still is."""
    session = current()
    if session is not None:
        session.open_marks["checkpoint"] = perf_counter_ns()


def set_total_steps(total_steps: int) -> None:
    """The run's plan changed (a second `fit` with another `max_steps`, early stopping): the ETA,
    the progress lines and `train.steps.planned` use `total_steps` from the next flush. Not an int
    >= 1: ignored with a warning."""
    session = current()
    if session is None:
        return
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        log.warning(
            "otel_train: set_total_steps(%r) ignored: the plan is a number of steps >= 1", total_steps
        )
        return
    session.config = dataclasses.replace(session.config, total_steps=total_steps)
    session.worker.total_steps = total_steps


def watch_batch(batch: object) -> None:
    """This step's batch, for `ot.watch`'s unsharded-data check (`data_not_sharded`). `ot.watch`
    fingerprints the first tensor argument of the watched model's first forward in a watched step by
    itself; call this inside the step when the batch never reaches that forward as an argument (a
    Lightning `training_step` that calls submodules). `batch` is a tensor, or a mapping / tuple /
    list whose first tensor (in order) is fingerprinted; the step's first fingerprint wins. Costs
    nothing on unwatched steps and in a single process; never raises."""
    session = current()
    if session is not None and session.watches:
        for handle in session.watches:
            handle.see_batch(batch)


def watch_read() -> None:
    """Take the watched step's `ot.watch` statistics now, not at the step's end: for a framework
    that clears the gradients before its step-end hook, outside an optimizer step `ot.watch` sees.
    Call it after the optimizer step; unwatched steps cost nothing."""

    session = current()
    if session is not None and session.watches:
        for handle in session.watches:
            handle.read_now()


def on_straggler(callback: Callable[[list[StragglerReport]], None]) -> None:
    """Call `callback(reports)` on EVERY rank with the same list of chronic stragglers (each a
    `StragglerReport`: rank, host, phase, lateness, the ranks that wait for it, ...), one flush
    after rank 0 found them, at the same flush on every rank while the ranks keep pace: for a
    decision all ranks must take alike (stop, checkpoint, drain a host). It runs on the thread
    of `ot.on_event`'s callbacks (it may block or call `ot.shutdown()`). Replaces an earlier
    callback. Before `init()`, or in a single process: never called."""
    session = current()
    if session is not None and callable(callback):
        hooks = session.events.hook_thread(session.instruments.dropped)
        session.reducer.on_straggler = functools.partial(hooks.submit, callback)
