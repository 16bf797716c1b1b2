"""Secrets in an event's attributes and in the OTLP endpoint's query (issue #48): none reaches a
file, an environment handed to other processes, an OTel log record or a console line."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from helpers.otlp_receiver import http_receiver
from helpers.ports import free_port

import otel_train as ot
from otel_train.testing import current_session

HF_TOKEN = "hf_Zq81SECRETxYw"
API_KEY = "sk-live-9f8eSECRET"


def _leaks(channels: dict[str, bytes], *secrets: str) -> list[str]:
    return [name for name, data in channels.items() for s in secrets if s.encode() in data]


def test_event_attributes_with_tokens_reach_no_output(tmp_path, capfd, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[dict[str, Any]] = []
    with http_receiver() as (endpoint, received):
        ot.init(
            otlp_endpoint=endpoint, output_dir=str(tmp_path), run_name="ev", prometheus_port=0,
            verbosity=2, hardware=False, log_interval=1, metric_export_interval_s=0.2,
        )  # fmt: skip
        session = current_session()
        assert session is not None and session.run_dir is not None
        ot.on_event(lambda event, message, attrs: seen.append(dict(attrs)))
        for i in range(3):
            with ot.step(i):
                ot.record("loss", 1.0)
        ot.event(
            "upload",
            f"pushed the checkpoint (api_key={API_KEY})",
            {"hf_token": HF_TOKEN, "api_key": API_KEY, "detail": f"HF_TOKEN={HF_TOKEN}", "tokens": 4096},
        )
        ot.shutdown()
        deadline = time.monotonic() + 30
        while not received.logs and time.monotonic() < deadline:
            time.sleep(0.05)
    out, err = capfd.readouterr()
    files = [p for p in Path(session.run_dir).rglob("*") if p.is_file()]
    channels = {str(p): p.read_bytes() for p in files}
    channels.update({"stdout": out.encode(), "stderr": err.encode(), "logging": caplog.text.encode()})
    channels.update({f"otlp body {i}": body for i, body in enumerate(received.raw)})
    channels["callback"] = json.dumps(seen).encode()
    assert received.logs, "no OTel log record arrived"
    assert _leaks(channels, HF_TOKEN, API_KEY) == []
    # the event itself is kept, its secrets replaced and its counts left alone
    (event,) = [
        json.loads(line)
        for line in (session.run_dir / "events.rank0.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "upload"
    ]
    assert (event["hf_token"], event["api_key"], event["detail"], event["tokens"]) == (
        "***", "***", "HF_TOKEN=***", 4096,
    )  # fmt: skip
    (hooked,) = [a for a in seen if a.get("otel_train.event") == "upload"]
    assert (hooked["hf_token"], hooked["api_key"]) == ("***", "***")
    bodies = b"".join(received.raw)
    assert b"upload" in bodies and b"***" in bodies  # the log record went out, redacted


def test_ray_runtime_env_leaves_out_an_endpoint_with_a_key(tmp_path, monkeypatch, caplog) -> None:
    import otel_train.integrations.ray as otr

    caplog.set_level(logging.WARNING, logger="otel_train")
    endpoint = f"http://127.0.0.1:{free_port()}/?api_key={API_KEY}"
    # on a driver without a session: the endpoint comes from the environment
    monkeypatch.setenv("OTEL_TRAIN_OTLP_ENDPOINT", endpoint)
    monkeypatch.setattr(otr, "_driver_run", {})
    driver_env = otr.runtime_env(role="worker", base={"pip": ["x"]})
    # with a running session: the endpoint comes from ot.run_info()
    monkeypatch.delenv("OTEL_TRAIN_OTLP_ENDPOINT")
    ot.init(otlp_endpoint=endpoint, otlp_timeout_s=1.0, output_dir=str(tmp_path), prometheus_port=0,
            verbosity=0, hardware=False, shutdown_timeout_s=2.0)  # fmt: skip
    session_env = otr.runtime_env(role="worker")
    ot.shutdown()
    for env in (driver_env, session_env):
        assert API_KEY not in json.dumps(env), env
        assert "OTEL_TRAIN_OTLP_ENDPOINT" not in env["env_vars"]  # a redacted URL would be a wrong one
        assert env["env_vars"]["OTEL_TRAIN_ROLE"] == "worker"
    assert driver_env["pip"] == ["x"]
    assert "otlp_endpoint carries credentials" in caplog.text and API_KEY not in caplog.text


def test_export_failure_warning_shows_no_key_from_the_endpoint(tmp_path, capfd, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    endpoint = f"http://127.0.0.1:{free_port()}/?api_key={API_KEY}"  # nothing listens there
    ot.init(
        otlp_endpoint=endpoint, otlp_timeout_s=1.0, metric_export_interval_s=0.2, output_dir=str(tmp_path),
        prometheus_port=0, verbosity=1, hardware=False, shutdown_timeout_s=2.0,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    i = 0
    while "export to" not in caplog.text and time.monotonic() < deadline:
        with ot.step(i):
            ot.record("loss", 1.0)
        i += 1
        time.sleep(0.02)
    ot.shutdown()
    out, err = capfd.readouterr()
    assert "export to" in caplog.text, caplog.text  # the outage was told
    assert "api_key=***" in caplog.text
    assert API_KEY not in caplog.text and API_KEY not in err and API_KEY not in out
