"""Checks of deploy/: there is no Docker engine here, so the stack is checked as files.

Every file by the real tool of the version the stack pins (deploy/versions.env): docker-compose
config, promtool check config (rules: tests/deploy/test_alert_rules.py), amtool check-config. No
collector binary exists here, so deploy/otelcol.yaml is checked key by key against the options of
the pinned collector, read from its upstream source (tests/helpers/collector_options.py). Plus
structure checks for security defaults, Tempo and Grafana provisioning. `make check-deploy` runs this file.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import pinned
from helpers.collector_options import collector_config_errors, pipeline_errors
from helpers.pinned import require_binary
from helpers.ports import free_port
from helpers.promstack import prometheus, wait_until
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from otel_train import semconv
from otel_train.config import FIELDS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"


def _load(rel: str) -> Any:
    return yaml.safe_load((DEPLOY / rel).read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load("docker-compose.yml")


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return _load("otelcol.yaml")


def _run(argv: list[str], cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=60)


# --- real tools ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ["prometheus/prometheus.yml", "prometheus/pull-endpoints.example.yml"])
def test_promtool_check_config(config: str) -> None:
    """Both Prometheus configs are valid (and load the rule files next to them)."""
    proc = _run([require_binary("promtool"), "check", "config", config])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 rule files found" in proc.stdout + proc.stderr


def test_amtool_check_config() -> None:
    proc = _run([require_binary("amtool"), "check-config", "alertmanager/alertmanager.yml"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- docker-compose --------------------------------------------------------------------------------
def _compose_config(compose_file: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` (validates against the Compose schema; no engine needed) with a
    test .env that sets the one required variable."""
    env_file = tmp_path / "test.env"
    env_file.write_text("GRAFANA_ADMIN_PASSWORD=test-only-not-a-secret\n")
    argv = [require_binary("docker-compose"), "--env-file", str(env_file), "-f", str(compose_file)]
    return _run([*argv, "config", "--quiet"], cwd=compose_file.parent)


def test_docker_compose_config_accepts_the_stack(tmp_path: Path) -> None:
    proc = _compose_config(COMPOSE, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docker_compose_config_rejects_a_misspelled_key(tmp_path: Path) -> None:
    """Negative control: the same check fails on a compose file with one key misspelled."""
    text = COMPOSE.read_text()
    assert "    restart: unless-stopped\n" in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace("    restart: unless-stopped\n", "    restrat: unless-stopped\n", 1))
    proc = _compose_config(broken, tmp_path)
    assert proc.returncode != 0
    assert "restrat" in proc.stdout + proc.stderr


def test_docker_compose_config_requires_the_grafana_password(tmp_path: Path) -> None:
    argv = [require_binary("docker-compose"), "--env-file", str(tmp_path / "none.env"), "-f", str(COMPOSE)]
    (tmp_path / "none.env").write_text("")
    proc = _run([*argv, "config", "--quiet"])
    assert proc.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in proc.stderr


def test_compose_images_are_the_tested_versions(compose: dict[str, Any]) -> None:
    """The images the stack starts carry the versions the tests ran (deploy/versions.env)."""
    versions = pinned.pinned()
    services = compose["services"]
    assert services["prometheus"]["image"] == f"prom/prometheus:v{versions['prometheus']}"
    assert services["alertmanager"]["image"] == f"prom/alertmanager:v{versions['alertmanager']}"
    assert services["otel-collector"]["image"] == (
        f"otel/opentelemetry-collector-contrib:{versions['otelcol-contrib']}"
    )


def test_pinned_tools_report_the_pinned_versions() -> None:
    """The binaries the tests use are the pinned ones (not the base system's 2.42/0.25)."""
    versions = pinned.pinned()
    for name in (
        "prometheus",
        "promtool",
        "prometheus-alertmanager",
        "amtool",
        "docker-compose",
        "victoria-metrics",
        "vmalert",
    ):
        path = require_binary(name)
        component, _ = pinned.VERSION_COMMANDS[name]
        line = pinned.reported_version(path, name)
        assert pinned.is_pinned(line, versions[component]), f"{path}: {line}"
    assert not pinned.is_pinned("prometheus, version 2.42.0+ds (branch: debian/sid)", versions["prometheus"])
    assert not pinned.is_pinned("prometheus, version 3.5.30", "3.5.3")


@pytest.mark.integration
def test_compose_prometheus_flags_store_exemplars(compose: dict[str, Any]) -> None:
    """The pinned Prometheus, started with the compose file's feature flags, scrapes an OpenMetrics
    endpoint (as the collector's exporter serves with enable_open_metrics) and stores the
    exemplars' trace ids, which Grafana's exemplar queries read."""
    flags = [a for a in compose["services"]["prometheus"]["command"] if a.startswith("--enable-feature=")]
    assert flags == ["--enable-feature=exemplar-storage"]
    registry = CollectorRegistry()
    hist = Histogram("train_step_duration_seconds", "step", ["run_id"], registry=registry, buckets=[0.1, 1.0])
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    hist.labels(run_id="r1").observe(0.5, exemplar={"trace_id": trace_id, "span_id": "00f067aa0ba902b7"})
    server, _thread = start_http_server(free_port(), addr="127.0.0.1", registry=registry)
    try:
        target = f"127.0.0.1:{server.server_address[1]}"
        with prometheus(targets=[target], extra_args=flags) as prom:

            def exemplars() -> list[dict[str, Any]]:
                qs = urllib.parse.urlencode(
                    {
                        "query": "train_step_duration_seconds_bucket",
                        "start": time.time() - 60,
                        "end": time.time() + 5,
                    }
                )
                with urllib.request.urlopen(f"{prom.url}/api/v1/query_exemplars?{qs}", timeout=5) as resp:
                    return json.loads(resp.read())["data"]

            found = wait_until(exemplars, timeout=30, what="stored exemplars")
    finally:
        server.shutdown()
        server.server_close()
    labels = [e["labels"] for series in found for e in series["exemplars"]]
    assert {"trace_id": trace_id, "span_id": "00f067aa0ba902b7"} in labels


def _volume_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for vol in service.get("volumes", []):
        if isinstance(vol, dict):
            out.append((vol["source"], vol["target"]))
        else:
            source, target = vol.split(":")[:2]
            out.append((source, target))
    return out


def test_compose_services(compose: dict[str, Any]) -> None:
    assert {"otel-collector", "prometheus", "alertmanager", "grafana", "tempo"} <= set(compose["services"])


def test_compose_mounted_host_paths_exist(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for source, _target in _volume_mounts(service):
            if source.startswith((".", "/")):
                assert (DEPLOY / source).resolve().exists(), f"{name}: {source} does not exist"
            else:
                assert source in named, f"{name}: named volume {source} not declared"


def test_compose_ports_bind_loopback_only(compose: dict[str, Any]) -> None:
    published = 0
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            published += 1
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", f"{name}: {port}"
            else:
                assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is not bound to 127.0.0.1"
        assert service.get("network_mode") != "host", name
    assert published >= 5  # OTLP x2, Prometheus, Alertmanager, Grafana


def test_compose_images_are_pinned(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        image = service["image"]
        if "@sha256:" in image:
            continue
        m = re.fullmatch(r"[\w./-]+:([\w.-]+)", image)
        assert m, f"{name}: {image} has no tag"
        tag = m.group(1)
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: {image} is not pinned to a version"


def test_compose_tempo_is_2x_with_2x_config(compose: dict[str, Any]) -> None:
    image = compose["services"]["tempo"]["image"]
    assert re.fullmatch(r"grafana/tempo:2\.\d+\.\d+", image), image
    tempo = _load("tempo/tempo.yaml")
    assert {"ingester", "compactor", "distributor", "storage"} <= set(tempo)  # Tempo 3 rejects these


def test_compose_grafana_is_secure_by_default(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    env = grafana.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    password = env.get("GF_SECURITY_ADMIN_PASSWORD")
    password_file = env.get("GF_SECURITY_ADMIN_PASSWORD__FILE")
    assert password or password_file, "Grafana admin password must come from a secret or env"
    if password:
        # required variable, no default: ${VAR:?message}
        assert re.fullmatch(r"\$\{\w+:\?[^}]+\}", password), (
            f"password must be required, not defaulted: {password}"
        )
    if password_file:
        assert password_file.startswith("/run/secrets/")
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert str(env.get("GF_USERS_ALLOW_SIGN_UP", "false")).lower() == "false"
    assert str(env.get("GF_AUTH_DISABLE_LOGIN_FORM", "false")).lower() == "false"
    # no password anywhere in plain text
    text = COMPOSE.read_text()
    assert not re.search(r"ADMIN_PASSWORD[:=]\s*['\"]?[A-Za-z0-9]", text)
    example = (DEPLOY / ".env.example").read_text()
    assert re.search(r"^GRAFANA_ADMIN_PASSWORD=\s*$", example, re.M), ".env.example must not ship a password"


def test_compose_dashboards_mount_matches_provider(compose: dict[str, Any]) -> None:
    mounts = dict(_volume_mounts(compose["services"]["grafana"]))
    assert (DEPLOY / "../dashboards/json").resolve() == (DEPLOY.parent / "dashboards" / "json").resolve()
    target = mounts["../dashboards/json"]
    providers = _load("grafana/provisioning/dashboards/otel_train.yaml")["providers"]
    assert [p["options"]["path"] for p in providers] == [target]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_grafana_datasources(compose: dict[str, Any]) -> None:
    sources = {d["uid"]: d for d in _load("grafana/provisioning/datasources/otel_train.yaml")["datasources"]}
    assert sources["prometheus"]["url"] == "http://prometheus:9090"
    assert sources["tempo"]["url"].startswith("http://tempo:")
    # trace links both ways
    assert sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == "tempo"
    assert sources["tempo"]["jsonData"]["tracesToMetrics"]["datasourceUid"] == "prometheus"
    # no dead view: the service map needs Tempo's metrics generator, which this stack does not run
    tempo = _load("tempo/tempo.yaml")
    if "metrics_generator" not in tempo:
        assert "serviceMap" not in sources["tempo"]["jsonData"]
    for ds in sources.values():
        m = re.match(r"https?://([\w-]+):", ds["url"])
        assert m, ds["url"]
        host = m.group(1)
        assert host in compose["services"], f"datasource {ds['name']} points at unknown service {host}"


# --- OTel Collector --------------------------------------------------------------------------------
def test_collector_scrapes_ray_node_metrics_with_a_valid_prometheus_config(
    collector: dict[str, Any], tmp_path: Path
) -> None:
    """Ray's node metrics reach the metrics pipeline through a prometheus receiver whose embedded
    Prometheus configuration the pinned promtool accepts."""
    assert "prometheus/ray" in collector["service"]["pipelines"]["metrics"]["receivers"]
    embedded = collector["receivers"]["prometheus/ray"]["config"]
    (job,) = embedded["scrape_configs"]
    assert job["job_name"] == "ray" and job["static_configs"][0]["targets"] == ["host.docker.internal:8080"]
    path = tmp_path / "ray-scrape.yml"
    path.write_text(yaml.safe_dump(embedded))
    proc = _run([require_binary("promtool"), "check", "config", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_collector_pipelines_reference_defined_components(collector: dict[str, Any]) -> None:
    assert set(collector["service"]["pipelines"]) >= {"metrics", "traces"}
    assert pipeline_errors(collector) == []


def test_collector_config_uses_only_options_of_the_pinned_collector(collector: dict[str, Any]) -> None:
    assert collector_config_errors(collector) == []


@pytest.mark.parametrize(
    ("path", "key"),
    [
        (("exporters", "prometheus"), "resource_constant_labels"),  # later than the pin
        (("exporters", "prometheus"), "without_scope_info"),
        (("exporters", "prometheus", "resource_to_telemetry_conversion"), "exclude_service_attributes"),
        (("receivers", "otlp", "protocols", "grpc"), "max_recv_msg_size"),
        (("exporters", "otlp_grpc/tempo", "tls"), "insecure_skip"),
        (("processors", "memory_limiter"), "limit_mb"),
        (("service",), "extension"),
    ],
)
def test_collector_option_check_rejects_an_unknown_key(
    collector: dict[str, Any], path: tuple[str, ...], key: str
) -> None:
    """Negative control: the check above fails when one unknown key is added anywhere."""
    broken = copy.deepcopy(collector)
    node = broken
    for part in path:
        node = node[part]
    node[key] = True
    errors = collector_config_errors(broken)
    assert errors and all(e.endswith(f".{key}") for e in errors), errors


def test_collector_option_check_rejects_unverified_components(collector: dict[str, Any]) -> None:
    broken = copy.deepcopy(collector)
    broken["exporters"]["otlp/tempo"] = broken["exporters"].pop("otlp_grpc/tempo")  # deprecated alias
    broken["processors"]["transform"] = {"metric_statements": []}
    errors = collector_config_errors(broken)
    assert any("'otlp'" in e for e in errors) and any("'transform'" in e for e in errors)


def _deleted_by(actions: list[dict[str, Any]], key: str) -> bool:
    return any(
        a["action"] == "delete" and (a.get("key") == key or re.search(a.get("pattern", "(?!)"), key))
        for a in actions
    )


def test_collector_puts_identity_labels_on_every_series_and_nothing_per_process(
    collector: dict[str, Any],
) -> None:
    """The Resource otel_train really builds, through the metrics pipeline's resource processors,
    becomes the label set (resource_to_telemetry_conversion): identity in, per-process out."""
    import otel_train
    from otel_train.testing import current_session

    prom = collector["exporters"]["prometheus"]
    assert prom["resource_to_telemetry_conversion"] == {"enabled": True}
    assert (
        prom.get("translation_strategy", "UnderscoreEscapingWithSuffixes") == "UnderscoreEscapingWithSuffixes"
    )
    processors = collector["service"]["pipelines"]["metrics"]["processors"]
    actions = [
        a
        for p in processors
        if p.split("/", 1)[0] == "resource"
        for a in collector["processors"][p]["attributes"]
    ]
    otel_train.init(prometheus_port=0, verbosity=0, run_id="ident", hardware=False)
    session = current_session()
    try:
        resource = dict(session.resource.attributes)
    finally:
        otel_train.shutdown()
    # the library keeps per-process attributes off the metrics Resource (tests/test_metric_identity.py)
    assert not [k for k in resource if k.startswith("process.")]
    labels = {re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in resource if not _deleted_by(actions, k)}
    assert {"run_id", "rank", "local_rank", "host_name"} <= labels
    # every identity key but the role, which is on the Resource only when set (tests/test_roles.py)
    keys = set(semconv.LABEL_RESOURCE_KEYS) - {semconv.ROLE}
    assert {re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in keys} <= labels
    assert not [label for label in labels if label.startswith("process_")]
    # the collector drops them too, for other SDKs and what resource detectors may add
    # (OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=process)
    for key in ("process.pid", "process.command_line", "process.command_args", "process.parent_pid"):
        assert _deleted_by(actions, key), key


def test_collector_listens_in_container_and_reaches_the_stack(
    collector: dict[str, Any], compose: dict[str, Any]
) -> None:
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    prom = collector["exporters"]["prometheus"]
    assert prom["enable_open_metrics"] is True  # exemplars reach Prometheus
    # Prometheus scrapes the exporter's port, honouring the exported job/instance
    port = prom["endpoint"].rsplit(":", 1)[1]
    scrape = _load("prometheus/prometheus.yml")["scrape_configs"]
    collector_jobs = [
        j
        for j in scrape
        if any(f"otel-collector:{port}" in t for g in j["static_configs"] for t in g["targets"])
    ]
    assert collector_jobs and all(j.get("honor_labels") is True for j in collector_jobs)
    # ... and stores exemplars
    assert "--enable-feature=exemplar-storage" in compose["services"]["prometheus"]["command"]
    # traces go to the Tempo service
    trace_exporters = collector["service"]["pipelines"]["traces"]["exporters"]
    endpoints = [collector["exporters"][e].get("endpoint", "") for e in trace_exporters]
    assert any(e.startswith("tempo:") for e in endpoints) and "tempo" in compose["services"]


def test_prometheus_alerts_to_compose_alertmanager(compose: dict[str, Any]) -> None:
    prom = _load("prometheus/prometheus.yml")
    targets = [
        t for am in prom["alerting"]["alertmanagers"] for g in am["static_configs"] for t in g["targets"]
    ]
    assert targets == ["alertmanager:9093"] and "alertmanager" in compose["services"]
    assert prom["rule_files"] == ["rules/*.yml"]
    mounts = dict(_volume_mounts(compose["services"]["prometheus"]))
    assert mounts["./prometheus/rules"] == "/etc/prometheus/rules"
    assert mounts["./prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_pull_endpoint_example_scrapes_one_port_per_local_rank() -> None:
    cfg = _load("prometheus/pull-endpoints.example.yml")
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "otel_train"]
    targets = [t for g in job["static_configs"] for t in g["targets"]]
    base = FIELDS["prometheus_port"].default
    assert isinstance(base, int)
    assert targets == [f"127.0.0.1:{base + i}" for i in range(len(targets))]
    assert len(targets) >= 8


def test_alertmanager_routes_by_severity_and_run() -> None:
    am = _load("alertmanager/alertmanager.yml")
    assert "run_id" in am["route"]["group_by"]
    matchers = [m for r in am["route"]["routes"] for m in r.get("matchers", [])]
    assert any("severity" in m and "critical" in m for m in matchers)
    receivers = {r["name"]: r for r in am["receivers"]}
    assert all(r.get("webhook_configs") for r in receivers.values())
    text = (DEPLOY / "alertmanager" / "alertmanager.yml").read_text()
    assert "# slack_configs:" in text and "# email_configs:" in text
