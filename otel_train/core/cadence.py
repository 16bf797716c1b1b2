"""When the training thread flushes: every `log_interval` steps, or, by default, at a human cadence;
distributed, at step-anchored steps, rank 0's schedule travelling in its answers. Design:
docs/design/core.md#cadence.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator

log = logging.getLogger("otel_train")

ADAPTIVE_BASE_STEPS = 10
# The worker's CPU per flush stays under WORKER_SHARE of the time between flushes, stretching the
# interval at most MAX_STRETCH x log_interval_min_s (docs/design/core.md#cadence).
WORKER_SHARE = 0.0025
MAX_STRETCH = 2.0
_NEVER = 2**62  # due_step when flushes are counted, not scheduled
_NICE = (1, 2, 5)
VALUE_HEADROOM = 2.0  # the adaptive interval leaves room for twice the measured values per step


def nice_interval(
    step_s: float, min_s: float, max_s: float, base: int = ADAPTIVE_BASE_STEPS, most_steps: int = _NEVER
) -> int:
    """Steps per flush for steps of `step_s` seconds: the smallest nice number of steps that lasts
    at least `min_s`, never below `base`, and no longer than `max_s` (when that is >= base);
    never more than `most_steps` (what the per-interval lists hold), not even to reach `base`."""
    if not math.isfinite(step_s) or step_s <= 0:
        return min(base, most_steps)
    needed = math.ceil(min_s / step_s)
    steps = next(n for n in _nice(base) if n >= needed)
    longest = max(base, int(min(max_s / step_s, _NEVER)))  # log_interval_s=inf
    return min(steps, longest, _nice_at_most(most_steps, base))


def _nice(base: int) -> Iterator[int]:
    """base x (1, 2, 5) x 10^k, ascending, without end."""
    for scale in itertools.count():
        yield from (base * factor * 10**scale for factor in _NICE)


def _nice_at_most(steps: int, base: int) -> int:
    """The largest nice number of steps that is at most `steps` (`steps` itself below base)."""
    if steps < base:
        return max(1, steps)
    return max(itertools.takewhile(lambda n: n <= steps, _nice(base)))


def steps_that_fit(max_values: int, values_per_step: float) -> int:
    """The most steps one flush interval may span so that no per-interval list outgrows
    `max_values`, given the densest list's values per step on the last flush (0: not measured).
    VALUE_HEADROOM keeps room for a loop whose density rises or is not measured yet."""
    return max(1, int(max_values / (VALUE_HEADROOM * max(1.0, values_per_step))))


def _grid_next(anchor: int, interval: int, step: int) -> int:
    """The first flush step after `step` on the schedule anchor + n x interval."""
    return anchor + ((step - anchor) // interval + 1) * interval


class Cadence:
    """The training thread's flush trigger (hot path: `index >= due_step or steps >= threshold`,
    then `due()`). `log_interval`: None is adaptive; `coordinated`: flush steps are step-anchored;
    `decides`: this is rank 0 (the others `adopt()` its decisions, from the worker).
    """

    def __init__(
        self,
        log_interval: int | None,
        min_interval_s: float,
        max_interval_s: float,
        coordinated: bool,
        decides: bool = False,
    ) -> None:
        self.adaptive = log_interval is None
        self.interval = ADAPTIVE_BASE_STEPS if log_interval is None else log_interval
        self.anchor = -1  # the schedule: flushes end at steps anchor + n x interval
        self.threshold = self.interval  # counted steps that make a flush due (coordinated: a fallback)
        self._min_s = min_interval_s
        self._max_s = max_interval_s
        self._coordinated = coordinated
        self._decides = decides and coordinated and self.adaptive
        self.due_step = self.interval - 1 if coordinated else _NEVER
        self._next: tuple[int, int] | None = None  # (interval, anchor) the schedule switches to
        self._received: tuple[int, int] | None = None  # the newest decision from rank 0 (worker)
        self._taken: tuple[int, int] | None = None  # the one the training thread last looked at
        self._frozen = False  # the exchange is off: no more decisions
        self._last_flush = -1
        self.late_decisions = 0  # decisions that came after their anchor step (realigned later)

    @property
    def decision(self) -> tuple[int, int]:
        """(interval, anchor) of the newest schedule (rank 0 sends it down at each flush)."""
        return self._next if self._next is not None else (self.interval, self.anchor)

    # --- training thread ---------------------------------------------------------------------------
    def proposal(
        self, steps: int, elapsed_s: float, flush_cpu_s: float = 0.0, most_steps: int = _NEVER
    ) -> int:
        """This process's proposed interval after `steps` steps over `elapsed_s`, its worker
        spending `flush_cpu_s` a flush (0: unknown), at most `most_steps` (`steps_that_fit`)."""
        if not self.adaptive or steps <= 0:
            return self.interval
        min_s = self.min_flush_s(flush_cpu_s)
        return nice_interval(elapsed_s / steps, min_s, self._max_s, most_steps=most_steps)

    def min_flush_s(self, flush_cpu_s: float) -> float:
        """log_interval_min_s, stretched (at most MAX_STRETCH x) to keep a flush's CPU under WORKER_SHARE."""
        return max(self._min_s, min(flush_cpu_s / WORKER_SHARE, self._min_s * MAX_STRETCH))

    def flushed(self, proposal: int, step: int) -> None:
        """A flush (not the final one) whose last step is `step` was taken, proposing `proposal`."""
        if not self._coordinated:
            if self.adaptive:
                self.interval = self.threshold = proposal
            return
        self._last_flush = step
        if self._received is not self._taken:
            self._take(step)
        self.due_step = self._next_after(step)
        if self._decides and not self._frozen and self._next is None and proposal != self.interval:
            # From the next scheduled flush on: the others learn it a whole interval before it holds.
            self._next = (proposal, self.due_step)
        self._set_fallback(step)

    def due(self, steps: int, index: int) -> bool:
        """Called when `index >= due_step` or `steps >= threshold`: whether to flush now. Never waits."""
        if not self._coordinated:
            return steps >= self.threshold
        if self._last_flush < 0 and index > self.due_step:
            # The first steps came after the schedule's first flush step (a resumed run): its next one.
            self.due_step = self._next_after(index - 1)
        if self._received is not self._taken:
            self._take(index - 1)
            self.due_step = self._next_after(index - 1)
            self._set_fallback(self._last_flush)
        return index >= self.due_step or steps >= self.threshold

    def _set_fallback(self, step: int) -> None:
        """Counted steps after which a flush is due even off the schedule (numbering went back)."""
        longest = max(self.interval, self._next[0] if self._next is not None else 0)
        self.threshold = max(1, self.due_step - step) + longest

    def _take(self, step: int) -> None:
        """Adopt rank 0's newest decision, as the step after `step` begins (others than rank 0)."""
        self._taken = decided = self._received
        if decided is None or decided == self.decision or decided[1] < self.anchor:
            return
        if decided[1] <= self._last_flush:
            self.late_decisions += 1  # its anchor passed here: join it at the next step on it
        self._next = decided

    def _next_after(self, step: int) -> int:
        """The first flush step after `step`, switching to the pending schedule at its anchor."""
        if self._next is not None:
            interval, anchor = self._next
            if step < anchor:
                return min(_grid_next(self.anchor, self.interval, step), anchor)
            self.interval, self.anchor, self._next = interval, anchor, None
        return _grid_next(self.anchor, self.interval, step)

    # --- worker thread -----------------------------------------------------------------------------
    def adopt(self, interval_steps: int, anchor: int) -> None:
        """Rank 0's schedule from an answer (0 steps: the exchange is off, stop adapting). One
        assignment: the training thread reads it at its next due step."""
        if interval_steps >= 1:
            self._received = (int(interval_steps), int(anchor))
        else:
            self._frozen = True
