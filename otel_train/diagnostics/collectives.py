"""The collective layer, read from PyTorch's Flight Recorder: per-rank collective metrics and the
hang signal `train.collective.last_seconds`. Design: docs/design/diagnostics.md#collectives.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval

log = logging.getLogger("otel_train")

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# torch's own default when neither variable is set (2.13's FlightRecorder, gloo and NCCL alike)
TORCH_DEFAULT_BUFFER = 2000
# The dump holds the GIL while torch serializes the buffer (~10 us an entry on a quiet core, so tens
# of ms for 2000): entries are read (dumped, loaded and counted) at most so often that this stays
# under 0.2 % of wall time.
MAX_READ_SHARE = 0.002
MAX_PAIRS = 16  # distinct (group, op) series per rank; later pairs count under ("other", "other")
OTHER = "other"
_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
    "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16,
}  # fmt: skip
OFF_MESSAGE = (
    "otel_train: PyTorch's Flight Recorder is off, so there are no train.collective.* metrics, no "
    "`hang` event naming the rank the others wait for, and no collective arrivals for the straggler "
    "verdicts (stall events and stack dumps stay). Turn it on with "
    f"TORCH_FR_BUFFER_SIZE={TORCH_DEFAULT_BUFFER} in the launch environment (torch 2.13's default "
    "when the variable is unset; it must be set before init_process_group)."
)


def buffer_size() -> int:
    """The Flight Recorder's entries per rank, read from the environment as torch reads it: the
    variable's value, else torch's default (0: off; design page, #collectives)."""
    for name in BUFFER_ENV:
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                return 0
    return TORCH_DEFAULT_BUFFER


def read_dump(entries: bool) -> dict[str, Any] | None:
    """This rank's Flight Recorder as one dict (`pg_status`, `pg_config`, and `entries` when
    asked), the CPU and NCCL recorders merged; None when torch or both recorders are unavailable."""
    if "torch" not in sys.modules:
        return None  # the job has no torch loaded: nothing records collectives
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    # "recorders": each recorder's own entries (record ids count per recorder, from 0 in each);
    # "statuses": each recorder's own pg_status
    merged: dict[str, Any] = {
        "pg_status": {},
        "pg_config": {},
        "entries": [],
        "recorders": {},
        "statuses": {},
    }
    for name, pickled, as_json in DUMPS:
        data = _dump(c10d, pickled, as_json, entries)
        if data is None:
            continue
        merged["pg_status"].update(data.get("pg_status") or {})
        merged["pg_config"].update(data.get("pg_config") or {})  # empty while it records nothing
        merged["entries"].extend(data.get("entries") or [])
        merged["recorders"][name] = data.get("entries") or []
        merged["statuses"][name] = data.get("pg_status") or {}
    return merged if merged["recorders"] else None


# (recorder, its pickle dump, its JSON dump): the pickle without stack traces is what torch's own
# fr_trace tool reads, and about half the cost (2,000 gloo entries, dump and load: 15-20 ms of CPU
# against 31-35 ms for the JSON, the fallback where a build lacks the pickle)
DUMPS = (
    ("cpu", "_dump_fr_trace", "_dump_fr_trace_json"),
    ("nccl", "_dump_nccl_trace", "_dump_nccl_trace_json"),
)


def _dump(c10d: Any, pickled: str, as_json: str, entries: bool) -> dict[str, Any] | None:
    """One recorder's dump as a dict, or None (no group of that backend yet, an older format...).
    The pickle comes from torch's own buffer in this process: loading it trusts nothing outside."""
    dump = getattr(c10d, pickled, None)
    try:
        if dump is not None:
            data = pickle.loads(dump(includeCollectives=entries, includeStackTraces=False, onlyActive=False))
        else:
            dump = getattr(c10d, as_json, None)
            if dump is None:
                return None
            data = json.loads(dump(includeCollectives=entries, onlyActive=False))
    except Exception as exc:  # torch's private Flight Recorder API and its pickle
        log.debug("otel_train: %s failed: %s", getattr(dump, "__name__", pickled), exc)
        return None
    return data if isinstance(data, dict) else None


def group_label(entry: dict[str, Any]) -> str:
    """A process group's label: its description (`default_pg`, a DeviceMesh dim) or its name."""
    names = entry.get("process_group") or ["?", ""]
    desc = str(names[1]) if len(names) > 1 else ""
    return desc if desc and desc != "undefined" else f"pg{names[0]}"


def op_name(entry: dict[str, Any]) -> str:
    """`nccl:all_reduce` -> `all_reduce`."""
    return str(entry.get("profiling_name") or "?").split(":", 1)[-1]


def input_bytes(entry: dict[str, Any]) -> int:
    sizes_and_dtypes = zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False)
    return sum(
        math.prod(map(int, sizes)) * _DTYPE_BYTES.get(str(dtype), 4) for sizes, dtype in sizes_and_dtypes
    )


def _done(entry: dict[str, Any]) -> bool:
    return bool(entry.get("retired")) or entry.get("state") == "completed"


def gloo_retired(dump: Mapping[str, Any]) -> dict[str, set[int]]:
    """Per gloo group (the CPU recorder's), the sequence ids whose entries are retired or completed:
    torch 2.13's gloo status can stay 1 to 4 ids behind for good (design page, #collectives)."""
    cpu = {str(name) for name in (dump.get("statuses") or {}).get("cpu") or {}}
    retired: dict[str, set[int]] = {}
    for entry in (dump.get("recorders") or {}).get("cpu") or []:
        group = str((entry.get("process_group") or ["?"])[0])
        seq = entry.get("collective_seq_id")
        if group in cpu and _done(entry) and not entry.get("is_p2p") and type(seq) is int:
            retired.setdefault(group, set()).add(seq)
    return retired


def progress_key(status: dict[str, Any], excluded: Iterable[str]) -> tuple[tuple[str, str, str], ...]:
    """Every group's (name, last enqueued, last completed) sequence ids, the excluded groups left out."""
    skip = set(excluded)
    return tuple(
        sorted(
            (str(name), str(s.get("last_enqueued_collective")), str(s.get("last_completed_collective")))
            for name, s in status.items()
            if str(name) not in skip
        )
    )


class CollectiveMonitor:
    """Flush listener: per (group, op) counts, bytes and backend time; the `last_seconds` gauge."""

    def __init__(self, meter: Any, excluded_groups: Iterable[str]) -> None:
        self.excluded = set(excluded_groups)
        self._count = semconv.COLLECTIVE_COUNT.create(meter)
        self._size = semconv.COLLECTIVE_SIZE.create(meter)
        self._time = semconv.COLLECTIVE_TIME.create(meter)
        # per recorder (CPU/gloo, NCCL): record ids counted, pruned to what its buffer still holds,
        # and the largest record id of the previous read
        self._seen: dict[str, set[int]] = {}
        self._highest: dict[str, int] = {}
        self._pairs: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._progress: tuple[tuple[str, str, str], ...] = ()
        self._progress_at = time.monotonic()
        self._retired: tuple[tuple[str, str, str], ...] = ()  # a key whose pending ops are retired
        self.overwritten = 0  # entries the ring buffer dropped before a flush read them
        self._next_read = 0.0  # monotonic time of the next full read (see MAX_READ_SHARE)
        self._read: tuple[int, dict[str, Any] | None] = (-1, None)  # (flush seq, its dump)
        # The stall watchdog's verdict (`HangWatchdog.stalled_s`) and whether a checkpoint save is
        # declared (`Session.saving`), wired once the session has them.
        self.stalled_s: Callable[[], float] = lambda: 0.0
        self.saving: Callable[[], bool] = lambda: False
        # Whether the cross-rank exchange times the reads (every rank at the flushes rank 0 picks,
        # for the arrivals), wired once the session has it: then a flush reads only when asked, or
        # a read of its own, on the budget freed since, would leave none for rank 0's next ask.
        self.led: Callable[[], bool] = lambda: False
        semconv.COLLECTIVE_LAST.create(meter, self._observe_last)

    # --- the hang signal ---------------------------------------------------------------------------
    def last_seconds(self) -> float:
        """Seconds since this rank's sequence ids last moved, while a collective is pending outside a
        declared checkpoint save or the watchdog finds it stalled; else 0 (design page, #collectives)."""
        dump = read_dump(entries=False)
        with self._lock:
            if dump is not None:
                self._note_progress(progress_key(dump["pg_status"], self.excluded))
            since = time.monotonic() - self._progress_at
            key = self._progress
        return since if (self._pending(key, dump) and not self.saving()) or self.stalled_s() > 0 else 0.0

    def _pending(self, key: tuple[tuple[str, str, str], ...], dump: dict[str, Any] | None) -> bool:
        """Whether a group's last enqueued collective is not its last completed one (for a gloo group
        nor retired in the entries: read until they say so, then not again for that key)."""
        waiting = {(group, enqueued) for group, enqueued, completed in key if enqueued != completed}
        cpu_groups = dump["statuses"].get("cpu", {}) if dump is not None else {}
        if not any(group in cpu_groups for group, _ in waiting):
            return bool(waiting)
        if key == self._retired:
            return False
        full = read_dump(entries=True)
        retired = gloo_retired(full) if full is not None else {}
        if all(enqueued.isdigit() and int(enqueued) in retired.get(group, ()) for group, enqueued in waiting):
            self._retired = key
        return key != self._retired

    def _note_progress(self, key: tuple[tuple[str, str, str], ...]) -> None:
        if key != self._progress:
            self._progress, self._progress_at = key, time.monotonic()

    def _observe_last(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        return [Observation(self.last_seconds())]

    # --- per-flush counts --------------------------------------------------------------------------
    def may_read(self) -> bool:
        """Whether a full read now stays within MAX_READ_SHARE of wall time."""
        return time.monotonic() >= self._next_read

    def read(self, seq: int, force: bool = False) -> dict[str, Any] | None:
        """The dump (with entries) of flush `seq`, read once when `force` or the budget allows; else None."""
        if self._read[0] == seq:
            return self._read[1]
        if not force and not self.may_read():
            return None
        started = time.monotonic()
        dump = read_dump(entries=True)
        self._next_read = started + (time.monotonic() - started) / MAX_READ_SHARE
        self._read = (seq, dump)
        return dump

    def on_flush(self, interval: Interval) -> None:
        # Without a read the counts catch up at the next one, from what the ring buffer still holds.
        if self.led() and self._read[0] != interval.seq and not interval.final:
            return
        dump = self.read(interval.seq, force=interval.final)
        if dump is None:
            return
        started = time.monotonic()
        with self._lock:
            self._note_progress(progress_key(dump["pg_status"], self.excluded))
        for recorder, entries in dump["recorders"].items():
            self.count(entries, recorder)
        self._next_read += (time.monotonic() - started) / MAX_READ_SHARE  # counting is part of a read

    def count(self, entries: list[dict[str, Any]], recorder: str = "") -> None:
        """Add each retired entry of `recorder` not counted before (the excluded groups' left out);
        forget ids its ring buffer no longer holds. Its record ids count across all its groups, so
        the gap check sees every group."""
        ids = [int(e.get("record_id", -1)) for e in entries]
        seen, highest = self._seen.setdefault(recorder, set()), self._highest.get(recorder)
        if ids and highest is not None and min(ids) > highest + 1:
            if not self.overwritten:
                log.warning(
                    "otel_train: the Flight Recorder's buffer (%d entries) wrapped between two reads: "
                    "train.collective.count and .size undercount; raise TORCH_FR_BUFFER_SIZE.",
                    buffer_size(),
                )
            self.overwritten += min(ids) - highest - 1
        # Summed per (group, op) here, one SDK add per series and read: an add per entry (2,000
        # a read) cost the worker more than the read itself, holding the GIL.
        totals: dict[tuple[str, str], list[float]] = {}  # pair -> [count, bytes, seconds, timed]
        for rid, entry in zip(ids, entries, strict=True):
            if rid in seen or not _done(entry):
                continue
            if str((entry.get("process_group") or ["?"])[0]) in self.excluded:
                continue  # otel_train's own exchange
            seen.add(rid)
            total = totals.setdefault(self._pair(group_label(entry), op_name(entry)), [0, 0, 0.0, 0])
            total[0] += 1
            total[1] += input_bytes(entry)
            duration_ms = entry.get("duration_ms")
            if isinstance(duration_ms, (int, float)) and duration_ms >= 0:
                total[2] += duration_ms / 1e3
                total[3] += 1
        for (group, op), (count, size, seconds, timed) in totals.items():
            attrs = {semconv.PROCESS_GROUP: group, semconv.COLLECTIVE_OP: op}
            self._count.add(count, attrs)
            self._size.add(size, attrs)
            if timed:
                self._time.add(seconds, attrs)
        if ids:
            low, self._highest[recorder] = min(ids), max(ids)
            self._seen[recorder] = {rid for rid in seen if rid >= low}

    def _pair(self, group: str, op: str) -> tuple[str, str]:
        pair = (group, op)
        if pair not in self._pairs:
            if len(self._pairs) >= MAX_PAIRS - 1:  # the last slot is the catch-all: MAX_PAIRS in all
                pair = (OTHER, OTHER)
            self._pairs.add(pair)
        return pair

    def close(self) -> None:
        pass


def start_monitor(meter: Any, telemetry_group: Any | None, rank: int) -> CollectiveMonitor | None:
    """The monitor when this rank is in a process group and the Flight Recorder records (torch's
    default, or the variable > 0); otherwise None, with OFF_MESSAGE logged once for the job (rank 0;
    the other ranks at debug level)."""
    dump = read_dump(entries=False)
    # A recording torch lists the groups it records (`pg_config`); an older torch whose default is
    # off lists none.
    if buffer_size() <= 0 or dump is None or not dump["pg_config"]:
        log.log(logging.WARNING if rank == 0 else logging.DEBUG, "%s", OFF_MESSAGE)
        return None
    excluded = {str(getattr(telemetry_group, "group_name", ""))} if telemetry_group is not None else set()
    return CollectiveMonitor(meter, excluded - {""})
