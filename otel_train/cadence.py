"""When the training thread flushes: every `log_interval` steps, or, by default, at a human cadence.

A flush every 10 steps is 100 flushes a second at 10 ms steps: 100 console lines, 100 SDK
collections and 100 bridge writes a second, each paid for on the training process's GIL, while
Prometheus scrapes every 15 s. So unless the user sets `log_interval`, the cadence adapts: every
`ADAPTIVE_BASE_STEPS` steps, but not more often than about once per `log_interval_min_s`, rounded
up to a "nice" number of steps (10, 20, 50, 100, 200, 500, ...), so step numbers in the console
and the bridges stay readable. An explicit `log_interval` keeps its exact meaning.

Distributed: every rank must flush at the same step (each flush issues one exchange, and
mismatched exchanges hang). The interval is therefore decided on rank 0 only, from rank 0's
own step times, and travels to every rank in the exchange that already runs at each flush (a
header field of rank 0's answer, `downwire`, which every rank receives in that same flush's
exchange, unlike the straggler verdicts, which ride one flush later): the value carried by flush k
sets the interval between flush k+1 and flush k+2 on every rank (a lag of one flush, so that the
worker's exchange has a whole interval to finish). A rank whose worker has not delivered it yet
when it is needed waits for it (bounded by `collective_timeout_s`). Adaptive intervals are never
below `ADAPTIVE_BASE_STEPS`, so that wait can only start `ADAPTIVE_BASE_STEPS` steps after flush
k+1; at a human cadence the worker is long done. If the exchange fails (a peer died), the
reducer reports no decision and every rank keeps its last interval: no exchange runs any more,
so nothing can hang on a disagreement. Independent ranks (`cross_rank=False`) exchange nothing:
each adapts its own interval and never waits.
"""

from __future__ import annotations

import logging
import math
import threading
import time

log = logging.getLogger("otel_train")

ADAPTIVE_BASE_STEPS = 10
WAIT_WARNING_S = 1.0  # a training-thread wait for the exchange this long is warned about (once)
_NICE = (1, 2, 5)


def nice_interval(step_s: float, min_s: float, max_s: float, base: int = ADAPTIVE_BASE_STEPS) -> int:
    """Steps per flush for steps of `step_s` seconds: the smallest of base x (1, 2, 5) x 10^k that
    lasts at least `min_s`, never below `base`, and no longer than `max_s` (when that is >= base)."""
    if not math.isfinite(step_s) or step_s <= 0:
        return base
    needed = math.ceil(min_s / step_s)
    scale = 1
    while True:
        for factor in _NICE:
            steps = base * factor * scale
            if steps >= needed:
                longest = max(base, int(max_s / step_s))
                return min(steps, longest)
        scale *= 10


class Cadence:
    """The training thread's flush trigger (hot path: `steps >= threshold`, then `due()`).

    `log_interval`: the user's explicit value (None: adaptive). `coordinated`: distributed, so the
    adaptive interval comes from rank 0 through `adopt()` (called by the worker after the exchange).
    """

    def __init__(
        self,
        log_interval: int | None,
        min_interval_s: float,
        max_interval_s: float,
        coordinated: bool,
        wait_timeout_s: float,
    ) -> None:
        self.adaptive = log_interval is None
        self.threshold = ADAPTIVE_BASE_STEPS if log_interval is None else log_interval
        self._agreed = self.threshold  # the last interval every rank adopted (coordinated)
        self._min_s = min_interval_s
        self._max_s = max_interval_s
        self._coordinated = coordinated and self.adaptive
        self._wait_timeout_s = wait_timeout_s
        self._decisions: dict[int, int] = {}  # flush seq -> interval carried by that flush (0: none)
        self._awaited: int | None = None  # the flush seq whose decision sets the current interval
        self._changed = threading.Condition()
        self._warned = False
        self._wait_warned = False

    # --- training thread ---------------------------------------------------------------------------
    def proposal(self, steps: int, elapsed_s: float) -> int:
        """This process's proposed interval after an interval of `steps` steps over `elapsed_s`."""
        if not self.adaptive or steps <= 0:
            return self.threshold
        return nice_interval(elapsed_s / steps, self._min_s, self._max_s)

    def flushed(self, seq: int, proposal: int) -> None:
        """Flush `seq` (not the final one) was handed to the worker carrying `proposal`."""
        if not self.adaptive:
            return
        if not self._coordinated:
            self.threshold = proposal
            return
        # The interval up to flush seq+1 was carried by flush seq-1 (the first two use the base).
        self._awaited = seq - 1 if seq >= 1 else None
        if self._awaited is not None:
            with self._changed:
                decided = self._decisions.pop(self._awaited, None)
                for old in [s for s in self._decisions if s < self._awaited]:
                    del self._decisions[old]
            if decided is not None:
                self._awaited = None
                self._apply(decided)
                return
        self.threshold = ADAPTIVE_BASE_STEPS  # a lower bound until the decision arrives

    def due(self, steps: int) -> bool:
        """Called when `steps >= threshold`: whether to flush now (may wait for rank 0's decision)."""
        if self._awaited is None:
            return steps >= self.threshold
        seq, self._awaited = self._awaited, None
        waited_from = time.perf_counter()
        with self._changed:
            if self._changed.wait_for(lambda: seq in self._decisions, self._wait_timeout_s):
                decided: int | None = self._decisions.pop(seq)
            else:
                decided = None
        self.note_wait(time.perf_counter() - waited_from)
        if decided is None:
            self.threshold = self._agreed
            if not self._warned:
                self._warned = True
                log.warning(
                    "otel_train: no flush interval from rank 0 for flush %d within %.0f s; keeping %d steps",
                    seq,
                    self._wait_timeout_s,
                    self.threshold,
                )
        else:
            self._apply(decided)
        return steps >= self.threshold

    def note_wait(self, seconds: float) -> None:
        """The training thread waited `seconds` for the exchange with the other ranks (here for rank
        0's interval, or in the flush for the worker, itself in an exchange). Ranks in lockstep
        wait for each other anyway; independent ranks must not, so say once how to stop it."""
        if seconds < WAIT_WARNING_S or self._wait_warned:
            return
        self._wait_warned = True
        log.warning(
            "otel_train: the training thread waited %.1f s for the telemetry exchange with the other "
            "ranks (a rank reaches its flushes later: it is slower, idle or paused). Ranks that train in "
            "lockstep (DDP, FSDP) wait for each other anyway; if these ranks are independent "
            "(evaluators, RL workers, separate trials), set cross_rank=False (OTEL_TRAIN_CROSS_RANK=0) "
            "so that telemetry never makes one wait for another.",
            seconds,
        )

    def _apply(self, decided: int) -> None:
        if decided >= 1:
            self._agreed = decided
        # 0: the exchange did not run (reducer disabled): every rank keeps the last agreed interval
        self.threshold = self._agreed

    # --- worker thread -----------------------------------------------------------------------------
    def adopt(self, seq: int, interval_steps: int) -> None:
        """The interval rank 0 carried in flush `seq`'s exchange (0: no exchange ran)."""
        with self._changed:
            self._decisions[seq] = max(0, int(interval_steps))
            self._changed.notify_all()
