"""Metric identity without per-process labels (issue #18, part 2).

A series is identified by run, rank and host, never by the process or the launch: a restarted rank
must continue its series, not start new ones. Stores that turn every resource attribute into a label
(VictoriaMetrics' OTLP ingestion, the Collector's prometheus exporter) and the pull endpoint's
target_info therefore must not see process.pid, any other process.* attribute, or the run name. Checked on both
paths with the SDK's process resource detector switched on, so what it adds is dropped too.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.otlp_receiver import attributes, http_receiver
from helpers.ports import free_port
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train import semconv

IDENTITY_LABELS = {"run_id", "rank", "local_rank", "host_name"}


@pytest.fixture
def process_detector(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The SDK's process detector adds process.pid, process.command_line, ... to Resource.create()."""
    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "otel,process")
    from opentelemetry.sdk.resources import Resource

    assert "process.pid" in Resource.create({}).attributes  # the detector is really active
    yield


def _train(steps: int) -> None:
    for step in range(steps):
        with ot.step(step, tokens=64, samples=4):
            with ot.timer("forward"):
                time.sleep(0.002)
            ot.record("loss", 1.0 / (step + 1))


def test_pull_endpoint_has_no_process_label_on_any_sample(process_detector: None, tmp_path) -> None:
    port = free_port()
    ot.init(prometheus_port=port, run_id="ident-pull", verbosity=0, log_interval=2, output_dir=str(tmp_path))
    try:
        _train(6)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        ot.shutdown()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert samples
    labelled = [(s.name, k) for s in samples for k in s.labels if k.startswith("process_")]
    assert labelled == []
    assert "process_pid" not in text
    assert "otel_train_run_name" not in text  # generated anew by each launch: not an identity
    # target_info keeps the rest of the Resource; the training series carry exactly the identity
    target_info = [s for s in samples if s.name == "target_info"]
    assert target_info and target_info[0].labels["run_id"] == "ident-pull"
    steps = [s for s in samples if s.name == semconv.STEPS.prometheus_name]
    assert steps and set(steps[0].labels) >= IDENTITY_LABELS
    assert set(steps[0].labels) - IDENTITY_LABELS <= {
        "otel_scope_name",
        "otel_scope_version",
        "otel_scope_schema_url",
    }


def _label_keys_per_point(request: Any) -> Iterator[tuple[str, set[str]]]:
    """(metric name, resource + point attribute keys): what an OTLP-ingesting store makes labels of."""
    for rm in request.resource_metrics:
        resource = set(attributes(rm.resource.attributes))
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                for point in getattr(metric, kind).data_points:
                    yield metric.name, resource | set(attributes(point.attributes))


def test_otlp_data_points_carry_no_process_attribute(process_detector: None) -> None:
    with http_receiver() as (endpoint, received):
        ot.init(
            otlp_endpoint=endpoint, prometheus_port=0, run_id="ident-otlp", verbosity=0, log_interval=2,
            metric_export_interval_s=0.2, run_dir_enabled=False,
        )  # fmt: skip
        _train(6)
        time.sleep(0.3)
        ot.shutdown()
    points = [p for request in received.metrics for p in _label_keys_per_point(request)]
    assert {name for name, _ in points} >= {semconv.STEPS.name, semconv.STEP_DURATION.name}
    per_launch = sorted(
        {(n, k) for n, keys in points for k in keys if k.startswith("process.") or k == semconv.RUN_NAME}
    )
    assert per_launch == []
    jobs = {spec.name for spec in semconv.JOB_SPECS}  # the job's own series name the run alone
    for name, keys in points:
        if name in jobs:
            assert "run_id" in keys and not {"rank", "local_rank", "host.name"} & keys, name
        else:
            assert {"run_id", "rank", "local_rank", "host.name"} <= keys
    # spans are events, not series: they still name the process they came from
    span_pids = {resource.get("process.pid") for resource, _ in received.spans()}
    assert span_pids == {os.getpid()}
    assert len({resource.get(semconv.RUN_NAME) for resource, _ in received.spans()} - {None}) == 1
