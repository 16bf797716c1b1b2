"""The cross-rank wire schema: every record the one exchange per flush carries, declared once
(offsets follow from the declaration; the other modules name fields), numbers as float64 words,
text as its UTF-8 bytes, every message led by `VERSION`. Design: docs/design/crossrank.md#wire.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

from otel_train.crossrank.spread import STATS_LEN

VERSION = 4.0  # of the whole schema: a change to any record below changes it
FAILED = -1.0  # a tree bundle's version word when its sender found a failed child (`tree_exchange`)

MAX_TIMERS = 64  # timer slots of an up row (the reducer's default capacity)
ANNOUNCE_SLOTS = 4  # new (id, name) pairs a row announces per flush
MAX_FINGERPRINTS = 4  # watched steps per flush whose batch fingerprints travel (the latest)
MAX_LAYERS = 64  # layers whose parameter norms travel (ot.watch's default max_layers)
MAX_ARRIVALS = 32  # collectives per rank per Flight Recorder read
MAX_CHRONIC = 4  # chronic stragglers an answer carries (the lowest scores); the rest are counted
WAIT_RUNS = 4  # runs of consecutive waiting ranks carried per report
K_EXACT = 4  # exact rows per tree bundle (`merge`), and so scored ranks in a tree's answer
MAX_RUNS = 8  # runs of covered ranks per bundle


@dataclass(frozen=True)
class Text:
    """UTF-8 text cut to `size` bytes (a multiple of 8), NUL-padded."""

    size: int

    @property
    def words(self) -> int:
        return self.size // 8


class Mismatch(ValueError):
    """A message of another wire version: the ranks run different otel_train releases."""


class Record:
    """Fields in order, each `(name,)` one number, `(name, n)` n numbers, `(name, Text(b))` text,
    or `(name, record, n)` n nested records; `words`: the record's size."""

    def __init__(self, *fields: tuple[Any, ...]) -> None:
        self.fields: dict[str, tuple[int, int, int, Any]] = {}  # name -> offset, item, all words, kind
        self.words = 0
        for name, *spec in fields:
            kind, count = [*spec, 1, 1][:2]
            width = kind if isinstance(kind, int) else kind.words
            self.fields[name] = (self.words, width, width * count, kind)
            self.words += width * count

    def at(self, name: str, index: int = 0) -> int:
        """The word where item `index` of field `name` begins (a nested record's base)."""
        offset, width, _, _ = self.fields[name]
        return offset + index * width

    def span(self, name: str) -> slice:
        offset, _, length, _ = self.fields[name]
        return slice(offset, offset + length)

    def new(self, **values: Any) -> list[float]:
        row = [0.0] * self.words
        self.put(row, 0, **values)
        return row

    def put(self, row: MutableSequence[float], base: int = 0, /, **values: Any) -> None:
        """Write fields: a number, a str into a text field, or a sequence from the field's start."""
        for name, value in values.items():
            offset, _, length, kind = self.fields[name]
            if isinstance(value, (int, float)):
                row[base + offset] = float(value)
                continue
            words = text_words(value, kind.size) if isinstance(kind, Text) else value
            if len(words) > length:
                raise ValueError(f"{len(words)} values do not fit field {name!r}")
            row[base + offset : base + offset + len(words)] = words

    def get(self, row: Sequence[float], name: str, base: int = 0, /) -> Any:
        """A number field as a float, a text field as a str, any other as a list of its words."""
        offset, _, length, kind = self.fields[name]
        words = row[base + offset : base + offset + length]
        if isinstance(kind, Text):
            return text_of(tuple(words))
        return words[0] if length == 1 else list(words)


@functools.lru_cache(maxsize=512)  # host and timer names: the same at every flush
def text_words(text: str, size: int) -> tuple[float, ...]:
    raw = text.encode("utf-8")[:size]
    return struct.unpack(f"<{size // 8}d", raw.ljust(size, b"\x00"))


@functools.lru_cache(maxsize=512)
def text_of(words: tuple[float, ...]) -> str:
    raw = struct.pack(f"<{len(words)}d", *words)
    return raw.rstrip(b"\x00").decode("utf-8", errors="ignore")


def refusal(version: float, sender: str) -> str:
    why = f"{sender} sends cross-rank wire version {version:g}, this rank reads {VERSION:g}"
    return why + ": every rank must run the same otel_train release"


def check(version: float, sender: str) -> None:
    """Refuse a message of another wire version, naming both (`sender`: who sent it)."""
    if version != VERSION:
        raise Mismatch(refusal(version, sender))


# --- the records ---------------------------------------------------------------------------------

NAME = Text(48)  # host, timer and phase names

SLOT = Record(("id",), ("count",), ("mean",), ("arrival", STATS_LEN))
ANNOUNCE = Record(("id",), ("name", NAME))


@functools.lru_cache(maxsize=8)
def up(capacity: int = MAX_TIMERS) -> Record:
    """One rank's interval (`up_row`); `from_step`: the row covers the steps (from_step, step]."""
    return Record(
        ("version",), ("rank",), ("seq",), ("step",), ("node_rank",), ("local_rank",), ("n_timers",),
        ("flags",), ("step_stats", STATS_LEN), ("host", NAME), ("flush_interval",), ("from_step",),
        ("slots", SLOT, capacity), ("announced", ANNOUNCE, ANNOUNCE_SLOTS),
    )  # fmt: skip


# The ZeRO facts (`zero_partition`); -1: not recorded. `present`: 1 when this rank trains ZeRO.
ZERO = Record(
    ("present",), ("stage",), ("dp_size",), ("model_numel",), ("partition_numel",), ("state_bytes",),
    ("shard_numel",),
)  # fmt: skip
BATCH = Record(("step",), ("sums", 2))  # one watched step's batch fingerprint
REPLICAS = Record(
    ("present",), ("key",), ("n_fingerprints",), ("fingerprints", BATCH, MAX_FINGERPRINTS),
    ("param_step",), ("n_layers",), ("labels_id",), ("norms", MAX_LAYERS), ("zero", ZERO, 1),
)  # fmt: skip
ARRIVAL = Record(("group",), ("seq",), ("at",))  # at: epoch seconds, the sender's clock
# `read`: 1 once the rank read its Flight Recorder; `t1`: its send time, stamped by the exchange
ARRIVALS = Record(
    ("read",), ("read_seq",), ("offset",), ("bound",), ("window",), ("steps",), ("count",),
    ("entries", ARRIVAL, MAX_ARRIVALS), ("t1",),
)  # fmt: skip


@functools.lru_cache(maxsize=8)
def row(capacity: int = MAX_TIMERS, job_words: int = 0) -> Record:
    """The whole up message: the up row, the replica block, in the star the job block
    (`job_block`, its own encoder: `job_words` = its JOB_LEN; 0 in the tree, whose bundles carry it
    in their head), and the arrivals block last (the exchange stamps its last word)."""
    job = [("job", job_words)] if job_words else []
    return Record(("up", up(capacity), 1), ("replicas", REPLICAS, 1), *job, ("arrivals", ARRIVALS, 1))


SCORES = Record(
    ("present",), ("relative",), ("individual",), ("raw_relative",), ("raw_individual",), ("lateness",),
    ("wait",),
)  # fmt: skip
REPORT = Record(
    ("rank",), ("local_rank",), ("lateness",), ("score",), ("raw_score",), ("wait",), ("category",),
    ("has_sync",), ("waiting_runs", 2 * WAIT_RUNS), ("host", NAME), ("phase", NAME), ("sync_phase", NAME),
)  # fmt: skip
# `verdict_seq`: -1 before the first verdict; in an ABORT the rank found gone. `t2`, `t3`: rank 0's
# clock when the row came and when the answer left.
DOWN = Record(
    ("version",), ("status",), ("verdict_seq",), ("flush_interval",), ("chronic_total",),
    ("chronic_carried",), ("flush_anchor",), ("scores", SCORES, 1), ("chronic", REPORT, MAX_CHRONIC),
    ("t2",), ("t3",), ("read_recorder",),
)  # fmt: skip
ENTRY = Record(("rank",), ("scores", SCORES, 1))
# The tree's answer: one row for every rank, then the scored ranks' table (each finds its own).
TREE_DOWN = Record(("down", DOWN, 1), ("table", ENTRY, K_EXACT))


@functools.lru_cache(maxsize=4)
def bundle_head(job_words: int) -> Record:
    """A tree bundle's head (`merge`): `exact` rows and `weight` (summarized ranks) follow it;
    `runs`: [lo, hi) of every rank covered; `job`: their job blocks summed (`job_block`); `gone`:
    in a FAILED bundle, the rank found gone (-1: not known)."""
    fields = (("version",), ("gone",), ("exact",), ("weight",), ("n_runs",), ("runs", 2 * MAX_RUNS))
    return Record(*fields, ("job", job_words))
