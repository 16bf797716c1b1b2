"""Real Prometheus (the pinned 3.5, deploy/versions.env) scraping the in-process pull endpoint of a short run."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.ports import free_port
from helpers.promstack import prometheus, wait_until

import otel_train as ot
from otel_train.testing import current_session

pytestmark = pytest.mark.integration


def test_prometheus_scrapes_pull_endpoint_with_run_and_rank_labels(tmp_path) -> None:
    port = free_port()
    ot.init(prometheus_port=port, run_id="pull-test", verbosity=0, log_interval=5, output_dir=str(tmp_path))
    session = current_session()
    assert session.prometheus_url == f"http://127.0.0.1:{port}/metrics"
    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.is_set():
            with ot.step(step, tokens=256, samples=8):
                with ot.timer("forward"):
                    time.sleep(0.01)
                with ot.timer("backward"):
                    time.sleep(0.005)
                ot.record("loss", 3.0 / (1 + step * 0.01))
                ot.record("lr", 3e-4)
            step += 1

    thread = threading.Thread(target=train)
    thread.start()
    try:
        with prometheus(targets=[f"127.0.0.1:{port}"]) as prom:
            sel = '{run_id="pull-test", rank="0"}'
            wait_until(
                lambda: (prom.value(f"train_steps_total{sel}") or 0) > 20, timeout=60, what="steps scraped"
            )
            assert prom.value(f"train_step_duration_seconds_count{sel}") > 20
            buckets = prom.query(f"train_step_duration_seconds_bucket{sel}")
            assert {b["metric"]["le"] for b in buckets} >= {"0.01", "0.025", "0.05", "+Inf"}
            mean_forward = (
                'sum(rate(train_phase_duration_seconds_sum{train_phase="forward"}[5s])) / '
                'sum(rate(train_phase_duration_seconds_count{train_phase="forward"}[5s]))'
            )
            forward = wait_until(lambda: prom.value(mean_forward), timeout=30, what="forward rate")
            assert 0.009 < forward < 0.5  # plausible: sleeps of 10 ms
            loss = prom.value(f"train_loss{sel}")
            assert loss is not None and 0 < loss <= 3.0
            assert prom.value(f"train_tokens_total{sel}") >= 256 * 20
            assert 0 < prom.value(f"time() - train_step_last_timestamp_seconds{sel}") < 60
            # run_id and rank on every series this run exports (synthetic up/scrape_* aside)
            unlabelled = prom.query('{job="otel_train", __name__!~"up|scrape_.*|target_info", run_id=""}')
            assert unlabelled == []
            # ... but the job's own series (exporters/job_provider), which name the run alone
            unranked = prom.query('{job="otel_train", __name__!~"up|scrape_.*|target_info", rank=""}')
            assert unranked and {s["metric"]["__name__"][:10] for s in unranked} == {"train_job_"}
            host = prom.query(f"train_steps_total{sel}")[0]["metric"]
            assert host.get("host_name") and host.get("local_rank") == "0"
    finally:
        stop.set()
        thread.join()
        ot.shutdown()


def test_busy_port_warns_and_continues(caplog) -> None:
    import socket

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        ot.init(prometheus_port=port, verbosity=0, run_dir_enabled=False)
        session = current_session()
        with ot.step(0):
            ot.record("loss", 1.0)
        assert session.prometheus_url is None
        ot.shutdown()
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(port) in m and "OTEL_TRAIN_PROMETHEUS_PORT" in m for m in messages), messages


def test_a_base_port_whose_local_rank_port_is_past_65535_warns_and_continues(monkeypatch, caplog) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")  # the pull endpoint's port is the base port + local rank
    ot.init(prometheus_port=65535, verbosity=0, run_dir_enabled=False, hardware=False)
    session = current_session()
    with ot.step(0):
        ot.record("loss", 1.0)
    assert session.prometheus_url is None
    ot.shutdown()
    assert any(
        "past 65535" in r.getMessage() and "OTEL_TRAIN_PROMETHEUS_PORT" in r.getMessage()
        for r in caplog.records
    )
