"""A secret planted in every input channel appears in no output channel."""

from __future__ import annotations

import argparse
import logging
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.otlp_receiver import http_receiver

import otel_train as ot
from otel_train.testing import current_session

SECRET = "S3CR3T-7f3a9c"


def test_planted_secret_reaches_no_output(tmp_path, monkeypatch, capfd, caplog) -> None:
    from helpers.ports import free_port

    caplog.set_level(logging.DEBUG)
    # environment: a token of the user's, secret-looking resource attributes, OTLP headers (one
    # of them a value the SDK's own parser rejects and used to log verbatim)
    monkeypatch.setenv("MY_SERVICE_TOKEN", SECRET)
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        f"team=ml,api_token={SECRET},db.password={SECRET},db.url=pg://bob:{SECRET}@db/x",
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f'authorization=Bearer%20{SECRET},x-api-key="{SECRET}"')
    with http_receiver() as (endpoint, received):
        # config file: endpoint and tracking URI with userinfo
        host = endpoint.removeprefix("http://")
        config_file = tmp_path / "otel_train.yaml"
        config_file.write_text(
            f"otlp_endpoint: http://trainer:{SECRET}@{host}\n"
            f"mlflow_tracking_uri: https://user:{SECRET}@mlflow.example\n"
            f"resource_attributes: {{team: ml, secret_sauce: {SECRET}}}\n"
        )
        ot.init(
            config_file=str(config_file),
            output_dir=str(tmp_path / "runs"),
            prometheus_port=free_port(),
            verbosity=2,
            log_interval=2,
            metric_export_interval_s=0.2,
            tensorboard=True,
        )
        session = current_session()
        ot.log_hyperparams(
            {"lr": 1e-3, "api_key": SECRET, "nested": {"password": SECRET}, "url": f"http://u:{SECRET}@h",
             "args": argparse.Namespace(hf_token=SECRET, lr=0.1), "argv": ["train.py", "--password", SECRET]}
        )  # fmt: skip
        ot.log_text("note", f"started with api_key={SECRET} and Authorization: Bearer {SECRET}")
        ot.log_samples([("prompt", f"password: {SECRET}")])
        for i in range(6):
            with ot.step(i, tokens=4):
                ot.record("loss", 1.0)
        time.sleep(0.5)
        assert session.prometheus_url is not None
        scrape = urllib.request.urlopen(session.prometheus_url, timeout=5).read()
        ot.shutdown()
    out, err = capfd.readouterr()
    channels: dict[str, bytes] = {"stdout": out.encode(), "stderr": err.encode(), "/metrics": scrape,
                                  "logging": caplog.text.encode()}  # fmt: skip
    files = [p for p in Path(session.run_dir).rglob("*") if p.is_file()]
    assert any("tfevents" in p.name for p in files)  # the TensorBoard bridge wrote its file
    assert {"config.json", "env.json", "hparams.json", "text.jsonl", "samples.jsonl"} <= {
        p.name for p in files
    }
    channels.update({str(p): p.read_bytes() for p in files})
    channels.update({f"otlp body {i}": body for i, body in enumerate(received.raw)})
    assert received.metrics and received.raw and b"target_info" in scrape
    leaks = [name for name, data in channels.items() if SECRET.encode() in data]
    assert leaks == [], leaks
    # The headers did their job (the endpoint's userinfo becomes requests' Basic auth header).
    assert any(h.get("x-api-key") == f'"{SECRET}"' for h in received.headers), received.headers[:1]


def test_events_and_nested_hyperparameters_are_redacted(tmp_path) -> None:
    import json

    from otel_train.integrations.megatron import _plain

    ot.init(output_dir=str(tmp_path), run_name="r", prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    ot.event(
        "worker_failure",
        f"upload to https://u:{SECRET}@host failed: token={SECRET}",
        {"detail": f"api_key={SECRET}"},
    )
    with pytest.raises(TypeError, match="needs a mapping"):  # the caller's bug (error policy)
        ot.event("bad", "attributes that are not a mapping", [1, 2])  # type: ignore[arg-type]
    # a Megatron config nested deeper than it is walked is rendered with str() before redaction
    ot.log_hyperparams(_plain({"model": {"a": {"b": {"tok": {"hf_token": SECRET}}}}}, 0))
    run_dir = session.run_dir
    ot.shutdown()
    assert run_dir is not None
    written = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())
    assert SECRET not in written
    events = [json.loads(line) for line in (run_dir / "events.rank0.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] == "worker_failure"] == ["worker_failure"]
