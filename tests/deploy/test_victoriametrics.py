"""Checks of the scale-out store variant, deploy/docker-compose.victoriametrics.yml, as files and
with the real tools of the pinned versions (deploy/versions.env): docker-compose config, every
VictoriaMetrics/vmalert flag it passes is one the pinned binary knows (its -help), vmalert -dryRun
loads the shipped alert pack as it is. `make check-deploy` runs this file. The running variant is
tested by tests/deploy/test_victoriametrics_e2e.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import pinned
from helpers.pinned import require_binary
from helpers.vmstack import OTLP_FLAGS

from deploy.test_static import _compose_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "docker-compose.victoriametrics.yml"
RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _load(rel: str) -> Any:
    return yaml.safe_load((DEPLOY / rel).read_text())


def test_docker_compose_config_accepts_the_variant(tmp_path: Path) -> None:
    proc = _compose_config(COMPOSE, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_images_are_the_tested_versions(compose: dict[str, Any]) -> None:
    versions = pinned.pinned()
    services = compose["services"]
    vm = versions["victoria-metrics"]
    assert services["victoriametrics"]["image"] == f"victoriametrics/victoria-metrics:v{vm}"
    assert services["vmalert"]["image"] == f"victoriametrics/vmalert:v{vm}"
    assert services["alertmanager"]["image"] == f"prom/alertmanager:v{versions['alertmanager']}"
    assert services["otel-collector"]["image"].endswith(f":{versions['otelcol-contrib']}")
    base = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    for shared in ("alertmanager", "otel-collector", "tempo", "tempo-init", "grafana"):
        assert services[shared]["image"] == base[shared]["image"], shared


def test_published_ports_bind_loopback_only(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"


def _flag_names(command: list[str]) -> list[str]:
    return [re.match(r"-+([\w.]+)", arg)[1] for arg in command if arg.startswith("-")]  # type: ignore[index]


@pytest.mark.parametrize(
    ("service", "binary"), [("victoriametrics", "victoria-metrics"), ("vmalert", "vmalert")]
)
def test_every_flag_is_known_to_the_pinned_binary(compose: dict[str, Any], service: str, binary: str) -> None:
    """VictoriaMetrics exits on an unknown flag: each one the variant passes is in the pinned
    binary's own -help."""
    proc = subprocess.run([require_binary(binary), "-help"], capture_output=True, text=True, timeout=30)
    known = set(re.findall(r"^  -([\w.]+)", proc.stdout + proc.stderr, re.M))
    assert len(known) > 50, proc.stdout + proc.stderr
    flags = _flag_names(compose["services"][service]["command"])
    assert flags and not sorted(set(flags) - known)
    assert "opentelemetry.notAFlag" not in known  # negative control of the parse


def test_victoriametrics_ingests_otlp_as_the_tests_run_it(compose: dict[str, Any]) -> None:
    command = compose["services"]["victoriametrics"]["command"]
    assert set(OTLP_FLAGS) <= set(command)  # what tests/helpers/vmstack.py starts, so the E2E test covers it
    # every resource attribute becomes a label unless told otherwise: none is filtered here, the
    # library keeps per-launch attributes off its metrics Resource (tests/test_metric_identity.py)
    assert not [a for a in command if a.startswith("-opentelemetry.promoteResourceAttributes")]


def test_vmalert_uses_the_same_rule_files_and_alertmanager(compose: dict[str, Any]) -> None:
    vmalert = compose["services"]["vmalert"]
    args = dict(a.lstrip("-").split("=", 1) for a in vmalert["command"])
    assert "./prometheus/rules:/etc/vmalert/rules:ro" in vmalert["volumes"]
    assert args["rule"] == "/etc/vmalert/rules/*.yml"
    assert args["notifier.url"] == "http://alertmanager:9093"
    store = "http://victoriametrics:8428"
    assert args["datasource.url"] == args["remoteWrite.url"] == args["remoteRead.url"] == store


def test_vmalert_dry_run_loads_the_alert_pack_as_it_is() -> None:
    binary = require_binary("vmalert")
    proc = subprocess.run(
        [binary, "-dryRun", *[f"-rule={p}" for p in RULES]], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vmalert_dry_run_rejects_a_broken_rule(tmp_path: Path) -> None:
    """Negative control: the same check fails on a rule MetricsQL cannot parse."""
    doc = yaml.safe_load(RULES[0].read_text())
    doc["groups"][0]["rules"][0]["expr"] = "sum(rate(train_steps_total[5m])"
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [require_binary("vmalert"), "-dryRun", f"-rule={broken}"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0


def test_grafana_datasources_keep_the_dashboards_uids(compose: dict[str, Any]) -> None:
    ours = _load("grafana/victoriametrics/datasources/otel_train.yaml")["datasources"]
    base = _load("grafana/provisioning/datasources/otel_train.yaml")["datasources"]
    assert {d["uid"] for d in ours} == {d["uid"] for d in base}
    metrics = next(d for d in ours if d["uid"] == "prometheus")
    assert metrics["type"] == "prometheus" and metrics["url"] == "http://victoriametrics:8428"
    volumes = compose["services"]["grafana"]["volumes"]
    assert "./grafana/victoriametrics/datasources:/etc/grafana/provisioning/datasources:ro" in volumes
    assert "./grafana/provisioning/dashboards:/etc/grafana/provisioning/dashboards:ro" in volumes
