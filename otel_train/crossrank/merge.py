"""What goes up the tree (`tree_exchange`): a rank's row merged with its children's into ONE
bundle of bounded size (the rows that stray most, whole, and a mergeable quantile summary of the
rest). Design, layout and error bound: docs/design/crossrank.md#merge.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_train.crossrank import job_block, wire
from otel_train.crossrank.spread import STATS_LEN
from otel_train.crossrank.up_row import (
    ANNOUNCE_SLOTS,
    COLUMNS,
    MAX_TIMERS,
    SUMMARY_RANK,
    RankRecord,
    floats,
    row_announcements,
    row_values,
    summary_row,
    unpack,
)
from otel_train.crossrank.verdicts import RankAssessment
from otel_train.crossrank.wire import K_EXACT, MAX_RUNS  # exact rows (the merging rank's first), runs

LEVELS = 3  # summary rows per bundle
HEAD = wire.bundle_head(job_block.JOB_LEN)  # beyond MAX_RUNS runs, the last ones are joined (overstated)
HEAD_LEN = HEAD.words
Parsed = tuple[list[float], dict[int, list[float]]]  # up_row.row_values of one row


def bundle_len(row_len: int, base_len: int, ranks: int = K_EXACT + 1) -> int:
    """Floats in a bundle of rows of `row_len` floats whose `up_row` part is `base_len`, from a
    subtree of `ranks` (one of at most K_EXACT ranks carries no summary rows, and fewer rows)."""
    return HEAD_LEN + min(ranks, K_EXACT) * row_len + (LEVELS * base_len if ranks > K_EXACT else 0)


@dataclass
class Bundle:
    """One bundle, decoded: rows as lists of floats."""

    exact: list[list[float]]
    summary: list[list[float]] = field(default_factory=list)  # LEVELS rows, or none
    weight: float = 0.0  # ranks the summary rows stand for, in all
    runs: list[tuple[int, int]] = field(default_factory=list)  # [lo, hi) of every rank covered
    # The exact rows as one [rows, row_len] float64 tensor where they came as one (a received
    # bundle, a rank's own row): rank 0 reads the blocks from it without rebuilding it (`unpacked`).
    tensor: Any = None
    # The job blocks of every rank covered, exact and summarized: one summed block
    # (`job_block.combine`), or at rank 0 the [n, JOB_LEN] blocks whose sum it is; None: none
    job: Any = None

    @classmethod
    def of_row(cls, row: Sequence[float], rank: int, tensor: Any = None) -> Bundle:
        """`tensor`: the same row as a 1-D tensor, when the caller has it."""
        return cls(
            [list(row)], runs=[(rank, rank + 1)], tensor=None if tensor is None else tensor.reshape(1, -1)
        )

    @property
    def ranks(self) -> int:
        return sum(hi - lo for lo, hi in self.runs)


def encode(bundle: Bundle, row_len: int, base_len: int, ranks: int = K_EXACT + 1) -> Any:
    """The bundle of a subtree of `ranks` (its length: `bundle_len`)."""
    import torch

    out = torch.zeros(bundle_len(row_len, base_len, ranks), dtype=torch.float64)
    runs = bundle.runs[:MAX_RUNS]
    head = HEAD.new(
        version=wire.VERSION, exact=len(bundle.exact), weight=bundle.weight, n_runs=len(runs),
        runs=[float(end) for run in runs for end in run],
    )  # fmt: skip
    out[:HEAD_LEN] = floats(head)
    if bundle.job is not None:
        out[HEAD.span("job")] = bundle.job
    if bundle.exact:
        exact = floats(itertools.chain.from_iterable(bundle.exact[:K_EXACT]))
        out[HEAD_LEN : HEAD_LEN + exact.numel()] = exact
    if bundle.summary:
        at = HEAD_LEN + min(ranks, K_EXACT) * row_len
        summary = floats(itertools.chain.from_iterable(bundle.summary[:LEVELS]))
        out[at : at + summary.numel()] = summary
    return out


def decode(message: Any, row_len: int, base_len: int, ranks: int = K_EXACT + 1) -> Bundle:
    values = message.tolist()
    n = min(int(HEAD.get(values, "exact")), K_EXACT)
    exact = [values[HEAD_LEN + i * row_len : HEAD_LEN + (i + 1) * row_len] for i in range(n)]
    weight = HEAD.get(values, "weight")
    at = HEAD_LEN + min(ranks, K_EXACT) * row_len
    summary = (
        [values[at + j * base_len : at + (j + 1) * base_len] for j in range(LEVELS)] if weight > 0 else []
    )
    ends = [int(end) for end in HEAD.get(values, "runs")[: 2 * int(HEAD.get(values, "n_runs"))]]
    runs = list(zip(ends[::2], ends[1::2], strict=True))
    tensor = message[HEAD_LEN : HEAD_LEN + n * row_len].reshape(n, row_len).clone()  # not the receive buffer
    return Bundle(exact, summary, weight, runs, tensor, message[HEAD.span("job")].clone())


def merge(parts: Sequence[Bundle]) -> Bundle:
    """The bundles of one rank (its own first) and its children, as one (module doc)."""
    own, *others = [row for part in parts for row in part.exact]
    parsed = [row_values(row) for row in others]
    ordered = sorted(range(len(others)), key=_strays(parsed), reverse=True)
    keep = [others[i] for i in sorted(ordered[: K_EXACT - 1])]
    points = [(others[i], parsed[i], 1.0) for i in ordered[K_EXACT - 1 :]]
    for part in parts:
        points.extend((row, row_values(row), part.weight / LEVELS) for row in part.summary)
    runs = _union([run for part in parts for run in part.runs])
    if not points:
        return Bundle([own, *keep], runs=runs)
    weight = sum(w for _, _, w in points)
    return Bundle([own, *keep], _summarize(own, points), weight, runs)


def join(own: Bundle, child: Bundle) -> Bundle:
    """Rank 0's view: its own row and its deputy's bundle (`tree.layout`), folded no further: every
    exact row stays exact (one more than a bundle holds) and the summary rows keep their weight."""
    tensor = None
    if own.tensor is not None and child.tensor is not None:
        import torch

        tensor = torch.cat([own.tensor, child.tensor])
    exact = [*own.exact, *child.exact]
    return Bundle(exact, child.summary, child.weight, _union([*own.runs, *child.runs]), tensor)


def _strays(parsed: Sequence[Parsed]) -> Any:
    """Key: how far a row strays from the rows' medians (seconds, at its worst timer or step)."""
    columns: dict[int, list[float]] = {}
    for step, timers in parsed:
        if step[0] > 0:
            columns.setdefault(0, []).append(step[1])
        for ident, values in timers.items():
            columns.setdefault(ident, []).append(values[3])  # arrival median
    medians = {ident: sorted(v)[(len(v) - 1) // 2] for ident, v in columns.items()}
    scores = []
    for step, timers in parsed:
        gaps = [abs(step[1] - medians[0])] if step[0] > 0 else []
        gaps += [abs(values[3] - medians[ident]) for ident, values in timers.items() if values[2] > 0]
        scores.append(max([g for g in gaps if g == g], default=0.0))
    return lambda i: scores[i]


def _quantiles(points: list[tuple[float, float]]) -> list[float]:
    """The weighted quantiles (j + 0.5) / LEVELS of (value, weight) points."""
    points.sort()
    total = sum(w for _, w in points)
    out, acc, i = [], points[0][1], 0
    for j in range(LEVELS):
        target = (j + 0.5) / LEVELS * total
        while acc < target and i < len(points) - 1:
            i += 1
            acc += points[i][1]
        out.append(points[i][0])
    return out


def _summarize(
    template: Sequence[float], points: Sequence[tuple[Sequence[float], Parsed, float]]
) -> list[list[float]]:
    """LEVELS summary rows of weighted rows (module doc)."""
    step_points: list[list[tuple[float, float]]] = [[] for _ in range(STATS_LEN)]
    timer_points: dict[int, list[list[tuple[float, float]]]] = {}
    announced: dict[float, list[float]] = {}
    for row, (step, timers), weight in points:
        if step[0] > 0 and all(v == v for v in step):
            for c, value in enumerate(step):
                step_points[c].append((value, weight))
        for ident, values in timers.items():
            if len(timer_points) < MAX_TIMERS or ident in timer_points:
                columns = timer_points.setdefault(ident, [[] for _ in range(COLUMNS)])
                for c, value in enumerate(values):
                    if value == value:
                        columns[c].append((value, weight))
        for entry in row_announcements(row):
            announced.setdefault(entry[0], entry)
    steps = [_quantiles(c) if c else [0.0] * LEVELS for c in step_points]
    timers_q = {i: [_quantiles(c) if c else [0.0] * LEVELS for c in cols] for i, cols in timer_points.items()}
    names = list(announced.values())
    return [
        summary_row(
            template,
            [steps[c][j] for c in range(STATS_LEN)],
            {i: [cols[c][j] for c in range(COLUMNS)] for i, cols in timers_q.items()},
            names[j * ANNOUNCE_SLOTS : (j + 1) * ANNOUNCE_SLOTS],
        )
        for j in range(LEVELS)
    ]


def _union(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    if len(out) > MAX_RUNS:
        out = [*out[: MAX_RUNS - 1], (out[MAX_RUNS - 1][0], out[-1][1])]
    return out


@dataclass(frozen=True)
class TreeView:
    """Rank 0's merged bundle, unpacked for the reduction (`reducer.CrossRankReducer`)."""

    rows: Any  # [exact, row_len] float64: the exact rows, whole (blocks included)
    exact: list[RankRecord]
    summary: list[RankRecord]  # LEVELS records of SUMMARY_RANK, or none
    weight: float  # ranks each summary record stands for
    ranks: int  # ranks covered, exact and summarized
    runs: tuple[tuple[int, int], ...]


def unpacked(bundle: Bundle, base_len: int) -> TreeView:
    import torch

    rows = bundle.tensor if bundle.tensor is not None else torch.tensor(bundle.exact, dtype=torch.float64)
    exact = unpack(bundle.exact)
    summary = unpack(bundle.summary)
    weight = bundle.weight / LEVELS if summary else 0.0
    return TreeView(rows, exact, summary, weight, bundle.ranks, tuple(bundle.runs))


def widen_waiting(assessments: Sequence[RankAssessment], tree: TreeView) -> list[RankAssessment]:
    """The assessments of real ranks; where the summary waits for a culprit, every summarized
    rank is among the ranks that wait for it."""
    exact = {r.rank for r in tree.exact}
    summarized = {rank for lo, hi in tree.runs for rank in range(lo, hi) if rank not in exact}
    real = [a for a in assessments if a.rank >= 0]
    for a in real:
        if SUMMARY_RANK in a.waiting_ranks:
            a.waiting_ranks = tuple(sorted({r for r in a.waiting_ranks if r >= 0} | summarized))
    return real
