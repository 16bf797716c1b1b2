"""The job block: what a rank adds to the job-level series (`job_outputs`), a fixed float64 block
that rides the one exchange per flush, merged exactly on the way up (every value a sum, a minimum or
a maximum). Design and layout: docs/design/crossrank.md#job-series.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval, finite
from otel_train.core.resolve import bucket_counts_of
from otel_train.crossrank.up_row import floats, name_id
from otel_train.crossrank.wire import Record

VERSION = 1.0
BUCKETS = len(semconv.PHASE_BUCKETS) + 1
assert len(semconv.STEP_BUCKETS) == len(semconv.PHASE_BUCKETS)  # one record layout for both
# The block's layout (`wire.Record`, as the rows' records): a header, then RECORDS timer records.
# Over the ranks' mean durations a record keeps the smallest and the largest with their ranks.
HEAD = Record(
    ("version",), ("rows",), ("overflow",), ("samples",), ("tokens",), ("loss_sum",), ("loss_count",),
    ("loss_min",), ("loss_max",),
)  # fmt: skip
TIMER = Record(
    ("id",), ("buckets", BUCKETS), ("sum",), ("dmin",), ("dmax",), ("mmin",), ("mmin_rank",), ("mmax",),
    ("mmax_rank",), ("msum",), ("n",),
)  # fmt: skip
_H = {name: HEAD.at(name) for name in HEAD.fields}  # header word of each field
_H_ADDED = [_H[name] for name in ("rows", "overflow", "samples", "tokens", "loss_sum", "loss_count")]
HEAD_LEN = HEAD.words
R_ID, R_BUCKETS, R_SUM, R_DMIN, R_DMAX, R_MMIN, R_MMIN_RANK, R_MMAX, R_MMAX_RANK, R_MSUM, R_N = (
    TIMER.at(name) for name in TIMER.fields
)
REC_LEN = TIMER.words
RECORDS = 16  # the step and up to 15 timers: a job's timers beyond are left out (counted, warned)
JOB_LEN = HEAD_LEN + RECORDS * REC_LEN
STEP_ID = float(2**48)  # above every name id (48 bits): the step time's record
_ADD = [R_SUM, R_MSUM, R_N, *range(R_BUCKETS, R_BUCKETS + BUCKETS)]


def encode(interval: Interval, rank: int) -> Any:
    """This rank's block of `interval` (a [JOB_LEN] float64 tensor)."""
    block = [0.0] * JOB_LEN
    block[_H["version"]], block[_H["rows"]] = VERSION, 1.0
    block[_H["samples"]], block[_H["tokens"]] = float(interval.samples), float(interval.tokens)
    loss = interval.scalars.get(semconv.LOSS.name) or []
    block[_H["loss_sum"]], block[_H["loss_count"]] = math.fsum(loss), float(len(loss))
    block[_H["loss_min"]], block[_H["loss_max"]] = min(loss, default=math.inf), max(loss, default=-math.inf)
    timers = [(STEP_ID, finite(interval.step_durations), semconv.STEP_BUCKETS)]
    phases = [(name, finite(values)) for name, values in interval.phases.items()]
    phases = sorted((p for p in phases if p[1]), key=lambda p: -len(p[1]))
    block[_H["overflow"]] = float(max(0, len(phases) - (RECORDS - 1)))
    timers += [
        (float(name_id(name)), values, semconv.PHASE_BUCKETS) for name, values in phases[: RECORDS - 1]
    ]
    # by id (the step, above every name id, last): ranks with the same timers lay them out alike,
    # so merging their blocks is column by column (`combine`)
    for index, (ident, values, bounds) in enumerate(sorted((t for t in timers if t[1]), key=lambda t: t[0])):
        at = HEAD_LEN + index * REC_LEN
        ordered = sorted(values)
        mean = math.fsum(ordered) / len(ordered)
        block[at + R_ID] = ident
        block[at + R_BUCKETS : at + R_SUM] = bucket_counts_of(ordered, bounds)  # as the SDK buckets them
        block[at + R_SUM : at + R_DMAX + 1] = [math.fsum(ordered), ordered[0], ordered[-1]]
        block[at + R_MMIN : at + REC_LEN] = [mean, float(rank), mean, float(rank), mean, 1.0]
    return floats(block)


@functools.cache
def available() -> bool:
    """Whether a block can be made here: blocks are torch tensors, and a single-process run may
    have no torch (no dependency of otel_train); a distributed job always has it."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def empty() -> Any:
    """A block that stands for no row (what a merge of nothing gives)."""
    import torch

    return torch.zeros(JOB_LEN, dtype=torch.float64)


def combine(blocks: Any) -> Any:
    """The blocks ([n, JOB_LEN] float64, or a list of [JOB_LEN] tensors) as one: sums added,
    minima and maxima kept with the lowest rank on ties, records matched by id. Exact: the result
    is what one block of all the rows would hold (beyond RECORDS timers, those with the fewest
    durations are left out and counted)."""
    import numpy as np
    import torch

    # numpy, not torch: a tree parent merges at every flush, and on arrays this small each torch
    # op costs microseconds of dispatch
    if isinstance(blocks, list):
        array = np.stack([b.numpy() for b in blocks]) if blocks else np.zeros((0, JOB_LEN))
    else:
        array = blocks.numpy()
    array = array.reshape(-1, JOB_LEN)
    array = array[array[:, _H["version"]] == VERSION]
    if not len(array):
        return empty()
    ids = array[:, _columns()[3] + R_ID]
    if (ids == ids[0]).all():  # the same records in the same places: column by column
        return torch.from_numpy(_by_column(array))
    return _by_id(torch.from_numpy(array))


@functools.cache
def _columns() -> tuple[Any, Any, Any, Any]:
    """The columns of a block that are summed, kept at their least, kept at their greatest (the
    rest, the version and the ids, are copied), and where each record starts: numpy index arrays."""
    import numpy as np

    records = [HEAD_LEN + index * REC_LEN for index in range(RECORDS)]
    added = _H_ADDED + [at + c for at in records for c in _ADD]
    least = [_H["loss_min"]] + [at + c for at in records for c in (R_DMIN, R_MMIN)]
    greatest = [_H["loss_max"]] + [at + c for at in records for c in (R_DMAX, R_MMAX)]
    return np.array(added), np.array(least), np.array(greatest), np.array(records)


def _by_column(blocks: Any) -> Any:
    """`combine` of blocks (a [n, JOB_LEN] numpy array) whose records sit in the same places."""
    import numpy as np

    added, least, greatest, records = _columns()
    out = blocks[0].copy()
    out[added] = blocks.sum(0)[added]
    out[least], out[greatest] = blocks.min(0)[least], blocks.max(0)[greatest]
    # the rank of each record's least and greatest mean (the next column): the lowest holding it
    for values in (records + R_MMIN, records + R_MMAX):
        held = np.where(blocks[:, values] == out[values], blocks[:, values + 1], math.inf)
        out[values + 1] = held.min(0)
    return out


def _by_id(blocks: Any) -> Any:
    """`combine` of blocks whose records differ: matched by id."""
    import torch

    out = empty()
    out[_H["version"]] = VERSION
    for at in _H_ADDED:
        out[at] = blocks[:, at].sum()
    low, high = _H["loss_min"], _H["loss_max"]
    out[low], out[high] = blocks[:, low].min(), blocks[:, high].max()
    records = blocks[:, HEAD_LEN:].reshape(-1, REC_LEN)
    records = records[records[:, R_ID] != 0]
    if not len(records):
        return out
    ids, where = torch.unique(records[:, R_ID], return_inverse=True)  # ascending: as `encode` lays them
    merged = torch.zeros(len(ids), REC_LEN, dtype=torch.float64)
    merged[:, R_ID] = ids
    # Sums as a product with the records' one-hot id matrix: far cheaper than index_add on CPU here
    onehot = (where.unsqueeze(0) == torch.arange(len(ids)).unsqueeze(1)).to(torch.float64)
    merged[:, _ADD] = onehot @ records[:, _ADD]
    for value, rank, reduce in ((R_MMIN, R_MMIN_RANK, "amin"), (R_MMAX, R_MMAX_RANK, "amax")):
        best = merged[:, value].scatter_reduce(0, where, records[:, value], reduce, include_self=False)
        merged[:, value] = best
        held = torch.where(records[:, value] == best[where], records[:, rank], math.inf)
        merged[:, rank] = torch.full_like(best, math.inf).scatter_reduce(0, where, held, "amin")
    for column, reduce in ((R_DMIN, "amin"), (R_DMAX, "amax")):
        merged[:, column] = merged[:, column].scatter_reduce(
            0, where, records[:, column], reduce, include_self=False
        )
    counts = merged[:, R_BUCKETS:R_SUM].sum(1).tolist()
    order = sorted(range(len(ids)), key=lambda i: (ids[i].item() != STEP_ID, -counts[i]))
    kept = sorted(order[:RECORDS])  # by id again
    out[_H["overflow"]] += float(len(order) - len(kept))
    out[HEAD_LEN : HEAD_LEN + len(kept) * REC_LEN] = merged[kept].reshape(-1)
    return out


@dataclass(frozen=True)
class TimerTotals:
    """One record of a block, decoded."""

    buckets: tuple[int, ...]
    total: float  # sum of durations (s)
    low: float  # smallest duration
    high: float  # largest duration
    mean_min: float  # over the ranks' mean durations: smallest, its rank, largest, its rank
    mean_min_rank: int
    mean_max: float
    mean_max_rank: int
    mean_of_means: float
    ranks: int

    @property
    def count(self) -> int:
        return sum(self.buckets)


@dataclass(frozen=True)
class JobTotals:
    """A block, decoded: rows it stands for, throughput, loss and timers by id (STEP_ID: step)."""

    rows: int
    overflow: int
    samples: float
    tokens: float
    loss_sum: float
    loss_count: int
    loss_min: float
    loss_max: float
    timers: Mapping[float, TimerTotals]


def loss_of(blocks: Any) -> tuple[float, float, float] | None:
    """(mean, min, max) of the loss values the ranks of `blocks` ([JOB_LEN] or [n, JOB_LEN])
    recorded in their intervals, or None when none did: the loss columns alone, not a `combine`."""
    array = blocks.numpy().reshape(-1, JOB_LEN)
    array = array[array[:, _H["version"]] == VERSION]
    count = float(array[:, _H["loss_count"]].sum())
    if not count:
        return None
    mean = float(array[:, _H["loss_sum"]].sum()) / count
    return mean, float(array[:, _H["loss_min"]].min()), float(array[:, _H["loss_max"]].max())


def decode(block: Any) -> JobTotals:
    """A block ([JOB_LEN] float64) as its totals."""
    values = block.tolist()
    timers: dict[float, TimerTotals] = {}
    for at in range(HEAD_LEN, JOB_LEN, REC_LEN):
        record = values[at : at + REC_LEN]
        if record[R_ID]:
            n = int(record[R_N])
            timers[record[R_ID]] = TimerTotals(
                tuple(int(c) for c in record[R_BUCKETS:R_SUM]), record[R_SUM], record[R_DMIN], record[R_DMAX],
                record[R_MMIN], int(record[R_MMIN_RANK]), record[R_MMAX], int(record[R_MMAX_RANK]),
                record[R_MSUM] / n if n else math.nan, n,
            )  # fmt: skip
    return JobTotals(
        rows=int(values[_H["rows"]]),
        overflow=int(values[_H["overflow"]]),
        samples=values[_H["samples"]],
        tokens=values[_H["tokens"]],
        loss_sum=values[_H["loss_sum"]],
        loss_count=int(values[_H["loss_count"]]),
        loss_min=values[_H["loss_min"]],
        loss_max=values[_H["loss_max"]],
        timers=timers,
    )
