"""The job-level series leave rank 0 once per job without any rank label (exporters/job_provider):
real gloo ranks with real sessions (ot.init) serve their pull endpoints and push OTLP into the
pinned VictoriaMetrics, which turns every resource attribute into a label. Rank 0's endpoint and
the store hold the `train.job.*` series labelled by the run alone; rank 0's own series keep their
rank labels; no other rank exports job series."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks
from helpers.vmstack import victoriametrics

from otel_train import semconv

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

WORLD = 2
RUN_ID = "jobseries"
RANK_LABELS = {"rank", "local_rank", "host_name"}


def _free_ports(count: int) -> int:
    """A base port with `count` free ports from it (the endpoint uses port + local_rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        try:
            for offset in range(count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def _rank(rank: int, world: int, out_dir: str, otlp_url: str, port: int) -> str:
    import torch
    import torch.distributed as dist

    import otel_train as ot

    ot.init(
        otlp_metrics_endpoint=otlp_url, metric_export_interval_s=1.0, prometheus_port=port,
        prometheus_host="127.0.0.1", run_id=RUN_ID, output_dir=out_dir, verbosity=0, log_interval=2,
        hardware=False, rank_series="full",
    )  # fmt: skip
    for step in range(40):
        with ot.step(step, tokens=256, samples=8):
            with ot.timer("forward"):
                time.sleep(0.002)
            with ot.timer("backward"):
                time.sleep(0.003)
            dist.all_reduce(torch.ones(1))
            ot.record("loss", 2.0 + rank)
    time.sleep(2.5)  # a few exports: the OTLP push and the endpoint hold the last flushes
    with urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics", timeout=10) as response:
        text = response.read().decode()
    dist.barrier()
    ot.shutdown()
    return str(text)


def _series(text: str, prefix: str) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every sample line whose name starts with `prefix`."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (sample.name, dict(sample.labels))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(prefix)
    ]


def test_job_series_carry_the_run_and_no_rank(tmp_path: Path) -> None:
    port = _free_ports(WORLD)
    with victoriametrics() as vm:
        texts = run_ranks(WORLD, _rank, (str(tmp_path), vm.otlp_metrics_url, port), timeout=180)
        job = _series(texts[0], "train_job_")
        names = {name for name, _ in job}
        # the step and phase histograms, throughput, loss and the timer statistics, on rank 0 only
        assert {
            "train_job_step_duration_seconds_bucket",
            "train_job_phase_duration_seconds_bucket",
            "train_job_samples_total",
            "train_job_tokens_total",
            "train_job_loss",
            "train_job_phase_cross_rank_seconds",
        } <= names, names
        assert all(labels.get("run_id") == RUN_ID and not RANK_LABELS & set(labels) for _, labels in job), job
        assert _series(texts[1], "train_job_") == []
        own = _series(texts[0], "train_steps_total")
        assert own and all(labels["rank"] == "0" for _, labels in own)  # rank 0's own keep theirs
        stored = _stored(vm)
    # as the metric catalogue says, the job's series reach no run-dir row (nor any bridge)
    rows = [line for path in tmp_path.rglob("metrics.rank*.jsonl") for line in path.read_text().splitlines()]
    assert rows and not [row for row in rows if '"job/' in row]
    assert {"train_job_phase_duration_seconds_bucket", "train_job_samples_total"} <= {
        s["__name__"] for s in stored
    }
    for labels in stored:  # every resource attribute became a label: none names a rank or host
        assert labels.get("run_id") == RUN_ID and not RANK_LABELS & set(labels), labels
        assert not [key for key in labels if key.startswith(("gpu", "hw_", "node", "world"))], labels


def _stored(vm: Any) -> list[dict[str, str]]:
    deadline = time.monotonic() + 20
    while True:
        stored = vm.series(f'{{__name__=~"train_job_.*",run_id="{RUN_ID}"}}')
        if stored or time.monotonic() > deadline:
            return stored
        time.sleep(0.5)


def test_job_resource_is_the_run_identity_alone() -> None:
    from otel_train.config import Config
    from otel_train.distributed import Identity
    from otel_train.exporters.job_provider import job_resource

    identity = Identity(rank=3, world_size=8, local_rank=1, node_rank=1, host="h", run_id="r", role="policy")
    attributes = dict(job_resource(Config(), identity).attributes)
    assert attributes == {"service.name": Config().service_name, semconv.RUN_ID: "r", semconv.ROLE: "policy"}
