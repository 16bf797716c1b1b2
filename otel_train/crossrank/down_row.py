"""The down message of the telemetry exchange: rank 0's answer to one rank at one flush, as one
fixed-size float64 row (status, flush schedule, the previous flush's verdicts, clock stamps).
Design and layout: docs/design/crossrank.md#down-row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, get_args

from otel_train.crossrank.scores import RankScores, StragglerReport
from otel_train.crossrank.up_row import HOST_FLOATS, NAME_FLOATS, decode_text, encode_text
from otel_train.crossrank.verdicts import Category

DOWN_VERSION = 2.0
STATUS_OK = 0
STATUS_ABORT = 1
MAX_CHRONIC = 4  # chronic stragglers carried per flush (the lowest scores); the rest are counted
WAIT_RUNS = 4  # runs of consecutive waiting ranks carried per report
CATEGORIES: tuple[Category, ...] = get_args(Category)

H_VERSION, H_STATUS, H_VERDICT_SEQ, H_FLUSH_INTERVAL, H_CHRONIC_TOTAL, H_CHRONIC_CARRIED = range(6)
H_FLUSH_ANCHOR = 6
H_GONE = H_VERDICT_SEQ  # in an ABORT answer (no verdict rides it): the rank found gone (-1: unknown)
HEADER_LEN = 7
SCORES_LEN = 7
_R_RANK, _R_LOCAL, _R_LATENESS, _R_SCORE, _R_RAW, _R_WAIT, _R_CATEGORY, _R_HAS_SYNC = range(8)
_R_RUNS = 8
_R_HOST = _R_RUNS + 2 * WAIT_RUNS
_R_PHASE = _R_HOST + HOST_FLOATS
_R_SYNC = _R_PHASE + NAME_FLOATS
REPORT_LEN = _R_SYNC + NAME_FLOATS
_CLOCK_AT = HEADER_LEN + SCORES_LEN + MAX_CHRONIC * REPORT_LEN
D_T2, D_T3, D_READ = _CLOCK_AT, _CLOCK_AT + 1, _CLOCK_AT + 2
DOWN_LEN = _CLOCK_AT + 3
# The tree's answer (`tree_exchange`): the same row for every rank, then a table of the scored ranks
# (rank, scores); each rank finds its own there. Rank 0 scores the exact rows of `merge` only.
TABLE_ENTRIES = 4  # = merge.K_EXACT
ENTRY_LEN = 1 + SCORES_LEN
TREE_DOWN_LEN = DOWN_LEN + TABLE_ENTRIES * ENTRY_LEN


@dataclass(frozen=True)
class Verdict:
    """What rank 0 decided at one flush, to be sent down at the next."""

    seq: int
    scores: Mapping[int, RankScores]  # by rank
    chronic: Sequence[StragglerReport]


@dataclass(frozen=True)
class Down:
    """One decoded down row."""

    status: int
    flush_interval: int  # rank 0's decided steps per flush (0: none) ...
    verdict_seq: int  # the flush whose verdicts these are (-1: none yet)
    scores: RankScores | None = None  # this rank's
    chronic: list[StragglerReport] = field(default_factory=list)
    chronic_total: int = 0  # chronic stragglers found (may exceed the carried list)
    read_recorder: bool = False  # every rank reads its Flight Recorder at this flush
    root_times: tuple[float, float] = (math.nan, math.nan)  # rank 0's (t2, t3) of this exchange
    flush_anchor: int = -1  # ... from this step on (flush steps: anchor + n x interval)


def _runs(ranks: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return runs


def carried(chronic: Sequence[StragglerReport], cap: int = MAX_CHRONIC) -> list[StragglerReport]:
    """The chronic reports that travel: all when at most `cap`, else the `cap` lowest scores
    (ties: lowest rank), in their original order."""
    if len(chronic) <= cap:
        return list(chronic)
    keep = {id(r) for r in sorted(chronic, key=lambda r: (r.score, r.rank))[:cap]}
    return [r for r in chronic if id(r) in keep]


def _encode_report(report: StragglerReport) -> list[float]:
    row = [0.0] * REPORT_LEN
    row[_R_RANK] = float(report.rank)
    row[_R_LOCAL] = float(report.local_rank)
    row[_R_LATENESS] = report.lateness_s
    row[_R_SCORE] = report.score
    row[_R_RAW] = report.raw_score
    row[_R_WAIT] = report.wait_s
    row[_R_CATEGORY] = float(CATEGORIES.index(report.category))
    row[_R_HAS_SYNC] = 0.0 if report.sync_phase is None else 1.0
    runs = _runs(report.waiting_ranks)[:WAIT_RUNS]
    for i in range(WAIT_RUNS):
        first, last = runs[i] if i < len(runs) else (-1, -1)
        row[_R_RUNS + 2 * i] = float(first)
        row[_R_RUNS + 2 * i + 1] = float(last)
    row[_R_HOST:_R_PHASE] = encode_text(report.host, HOST_FLOATS)
    row[_R_PHASE:_R_SYNC] = encode_text(report.phase, NAME_FLOATS)
    row[_R_SYNC:REPORT_LEN] = encode_text(report.sync_phase or "", NAME_FLOATS)
    return row


def _decode_report(row: Sequence[float]) -> StragglerReport:
    waiting: list[int] = []
    for i in range(WAIT_RUNS):
        first, last = int(row[_R_RUNS + 2 * i]), int(row[_R_RUNS + 2 * i + 1])
        if first >= 0:
            waiting.extend(range(first, last + 1))
    return StragglerReport(
        rank=int(row[_R_RANK]),
        host=decode_text(row[_R_HOST:_R_PHASE]),
        local_rank=int(row[_R_LOCAL]),
        pattern="chronic",
        phase=decode_text(row[_R_PHASE:_R_SYNC]),
        category=CATEGORIES[int(row[_R_CATEGORY])],
        lateness_s=row[_R_LATENESS],
        score=row[_R_SCORE],
        raw_score=row[_R_RAW],
        sync_phase=decode_text(row[_R_SYNC:REPORT_LEN]) if row[_R_HAS_SYNC] else None,
        waiting_ranks=tuple(waiting),
        wait_s=row[_R_WAIT],
    )


def _optional(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _encode_scores(scores: RankScores | None) -> list[float]:
    if scores is None:
        return [0.0] + [math.nan] * (SCORES_LEN - 1)
    values = (scores.relative, scores.individual, scores.raw_relative, scores.raw_individual)
    return [1.0, *(_optional(v) for v in values), scores.lateness_s, scores.wait_s]


def _decode_scores(rank: int, values: Sequence[float]) -> RankScores | None:
    if not values[0]:
        return None
    relative, individual, raw_relative, raw_individual = (None if math.isnan(v) else v for v in values[1:5])
    return RankScores(rank, relative, individual, raw_relative, raw_individual, values[5], values[6])


def answers(
    world: int,
    flush_interval: int,
    verdict: Verdict | None,
    flush_anchor: int = -1,
    read_recorder: bool = False,
) -> Any:
    """Rank 0's down rows for this flush, one per rank (row r for rank r): a [world, DOWN_LEN]
    float64 tensor with status OK (the exchange sets ABORT when a peer fails, and the clock)."""
    import torch

    common = [0.0] * DOWN_LEN
    common[D_T2] = common[D_T3] = math.nan
    common[D_READ] = 1.0 if read_recorder else 0.0
    common[H_VERSION] = DOWN_VERSION
    common[H_STATUS] = float(STATUS_OK)
    common[H_FLUSH_INTERVAL] = float(flush_interval)
    common[H_FLUSH_ANCHOR] = float(flush_anchor)
    common[H_VERDICT_SEQ] = -1.0 if verdict is None else float(verdict.seq)
    if verdict is not None:
        reports = carried(verdict.chronic)
        common[H_CHRONIC_TOTAL] = float(len(verdict.chronic))
        common[H_CHRONIC_CARRIED] = float(len(reports))
        for i, report in enumerate(reports):
            at = HEADER_LEN + SCORES_LEN + i * REPORT_LEN
            common[at : at + REPORT_LEN] = _encode_report(report)
    rows = torch.tensor(common, dtype=torch.float64).repeat(world, 1)
    if verdict is not None:
        scores = [_encode_scores(verdict.scores.get(rank)) for rank in range(world)]
        rows[:, HEADER_LEN : HEADER_LEN + SCORES_LEN] = torch.tensor(scores, dtype=torch.float64)
    return rows


def tree_answer(
    flush_interval: int, verdict: Verdict | None, flush_anchor: int = -1, read_recorder: bool = False
) -> Any:
    """Rank 0's answer in a tree: one TREE_DOWN_LEN row for every rank (module constants)."""
    import torch

    bare = None if verdict is None else replace(verdict, scores={})  # the scores go in the table
    common = answers(1, flush_interval, bare, flush_anchor, read_recorder)[0]
    table = [-1.0, *_encode_scores(None)] * TABLE_ENTRIES
    scored = sorted(verdict.scores.items())[:TABLE_ENTRIES] if verdict is not None else []
    for i, (rank, scores) in enumerate(scored):
        table[i * ENTRY_LEN : (i + 1) * ENTRY_LEN] = [float(rank), *_encode_scores(scores)]
    return torch.cat([common, torch.tensor(table, dtype=torch.float64)])


def no_news() -> Any:
    """A tree's inner rank's answer when its parent's has not come: nothing to adopt."""
    return tree_answer(0, None)


def decode(row: Any, rank: int) -> Down:
    """One rank's down row (a DOWN_LEN float64 tensor, or a tree's TREE_DOWN_LEN) -> Down."""
    values = row.tolist()
    if len(values) > DOWN_LEN:  # a tree's answer: this rank's scores from the table
        entries = (values[at : at + ENTRY_LEN] for at in range(DOWN_LEN, len(values), ENTRY_LEN))
        mine = next((e[1:] for e in entries if int(e[0]) == rank), _encode_scores(None))
        values[HEADER_LEN : HEADER_LEN + SCORES_LEN] = mine
    verdict_seq = int(values[H_VERDICT_SEQ])
    read, times = bool(values[D_READ]), (values[D_T2], values[D_T3])
    anchor = int(values[H_FLUSH_ANCHOR])
    down = Down(
        int(values[H_STATUS]),
        int(values[H_FLUSH_INTERVAL]),
        verdict_seq,
        read_recorder=read,
        root_times=times,
        flush_anchor=anchor,
    )
    if verdict_seq < 0:
        return down
    chronic = [
        _decode_report(values[at : at + REPORT_LEN])
        for at in (HEADER_LEN + SCORES_LEN + i * REPORT_LEN for i in range(int(values[H_CHRONIC_CARRIED])))
    ]
    scores = _decode_scores(rank, values[HEADER_LEN : HEADER_LEN + SCORES_LEN])
    total = int(values[H_CHRONIC_TOTAL])
    return Down(down.status, down.flush_interval, verdict_seq, scores, chronic, total, read, times, anchor)
