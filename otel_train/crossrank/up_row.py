"""The up row of the one telemetry exchange per flush (`exchange`): one rank's interval as a
fixed-size row (`wire.up`), and back (rank 0 unpacks every rank's).

Timers travel by stable id, never by position. Design: docs/design/crossrank.md#up-row.
"""

from __future__ import annotations

import array
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_train.core.buffer import Interval, finite
from otel_train.crossrank import wire
from otel_train.crossrank.spread import Spread
from otel_train.crossrank.wire import ANNOUNCE, ANNOUNCE_SLOTS, MAX_TIMERS, SLOT
from otel_train.distributed import Identity

logger = logging.getLogger("otel_train")

NAME_BYTES = wire.NAME.size  # names travel as up to 48 UTF-8 bytes
FLAG_SHARDED = 1  # this rank trains FSDP-sharded modules: collectives run inside forward too
# A keep-alive row: the rank is alive but has not flushed for a while (idle, a rank-local pause). It
# covers no steps and carries no statistics; rank 0 only notes that the rank is there.
FLAG_KEEPALIVE = 2


def pack_len(max_timers: int = MAX_TIMERS) -> int:
    return wire.up(max_timers).words


def floats(values: Iterable[float]) -> Any:
    """A 1-D float64 tensor of `values`: built through a C array of doubles, several times
    faster than `torch.tensor` of a list (a flush builds rows of hundreds of floats)."""
    import torch

    return torch.frombuffer(array.array("d", values), dtype=torch.float64)


def name_id(name: str) -> int:
    """Stable 48-bit id of a timer name (same on every rank and across restarts); never 0."""
    value = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=6).digest(), "big")
    return value or 1


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
            message = "otel_train: timer %r collides with %r (same id); it is left out of cross-rank stats"
            logger.warning(message, name, other)
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


@dataclass(frozen=True)
class TimerStats:
    """One timer of one rank over one interval."""

    count: int
    mean: float  # mean duration (s): the cross-rank timer gauges and console
    arrival: Spread  # seconds from the step's start to the timer's end

    @property
    def per_step(self) -> tuple[float, float]:
        """(runs, seconds) of this timer per step it ran in (its arrivals' count): runs > 1 when it
        runs several times a step (micro-batches under gradient accumulation)."""
        steps = self.arrival.count
        return (self.count / steps, self.mean * self.count / steps) if steps else (0.0, 0.0)


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
        return {names[i]: stats for i, stats in self.timers.items() if i in names and stats.count > 0}


def pack(
    interval: Interval,
    identity: Identity,
    table: TimerTable,
    flags: int = 0,
    from_step: int = -1,
) -> Any:
    """This rank's interval as one float64 tensor of `pack_len(table.capacity)` words (`wire.up`);
    `from_step`: the last step of this rank's previous flush."""
    up = wire.up(table.capacity)
    row = up.new(
        version=wire.VERSION, rank=identity.rank, seq=interval.seq, step=interval.step,
        node_rank=identity.node_rank, local_rank=identity.local_rank, flags=flags,
        step_stats=Spread.of(interval.step_durations).encode(), host=identity.host,
        flush_interval=interval.flush_interval, from_step=from_step,
    )  # fmt: skip
    n = 0
    for name, durations in interval.phases.items():
        kept = finite(durations)
        if not kept or not table.add(name):
            continue
        arrival = Spread.of(interval.arrivals.get(name, ())).encode()
        at = up.at("slots", table.slots[name])
        SLOT.put(row, at, id=table.ids[name], count=len(kept), mean=sum(kept) / len(kept), arrival=arrival)
        n += 1
    up.put(row, n_timers=n)
    for i, name in enumerate(table.take_announcements()):
        ANNOUNCE.put(row, up.at("announced", i), id=table.ids[name], name=name)
    return floats(row)


_UP = wire.up()
_NUMBERS = ("rank", "seq", "step", "node_rank", "local_rank", "flags", "flush_interval", "from_step")


def keepalive(identity: Identity, step: int, length: int) -> Any:
    """A keep-alive up message of `length` floats (`FLAG_KEEPALIVE`; `step`: the last step of this
    rank's previous flush): the up row's header and zeros, so every block after it is empty."""
    import torch

    header = _UP.new(
        version=wire.VERSION, rank=identity.rank, seq=-1, step=step, node_rank=identity.node_rank,
        local_rank=identity.local_rank, flags=FLAG_KEEPALIVE, from_step=step, host=identity.host,
    )  # fmt: skip
    message = torch.zeros(length, dtype=torch.float64)
    message[: len(header)] = floats(header)
    return message


def is_keepalive(row: Any) -> bool:
    """Whether one packed up message is a keep-alive (`keepalive`), without unpacking it."""
    return bool(int(row[_UP.at("flags")]) & FLAG_KEEPALIVE)


def row_steps(row: Any) -> tuple[int, int]:
    """(from step, step) of one packed row: the steps it covers, without unpacking it."""
    return int(row[_UP.at("from_step")]), int(row[_UP.at("step")])


def unpack(gathered: Any, capacity: int = MAX_TIMERS) -> list[RankRecord]:
    """Rows gathered on rank 0 (shape [world * pack_len] or [world, pack_len], or a list of rows
    as lists of floats) -> records."""
    up = wire.up(capacity)
    # rows already as lists (crossrank/merge): their first `up.words` floats
    is_list = isinstance(gathered, list)
    flat = [r[: up.words] for r in gathered] if is_list else gathered.reshape(-1, up.words).tolist()
    records: list[RankRecord] = []
    for row in flat:
        numbers: dict[str, Any] = {name: int(row[up.at(name)]) for name in _NUMBERS}
        host, stats = up.get(row, "host"), Spread.decode(up.get(row, "step_stats"))
        record = RankRecord(host=host, step_stats=stats, **numbers)
        for ident, values in _timers(row, up, capacity).items():
            record.timers[ident] = TimerStats(int(values[0]), values[1], Spread.decode(values[2:]))
        for entry in row_announcements(row, capacity):
            record.announced[int(entry[0])] = ANNOUNCE.get(entry, "name")
        records.append(record)
    return records


def _timers(row: Sequence[float], up: wire.Record, capacity: int) -> dict[int, list[float]]:
    """{timer id: its slot's words after the id} of the used slots of one row."""
    first = up.at("slots")
    ids = row[first : first + capacity * SLOT.words : SLOT.words]
    return {
        int(ident): list(row[first + slot * SLOT.words + 1 : first + (slot + 1) * SLOT.words])
        for slot, ident in enumerate(ids)
        if ident
    }


def local_record(interval: Interval, identity: Identity) -> RankRecord:
    """This rank's record without packing (not distributed): the same statistics, by name id."""
    record = RankRecord(
        identity.rank, interval.seq, interval.step, identity.node_rank, identity.host,
        Spread.of(interval.step_durations), identity.local_rank,
    )  # fmt: skip
    for name, durations in interval.phases.items():
        kept = finite(durations)
        if kept:
            arrival = Spread.of(interval.arrivals.get(name, ()))
            record.timers[name_id(name)] = TimerStats(len(kept), sum(kept) / len(kept), arrival)
            record.announced[name_id(name)] = name
    return record


# --- rows standing for many ranks (crossrank/merge) ------------------------------------------------------

SUMMARY_RANK = -1  # the rank field of a row that stands for summarized ranks (never a real rank)
COLUMNS = SLOT.words - 1  # per timer: count, mean duration, arrival count, median, max, MAD


def row_values(row: Sequence[float]) -> tuple[list[float], dict[int, list[float]]]:
    """(step stats, {timer id: COLUMNS values}) of one packed row (a list of floats)."""
    timers = {ident: values for ident, values in _timers(row, _UP, MAX_TIMERS).items() if values[0] > 0}
    return _UP.get(row, "step_stats"), timers


def row_announcements(row: Sequence[float], capacity: int = MAX_TIMERS) -> list[list[float]]:
    """The (id, name) announcements of one packed row, each ANNOUNCE.words floats."""
    base = wire.up(capacity).at("announced")
    spans = (row[base + i * ANNOUNCE.words : base + (i + 1) * ANNOUNCE.words] for i in range(ANNOUNCE_SLOTS))
    return [list(values) for values in spans if values[0]]


def summary_row(
    template: Sequence[float],
    step: Sequence[float],
    timers: Mapping[int, Sequence[float]],
    announced: Sequence[Sequence[float]],
) -> list[float]:
    """A row of SUMMARY_RANK with the template's steps and schedule and these values: what
    `crossrank/merge` sends for the ranks it summarizes (one row per quantile level)."""
    up = _UP
    kept = ("version", "seq", "step", "flush_interval", "from_step", "flags")
    row = up.new(**{name: template[up.at(name)] for name in kept})
    up.put(row, rank=SUMMARY_RANK, step_stats=list(step), n_timers=min(len(timers), MAX_TIMERS))
    for slot, (ident, values) in enumerate(list(timers.items())[:MAX_TIMERS]):
        SLOT.put(row, up.at("slots", slot), id=ident)
        row[up.at("slots", slot) + 1 : up.at("slots", slot + 1)] = list(values)
    up.put(row, announced=[v for values in announced[:ANNOUNCE_SLOTS] for v in values])
    return row
