"""Series tiers (`rank_series`): what a real rank sends to the metrics store in each tier.

The series are counted from what was exported, never from a constant: the samples of the rank's
real `/metrics` (one sample is one Prometheus series) and the data points of its real OTLP push
(decoded by a real receiver, turned into series as a store does: a histogram point is one series
per bucket plus `_sum` and `_count`). The training loop is `bench/series_budget.py`'s; the rank's
GPU is the NVML fake the hardware tests use, so the per-GPU set is counted too.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers.fake_nvml import FakeGpu, FakeNvml, gpu_uuid
from helpers.multirank import run_ranks
from helpers.otlp_receiver import Received, http_receiver
from helpers.ports import free_port
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train import semconv
from otel_train.config import RANK_SERIES_ESSENTIAL_FROM
from otel_train.exporters import essential_names, resolve_rank_series
from otel_train.testing import current_session

BENCH = Path(__file__).resolve().parents[2] / "bench" / "series_budget.py"
BUDGET_PER_RANK = 21  # the essential tier's budget (docs/scale.md "Series budget"), GPUs aside
BUDGET_PER_GPU = 12
GPU_LABEL = "hw_id"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("series_budget", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- what was exported, as series ------------------------------------------------------------------
def pull_series(url: str) -> list[tuple[str, dict[str, str]]]:
    """(sample name, labels) of every sample the pull endpoint serves now."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return [(s.name, dict(s.labels)) for f in text_string_to_metric_families(text) for s in f.samples]


def job_level(sample_name: str) -> bool:
    """A sample of a job-level series (exported once per job by rank 0, outside the per-rank budget)."""
    return any(
        sample_name.removesuffix(suffix) == spec.prometheus_name
        for spec in semconv.CATALOGUE
        if spec.scope == "job"
        for suffix in ("", "_bucket", "_sum", "_count")
    )


def otlp_series(received: Received) -> Counter[str]:
    """Series per metric name in the last push that held each metric (cumulative: the last holds
    them all), counted as a store makes them."""
    last: dict[str, Any] = {}
    for request in received.metrics:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    last[metric.name] = metric
    counts: Counter[str] = Counter()
    for name, metric in last.items():
        kind = metric.WhichOneof("data")
        for point in getattr(metric, kind).data_points:
            counts[name] += len(point.explicit_bounds) + 3 if kind == "histogram" else 1
    return counts


def otlp_gpu_series(received: Received) -> int:
    last: dict[str, Any] = {}
    for request in received.metrics:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    last[metric.name] = metric
    return sum(
        1
        for metric in last.values()
        for point in getattr(metric, metric.WhichOneof("data")).data_points
        if any(kv.key == semconv.HW_ID for kv in point.attributes)
    )


def run_one_rank(tier: str, endpoint: str) -> tuple[list[tuple[str, dict[str, str]]], Path]:
    """The bench's loop on a rank with a fake GPU: its /metrics samples at the end, its run dir."""
    port = free_port()
    run = ot.init(
        prometheus_port=port, run_id=f"tiers-{tier}", verbosity=0, log_interval=2, rank_series=tier,
        otlp_metrics_endpoint=f"{endpoint}/v1/metrics", metric_export_interval_s=60,
        hardware_interval_s=0.05,
    )  # fmt: skip
    try:
        assert run.info().rank_series == tier
        _bench().train(12, watch=False)
        session = current_session()
        assert session is not None
        session.worker.stop(timeout_s=10)
        samples = pull_series(f"http://127.0.0.1:{port}/metrics")
        run_dir = run.run_dir
        assert run_dir is not None
    finally:
        ot.shutdown()  # the last OTLP push
    return samples, run_dir


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    gpu = FakeGpu(uuid=gpu_uuid(0), clock_reasons=0x40)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([gpu]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return gpu


# --- the setting ------------------------------------------------------------------------------------
def test_auto_is_essential_from_the_threshold_on() -> None:
    assert RANK_SERIES_ESSENTIAL_FROM == 1024
    assert resolve_rank_series("auto", 1) == "full"
    assert resolve_rank_series("auto", 1023) == "full"
    assert resolve_rank_series("auto", 1024) == "essential"
    assert resolve_rank_series("auto", 100_000) == "essential"
    assert resolve_rank_series("full", 100_000) == "full"
    assert resolve_rank_series("essential", 2) == "essential"


def test_the_essential_set_holds_what_the_per_rank_alerts_read() -> None:
    """Every metric a shipped alert rule reads per rank (deploy/prometheus/rules) is sent in essential."""
    per_rank_alerts = (
        semconv.STEPS, semconv.CURRENT_STEP, semconv.TOTAL_STEPS, semconv.STRAGGLER_SCORE,
        semconv.COLLECTIVE_LAST, semconv.STALL_DURATION, semconv.NONFINITE_LOSS, semconv.HEALTH_EVENTS,
        semconv.SKIPPED_STEPS, semconv.DATA_DUPLICATE_RANKS, semconv.REPLICA_DIVERGENCE, semconv.GPU_THROTTLE,
        semconv.GPU_TEMPERATURE, semconv.GPU_MEMORY_USAGE, semconv.GPU_MEMORY_LIMIT, semconv.GPU_ERRORS,
    )  # fmt: skip
    rules = (Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules").glob("*.yml")
    text = "\n".join(path.read_text() for path in rules)
    for spec in per_rank_alerts:
        assert spec.prometheus_name in text, spec.name  # the list above is the rules' own
        assert spec.name in essential_names(), spec.name


# --- one rank, both export paths ------------------------------------------------------------------
def test_essential_rank_sends_its_budget_on_both_paths(fake_gpu: FakeGpu) -> None:
    with http_receiver() as (endpoint, received):
        samples, run_dir = run_one_rank("essential", endpoint)

    gpu = [(name, labels) for name, labels in samples if GPU_LABEL in labels]
    rank = [(name, labels) for name, labels in samples if GPU_LABEL not in labels and not job_level(name)]
    assert {labels[GPU_LABEL] for _, labels in gpu} == {fake_gpu.uuid}  # one GPU: its whole set
    assert 0 < len(rank) <= BUDGET_PER_RANK, Counter(name for name, _ in rank)
    # The per-GPU set: the essential GPU metrics, each with its fixed attribute values.
    gpu_specs = [s for s in semconv.CATALOGUE if s.essential and semconv.HW_ID in s.attributes]
    assert {name for name, _ in gpu} == {s.prometheus_name for s in gpu_specs}
    assert len(gpu) == otlp_gpu_series(received)
    assert len(gpu) <= BUDGET_PER_GPU, Counter(name for name, _ in gpu)
    # The step histogram per rank: its sum and count (the +Inf bucket only).
    step = semconv.STEP_DURATION.prometheus_name
    assert [labels["le"] for name, labels in rank if name == f"{step}_bucket"] == ["+Inf"]
    assert not [name for name, _ in samples if name.startswith(semconv.PHASE_DURATION.prometheus_name)]

    pushed = otlp_series(received)
    assert set(pushed) <= essential_names(), set(pushed) - essential_names()
    assert {s.name for s in gpu_specs} <= set(pushed)
    assert sum(pushed.values()) == len(samples) - 1  # all but target_info, the pull endpoint's own
    per_rank = [n for name, n in pushed.items() if semconv.BY_NAME[name].scope != "job"]
    assert sum(per_rank) - len(gpu) == len(rank) - 1  # target_info aside, as on /metrics

    # The local outputs keep every metric: the run dir's JSONL has the phases, loss and lr.
    keys = set()
    for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines():
        keys |= set(json.loads(line))
    assert {"timers/forward/mean", "train/loss", "train/learning_rate", "throughput/tokens"} <= keys, keys


def test_full_rank_sends_every_series_on_both_paths(fake_gpu: FakeGpu) -> None:
    with http_receiver() as (endpoint, received):
        samples, _ = run_one_rank("full", endpoint)
    names = {name for name, _ in samples}
    pushed = otlp_series(received)
    # the push and the scrape read at different moments: a series born between them (a drop or
    # health counter's first value) may be in one only
    assert abs(sum(pushed.values()) - (len(samples) - 1)) <= 1
    # What essential leaves out is here: per-phase histograms with their buckets, the loss, host
    # and the other GPU gauges.
    phase = semconv.PHASE_DURATION.prometheus_name
    assert len([n for n in names if n.startswith(phase)]) == 3
    assert len([n for n, labels in samples if n == f"{phase}_bucket"]) == 4 * (len(semconv.PHASE_BUCKETS) + 1)
    for spec in (
        semconv.LOSS,
        semconv.TOKENS,
        semconv.GPU_CLOCK_SM,
        semconv.GPU_ENERGY,
        semconv.LAST_STEP_TIME,
    ):
        assert spec.name in pushed, spec.name
    assert set(pushed) - essential_names()
    assert len(samples) > BUDGET_PER_RANK + len([1 for _, labels in samples if GPU_LABEL in labels])


# --- a real 2-rank job: one tier for every rank -------------------------------------------------------
def _tiered_rank(rank: int, world_size: int, tiers: list[str], ports: list[int]) -> dict[str, Any]:
    """The bench's loop on a gloo rank asking for `tiers[rank]`; what it resolved and exported."""
    run = ot.init(
        prometheus_port=ports[rank] - rank, run_name="tiers", verbosity=0, log_interval=2, hardware=False,
        rank_series=tiers[rank],
    )  # fmt: skip
    try:
        _bench().train(12, watch=False)
        session = current_session()
        assert session is not None
        session.worker.stop(timeout_s=10)
        assert run.prometheus_url is not None
        samples = pull_series(run.prometheus_url)
        run_dir = run.run_dir
        assert run_dir is not None
        resolved = run.info().rank_series
    finally:
        ot.shutdown()
    events_file = run_dir / f"events.rank{rank}.jsonl"  # written at the first event
    lines = events_file.read_text().splitlines() if events_file.exists() else []
    events = [json.loads(line) for line in lines]
    return {
        "resolved": resolved,
        "series": Counter(name for name, _ in samples if not job_level(name)),
        "job_series": Counter(name for name, _ in samples if job_level(name)),
        "notices": [e for e in events if e.get("event") == "settings_mismatch"],
    }


def test_every_rank_sends_rank_0s_tier() -> None:
    """Rank 1 asks for "auto" (2 ranks: full on its own); rank 0's "essential" wins on both, and
    rank 1 says so. Each rank's /metrics, with the cross-rank series a job adds, is in budget."""
    ports = [free_port(), free_port()]
    ranks = run_ranks(2, _tiered_rank, (["essential", "auto"], ports), timeout=120)
    assert [r["resolved"] for r in ranks] == ["essential", "essential"]
    assert ranks[0]["notices"] == []
    (notice,) = ranks[1]["notices"]
    assert "rank_series" in notice["message"] and "'essential'" in notice["message"], notice
    for rank in ranks:
        series: Counter[str] = rank["series"]
        assert sum(series.values()) <= BUDGET_PER_RANK, series
        assert series[semconv.STRAGGLER_LATENESS.prometheus_name] == 1, series  # the job's own series
        assert not [n for n in series if n.startswith(semconv.PHASE_DURATION.prometheus_name)], series
    # The job-level series pass the filter, from rank 0 only.
    assert ranks[0]["job_series"][semconv.JOB_PHASE_DURATION.prometheus_name + "_count"] == 4
    assert not ranks[1]["job_series"]
