"""The series load test (issue #47): 1,000 ranks' OTLP, through the library's own export path, into
the pinned VictoriaMetrics; the active series count read back from the store matches the per-rank
counts of a real rank's push, and those are within the tier's budget (bench/bench_series_load.py
has the details and the bench itself)."""

from __future__ import annotations

import pytest

from bench.bench_series_load import measure

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

RANKS = 1_000
# Per rank, GPU series apart: the full tier's default budget (semconv: <= 200 at default
# settings), the essential tier's (issue #47: <= 20 plus a fixed set per GPU).
BUDGET = {"full": 200, "essential": 21}


@pytest.mark.parametrize("tier", ["essential", "full"])
def test_a_thousand_ranks_hold_the_budgeted_series_in_victoriametrics(tier: str) -> None:
    result = measure(tier, RANKS, rounds=1, gpu=True, log=lambda _line: None)

    # what the store holds is what the ranks' pushes expand to, series for series
    assert result.measured == result.expected, result.by_metric
    assert sum(result.by_metric.values()) == result.measured
    # one series set per rank: every rank has its own steps counter, GPU and step-time histogram
    assert result.by_metric["train_steps_total"] == RANKS
    assert result.by_metric["hw_temperature_celsius"] == RANKS
    assert result.by_metric["train_step_duration_seconds_count"] == RANKS
    # within the tier's budget: per rank, plus the per-GPU set (one fake GPU per rank here)
    assert 0 < result.per_rank_gpu < result.per_rank
    assert result.per_rank - result.per_rank_gpu <= BUDGET[tier]
    assert result.rank0 >= result.per_rank  # rank 0 adds the job's cross-rank verdicts
    # the job-level series come once per job (rank 0's own Resource, no rank label), in both tiers
    assert result.job > 0
    assert result.by_metric["train_job_ranks"] == 1
    assert result.by_metric["train_job_step_duration_seconds_count"] == 1
    # the 100,000-rank figure is the formula of the measured counts
    assert result.model(RANKS) == result.measured
    assert result.model(100_000) == result.rank0 + (100_000 - 1) * result.per_rank + result.job
