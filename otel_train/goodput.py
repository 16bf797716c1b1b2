"""Goodput: each rank's wall time split into productive steps and badput by cause.

    productive  training steps (minus eval / checkpoint spans that run inside a step)
    startup     process start -> first step
    eval        `ot.span("eval" | "validation" | "generate" ...)` spans
    checkpoint  `ot.span("checkpoint" | "save" ...)` spans
    stall       gaps between steps longer than `stall_timeout_s` (less any span inside the gap)
    restart     from the last record of the previous process of the same run id to this start
    other       the rest (logging, short gaps between steps, spans of other names)

The training thread only keeps a few cumulative nanosecond counters (a compare per step, the rest
when a span ends or a long gap closes); this listener turns them into `train.goodput` and
`train.badput.duration{train.badput.cause}` at each flush and saves the totals to
`goodput.rank<k>.json`, so a restart of the same run id continues the account (DESIGN: the run id
is stable across restarts when the scheduler gives one).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from otel_train import semconv
from otel_train.interval import Interval

log = logging.getLogger("otel_train")

SAVE_EVERY_S = 5.0  # goodput.rank<k>.json is rewritten at most this often (and at the last flush)
CAUSES = ("startup", "eval", "checkpoint", "stall", "restart", "other")
_EVAL_NAMES = {"eval", "evaluate", "evaluation", "validation", "validate", "val", "test", "generate"}
_EVAL_NAMES |= {"sample", "samples", "sampling"}
_CHECKPOINT_NAMES = {"checkpoint", "ckpt", "save", "save_checkpoint", "load_checkpoint", "checkpointing"}


def span_cause(name: str) -> str:
    """The badput cause of an `ot.span` name: eval, checkpoint, or other."""
    lower = name.lower().replace("-", "_")
    if lower in _EVAL_NAMES or lower.startswith(("eval", "valid")):
        return "eval"
    if lower in _CHECKPOINT_NAMES or "checkpoint" in lower:
        return "checkpoint"
    return "other"


class StepClock(Protocol):
    """What the session's training thread keeps (cumulative, written by that thread only)."""

    process_start_s: float  # perf_counter seconds at process start
    first_step_start_ns: int | None
    stall_ns: int
    nested_badput_ns: int  # eval/checkpoint spans inside steps (not productive)
    span_ns: dict[str, int]  # per cause, all eval/checkpoint spans


class GoodputListener:
    def __init__(self, clock: StepClock, meter: Any, state_path: Path | None, run_id: str) -> None:
        self._clock = clock
        self._state_path = state_path
        self._run_id = run_id
        self._gauge = meter.create_gauge(
            semconv.GOODPUT.name, semconv.GOODPUT.unit, semconv.GOODPUT.description
        )
        self._badput = meter.create_counter(
            semconv.BADPUT_DURATION.name, semconv.BADPUT_DURATION.unit, semconv.BADPUT_DURATION.description
        )
        for cause in CAUSES:
            self._badput.add(0, {semconv.BADPUT_CAUSE: cause})
        self.step_s = 0.0  # this process's step time (worker-side, from the flushed durations)
        self.steps = 0
        self._previous = _load(state_path, run_id)
        self._reported = dict.fromkeys(CAUSES, 0.0)
        self._saved_at = 0.0
        self.totals: dict[str, float] = {}  # the last account, job-wide (for tests and summaries)
        if self._previous is not None:
            gap = max(0.0, _process_start_epoch(clock) - self._previous["updated"])
            self._previous["badput"]["restart"] += gap
            self._previous["wall_s"] += gap

    def on_flush(self, interval: Interval) -> None:
        self.step_s += math.fsum(interval.step_durations)
        self.steps += interval.steps
        account = self.account()
        self.totals = account
        if interval.steps:
            self._report(account)
        if interval.final or time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._save(account)

    def _report(self, account: dict[str, float]) -> None:
        """Metrics move only with flushes that carry steps: a flush without steps (a
        `log_metrics(step=...)` or the final one) repeats the last step, and bridges keep one
        value per step. The state file and the end-of-run summary still get the last account."""
        for cause in CAUSES:
            delta = account[cause] - self._reported[cause]
            if delta > 0:
                self._badput.add(delta, {semconv.BADPUT_CAUSE: cause})
                self._reported[cause] = account[cause]
        if account["wall_s"] > 0:
            self._gauge.set(account["productive_s"] / account["wall_s"])

    def account(self) -> dict[str, float]:
        """Job-wide totals in seconds: `wall_s`, `productive_s` and one entry per cause."""
        clock = self._clock
        wall = time.perf_counter() - clock.process_start_s
        first = clock.first_step_start_ns
        startup = (first * 1e-9 - clock.process_start_s) if first is not None else wall
        productive = max(0.0, self.step_s - clock.nested_badput_ns * 1e-9)
        badput = {
            "startup": max(0.0, startup),
            "eval": clock.span_ns.get("eval", 0) * 1e-9,
            "checkpoint": clock.span_ns.get("checkpoint", 0) * 1e-9,
            "stall": clock.stall_ns * 1e-9,
            "restart": 0.0,
        }
        badput["other"] = max(0.0, wall - productive - sum(badput.values()))
        previous = self._previous
        if previous is not None:
            wall += previous["wall_s"]
            productive += previous["productive_s"]
            for cause in CAUSES:
                badput[cause] += previous["badput"][cause]
        return {"wall_s": wall, "productive_s": productive, **badput}

    def _save(self, account: dict[str, float]) -> None:
        self._saved_at = time.monotonic()
        if self._state_path is None:
            return
        state = {
            "run_id": self._run_id,
            "updated": time.time(),
            "wall_s": account["wall_s"],
            "productive_s": account["productive_s"],
            "badput": {cause: account[cause] for cause in CAUSES},
        }
        tmp = self._state_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(state), encoding="utf-8")
            tmp.replace(self._state_path)
        except OSError as exc:
            log.debug("otel_train: cannot save %s: %s", self._state_path, exc)

    def close(self) -> None:
        pass


SUMMARY_PREFIX = "goodput/"  # how the final account travels to the sinks' close()


def final_scalars(account: dict[str, float]) -> dict[str, float]:
    return {f"{SUMMARY_PREFIX}{key}": value for key, value in account.items()}


def summary(final: Mapping[str, float]) -> str:
    """`goodput 91.3% of 60.0s | badput startup 2.1s eval 1.0s ...` from the final scalars, for
    progress.txt and the console; empty when there is no account."""
    account = {k[len(SUMMARY_PREFIX) :]: v for k, v in final.items() if k.startswith(SUMMARY_PREFIX)}
    wall = account.get("wall_s", 0.0)
    if wall <= 0:
        return ""
    causes = " ".join(f"{cause} {account.get(cause, 0.0):.1f}s" for cause in CAUSES)
    return f"goodput {100 * account['productive_s'] / wall:.1f}% of {wall:.1f}s | badput {causes}"


def _process_start_epoch(clock: StepClock) -> float:
    return time.time() - (time.perf_counter() - clock.process_start_s)


MAX_STATE_BYTES = 64 * 1024  # a goodput file is ~300 bytes; anything larger is not ours
MAX_WALL_S = 10 * 366 * 86400.0  # an account longer than ten years is a damaged file
MAX_CLOCK_AHEAD_S = 86400.0  # an `updated` later than now by more than this (clock skew) is damaged


def _load(path: Path | None, run_id: str) -> dict[str, Any] | None:
    """The account of an earlier process of the same run id, if any. A file we cannot trust
    (unreadable, not our shape, a value out of range) never stops a restart: it is warned about
    once, kept aside as `<name>.corrupt` and the account starts over from this process."""
    if path is None or not path.exists():
        return None
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
        state = json.loads(path.read_text(encoding="utf-8"))
        owner = state.get("run_id") if isinstance(state, dict) else None
        if isinstance(owner, str) and owner != run_id:
            return None  # another job's account: this one starts over and overwrites it
        return _validated(state)
    except Exception as exc:  # whatever is in the file, a restart must not crash on it
        aside = path.with_name(path.name + ".corrupt")
        try:
            path.replace(aside)
        except OSError:
            aside = path  # it is overwritten at the next save
        log.warning(
            "otel_train: ignoring the goodput file %s (%s); kept as %s, goodput starts over from this process.",
            path, exc, aside,
        )  # fmt: skip
        return None


def _validated(state: object) -> dict[str, Any]:
    """`state` as numbers we can add to (every cause present), or ValueError saying what is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"not a JSON object but {type(state).__name__}")
    if not isinstance(state.get("run_id"), str):
        raise ValueError("no run_id")
    now = time.time()
    updated = _number(state, "updated", 0.0, now + MAX_CLOCK_AHEAD_S)
    wall = _number(state, "wall_s", 0.0, MAX_WALL_S)
    productive = _number(state, "productive_s", 0.0, wall * (1 + 1e-9))
    badput = state.get("badput")
    if not isinstance(badput, dict):
        raise ValueError(f"badput is {type(badput).__name__}, not an object")
    # A cause missing from the file (written by a version that did not have it) is zero.
    causes = {cause: _number(badput, cause, 0.0, wall * (1 + 1e-9)) for cause in CAUSES if cause in badput}
    return {
        "updated": updated,
        "wall_s": wall,
        "productive_s": productive,
        "badput": {cause: causes.get(cause, 0.0) for cause in CAUSES},
    }


def _number(values: dict[Any, Any], key: str, low: float, high: float) -> float:
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} is {value!r}, not a number")
    if not low <= value <= high:  # also false for NaN
        raise ValueError(f"{key} is {value!r}, outside [{low:g}, {high:g}]")
    return float(value)


def process_start_perf_s() -> float:
    """This process's start time on the perf_counter clock.

    Linux: `/proc/self/stat`'s starttime (clock ticks since boot, on CLOCK_BOOTTIME), against
    CLOCK_BOOTTIME now; exact to one clock tick (10 ms at the usual USER_HZ of 100, always early).
    Not psutil's create_time(): it adds the ticks to `/proc/stat`'s btime, a whole number of
    seconds, so every start was off by up to 1 s (differently on each machine) and a restart's gap
    and the account's wall time with it. Elsewhere psutil's create_time() (microseconds on macOS),
    and when nothing answers, now."""
    age = _age_from_proc()
    if age is None:
        try:
            import psutil

            age = time.time() - psutil.Process().create_time()
        except Exception:  # no process table: count from now
            age = 0.0
    return time.perf_counter() - max(0.0, age)


def _age_from_proc() -> float | None:
    """Seconds since this process started, from /proc/self/stat; None where that is missing."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            text = stat.read()
        # Field 22 (starttime); the command name (field 2) may hold spaces and ")".
        ticks = int(text[text.rindex(")") + 2 :].split()[19])
        per_second = os.sysconf("SC_CLK_TCK")
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / per_second
    except (OSError, ValueError, IndexError, AttributeError):
        return None
