"""The up row of the one telemetry exchange per flush (`exchange`): one rank's interval as a
fixed-size float64 row, and back (rank 0 unpacks every rank's).

Timers travel by stable id, never by position. Design and layout: docs/design/crossrank.md#up-row.
"""

from __future__ import annotations

import array
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_train.core.buffer import Interval, finite
from otel_train.crossrank.spread import STATS_LEN, Spread
from otel_train.distributed import Identity

logger = logging.getLogger("otel_train")

PACK_VERSION = 3.0
MAX_TIMERS = 64
ANNOUNCE_SLOTS = 4
NAME_FLOATS = 8  # 6 bytes per float64 (exact below 2**53): names up to 48 UTF-8 bytes travel
NAME_BYTES = 6 * NAME_FLOATS
HOST_FLOATS = 8
_H_VERSION, _H_RANK, _H_SEQ, _H_STEP, _H_NODE, _H_LOCAL, _H_NTIMERS, _H_FLAGS = range(8)
_H_STEP_STATS = 8
_H_HOST = _H_STEP_STATS + STATS_LEN
# This rank's flush interval (otel_train.core.cadence); rank 0's decision travels down in its answer.
_H_FLUSH_INTERVAL = _H_HOST + HOST_FLOATS
_H_FROM_STEP = _H_FLUSH_INTERVAL + 1
HEADER_LEN = _H_FROM_STEP + 1
_S_ID, _S_COUNT, _S_MEAN, _S_ARRIVAL = range(4)
SLOT_LEN = _S_ARRIVAL + STATS_LEN
ANNOUNCE_LEN = 1 + NAME_FLOATS
FLAG_SHARDED = 1  # this rank trains FSDP-sharded modules: collectives run inside forward too


def pack_len(max_timers: int = MAX_TIMERS) -> int:
    return HEADER_LEN + max_timers * SLOT_LEN + ANNOUNCE_SLOTS * ANNOUNCE_LEN


def floats(values: Iterable[float]) -> Any:
    """A 1-D float64 tensor of `values`: built through a C array of doubles, several times
    faster than `torch.tensor` of a list (a flush builds rows of hundreds of floats)."""
    import torch

    return torch.frombuffer(array.array("d", values), dtype=torch.float64)


# --- names -------------------------------------------------------------------------------------------


def name_id(name: str) -> int:
    """Stable 48-bit id of a timer name (same on every rank and across restarts); never 0."""
    value = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=6).digest(), "big")
    return value or 1


def encode_text(text: str, floats: int) -> list[float]:
    raw = text.encode("utf-8")[: 6 * floats]
    raw = raw + b"\x00" * (6 * floats - len(raw))
    return [float(int.from_bytes(raw[i : i + 6], "big")) for i in range(0, 6 * floats, 6)]


def decode_text(values: Iterable[float]) -> str:
    raw = b"".join(int(v).to_bytes(6, "big") for v in values)
    return raw.rstrip(b"\x00").decode("utf-8", errors="ignore")


@functools.lru_cache(maxsize=256)  # one host name per rank, decoded at every flush
def _decode_host(values: tuple[float, ...]) -> str:
    return decode_text(values)


class TimerTable:
    """This rank's stable name -> slot table (first-seen order, bounded) and name announcements."""

    def __init__(self, capacity: int = MAX_TIMERS, hash_fn: Callable[[str], int] = name_id) -> None:
        self.capacity = capacity
        self.hash_fn = hash_fn
        self.slots: dict[str, int] = {}
        self.ids: dict[str, int] = {}
        self.names: dict[int, str] = {}  # every id -> name this rank knows (own + announced by peers)
        self.dropped: set[str] = set()
        self._unannounced: list[str] = []

    def add(self, name: str) -> bool:
        """Give `name` a slot; False (and warned once) when full or its id collides with another name."""
        if name in self.slots:
            return True
        if name in self.dropped:
            return False
        ident = self.hash_fn(name) or 1
        other = self.names.get(ident)
        if other is not None and other != name and other in self.slots:  # a peer's name may be truncated
            self.dropped.add(name)
            logger.warning(
                "otel_train: timer %r collides with %r (same id); it is left out of cross-rank stats",
                name,
                other,
            )
            return False
        if len(self.slots) >= self.capacity:
            self.dropped.add(name)
            logger.warning(
                "otel_train: more than %d timers; %r is left out of cross-rank stats", self.capacity, name
            )
            return False
        self.slots[name] = len(self.slots)
        self.ids[name] = ident
        self.names[ident] = name
        self._unannounced.append(name)
        return True

    def take_announcements(self, limit: int = ANNOUNCE_SLOTS) -> list[str]:
        out, self._unannounced = self._unannounced[:limit], self._unannounced[limit:]
        return out


# --- records -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimerStats:
    """One timer of one rank over one interval."""

    count: int
    mean: float  # mean duration (s): the cross-rank timer gauges and console
    arrival: Spread  # seconds from the step's start to the timer's end


@dataclass
class RankRecord:
    """One rank's row of the gathered tensor, unpacked."""

    rank: int
    seq: int
    step: int
    node_rank: int
    host: str
    step_stats: Spread
    local_rank: int = 0
    flags: int = 0
    flush_interval: int = 0  # this rank's steps per flush (the cadence)
    from_step: int = -1  # the last step of the rank's previous flush: this row covers (from_step, step]
    timers: dict[int, TimerStats] = field(default_factory=dict)  # id -> stats
    announced: dict[int, str] = field(default_factory=dict)  # id -> name

    @property
    def step_count(self) -> int:
        return self.step_stats.count

    def named_timers(self, names: Mapping[int, str]) -> dict[str, TimerStats]:
        """This rank's timers by name (ids whose name is not known yet are left out)."""
        out: dict[str, TimerStats] = {}
        for ident, stats in self.timers.items():
            name = names.get(ident)
            if name is not None and stats.count > 0:
                out[name] = stats
        return out


def pack(
    interval: Interval,
    identity: Identity,
    table: TimerTable,
    out: Any | None = None,
    flags: int = 0,
    from_step: int = -1,
) -> Any:
    """This rank's interval as one float64 tensor of `pack_len(table.capacity)` (see module doc);
    `from_step`: the last step of this rank's previous flush."""

    row = [0.0] * pack_len(table.capacity)
    row[_H_VERSION] = PACK_VERSION
    row[_H_RANK] = float(identity.rank)
    row[_H_SEQ] = float(interval.seq)
    row[_H_STEP] = float(interval.step)
    row[_H_NODE] = float(identity.node_rank)
    row[_H_LOCAL] = float(identity.local_rank)
    row[_H_FLAGS] = float(flags)
    row[_H_STEP_STATS : _H_STEP_STATS + STATS_LEN] = Spread.of(interval.step_durations).encode()
    row[_H_HOST : _H_HOST + HOST_FLOATS] = encode_text(identity.host, HOST_FLOATS)
    row[_H_FLUSH_INTERVAL] = float(interval.flush_interval)
    row[_H_FROM_STEP] = float(from_step)
    n = 0
    for name, durations in interval.phases.items():
        kept = finite(durations)
        if not kept or not table.add(name):
            continue
        base = HEADER_LEN + table.slots[name] * SLOT_LEN
        row[base + _S_ID] = float(table.ids[name])
        row[base + _S_COUNT] = float(len(kept))
        row[base + _S_MEAN] = sum(kept) / len(kept)
        arrival = Spread.of(interval.arrivals.get(name, ()))
        row[base + _S_ARRIVAL : base + SLOT_LEN] = arrival.encode()
        n += 1
    row[_H_NTIMERS] = float(n)
    base = HEADER_LEN + table.capacity * SLOT_LEN
    for i, name in enumerate(table.take_announcements()):
        at = base + i * ANNOUNCE_LEN
        row[at] = float(table.ids[name])
        row[at + 1 : at + ANNOUNCE_LEN] = encode_text(name, NAME_FLOATS)
    tensor = floats(row)
    if out is not None:
        out.copy_(tensor)
        return out
    return tensor


def row_steps(row: Any) -> tuple[int, int]:
    """(from step, step) of one packed row: the steps it covers, without unpacking it."""
    return int(row[_H_FROM_STEP]), int(row[_H_STEP])


def unpack(gathered: Any, capacity: int = MAX_TIMERS) -> list[RankRecord]:
    """Rows gathered on rank 0 (shape [world * pack_len] or [world, pack_len], or a list of rows
    as lists of floats) -> records."""
    length = pack_len(capacity)
    # rows already as lists (crossrank/merge): their first `length` floats
    flat = (
        [r[:length] for r in gathered]
        if isinstance(gathered, list)
        else gathered.reshape(-1, length).tolist()
    )
    records: list[RankRecord] = []
    for row in flat:
        record = RankRecord(
            rank=int(row[_H_RANK]),
            seq=int(row[_H_SEQ]),
            step=int(row[_H_STEP]),
            node_rank=int(row[_H_NODE]),
            host=_decode_host(tuple(row[_H_HOST : _H_HOST + HOST_FLOATS])),
            step_stats=Spread.decode(row[_H_STEP_STATS : _H_STEP_STATS + STATS_LEN]),
            local_rank=int(row[_H_LOCAL]),
            flags=int(row[_H_FLAGS]),
            flush_interval=int(row[_H_FLUSH_INTERVAL]),
            from_step=int(row[_H_FROM_STEP]),
        )
        ids = row[HEADER_LEN + _S_ID : HEADER_LEN + capacity * SLOT_LEN : SLOT_LEN]
        for slot in (i for i, v in enumerate(ids) if v):  # used slots only
            base = HEADER_LEN + slot * SLOT_LEN
            ident = int(row[base + _S_ID])
            if ident:
                record.timers[ident] = TimerStats(
                    int(row[base + _S_COUNT]),
                    row[base + _S_MEAN],
                    Spread.decode(row[base + _S_ARRIVAL : base + SLOT_LEN]),
                )
        base = HEADER_LEN + capacity * SLOT_LEN
        for i in range(ANNOUNCE_SLOTS):
            at = base + i * ANNOUNCE_LEN
            ident = int(row[at])
            if ident:
                record.announced[ident] = decode_text(row[at + 1 : at + ANNOUNCE_LEN])
        records.append(record)
    return records


def local_record(interval: Interval, identity: Identity) -> RankRecord:
    """This rank's record without packing (not distributed): the same statistics, by name id."""
    record = RankRecord(
        identity.rank,
        interval.seq,
        interval.step,
        identity.node_rank,
        identity.host,
        Spread.of(interval.step_durations),
        identity.local_rank,
    )
    for name, durations in interval.phases.items():
        kept = finite(durations)
        if kept:
            record.timers[name_id(name)] = TimerStats(
                len(kept), sum(kept) / len(kept), Spread.of(interval.arrivals.get(name, ()))
            )
            record.announced[name_id(name)] = name
    return record


# --- rows standing for many ranks (crossrank/merge) ------------------------------------------------------

SUMMARY_RANK = -1  # the rank field of a row that stands for summarized ranks (never a real rank)
COLUMNS = 2 + STATS_LEN  # per timer: count, mean duration, arrival count, median, max, MAD


def row_values(
    row: Sequence[float], capacity: int = MAX_TIMERS
) -> tuple[list[float], dict[int, list[float]]]:
    """(step stats, {timer id: COLUMNS values}) of one packed row (a list of floats)."""
    timers: dict[int, list[float]] = {}
    ids = row[HEADER_LEN + _S_ID : HEADER_LEN + capacity * SLOT_LEN : SLOT_LEN]
    for slot in (i for i, v in enumerate(ids) if v):  # used slots only
        base = HEADER_LEN + slot * SLOT_LEN
        if row[base + _S_COUNT] > 0:
            timers[int(row[base + _S_ID])] = list(row[base + _S_COUNT : base + SLOT_LEN])
    return list(row[_H_STEP_STATS : _H_STEP_STATS + STATS_LEN]), timers


def row_announcements(row: Sequence[float], capacity: int = MAX_TIMERS) -> list[list[float]]:
    """The (id, name...) announcements of one packed row, each ANNOUNCE_LEN floats."""
    base = HEADER_LEN + capacity * SLOT_LEN
    spans = (row[base + i * ANNOUNCE_LEN : base + (i + 1) * ANNOUNCE_LEN] for i in range(ANNOUNCE_SLOTS))
    return [list(values) for values in spans if values[0]]


def summary_row(
    template: Sequence[float],
    step: Sequence[float],
    timers: Mapping[int, Sequence[float]],
    announced: Sequence[Sequence[float]],
    capacity: int = MAX_TIMERS,
) -> list[float]:
    """A row of SUMMARY_RANK with the template's steps and schedule and these values: what
    `crossrank/merge` sends for the ranks it summarizes (one row per quantile level)."""
    row = [0.0] * pack_len(capacity)
    for at in (_H_VERSION, _H_SEQ, _H_STEP, _H_FLUSH_INTERVAL, _H_FROM_STEP, _H_FLAGS):
        row[at] = float(template[at])
    row[_H_RANK] = float(SUMMARY_RANK)
    row[_H_STEP_STATS : _H_STEP_STATS + STATS_LEN] = list(step)
    for slot, (ident, values) in enumerate(list(timers.items())[:capacity]):
        base = HEADER_LEN + slot * SLOT_LEN
        row[base + _S_ID] = float(ident)
        row[base + _S_COUNT : base + SLOT_LEN] = list(values)
    row[_H_NTIMERS] = float(min(len(timers), capacity))
    base = HEADER_LEN + capacity * SLOT_LEN
    for i, values in enumerate(announced[:ANNOUNCE_SLOTS]):
        row[base + i * ANNOUNCE_LEN : base + (i + 1) * ANNOUNCE_LEN] = list(values)
    return row


def row_rank(row: Any) -> int:
    return int(row[_H_RANK])
