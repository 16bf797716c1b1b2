"""Profiler windows: `run.profile(...)` (the `Run` `ot.init()` returns) drives `torch.profiler` on
a step schedule.

    run.profile(wait=10, warmup=1, active=3)       # steps 11-13 from now, on every rank

Each active stretch becomes a chrome trace in the run directory. Design: docs/design/core.md#profiling.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.distributed import Identity
from otel_train.run_directory import RunFiles

log = logging.getLogger("otel_train")


# Caps on one window (from ot.profile and from control.json alike): a trace grows by tens of MB per
# recorded step and is written at the window's end, on the training thread.
MAX_ACTIVE = 50  # recorded steps per cycle
MAX_RECORDED = 100  # recorded steps in the whole window (repeat * active)
MAX_WINDOW = 100_000  # steps from the call to the window's end (skip_first + repeat * cycle)
_FIELDS = ("wait", "warmup", "active", "repeat", "skip_first")


def window_problem(options: dict[str, Any]) -> str | None:
    """None when `options` (ProfileWindow fields) make a window within the caps, else what is wrong."""
    numbers = {"wait": 0, "warmup": 1, "active": 3, "repeat": 1, "skip_first": 0}
    for key in _FIELDS:
        value = options.get(key, numbers[key])
        try:
            numbers[key] = operator.index(value)  # numpy integers too; not floats or strings
        except TypeError:
            value = None
        if value is None or isinstance(value, bool):
            return f"profile {key}={options.get(key)!r}: use an integer"
    wait, warmup, skip_first = numbers["wait"], numbers["warmup"], numbers["skip_first"]
    active, repeat = numbers["active"], numbers["repeat"]
    if min(wait, warmup, skip_first) < 0 or not 1 <= active <= MAX_ACTIVE or repeat < 1:
        return f"use wait/warmup/skip_first >= 0, active >= 1 (at most {MAX_ACTIVE}) and repeat >= 1"
    if active * repeat > MAX_RECORDED:
        return f"repeat * active = {active * repeat}: at most {MAX_RECORDED} recorded steps per window"
    if skip_first + repeat * (wait + warmup + active) > MAX_WINDOW:
        return f"skip_first + repeat * (wait + warmup + active): at most {MAX_WINDOW} steps"
    return None


@dataclass(frozen=True)
class ProfileWindow:
    """A torch.profiler schedule in steps, within the caps above (`repeat=0` would never end)."""

    wait: int = 0
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    skip_first: int = 0

    def __post_init__(self) -> None:
        problem = window_problem(dataclasses.asdict(self))
        if problem is not None:
            raise ValueError(f"ot.profile: {problem} (got {self})")

    @property
    def length(self) -> int:
        return self.skip_first + self.repeat * (self.wait + self.warmup + self.active)

    def is_active(self, position: int) -> bool:
        """Is the `position`-th step of the window (0 = the first step after the call) recorded?"""
        if position < self.skip_first or position >= self.length:
            return False
        cycle = self.wait + self.warmup + self.active
        return (position - self.skip_first) % cycle >= self.wait + self.warmup


class StepProfiler:
    """One window of torch.profiler on this rank, advanced by the session at each step end."""

    def __init__(self, window: ProfileWindow, out_dir: Path) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.window = window
        self.out_dir = out_dir
        self.busy = False  # torch.profiler works between steps (stops, processes, writes a trace)
        self._position = 0
        self._active_steps: list[int] = []
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # ProfileWindow's fields are torch.profiler.schedule's arguments
        self._profiler = profile(
            activities=activities, schedule=schedule(**dataclasses.asdict(window)), on_trace_ready=self._save
        )
        self._profiler.start()

    @property
    def done(self) -> bool:
        return self._position >= self.window.length

    def next_step_active(self) -> bool:
        return self.window.is_active(self._position)

    def step_ended(self, step: int) -> bool:
        """Advance the profiler past `step`; True when `step` was recorded."""
        active = self.window.is_active(self._position)
        if active:
            self._active_steps.append(step)
        self._position += 1
        self.busy = True  # seconds for a large window: the stall watchdog counts it as progress
        try:
            self._profiler.step()  # may call _save (on this thread) when an active stretch ends
            if self.done:
                self._profiler.stop()
        finally:
            self.busy = False
        return active

    def stop(self) -> None:
        if not self.done:
            self._position = self.window.length
            self._profiler.stop()

    def _save(self, profiler: Any) -> None:
        steps, self._active_steps = self._active_steps, []  # this stretch's (one cut short: fewer)
        name = f"steps{steps[0]}-{steps[-1]}.json" if steps else f"position{self._position}.json"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / name
        try:
            profiler.export_chrome_trace(str(path))
        except Exception as exc:  # torch.profiler's export (and a full disk) must not stop training
            log.warning("otel_train: could not write the profiler trace %s: %s", path, exc)
            return
        log.info("otel_train: profiler trace for steps %s written to %s", steps, path)


class ProfiledStepsCounter:
    """Flush listener: adds the steps profiled since the last flush to `train.profiler.steps`."""

    def __init__(self, meter: Any) -> None:
        self._counter = semconv.PROFILED_STEPS.create(meter)
        self._counter.add(0)
        self.total = 0  # written by the training thread only
        self._reported = 0  # read and written by the worker only

    def on_flush(self, interval: Interval) -> None:
        total = self.total
        if total > self._reported:
            self._counter.add(total - self._reported)
            self._reported = total

    def close(self) -> None:
        pass


def start_window(
    window: ProfileWindow,
    base: Path,
    ident: Identity,
    ranks: Sequence[int] | None,
    warn: Callable[[str], None],
) -> StepProfiler | None:
    """A profiler for this rank (`ident`) writing under `base` (the run dir), or None when it is not
    among `ranks`."""
    if ranks is not None and ident.rank not in ranks:
        return None
    try:
        return StepProfiler(window, RunFiles(base, ident.rank, ident.role).profiles)
    except (ImportError, RuntimeError) as exc:  # torch missing or a profiler already running here
        warn(f"otel_train: ot.profile could not start torch.profiler: {exc}")
        return None


def advance_window(session: Any, index: int) -> bool:
    """Step `index` ended: advance `session.profiler` (None once its window is done) and count the
    profiler's own work, which may take seconds (stopping, writing a trace), as the loop's progress
    (`session.progress_ns`: no stall). Whether the step was profiled. A profiler that fails is
    stopped with a warning: it must not stop training."""
    profiler: StepProfiler = session.profiler
    try:
        profiled = profiler.step_ended(index)
    except RuntimeError as exc:  # torch.profiler's errors
        log.warning("otel_train: torch.profiler failed and was stopped: %s", exc)
        profiled, session.profiler = False, None
    else:
        session.profiler = None if profiler.done else profiler
    session.profiled_steps.total += profiled
    session.progress_ns = max(session.progress_ns, time.perf_counter_ns())
    return profiled
