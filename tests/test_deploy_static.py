"""Static checks of deploy/: there is no Docker engine here, so the stack is checked as files.

Real tools where they exist (promtool check config, amtool check-config); YAML structure checks
for docker-compose, the OTel Collector, Tempo and Grafana provisioning.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import require_binary

from otel_train import semconv
from otel_train.config import FIELDS

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
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
    for ds in sources.values():
        m = re.match(r"https?://([\w-]+):", ds["url"])
        assert m, ds["url"]
        host = m.group(1)
        assert host in compose["services"], f"datasource {ds['name']} points at unknown service {host}"


# --- OTel Collector --------------------------------------------------------------------------------
def test_collector_pipelines_reference_defined_components(collector: dict[str, Any]) -> None:
    service = collector["service"]
    connectors = set(collector.get("connectors") or {})
    for ext in service.get("extensions", []):
        assert ext in collector["extensions"], ext
    assert set(service["pipelines"]) >= {"metrics", "traces"}
    for name, pipeline in service["pipelines"].items():
        for rec in pipeline["receivers"]:
            assert rec in (collector["receivers"] or {}) or rec in connectors, f"{name}: receiver {rec}"
        for proc in pipeline.get("processors", []):
            assert proc in collector["processors"], f"{name}: processor {proc}"
        for exp in pipeline["exporters"]:
            assert exp in collector["exporters"] or exp in connectors, f"{name}: exporter {exp}"
        assert pipeline["processors"][0] == "memory_limiter", f"{name}: memory_limiter must come first"
        assert "batch" in pipeline["processors"]


def test_collector_listens_in_container_and_keeps_identity(
    collector: dict[str, Any], compose: dict[str, Any]
) -> None:
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    assert collector["extensions"]["health_check"]["endpoint"].endswith(":13133")
    prom = collector["exporters"]["prometheus"]
    # run_id/rank/local_rank/host.name labels on every series: the catalogue's list, exactly
    assert prom["resource_constant_labels"]["included"] == list(semconv.LABEL_RESOURCE_KEYS)
    assert (
        prom.get("translation_strategy", "UnderscoreEscapingWithSuffixes") == "UnderscoreEscapingWithSuffixes"
    )
    # Prometheus scrapes the exporter's port, honouring the exported job/instance
    port = prom["endpoint"].rsplit(":", 1)[1]
    scrape = _load("prometheus/prometheus.yml")["scrape_configs"]
    collector_jobs = [
        j
        for j in scrape
        if any(f"otel-collector:{port}" in t for g in j["static_configs"] for t in g["targets"])
    ]
    assert collector_jobs and all(j.get("honor_labels") is True for j in collector_jobs)
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
