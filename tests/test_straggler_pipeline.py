"""Full sessions on 4 real gloo ranks: stragglers flagged through the whole pipeline, one trace
per step across ranks, per-rank resources."""

from __future__ import annotations

import time

import pytest
from helpers.multirank import run_ranks
from helpers.otlp_receiver import http_receiver

pytestmark = [pytest.mark.multirank, pytest.mark.integration]

STEPS = 30
LOG_INTERVAL = 5


def _train_rank(
    rank: int, world: int, endpoint: str | None, out_dir: str, slow_rank: int, slow_phase: str
) -> dict:
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train.testing import current_session

    events: list[tuple[str, dict]] = []
    ot.init(
        otlp_endpoint=endpoint, prometheus_port=0, output_dir=out_dir, run_name="mr", verbosity=0,
        log_interval=LOG_INTERVAL, trace_first=1, trace_every=10, hardware=False, metric_export_interval_s=1.0,
    )  # fmt: skip
    session = current_session()
    session.events.add_callback(lambda event, message, attrs: events.append((event, dict(attrs))))
    for step in range(STEPS):
        with ot.step(step, tokens=128):
            # compute: 1.5x forward+backward; data: 2x the data wait (a smaller share of the step)
            slow = (2.0 if slow_phase == "data" else 1.5) if rank == slow_rank else 1.0
            with ot.timer("data"):
                time.sleep(0.012 * (slow if slow_phase == "data" else 1.0))
            with ot.timer("forward"):
                time.sleep(0.012 * (slow if slow_phase == "compute" else 1.0))
            with ot.timer("backward"):
                time.sleep(0.012 * (slow if slow_phase == "compute" else 1.0))
            with ot.timer("allreduce"):
                dist.all_reduce(torch.zeros(1))  # the training's own collective equalizes steps
    ot.shutdown()  # drains the worker: every aligned flush has run its collective
    return {
        "run_id": session.identity.run_id,
        "events": events,
        "collectives": session.reducer.collectives,
        "flushes": session.worker.flushes,
    }


def _stragglers(results: list[dict]) -> list[dict]:
    return [attrs for event, attrs in results[0]["events"] if event == "straggler"]


def test_compute_straggler_flagged_within_three_flushes(tmp_path) -> None:
    with http_receiver() as (endpoint, received):
        results = run_ranks(4, _train_rank, (endpoint, str(tmp_path), 2, "compute"), timeout=240)
        time.sleep(0.5)
    assert len({r["run_id"] for r in results}) == 1  # agreed once at init
    run_dir = tmp_path / "mr"
    for rank in range(4):  # every rank keeps its own local copy; progress.txt is rank 0's
        rows = (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()
        assert len(rows) >= STEPS // LOG_INTERVAL
    assert (run_dir / "progress.txt").read_text().count("\n") >= STEPS // LOG_INTERVAL
    flagged = _stragglers(results)
    assert flagged, results[0]["events"]
    first = flagged[0]
    assert (
        first["rank"] == 2
        and first["category"] == "compute"
        and first["train.phase"] in ("forward", "backward")
    )
    assert first["step"] <= 3 * LOG_INTERVAL - 1  # within 3 flushes
    assert {a["rank"] for a in flagged} == {2}
    # exactly one collective per aligned flush on every rank (the final flush issues none)
    for r in results:
        assert r["collectives"] == STEPS // LOG_INTERVAL
    # OTLP: each rank's straggler score; rank 2 is the low one
    scores: dict[int, float] = {}
    for resource, metric, _ in received.metric_points().get("train.straggler.score", []):
        for dp in metric.gauge.data_points:
            attrs = {kv.key: kv.value.string_value for kv in dp.attributes}
            if attrs.get("straggler.kind") == "relative" and attrs.get("train.phase") == "all":
                scores[resource["rank"]] = dp.as_double
    assert set(scores) == {0, 1, 2, 3}
    assert scores[2] < 0.8 and min(scores[r] for r in (0, 1, 3)) > 0.8
    # one trace per step across ranks: the sampled spans of step 10 share a trace id
    spans = received.spans()
    step10 = [(res, span) for res, span in spans if span.name == "train.step 10"]
    assert {res["rank"] for res, _ in step10} == {0, 1, 2, 3}
    assert len({span.trace_id for _, span in step10}) == 1
    assert len({span.parent_span_id for _, span in step10}) == 1  # the shared virtual root
    assert len({res["service.instance.id"] for res, _ in step10}) == 4


def test_data_straggler_is_attributed_to_data(tmp_path) -> None:
    results = run_ranks(4, _train_rank, (None, str(tmp_path), 1, "data"), timeout=240)
    flagged = _stragglers(results)
    assert flagged and flagged[0]["rank"] == 1 and flagged[0]["category"] == "data", results[0]["events"]


def test_balanced_run_flags_nothing(tmp_path) -> None:
    results = run_ranks(4, _train_rank, (None, str(tmp_path), -1, "compute"), timeout=240)
    assert _stragglers(results) == []
