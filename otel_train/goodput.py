"""Goodput: each rank's wall time split into productive steps and badput by cause.

The training thread keeps a few cumulative counters; this listener publishes `train.goodput`,
`train.productive.duration` and `train.badput.duration` at each flush and keeps the account in
`goodput.rank<k>.json` across restarts. The causes: docs/design/core.md#goodput.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.run_directory import process_start, read_regular_file, write_json

log = logging.getLogger("otel_train")

SAVE_EVERY_S = 5.0  # goodput.rank<k>.json is rewritten at most this often (and at the last flush)
CAUSES = (
    "startup", "eval", "checkpoint_save", "checkpoint_restore", "data", "wasted_progress", "stall",
    "restart", "other",
)  # fmt: skip
SPAN_CAUSES = ("eval", "checkpoint_save", "checkpoint_restore")  # the causes `ot.span` names carry
_EVAL_NAMES = {"eval", "evaluate", "evaluation", "validation", "validate", "val", "test", "generate"}
_EVAL_NAMES |= {"sample", "samples", "sampling"}
_CHECKPOINT_NAMES = {"checkpoint", "ckpt", "save", "save_checkpoint", "checkpointing"}
_RESTORE_NAMES = {"load_checkpoint", "restore", "restore_checkpoint", "resume", "load", "load_ckpt"}
# Timer names that are the step waiting for its input (the same names crossrank/verdicts files as data).
DATA_PHASES = frozenset(
    {"data", "dataloader", "data_wait", "datawait", "data_loading", "batch", "get_batch", "input"}
)
DEVIATION_BASELINE = 100  # the typical step time is the median of the last this many intervals' means
# A stall inside a step reaches the listener up to a watchdog tick (<= 1 s) after its step's flush:
# the data-phase timers of this many recent intervals are looked at to tell a hung data wait.
RECENT_INTERVALS = 64


def span_cause(name: str) -> str:
    """The badput cause of an `ot.span` name: eval, checkpoint_save, checkpoint_restore or other."""
    lower = name.lower().replace("-", "_")
    if lower in _EVAL_NAMES or lower.startswith(("eval", "valid")):
        return "eval"
    if lower in _RESTORE_NAMES or "restore" in lower or ("load" in lower and "checkpoint" in lower):
        return "checkpoint_restore"
    if lower in _CHECKPOINT_NAMES or "checkpoint" in lower:
        return "checkpoint_save"
    return "other"


def _boot_stamp_now() -> tuple[str, float] | None:
    """This host's boot id and seconds since boot (CLOCK_BOOTTIME), where the system has them."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read(64).strip()
    except (OSError, ValueError):
        return None
    return (boot_id, time.clock_gettime(time.CLOCK_BOOTTIME)) if boot_id else None


@dataclass(frozen=True)
class Clocks:
    """The time sources of the account. Tests pass fake ones and move time by hand."""

    perf: Callable[[], float] = time.perf_counter  # the steps' clock (timing's perf_counter_ns, in s)
    wall: Callable[[], float] = time.time  # `updated` in the file; a restart gap across hosts
    boot: Callable[[], tuple[str, float] | None] = _boot_stamp_now  # a restart gap on the same boot
    started: Callable[[], float] = lambda: run_start_perf_s()  # where the account begins, on `perf`


class StepClock:
    """Goodput's books on the training thread: cumulative nanosecond counters written by that thread
    only (at a long gap, a span's end, an eval batch; never per step), read by `GoodputListener` on
    the worker. The stall watchdog adds the stalls it saw inside steps (`note_step_stall`)."""

    def __init__(self, stall_timeout_s: float, clocks: Clocks | None = None) -> None:
        self.clocks = clocks if clocks is not None else Clocks()
        self.process_start_s = self.clocks.started()  # `clocks.perf` seconds where the account begins
        self.first_step_start_ns: int | None = None
        self.startup_span_ns = 0  # eval/checkpoint spans before the first step (not startup)
        self.stall_ns = 0
        self.nested_badput_ns = 0  # eval/checkpoint spans inside steps (not productive)
        self.span_ns: dict[str, int] = {}  # per cause: all eval/checkpoint spans, gaps of eval batches
        self.rerun_through = -1  # the last step of the previous processes (-1: none); set by the listener
        # spans between two steps (not stall time): their total, and the end of the step before them
        self.gap_span_ns = 0
        self.gap_after_ns: int | None = None
        self.stall_gap_ns = int(stall_timeout_s * 1e9)
        self.eval_batch_ns = 0  # the latest eval batch between steps (adapters.heartbeat)
        self.idle_after_ns: int | None = None  # the end of the step after which the loop idled on purpose
        # (the last step completed before the stalled one, seconds, frozen through): appended by the
        # watchdog thread, taken by the listener once that step is flushed
        self.step_stalls: deque[tuple[int, float, int | None]] = deque()

    def note_step_stall(self, after_step: int, seconds: float, frozen_through: int | None = None) -> None:
        """The watchdog saw the step after `after_step` stalled for `seconds` (without progress).
        `frozen_through`: it could not run itself for that long (the process was stopped or frozen)
        and found the loop at this step after it: the freeze lay inside one of the steps in between,
        or between two of them, where `note_gap` books it."""
        self.step_stalls.append((after_step, seconds, frozen_through))

    def note_gap(self, start_ns: int, previous_end_ns: int | None) -> None:
        """A step starts at `start_ns` (the first one: `previous_end_ns` None). A gap over
        stall_timeout_s, less the spans in it, is stall time, or eval time when eval batches ran in it
        (`adapters.heartbeat()` between steps, as an eval without `ot.span("eval")` calls it); a
        pause on purpose (`adapters.idle()`) stays `other`."""
        if previous_end_ns is None:
            self.first_step_start_ns = start_ns
            return
        spans = self.gap_span_ns if self.gap_after_ns == previous_end_ns else 0
        stalled = start_ns - previous_end_ns - spans
        if stalled <= self.stall_gap_ns:
            return
        if self.eval_batch_ns > previous_end_ns:
            self.span_ns["eval"] = self.span_ns.get("eval", 0) + stalled
        elif self.idle_after_ns != previous_end_ns:  # not a pause on purpose (`adapters.idle()`)
            self.stall_ns += stalled

    def note_span(self, name: str, duration_ns: int, in_step: bool, last_step_end_ns: int | None) -> None:
        """An `ot.span` ended: its cause's time, and where it sits (inside a step, between steps,
        before the first one)."""
        cause = span_cause(name)
        if cause != "other":
            self.span_ns[cause] = self.span_ns.get(cause, 0) + duration_ns
            if in_step:
                self.nested_badput_ns += duration_ns
        if in_step:
            return
        if self.gap_after_ns != last_step_end_ns:  # the first span of a new gap
            self.gap_after_ns, self.gap_span_ns = last_step_end_ns, 0
        self.gap_span_ns += duration_ns
        if self.first_step_start_ns is None and cause != "other":
            self.startup_span_ns += duration_ns  # not startup: its own cause


class GoodputListener:
    def __init__(self, clock: StepClock, meter: Any, state_path: Path | None, run_id: str) -> None:
        self._clock = clock
        self._state_path = state_path
        self._run_id = run_id
        self._gauge = semconv.GOODPUT.create(meter)
        badput = semconv.BADPUT_DURATION.create(meter)
        # (counter, account key, attributes): productive time and each badput cause, in seconds
        self._counters: list[tuple[Any, str, dict[str, str]]] = [
            (semconv.PRODUCTIVE_DURATION.create(meter), "productive_s", {})
        ]
        self._counters += [(badput, cause, {semconv.BADPUT_CAUSE: cause}) for cause in CAUSES]
        interruptions = semconv.INTERRUPTIONS.create(meter)
        self._deviation = semconv.STEP_DEVIATION.create(meter)
        self._dropped = semconv.DROPPED.create(meter)
        self._means: deque[float] = deque(maxlen=DEVIATION_BASELINE)
        self.step_s = 0.0  # this process's step time (worker-side, from the flushed durations)
        self.data_s = 0.0  # data-phase timers inside steps that are not re-runs (from the flushes)
        self.rerun_s = 0.0  # steps that re-ran a step of the previous processes (from the flushes)
        self.steps = 0
        self.step_stall_s = 0.0  # stalls inside steps (the watchdog's), taken out of the steps' time
        # stalls inside steps that then failed (a hung collective that timed out): stall time, but
        # out of no productive time, as a failed step has none; (step before it, seconds) of recent ones
        self.failed_stall_s = 0.0
        self._failed_steps: deque[tuple[int, float]] = deque(maxlen=RECENT_INTERVALS)
        self._data_peaks: deque[float] = deque(maxlen=RECENT_INTERVALS)
        self._step_peaks: deque[tuple[int, float]] = deque(maxlen=RECENT_INTERVALS)  # (last step, longest)
        self._previous = _load(state_path, run_id, clock.clocks.wall())
        self._saved_at = -math.inf
        self.failed_saves = 0  # in a row: the file on disk is stale meanwhile
        self.totals: dict[str, float] = {}  # the last account, job-wide (for tests and summaries)
        self.interruptions = 0
        self.last_step = -1  # the highest step index completed under this run id
        previous = self._previous
        if previous is not None:
            gap = _restart_gap(previous, clock, state_path)
            previous["badput"]["restart"] += gap
            previous["wall_s"] += gap
            self.interruptions = previous["interruptions"] + 1
            self.last_step = clock.rerun_through = previous["last_step"]
        # The counters start at the job's totals: a restarted process's series continue from where
        # the previous one left them (no reset to 0 for rate() to misread). `carried`: those totals
        # as (instrument, attributes, amount), which the per-flush rows leave out (StepReader.carry).
        totals = {"productive_s": previous["productive_s"], **previous["badput"]} if previous else {}
        self._reported = {key: totals.get(key, 0.0) for _, key, _ in self._counters}
        self.carried: list[tuple[str, dict[str, str], float]] = []
        for counter, key, attributes in self._counters:
            counter.add(self._reported[key], attributes)
            spec = semconv.PRODUCTIVE_DURATION if key == "productive_s" else semconv.BADPUT_DURATION
            self.carried.append((spec.name, attributes, self._reported[key]))
        interruptions.add(self.interruptions)  # the previous processes' count, and this restart: its row's 1
        earlier = previous["interruptions"] if previous else 0
        self.carried.append((semconv.INTERRUPTIONS.name, {}, float(earlier)))
        # Saved at once: a process that dies before its first flush (a worker that fails at its
        # first steps) still leaves the account, so its successor books the restart.
        self._save(self.account())

    def on_flush(self, interval: Interval) -> None:
        self.step_s += math.fsum(interval.step_durations)
        self.data_s += interval.data_s
        self.rerun_s += interval.rerun_s
        self.steps += interval.steps
        if interval.steps:
            done = interval.step if interval.completed_step is None else interval.completed_step
            self.last_step = max(self.last_step, done)
            self._set_deviation(interval.step_durations)
        self._book_step_stalls(interval)
        account = self.account()
        self.totals = account
        if interval.steps:
            self._report(account)
        if interval.final or self._clock.clocks.perf() - self._saved_at >= SAVE_EVERY_S:
            self._save(account)

    def _book_step_stalls(self, interval: Interval) -> None:
        """The watchdog's stalls inside steps become stall badput once their step is flushed, less the
        longest recent data-phase timer (a hang inside `ot.timer("data")` is data badput already)."""
        if interval.steps:
            data = [max(values) for name, values in interval.phases.items() if name in DATA_PHASES and values]
            self._data_peaks.append(max(data, default=0.0))
            self._step_peaks.append((interval.step, max(interval.step_durations, default=0.0)))
        self._failed_steps.extend(interval.failed_steps)
        stalls = self._clock.step_stalls
        while stalls and (interval.final or interval.step > stalls[0][0]):
            after, seconds, frozen_through = stalls.popleft()
            if frozen_through is not None and self._longest_step(after, frozen_through) < 0.9 * seconds:
                continue  # no step lasted the freeze: it was between steps (note_gap's)
            stalled = max(0.0, seconds - max(self._data_peaks, default=0.0))
            failed = next((f for f in self._failed_steps if f[0] == after), None)
            if failed is None:
                self.step_stall_s += stalled
            else:
                self._failed_steps.remove(failed)
                self.failed_stall_s += min(stalled, failed[1])

    def _longest_step(self, after: int, through: int) -> float:
        """The longest step of the recent flushes that hold the steps after `after` through `through`."""
        longest = 0.0
        for last, peak in self._step_peaks:
            if last > after:
                longest = max(longest, peak)
                if last >= through:
                    break
        return longest

    def _report(self, account: dict[str, float]) -> None:
        """Metrics move only with flushes that carry steps (one without repeats the last step, and
        bridges keep one value per step); the state file and the summary still get the account."""
        for counter, key, attributes in self._counters:
            delta = account[key] - self._reported[key]
            if delta > 0:
                counter.add(delta, attributes)
                self._reported[key] = account[key]
        if account["wall_s"] > 0:
            self._gauge.set(account["productive_s"] / account["wall_s"])

    def _set_deviation(self, durations: list[float]) -> None:
        """`train.step.deviation` (the typical mean includes this interval's)."""
        if not durations:
            return
        mean = math.fsum(durations) / len(durations)
        self._means.append(mean)
        baseline = statistics.median(self._means)
        if baseline > 0:
            self._deviation.set(mean / baseline - 1.0)

    def account(self) -> dict[str, float]:
        """Job-wide totals in seconds: `wall_s`, `productive_s` and one entry per cause."""
        clock = self._clock
        wall = clock.clocks.perf() - clock.process_start_s
        first = clock.first_step_start_ns
        before_first = (first * 1e-9 - clock.process_start_s) if first is not None else wall
        data, wasted = self.data_s, self.rerun_s
        productive = max(0.0, self.step_s - clock.nested_badput_ns * 1e-9 - data - wasted)
        stalled_in_steps = min(self.step_stall_s, productive)  # out of the steps' own productive time
        productive -= stalled_in_steps
        spans = {cause: clock.span_ns.get(cause, 0) * 1e-9 for cause in SPAN_CAUSES}
        startup_spans = clock.startup_span_ns if first is not None else sum(clock.span_ns.values())
        badput = {
            "startup": max(0.0, before_first - startup_spans * 1e-9),
            **spans,
            "data": data,
            "wasted_progress": wasted,
            "stall": clock.stall_ns * 1e-9 + stalled_in_steps + self.failed_stall_s,
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
        clocks = self._clock.clocks
        self._saved_at = clocks.perf()
        if self._state_path is None:
            return
        boot = clocks.boot()
        state = {
            "run_id": self._run_id,
            "updated": clocks.wall(),
            **({"boot_id": boot[0], "boottime": boot[1]} if boot is not None else {}),
            "wall_s": account["wall_s"],
            "productive_s": account["productive_s"],
            "badput": {cause: account[cause] for cause in CAUSES},
            "last_step": self.last_step,
            "interruptions": self.interruptions,
        }
        try:
            write_json(self._state_path, state)
        except OSError as exc:
            # A stale file misleads the next process of this run: it would book its restart gap
            # and re-run steps from the last account that was saved. Said once per failing spell.
            self.failed_saves += 1
            self._dropped.add(1, {semconv.REASON: "goodput_save_failed"})
            if self.failed_saves == 1:
                log.warning(
                    "otel_train: cannot save the goodput account (%s); a restart would book its gap and "
                    "wasted progress from the last account saved. Retried every %.0f s; failures are "
                    "counted in otel_train.dropped{reason=goodput_save_failed}.",
                    exc, SAVE_EVERY_S,
                )  # fmt: skip
            return
        if self.failed_saves:
            log.warning(
                "otel_train: the goodput account is saved again to %s, after %d failed save(s).",
                self._state_path, self.failed_saves,
            )  # fmt: skip
            self.failed_saves = 0

    def close(self) -> None:
        pass


SUMMARY_PREFIX = "goodput/"  # how the final account travels to the sinks' close()


def final_scalars(account: dict[str, float]) -> dict[str, float]:
    return {f"{SUMMARY_PREFIX}{key}": value for key, value in account.items()}


def summary(final: Mapping[str, float]) -> str:
    """`goodput 91.3% of 60.0s | badput startup 2.1s eval 1.0s` from the final scalars (the causes
    that took 0.1 s or more), for progress.txt and the console; empty when there is no account."""
    account = {k[len(SUMMARY_PREFIX) :]: v for k, v in final.items() if k.startswith(SUMMARY_PREFIX)}
    wall = account.get("wall_s", 0.0)
    if wall <= 0:
        return ""
    causes = " ".join(
        f"{cause} {seconds:.1f}s" for cause in CAUSES if (seconds := account.get(cause, 0.0)) >= 0.05
    )
    return f"goodput {100 * account['productive_s'] / wall:.1f}% of {wall:.1f}s" + (
        f" | badput {causes}" if causes else ""
    )


# Restart gaps. `updated` is the previous process's wall clock, which may have been off (a host
# clock hours behind, stepped later by chrony or a VM migration): the gap would then book hours of
# restart badput that never happened. On the same boot of the same host the gap is read on
# CLOCK_BOOTTIME instead (no steps, counts suspend). Elsewhere `updated` must agree with the file's
# own modification time (set by the file system's clock when it was written) and lie after
# EARLIEST_UPDATED; otherwise the gap is unknown: not booked, said once.
EARLIEST_UPDATED = 1.6e9  # 2020-09-13: no goodput file was written before it
MAX_MTIME_DISAGREEMENT_S = 600.0  # `updated` vs the file's mtime: clocks in sync agree to far less


def _restart_gap(previous: Mapping[str, Any], clock: StepClock, state_path: Path | None) -> float:
    """Seconds from the previous process's last record to this process's start; 0 (and one
    warning) when they cannot be trusted (see EARLIEST_UPDATED)."""
    clocks = clock.clocks
    started_ago = clocks.perf() - clock.process_start_s
    boot, boot_id, boottime = clocks.boot(), previous["boot_id"], previous["boottime"]
    if boot is not None and boot_id == boot[0] and boottime is not None:
        return max(0.0, boot[1] - started_ago - boottime)
    updated = previous["updated"]
    problem = None
    if updated < EARLIEST_UPDATED:
        problem = f"its last record is dated {updated:.0f} (unix time), before {EARLIEST_UPDATED:.0f}"
    elif state_path is not None:
        try:
            written = state_path.stat().st_mtime
        except OSError:
            written = updated
        if abs(written - updated) > MAX_MTIME_DISAGREEMENT_S:
            problem = (
                f"the clock of the process that wrote it was {updated - written:+.0f} s off the file system's"
            )
    if problem is None:
        return max(0.0, clocks.wall() - started_ago - updated)
    log.warning(
        "otel_train: the restart gap before this process is unknown (%s: %s); no restart badput is "
        "booked for it, the rest of the account continues.",
        state_path, problem,
    )  # fmt: skip
    return 0.0


MAX_STATE_BYTES = 64 * 1024  # a goodput file is ~300 bytes; anything larger is not ours
MAX_WALL_S = 10 * 366 * 86400.0  # an account longer than ten years is a damaged file
MAX_CLOCK_AHEAD_S = 86400.0  # an `updated` later than now by more than this (clock skew) is damaged


def _load(path: Path | None, run_id: str, now: float) -> dict[str, Any] | None:
    """The account of an earlier process of the same run id, if any. A file we cannot trust never
    stops a restart: warned once, kept aside as `<name>.corrupt`, and the account starts over."""
    if path is None or not path.exists():
        return None
    try:
        state = json.loads(read_regular_file(path, MAX_STATE_BYTES))
        if not isinstance(state, dict):
            raise ValueError(f"not a JSON object but {type(state).__name__}")
        owner = state.get("run_id")
        if isinstance(owner, str) and owner != run_id:
            return None  # another job's account: this one starts over and overwrites it
        # This process's clock may be the one that is off (stepped back a day): the file's own
        # modification time, the file system's clock, vouches for an `updated` as late as it.
        return _validated(state, max(now, path.stat().st_mtime))
    except Exception as exc:  # a file on disk that anything may have damaged must not crash a restart
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


def _validated(state: dict[str, Any], now: float) -> dict[str, Any]:
    """`state` as numbers we can add to, or ValueError naming the first bad field. An older writer's
    missing fields take defaults; its one `checkpoint` cause is checkpoint_save."""
    if not isinstance(state.get("run_id"), str):
        raise ValueError("no run_id")
    badput = state.get("badput")
    if not isinstance(badput, dict):
        raise ValueError(f"badput is {type(badput).__name__}, not an object")
    if "checkpoint" in badput:
        badput = {"checkpoint_save": badput["checkpoint"], **badput}
    wall = _field(state, "wall_s", 0.0, MAX_WALL_S)
    most = wall * (1 + 1e-9)  # no part of the account exceeds its wall time
    boot_id, boottime = state.get("boot_id"), state.get("boottime")
    stamped = isinstance(boot_id, str) and len(boot_id) <= 64 and _in_range(boottime, 0.0, 1e12)
    return {
        "updated": _field(state, "updated", 0.0, now + MAX_CLOCK_AHEAD_S),
        "boot_id": boot_id if stamped else None,
        "boottime": boottime if stamped else None,
        "wall_s": wall,
        "productive_s": _field(state, "productive_s", 0.0, most),
        "badput": {cause: _field(badput, cause, 0.0, most, default=0.0) for cause in CAUSES},
        "last_step": int(_field(state, "last_step", -1, 2**63, default=-1, integer=True)),
        "interruptions": int(_field(state, "interruptions", 0, 10**9, default=0, integer=True)),
    }


def _field(
    values: dict[str, Any],
    key: str,
    low: float,
    high: float,
    default: float | None = None,
    integer: bool = False,
) -> float:
    """`values[key]` when it is a number (an int where `integer`) in [low, high]; `default` when the
    key is absent and there is one; otherwise ValueError naming the field."""
    if key not in values and default is not None:
        return default
    value = values.get(key)
    if not _in_range(value, low, high) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{key} is {value!r}, not {kind} in [{low:g}, {high:g}]")
    return value if integer else float(value)


def _in_range(value: object, low: float, high: float) -> TypeGuard[float]:
    """A real number (not a bool) in [low, high]; NaN never is."""
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


_process_has_run = False  # a run's account already began at this process's start


def run_start_perf_s() -> float:
    """Where a run's account begins (perf_counter clock): the process's start for its first run
    (imports and set-up are startup); a later run of the same process (a sweep's next trial) at its
    own `ot.init()`."""
    global _process_has_run
    if _process_has_run:
        return time.perf_counter()
    _process_has_run = True
    return process_start_perf_s()


def process_start_perf_s() -> float:
    """This process's start time on the perf_counter clock.

    Linux: `/proc/self/stat`'s starttime against CLOCK_BOOTTIME now, exact to one clock tick. Not
    psutil's create_time() there: it adds the ticks to `/proc/stat`'s whole-second btime, off by up
    to 1 s. Elsewhere psutil's create_time(), and when nothing answers, now."""
    ticks = process_start(os.getpid())
    if ticks:
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(ticks) / os.sysconf("SC_CLK_TCK")
    else:
        age = 0.0  # no process table: count from now
        with contextlib.suppress(ImportError):
            import psutil

            with contextlib.suppress(psutil.Error, OSError):
                age = time.time() - psutil.Process().create_time()
    return time.perf_counter() - max(0.0, age)
