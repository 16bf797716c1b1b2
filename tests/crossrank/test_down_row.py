"""The exchange's down message: rank 0's answer row encodes and decodes exactly, and stays bounded."""

from __future__ import annotations

import math

from otel_train.crossrank import down_row
from otel_train.crossrank.down_row import MAX_CHRONIC, Verdict, answers, carried, decode
from otel_train.crossrank.scores import RankScores, StragglerReport


def _report(
    rank: int, score: float, waiting: tuple[int, ...] = (), sync: str | None = "backward"
) -> StragglerReport:
    return StragglerReport(
        rank, f"node-{rank // 8}", rank % 8, "chronic", "forward", "compute", 0.015, score, score - 0.01,
        sync, waiting, 0.012,
    )  # fmt: skip


def test_round_trip_of_scores_reports_and_cadence() -> None:
    scores = {
        0: RankScores(0, 1.0, 0.98, 1.0, 0.97, 0.0, 0.015),
        2: RankScores(2, 0.8, None, 0.7, None, 0.015, 0.0),
    }
    culprit = _report(2, 0.8, waiting=(0, 1, 3))
    rows = answers(4, 50, Verdict(7, scores, [culprit]))
    assert rows.shape == (4, down_row.DOWN_LEN)
    for rank in range(4):
        down = decode(rows[rank], rank)
        assert (down.status, down.flush_interval, down.verdict_seq) == (down_row.STATUS_OK, 50, 7)
        assert down.chronic == [culprit] and down.chronic_total == 1
        assert down.scores == scores.get(rank)  # None for a rank without scores (1 has none here)
    first = decode(answers(4, 10, None)[3], 3)
    assert (first.verdict_seq, first.scores, first.chronic, first.flush_interval) == (-1, None, [], 10)


def test_chronic_list_is_capped_to_the_lowest_scores_in_rank_order() -> None:
    reports = [_report(r, 0.5 + 0.01 * ((r * 7) % 10), sync=None) for r in range(10)]
    kept = carried(reports)
    assert len(kept) == MAX_CHRONIC
    lowest = sorted(reports, key=lambda r: (r.score, r.rank))[:MAX_CHRONIC]
    assert {r.rank for r in kept} == {r.rank for r in lowest}
    assert [r.rank for r in kept] == sorted(r.rank for r in kept)  # original (rank) order kept
    down = decode(answers(16, 10, Verdict(3, {}, reports))[5], 5)
    assert down.chronic == kept and down.chronic_total == 10
    assert all(r.sync_phase is None for r in down.chronic)


def test_waiting_ranks_travel_as_bounded_runs_and_names_are_cut() -> None:
    everyone_else = tuple(r for r in range(1000) if r != 417)
    long_name = "x" * 80
    report = StragglerReport(
        417, long_name, 1, "chronic", long_name, "other", 0.1, 0.5, 0.5, "allreduce", everyone_else, 0.1
    )
    (down,) = decode(answers(1000, 10, Verdict(0, {}, [report]))[999], 999).chronic
    assert down.waiting_ranks == everyone_else  # two runs
    assert down.host == long_name[:48] and down.phase == long_name[:48]
    scattered = tuple(range(0, 20, 2))  # ten runs: the first WAIT_RUNS travel
    cut = StragglerReport(1, "h", 1, "chronic", "data", "data", 0.1, 0.5, 0.5, None, scattered, 0.0)
    (down,) = decode(answers(2, 10, Verdict(0, {}, [cut]))[1], 1).chronic
    assert down.waiting_ranks == scattered[: down_row.WAIT_RUNS]
    assert not math.isnan(down.wait_s)
