"""OTLP export against a real receiver (HTTP/protobuf and gRPC), and an unavailable collector."""

from __future__ import annotations

import contextlib
import logging
import time

import pytest
import torch
from helpers.otlp_receiver import grpc_receiver, http_receiver, refused_endpoint, tarpit

import otel_train as ot
from otel_train import semconv
from otel_train.core.instruments import step_trace_ids
from otel_train.testing import current_session


def _train(steps: int = 25, sleep: float = 0.0) -> None:
    for i in range(steps):
        with ot.step(i, tokens=64, samples=4):
            with ot.timer("forward"):
                time.sleep(sleep)
            with ot.timer("backward"):
                pass
            ot.record("loss", 2.0 - i * 0.01)
            ot.record("lr", 1e-3)
    with ot.span("eval"):
        ot.log_metrics({"eval/loss": 1.5, "eval/perplexity": 4.48})


def _run(endpoint: str, protocol: str) -> ot.Session:
    ot.init(
        otlp_endpoint=endpoint,
        otlp_protocol=protocol,
        run_id="otlp-test-run",
        prometheus_port=0,
        verbosity=0,
        log_interval=5,
        metric_export_interval_s=0.5,
        trace_first=2,
        trace_every=10,
    )
    session = current_session()
    _train()
    ot.shutdown()
    return session


def _check_metrics(received) -> None:
    points = received.metric_points()
    for spec in (semconv.STEPS, semconv.TOKENS, semconv.STEP_DURATION, semconv.PHASE_DURATION, semconv.LOSS,
                 semconv.LEARNING_RATE, semconv.EVAL_LOSS, semconv.LAST_STEP_TIME):  # fmt: skip
        assert spec.name in points, f"{spec.name} missing; got {sorted(points)}"
        for resource, _metric, unit in points[spec.name]:
            assert unit == spec.unit, (spec.name, unit)
            assert resource["run_id"] == "otlp-test-run"
            assert resource["rank"] == 0
            assert resource["service.name"] == "otel-train"
            assert resource["service.instance.id"] == "otlp-test-run-rank0"
    # cumulative totals are right in the last export
    steps = points[semconv.STEPS.name][-1][1]
    assert steps.sum.data_points[0].as_int == 25 or steps.sum.data_points[0].as_double == 25
    hist = points[semconv.STEP_DURATION.name][-1][1].histogram
    assert hist.data_points[0].count == 25
    assert list(hist.data_points[0].explicit_bounds) == list(semconv.STEP_BUCKETS)
    phases = {
        kv.value.string_value
        for dp in points[semconv.PHASE_DURATION.name][-1][1].histogram.data_points
        for kv in dp.attributes
        if kv.key == semconv.PHASE
    }
    assert {"forward", "backward", "eval"} <= phases


def _check_spans(received) -> None:
    spans = [span for _, span in received.spans()]
    steps = {s.name: s for s in spans if s.name.startswith("train.step ")}
    assert set(steps) == {"train.step 0", "train.step 1", "train.step 10", "train.step 20"}
    for name, span in steps.items():
        step = int(name.split()[-1])
        trace_id, root_id = step_trace_ids("otlp-test-run", step)
        assert int.from_bytes(span.trace_id, "big") == trace_id  # deterministic from (run id, step)
        assert int.from_bytes(span.parent_span_id, "big") == root_id  # child of the virtual root
        children = [s for s in spans if s.parent_span_id == span.span_id]
        assert sorted(c.name for c in children) == ["backward", "forward"]
        for child in children:
            assert span.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
            assert child.end_time_unix_nano <= span.end_time_unix_nano
    assert any(s.name == "eval" for s in spans)  # eval marks are always traced
    assert not any(s.name == "train.step 5" for s in spans)  # unsampled


def test_otlp_http_metrics_spans_resource() -> None:
    with http_receiver() as (endpoint, received):
        _run(endpoint, "http/protobuf")
        deadline = time.monotonic() + 5
        while not (received.metrics and received.traces) and time.monotonic() < deadline:
            time.sleep(0.05)
    _check_metrics(received)
    _check_spans(received)


def test_metrics_endpoint_takes_metrics_only_and_is_used_as_is() -> None:
    """OTEL_EXPORTER_OTLP_METRICS_ENDPOINT: metrics straight to a store's own OTLP URL (e.g.
    VictoriaMetrics' /opentelemetry/v1/metrics), spans and logs still to the base endpoint."""
    with http_receiver() as (store, to_store), http_receiver() as (collector, to_collector):
        ot.init(
            otlp_endpoint=collector, otlp_metrics_endpoint=f"{store}/v1/metrics", prometheus_port=0,
            verbosity=0, log_interval=5, metric_export_interval_s=0.2, run_dir_enabled=False,
        )  # fmt: skip
        _train(10)
        ot.shutdown()
    assert semconv.STEPS.name in to_store.metric_points()
    assert not to_store.traces and not to_store.logs
    assert to_collector.traces and not to_collector.metrics


def test_traces_and_logs_endpoints_from_the_environment_take_their_signal_only(monkeypatch) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / _LOGS_ENDPOINT alone (spans to Tempo, logs to Loki, no
    base endpoint): each signal reaches its own URL as-is, and metrics go nowhere."""
    with http_receiver() as (tempo, to_tempo), http_receiver() as (loki, to_loki):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{tempo}/v1/traces")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", f"{loki}/v1/logs")
        ot.init(prometheus_port=0, verbosity=0, log_interval=5, run_dir_enabled=False, trace_first=2)
        assert ot.run_info().otlp_traces_endpoint == f"{tempo}/v1/traces"
        _train(10)
        ot.event("checkpoint_slow", "a health event for the logs endpoint")
        ot.shutdown()
    assert to_tempo.traces and not to_tempo.logs and not to_tempo.metrics
    assert to_loki.logs and not to_loki.traces and not to_loki.metrics


@pytest.mark.parametrize("value", ["none", "gzip", "GZIP "])
def test_grpc_takes_the_specs_compression_values(value: str, monkeypatch) -> None:
    """OTEL_EXPORTER_OTLP_COMPRESSION=none is the spec's, and the SDK's gRPC exporter raised on it:
    init() failed. Both spec values work; another is a ConfigError naming the variable."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", value)
    with grpc_receiver() as (endpoint, received):
        ot.init(otlp_endpoint=endpoint, otlp_protocol="grpc", prometheus_port=0, verbosity=0,
                log_interval=5, metric_export_interval_s=0.2, run_dir_enabled=False, trace_first=1)  # fmt: skip
        _train(10)
        ot.shutdown()
    assert received.metrics and received.traces


def test_an_unknown_compression_is_a_config_error_naming_the_variable(monkeypatch) -> None:
    from otel_train.config import ConfigError

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd")
    with pytest.raises(ConfigError, match=r"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION='zstd'.*gzip or none"):
        ot.init(otlp_endpoint=refused_endpoint(), otlp_protocol="grpc", prometheus_port=0, verbosity=0)


def test_a_logs_endpoint_that_fails_is_warned_about(caplog) -> None:
    """Health events sent to their own logs endpoint were lost without a word when it failed."""
    import logging

    caplog.set_level(logging.WARNING, logger="otel_train")
    ot.init(otlp_logs_endpoint=f"{refused_endpoint()}/v1/logs", prometheus_port=0, verbosity=0,
            run_dir_enabled=False, otlp_timeout_s=1.0, shutdown_timeout_s=2.0)  # fmt: skip
    ot.event("checkpoint_slow", "a health event for the logs endpoint")
    ot.shutdown()
    assert any("OTLP log export" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)


def test_otlp_grpc_metrics_spans_resource() -> None:
    with grpc_receiver() as (endpoint, received):
        _run(endpoint, "grpc")
    _check_metrics(received)
    _check_spans(received)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_headers_named_in_capitals_reach_the_collector_over_either_protocol(protocol: str) -> None:
    """gRPC refuses metadata keys with capital letters: `Authorization=...` or `X-Tenant=...`
    (how people write them) made every gRPC export fail as if the collector were down."""
    receiver = grpc_receiver if protocol == "grpc" else http_receiver
    with receiver() as (endpoint, received):
        ot.init(otlp_endpoint=endpoint, otlp_protocol=protocol, otlp_headers={"X-Tenant": "team-a"},
                prometheus_port=0, verbosity=0, log_interval=5, metric_export_interval_s=0.5)  # fmt: skip
        _train()
        ot.shutdown()
    assert received.metrics, "no export reached the collector"
    assert all(headers.get("x-tenant") == "team-a" for headers in received.headers), received.headers[:1]


def test_a_slow_collectors_span_export_does_not_take_the_metrics_shutdown_time() -> None:
    """Shutdown sends the last spans and the last metrics at once: one after the other, a collector
    answering in 3 s (past the 2 s shutdown bound) left no time for the metrics of a run shorter
    than one export interval: they were never sent."""
    with http_receiver(delay_s=3.0) as (endpoint, received):
        ot.init(otlp_endpoint=endpoint, otlp_protocol="http/protobuf", prometheus_port=0, verbosity=0,
                log_interval=5, metric_export_interval_s=60, trace_first=2, shutdown_timeout_s=2.0)  # fmt: skip
        _train()
        ot.shutdown()
        assert received.traces, "the spans were sent too"
        assert received.metrics, "the run's only metrics export was never sent"


def test_a_collector_that_refuses_the_export_is_not_called_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A collector that answers with a refusal (HTTP 400: a proxy, a wrong path, a schema it
    rejects) is up: the one warning says so (a TCP connect tells), not "collector down?"."""
    with (
        http_receiver(status=400) as (endpoint, _received),
        caplog.at_level(logging.WARNING, logger="otel_train"),
    ):
        ot.init(otlp_endpoint=endpoint, otlp_protocol="http/protobuf", prometheus_port=0, verbosity=0,
                log_interval=5, metric_export_interval_s=0.5)  # fmt: skip
        _train()
        ot.shutdown()
    failed = [
        r.getMessage() for r in caplog.records if "export to" in r.getMessage() and "failed" in r.getMessage()
    ]
    assert failed and all("accepts TCP connections there but refused" in message for message in failed), (
        failed
    )


def test_duration_histograms_carry_exemplars_of_the_sampled_spans() -> None:
    """Step- and phase-duration points carry exemplars whose trace and span ids are those of the
    exported spans of the sampled steps (Grafana links a slow step to its trace in Tempo)."""
    with http_receiver() as (endpoint, received):
        _run(endpoint, "http/protobuf")
        deadline = time.monotonic() + 5
        while not (received.metrics and received.traces) and time.monotonic() < deadline:
            time.sleep(0.05)
    spans = {(s.trace_id, s.span_id): s for _, s in received.spans()}
    step_spans = {k for k, s in spans.items() if s.name.startswith("train.step ")}
    assert len(step_spans) == 4  # steps 0, 1, 10, 20
    points = received.metric_points()
    found: dict[str, int] = {}
    for spec in (semconv.STEP_DURATION, semconv.PHASE_DURATION):
        for _resource, metric, _unit in points[spec.name]:
            for dp in metric.histogram.data_points:
                phase = {kv.key: kv.value.string_value for kv in dp.attributes}.get(semconv.PHASE)
                for ex in dp.exemplars:
                    span = spans.get((ex.trace_id, ex.span_id))
                    assert span is not None, "exemplar points at a span that was not exported"
                    if spec is semconv.STEP_DURATION:
                        assert (ex.trace_id, ex.span_id) in step_spans
                    else:  # the span of this phase (a sampled step's timer, or the eval mark)
                        assert span.name == phase
                        if phase != "eval":
                            assert any(t == ex.trace_id for t, _ in step_spans)
                    seconds = (span.end_time_unix_nano - span.start_time_unix_nano) * 1e-9
                    assert ex.as_double == pytest.approx(seconds, abs=1e-6)
                    key = spec.name if phase in (None, "eval") else f"{spec.name}/step"
                    found[key] = found.get(key, 0) + 1
    assert found.get(semconv.STEP_DURATION.name) and found.get(f"{semconv.PHASE_DURATION.name}/step"), found


def test_health_events_leave_as_log_records() -> None:
    with http_receiver() as (endpoint, received):
        ot.init(otlp_endpoint=endpoint, prometheus_port=0, verbosity=0, log_interval=2)
        for i in range(4):
            with ot.step(i):
                ot.record("loss", float("nan") if i == 3 else 1.0)
        ot.log_text("notes", "hello collector", step=3)
        ot.log_samples([("def ", "main():")], step=3)
        ot.log_histogram("weights", torch.tensor([0.5, 1.5, float("nan")]), step=3)
        ot.shutdown()
    records = received.log_records()
    by_event = {r.event_name: r for _, r in records}
    assert by_event["otel_train.text"].body.string_value == "hello collector"
    assert "main():" in by_event["otel_train.samples"].body.string_value
    summary = {kv.key: kv.value for kv in by_event["otel_train.histogram"].body.kvlist_value.values}
    assert summary["count"].int_value == 2 and summary["max"].double_value == 1.5
    events = [r for _, r in records if r.event_name == "otel_train.nonfinite"]
    assert events, [r.event_name for _, r in records]
    points = received.metric_points()
    nonfinite = points[semconv.NONFINITE_LOSS.name][-1][1].sum.data_points[0]
    assert (nonfinite.as_int or nonfinite.as_double) == 1


@pytest.mark.parametrize("kind", ["refused", "tarpit"])
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_collector_unavailable_does_not_block(kind: str, protocol: str) -> None:
    """Training completes and shutdown returns; the real figure is in bench/. Generous bound only
    guards against hangs (OTel defaults take 40-50 s)."""
    ctx = tarpit() if kind == "tarpit" else None
    endpoint = ctx.__enter__() if ctx else refused_endpoint()
    try:
        ot.init(
            otlp_endpoint=endpoint,
            otlp_protocol=protocol,
            prometheus_port=0,
            verbosity=0,
            log_interval=5,
            metric_export_interval_s=0.2,
            otlp_timeout_s=1.0,
            shutdown_timeout_s=2.0,
        )
        _train(steps=40)
        started = time.monotonic()
        ot.shutdown()
        assert time.monotonic() - started < 15
    finally:
        if ctx:
            ctx.__exit__(None, None, None)


def test_collector_outage_warns_once_and_recovery_is_reported(caplog) -> None:
    """Collector down at start, then up on the same port: one warning for the outage, one for the
    recovery, no SDK retry spam, and the cumulative totals arrive right after it returns."""
    import logging

    from helpers.ports import free_port

    caplog.set_level(logging.WARNING)
    port = free_port()
    ot.init(otlp_endpoint=f"http://127.0.0.1:{port}", prometheus_port=0, verbosity=0, log_interval=1,
            metric_export_interval_s=0.2, otlp_timeout_s=0.5)  # fmt: skip
    for i in range(5):
        with ot.step(i):
            pass
    time.sleep(1.0)
    with http_receiver(port=port) as (_, received):
        for i in range(5, 10):
            with ot.step(i):
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not received.metrics:
            time.sleep(0.1)
        ot.shutdown()
    messages = [r.getMessage() for r in caplog.records if r.name == "otel_train"]
    assert sum("failed: the collector is down or unreachable" in m for m in messages) == 1, messages
    assert sum("works again" in m for m in messages) == 1, messages
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
    steps = received.metric_points()[semconv.STEPS.name][-1][1].sum.data_points[0]
    assert (steps.as_int or steps.as_double) == 10  # cumulative: nothing lost across the outage


def test_an_https_collectors_untrusted_certificate_is_named_as_the_cause(tmp_path, monkeypatch) -> None:
    """A TLS failure read as "something accepts TCP connections there but refused the export":
    the cause names the CA variable, and the trap of REQUESTS_CA_BUNDLE winning over it."""
    import os
    import socket
    import ssl
    import subprocess
    import threading

    from otel_train.exporters import export_failure_cause

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    mutual = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # mTLS: a client certificate its CA signed
    mutual.load_cert_chain(cert, key)
    mutual.load_verify_locations(cert)
    mutual.verify_mode = ssl.CERT_REQUIRED
    urls = []

    def serve(listener: socket.socket, context: ssl.SSLContext) -> None:  # TLS handshakes, nothing more
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), context.wrap_socket(connection, server_side=True):
                pass

    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    for listener, context in zip(listeners, (server, mutual), strict=True):
        urls.append(f"https://127.0.0.1:{listener.getsockname()[1]}")
        threading.Thread(target=serve, args=(listener, context), daemon=True).start()
    url, mutual_url = urls
    for name in [
        *(n for n in os.environ if n.startswith("OTEL_EXPORTER_OTLP")),
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
    ]:
        monkeypatch.delenv(name, raising=False)
    try:
        assert "TLS certificate is not trusted" in export_failure_cause(url, "http/protobuf")
        assert "OTEL_EXPORTER_OTLP_CERTIFICATE" in export_failure_cause(url, "grpc")
        # a signal's own CA file, as the SDK's exporters read it: that signal's handshake only
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(cert))
        assert "TLS" not in export_failure_cause(url, "grpc", signal="traces")
        assert "set OTEL_EXPORTER_OTLP_CERTIFICATE" in export_failure_cause(url, "grpc", signal="logs")
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(cert))
        assert "TLS" not in export_failure_cause(url, "http/protobuf")  # trusted: the export's own fault
        # mTLS without a client certificate: under TLS 1.3 the refusal comes after the handshake
        cause = export_failure_cause(mutual_url, "http/protobuf")
        assert "ended the TLS session" in cause and "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE" in cause, cause
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", str(cert))
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", str(key))
        assert "TLS" not in export_failure_cause(mutual_url, "http/protobuf")  # its certificate taken
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
        assert "REQUESTS_CA_BUNDLE is set" in export_failure_cause(url, "http/protobuf")
    finally:
        for listener in listeners:
            listener.close()
