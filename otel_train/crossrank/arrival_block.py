"""The arrivals block of the up row: what each rank reads from its Flight Recorder at a read flush
and sends up for `collective_lateness` to judge on rank 0.
Design and layout: docs/design/crossrank.md#arrival-block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from otel_train.crossrank.up_row import name_id
from otel_train.crossrank.wire import ARRIVAL, ARRIVALS, MAX_ARRIVALS
from otel_train.diagnostics import group_label, op_name

RUN = 8  # consecutive collectives sampled together
SPAN = 8 * MAX_ARRIVALS  # the latest collectives of a window they are sampled from (<< a ring buffer)
BLOCK_LEN = ARRIVALS.words  # its last word: the send time t1 (written by the exchange)

Key = tuple[int, int]  # (group id, sequence id)


@dataclass(frozen=True)
class Arrival:
    """One collective as this rank enqueued it."""

    group: str  # the group's name (the same on every rank)
    label: str  # its description (`default_pg`) for messages
    seq: int
    op: str
    at: float  # epoch seconds on this rank's clock

    @property
    def key(self) -> Key:
        return (name_id(self.group), self.seq)


def window(
    entries: Sequence[Mapping[str, Any]], excluded: set[str], after: float, until: float, skew: float = 0.0
) -> list[Arrival]:
    """The collectives enqueued in (after, until] (epoch seconds), in time order."""
    out: list[Arrival] = []
    for entry in entries:
        names = entry.get("process_group") or ["?"]
        if entry.get("is_p2p") or str(names[0]) in excluded:
            continue
        at = int(entry.get("time_created_ns") or 0) / 1e9 + skew
        if after < at <= until:
            seq = int(entry.get("collective_seq_id") or 0)
            out.append(Arrival(str(names[0]), group_label(dict(entry)), seq, op_name(dict(entry)), at))
    out.sort(key=lambda a: a.at)
    return out


def span(arrivals: Sequence[Arrival]) -> Sequence[Arrival]:
    """The window's latest SPAN collectives: the same on every rank even where a ring buffer
    wrapped (lost the window's start) on some ranks and not on others."""
    return arrivals[-SPAN:]


def sample(arrivals: Sequence[Arrival], read_seq: int, cap: int = MAX_ARRIVALS) -> list[Arrival]:
    """At most `cap` of a span (`span`), picked by their ids alone (module doc), in runs of RUN
    consecutive ids: a collective enqueued right after another without waiting for it is judged
    against the one before (`collective_lateness._floors`)."""
    stride = max(1, math.ceil(len(arrivals) / cap))
    return [a for a in arrivals if (a.seq // RUN + read_seq) % stride == 0][-cap:]


def encode(
    read_seq: int, offset: float, bound: float, window_len: int, steps: float, picked: Sequence[Arrival]
) -> list[float]:
    entries = [v for a in picked[:MAX_ARRIVALS] for v in (float(name_id(a.group)), float(a.seq), a.at)]
    return ARRIVALS.new(
        read=1, read_seq=read_seq, offset=offset, bound=bound, window=window_len, steps=steps,
        count=len(picked), entries=entries,
    )  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One rank's block, decoded on rank 0."""

    rank: int
    read_seq: int
    offset: float
    bound: float
    window: int  # collectives in the span sampled
    steps: float  # steps the span covers
    arrivals: dict[Key, float]


def decode(rank: int, block: Sequence[float]) -> Row | None:
    if not block[ARRIVALS.at("read")]:
        return None  # no read yet, or the recorder is off on that rank
    arrivals: dict[Key, float] = {}
    for i in range(min(int(block[ARRIVALS.at("count")]), MAX_ARRIVALS)):
        at = ARRIVALS.at("entries", i)
        arrivals[(int(block[at]), int(block[at + 1]))] = block[at + ARRIVAL.at("at")]
    get = ARRIVALS.get
    return Row(
        rank, int(get(block, "read_seq")), get(block, "offset"), get(block, "bound"),
        int(get(block, "window")), get(block, "steps"), arrivals,
    )  # fmt: skip
