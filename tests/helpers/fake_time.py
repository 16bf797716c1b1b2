"""A hand-moved clock for goodput tests: a running session's steps, timers and spans read it
(scopes' `perf_counter_ns`), and so does its goodput account (`goodput.Clocks`), so a test books
0.2 s of eval by advancing 0.2 s, not by sleeping.

It starts at the real clocks' readings, so the session's real process start stays consistent
with it; from then on only `advance` moves it.
"""

from __future__ import annotations

import time
from typing import Any

from otel_train.core import scopes
from otel_train.goodput import Clocks


class FakeTime:
    def __init__(self) -> None:
        self.perf_ns = time.perf_counter_ns()
        self.wall_s = time.time()
        boot = Clocks().boot()  # (boot id, seconds since boot) where the system has them
        self.boot_id, self.boot_s = boot if boot is not None else (None, 0.0)

    def advance(self, seconds: float) -> None:
        self.perf_ns += round(seconds * 1e9)
        self.wall_s += seconds
        self.boot_s += seconds

    def clocks(self, started_s: float) -> Clocks:
        """goodput's clocks on this time line, for a process that started at `started_s` (perf s)."""
        boot_id = self.boot_id
        return Clocks(
            perf=lambda: self.perf_ns * 1e-9,
            wall=lambda: self.wall_s,
            boot=lambda: None if boot_id is None else (boot_id, self.boot_s),
            started=lambda: started_s,
        )

    def install(self, session: Any, monkeypatch: Any = None) -> FakeTime:
        """Drive `session` (already initialised) by this clock until the test ends (`monkeypatch`
        undoes it then; without one, in a child process, for the rest of the process)."""
        if monkeypatch is not None:
            monkeypatch.setattr(scopes, "perf_counter_ns", lambda: self.perf_ns)
        else:
            scopes.perf_counter_ns = lambda: self.perf_ns
        session.clock.clocks = self.clocks(session.clock.process_start_s)
        return self
