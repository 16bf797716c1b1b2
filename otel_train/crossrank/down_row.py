"""The down message of the telemetry exchange: rank 0's answer to one rank at one flush, as one
fixed-size row (`wire.DOWN`: status, flush schedule, the previous flush's verdicts, clock stamps).
Design: docs/design/crossrank.md#down-row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, get_args

from otel_train.crossrank import wire
from otel_train.crossrank.scores import RankScores, StragglerReport
from otel_train.crossrank.verdicts import Category
from otel_train.crossrank.wire import DOWN, ENTRY, MAX_CHRONIC, REPORT, SCORES, TREE_DOWN, WAIT_RUNS

STATUS_OK = 0
STATUS_ABORT = 1
CATEGORIES: tuple[Category, ...] = get_args(Category)

# The words the exchange writes into an answer on its way (status, the rank gone, clock stamps).
H_STATUS, H_FLUSH_INTERVAL, H_GONE = DOWN.at("status"), DOWN.at("flush_interval"), DOWN.at("verdict_seq")
D_T2, D_T3, D_READ = DOWN.at("t2"), DOWN.at("t3"), DOWN.at("read_recorder")
DOWN_LEN = DOWN.words
TREE_DOWN_LEN = TREE_DOWN.words


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


def _encode_report(row: list[float], at: int, report: StragglerReport) -> None:
    runs = (_runs(report.waiting_ranks)[:WAIT_RUNS] + [(-1, -1)] * WAIT_RUNS)[:WAIT_RUNS]
    REPORT.put(
        row, at, rank=report.rank, local_rank=report.local_rank, lateness=report.lateness_s,
        score=report.score, raw_score=report.raw_score, wait=report.wait_s,
        category=CATEGORIES.index(report.category), has_sync=report.sync_phase is not None,
        waiting_runs=[float(r) for run in runs for r in run], host=report.host, phase=report.phase,
        sync_phase=report.sync_phase or "",
    )  # fmt: skip


def _decode_report(row: Sequence[float], at: int) -> StragglerReport:
    got = {name: REPORT.get(row, name, at) for name in REPORT.fields}
    runs = got["waiting_runs"]
    waiting = [
        r for first, last in zip(runs[::2], runs[1::2], strict=True) if first >= 0
        for r in range(int(first), int(last) + 1)
    ]  # fmt: skip
    return StragglerReport(
        rank=int(got["rank"]), host=got["host"], local_rank=int(got["local_rank"]), pattern="chronic",
        phase=got["phase"], category=CATEGORIES[int(got["category"])], lateness_s=got["lateness"],
        score=got["score"], raw_score=got["raw_score"], waiting_ranks=tuple(waiting), wait_s=got["wait"],
        sync_phase=got["sync_phase"] if got["has_sync"] else None,
    )  # fmt: skip


def _optional(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _encode_scores(scores: RankScores | None) -> list[float]:
    if scores is None:
        return SCORES.new(**dict.fromkeys(list(SCORES.fields)[1:], math.nan))
    return SCORES.new(
        present=1, relative=_optional(scores.relative), individual=_optional(scores.individual),
        raw_relative=_optional(scores.raw_relative), raw_individual=_optional(scores.raw_individual),
        lateness=scores.lateness_s, wait=scores.wait_s,
    )  # fmt: skip


def _decode_scores(rank: int, values: Sequence[float]) -> RankScores | None:
    if not SCORES.get(values, "present"):
        return None
    got = {name: SCORES.get(values, name) for name in SCORES.fields}
    kept = {name: None if math.isnan(value) else value for name, value in got.items()}
    return RankScores(
        rank, kept["relative"], kept["individual"], kept["raw_relative"], kept["raw_individual"],
        got["lateness"], got["wait"],
    )  # fmt: skip


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

    common = DOWN.new(
        version=wire.VERSION, status=STATUS_OK, flush_interval=flush_interval, flush_anchor=flush_anchor,
        verdict_seq=-1 if verdict is None else verdict.seq, t2=math.nan, t3=math.nan,
        read_recorder=read_recorder,
    )  # fmt: skip
    if verdict is not None:
        reports = carried(verdict.chronic)
        DOWN.put(common, chronic_total=len(verdict.chronic), chronic_carried=len(reports))
        for i, report in enumerate(reports):
            _encode_report(common, DOWN.at("chronic", i), report)
    rows = torch.tensor(common, dtype=torch.float64).repeat(world, 1)
    if verdict is not None:
        scores = [_encode_scores(verdict.scores.get(rank)) for rank in range(world)]
        rows[:, DOWN.span("scores")] = torch.tensor(scores, dtype=torch.float64)
    return rows


def tree_answer(
    flush_interval: int, verdict: Verdict | None, flush_anchor: int = -1, read_recorder: bool = False
) -> Any:
    """Rank 0's answer in a tree: one TREE_DOWN_LEN row for every rank (`wire.TREE_DOWN`)."""
    import torch

    bare = None if verdict is None else replace(verdict, scores={})  # the scores go in the table
    common = answers(1, flush_interval, bare, flush_anchor, read_recorder)[0]
    scored = dict(sorted(verdict.scores.items())[: wire.K_EXACT]) if verdict is not None else {}
    unused: list[tuple[int, RankScores | None]] = [(-1, None)] * (wire.K_EXACT - len(scored))
    entries = [*scored.items(), *unused]
    table = [v for rank, scores in entries for v in ENTRY.new(rank=rank, scores=_encode_scores(scores))]
    return torch.cat([common, torch.tensor(table, dtype=torch.float64)])


def decode(row: Any, rank: int) -> Down:
    """One rank's down row (a DOWN_LEN float64 tensor, or a tree's TREE_DOWN_LEN) -> Down; one of
    another wire version raises `wire.Mismatch`."""
    values = row.tolist()
    wire.check(values[DOWN.at("version")], "rank 0")
    if len(values) > DOWN_LEN:  # a tree's answer: this rank's scores from the table
        entries = (values[at : at + ENTRY.words] for at in range(DOWN_LEN, len(values), ENTRY.words))
        mine = next(
            (e[ENTRY.span("scores")] for e in entries if ENTRY.get(e, "rank") == rank), _encode_scores(None)
        )
        values[DOWN.span("scores")] = mine
    # Before the first verdict the row holds no scores (`present` 0) and no chronic reports.
    carried_n = int(values[DOWN.at("chronic_carried")])
    return Down(
        status=int(values[H_STATUS]), flush_interval=int(values[H_FLUSH_INTERVAL]),
        verdict_seq=int(values[DOWN.at("verdict_seq")]),
        scores=_decode_scores(rank, values[DOWN.span("scores")]),
        chronic=[_decode_report(values, DOWN.at("chronic", i)) for i in range(carried_n)],
        chronic_total=int(values[DOWN.at("chronic_total")]), read_recorder=bool(values[D_READ]),
        root_times=(values[D_T2], values[D_T3]), flush_anchor=int(values[DOWN.at("flush_anchor")]),
    )  # fmt: skip
