"""Checks of deploy/kubernetes/: no cluster here, so the manifests are checked as files.

Every manifest by kubernetes-validate (the Kubernetes OpenAPI schemas of KUBERNETES_VERSION, strict:
an unknown field is an error), the collector configs embedded in the ConfigMaps key by key against
the pinned collector (tests/helpers/collector_options.py), the references between the manifests (selectors,
ConfigMaps, ports, the agent's gateway address, the training pod's endpoint) by a small helper, and
the in-cluster Prometheus scrape job by the pinned promtool.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from helpers import pinned
from helpers.collector_options import collector_config_errors, env_references, pipeline_errors
from helpers.pinned import require_binary

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBE = DEPLOY / "kubernetes"
# The Kubernetes minor version whose OpenAPI schemas the manifests are validated against.
KUBERNETES_VERSION = "1.33"
COLLECTOR_KEY = "collector.yaml"  # the ConfigMaps' key holding a collector config
Manifest = dict[str, Any]


def kubernetes_validate() -> ModuleType:
    """The kubernetes-validate package (the `dev` extra); a failure under CI when missing."""
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError:
        message = "kubernetes-validate is not installed: pip install -e '.[dev]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")


def load_manifests(paths: list[Path]) -> list[Manifest]:
    return [doc for p in paths for doc in yaml.safe_load_all(p.read_text()) if doc]


MANIFESTS = load_manifests(manifest_files())


def _id(doc: Manifest) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def collector_config(docs: list[Manifest], configmap: str) -> dict[str, Any]:
    return yaml.safe_load(find(docs, "ConfigMap", configmap)["data"][COLLECTOR_KEY])


# --- schema validation -----------------------------------------------------------------------------
def schema_error(doc: Manifest) -> str | None:
    """kubernetes-validate's verdict on one manifest (None: valid). A kind without a schema is an
    error here (the library itself only warns), so nothing passes unchecked."""
    kv = kubernetes_validate()
    try:
        kv.validate(doc, KUBERNETES_VERSION, strict=True)
    except kv.ValidationError as exc:
        return f"{'.'.join(map(str, exc.path))}: {exc.message}"
    except kv.SchemaNotFoundError as exc:
        return exc.message
    return None


@pytest.mark.parametrize("doc", MANIFESTS, ids=_id)
def test_manifest_validates_against_the_kubernetes_schema(doc: Manifest) -> None:
    assert schema_error(doc) is None


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolcy="Always"),
            "imagePullPolcy",
        ),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(hostPort="4317"),
            "4317",
        ),
        (lambda d: d["spec"]["template"]["spec"].pop("containers"), "containers"),
        (lambda d: d.update(apiVersion="apps/v1beta2"), "apps/v1beta2"),
    ],
    ids=["misspelled-field", "port-as-string", "no-containers", "removed-api-version"],
)
def test_schema_check_rejects_a_broken_manifest(mutate: Any, expected: str) -> None:
    """Negative control: the same check fails on a copy of the agent DaemonSet with one defect."""
    broken = copy.deepcopy(find(MANIFESTS, "DaemonSet", "otel-agent"))
    mutate(broken)
    error = schema_error(broken)
    assert error is not None and expected in error, error


def test_kubernetes_validate_cli_accepts_every_file() -> None:
    """What an operator runs (the README's command): every resource of every file passes."""
    kubernetes_validate()
    argv = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBERNETES_VERSION]
    proc = subprocess.run([*argv, *map(str, manifest_files())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" passed for resource ") == len(MANIFESTS), proc.stdout
    assert "WARN" not in proc.stdout + proc.stderr


def test_kustomization_applies_the_collectors_not_the_example() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    expected = {p.name for p in manifest_files()} - {"training-job.example.yaml"}
    assert sorted(kustomization["resources"]) == sorted(expected)
    applied = load_manifests([KUBE / name for name in kustomization["resources"]])
    assert {d["metadata"].get("namespace", d["metadata"]["name"]) for d in applied} == {"otel-train"}


# --- references between the manifests ---------------------------------------------------------------
def _pod_spec(doc: Manifest) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def _workloads(docs: list[Manifest]) -> list[Manifest]:
    return [d for d in docs if d["kind"] in {"Deployment", "DaemonSet", "Job", "StatefulSet"}]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _service_errors(service: Manifest, docs: list[Manifest]) -> list[str]:
    namespace = service["metadata"]["namespace"]
    pods = [
        w
        for w in _workloads(docs)
        if w["metadata"]["namespace"] == namespace
        and _matches(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
    ]
    if not pods:
        return [f"{_id(service)}: selector matches no pod template"]
    errors = []
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        for w in pods:
            ports = [p for c in _pod_spec(w)["containers"] for p in c.get("ports", [])]
            if not any(target in (p.get("name"), p["containerPort"]) for p in ports):
                errors.append(f"{_id(service)}: targetPort {target} not a port of {_id(w)}")
    return errors


def _workload_errors(workload: Manifest, docs: list[Manifest]) -> list[str]:
    errors = []
    spec = workload["spec"]
    if "selector" in spec and not _matches(
        spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]
    ):
        errors.append(f"{_id(workload)}: selector does not match its pod template")
    namespace = workload["metadata"]["namespace"]
    for volume in _pod_spec(workload).get("volumes", []):
        if "configMap" not in volume:
            continue
        name = volume["configMap"]["name"]
        maps = [
            d
            for d in docs
            if d["kind"] == "ConfigMap"
            and d["metadata"]["name"] == name
            and d["metadata"]["namespace"] == namespace
        ]
        if not maps:
            errors.append(f"{_id(workload)}: ConfigMap {name} not defined in {namespace}")
            continue
        errors += [
            f"{_id(workload)}: key {item['key']} not in ConfigMap {name}"
            for item in volume["configMap"].get("items", [])
            if item["key"] not in maps[0]["data"]
        ]
    return errors


def reference_errors(docs: list[Manifest]) -> list[str]:
    """Services that select no pod or target a port no container has; workloads whose selector
    misses their own pods or that mount a ConfigMap (key) that does not exist."""
    errors = [e for d in docs if d["kind"] == "Service" for e in _service_errors(d, docs)]
    return errors + [e for w in _workloads(docs) for e in _workload_errors(w, docs)]


def test_manifests_reference_each_other_consistently() -> None:
    assert reference_errors(MANIFESTS) == []


@pytest.mark.parametrize(
    "break_it",
    [
        lambda docs: find(docs, "Service", "otel-gateway")["spec"]["selector"].update(
            {"app.kubernetes.io/name": "otel-gatway"}
        ),
        lambda docs: find(docs, "Service", "otel-gateway")["spec"]["ports"][2].update(targetPort="prom"),
        lambda docs: _pod_spec(find(docs, "DaemonSet", "otel-agent"))["volumes"][0]["configMap"].update(
            name="otel-agent-conf"
        ),
        lambda docs: find(docs, "ConfigMap", "otel-gateway-config")["data"].update(
            {"config.yaml": find(docs, "ConfigMap", "otel-gateway-config")["data"].pop(COLLECTOR_KEY)}
        ),
        lambda docs: find(docs, "Deployment", "otel-gateway")["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/name": "gateway"}
        ),
    ],
    ids=["service-selector", "service-target-port", "configmap-name", "configmap-key", "workload-selector"],
)
def test_reference_check_finds_a_broken_reference(break_it: Any) -> None:
    docs = copy.deepcopy(MANIFESTS)
    break_it(docs)
    assert reference_errors(docs)


def _container(docs: list[Manifest], kind: str, name: str) -> dict[str, Any]:
    (container,) = _pod_spec(find(docs, kind, name))["containers"]
    return container


def _ports(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in container["ports"]}


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize(("kind", "name"), [("DaemonSet", "otel-agent"), ("Deployment", "otel-gateway")])
def test_collector_pods_load_their_config_and_open_its_ports(kind: str, name: str) -> None:
    """The container runs the pinned image on the mounted config, and every port the config
    listens on (receivers, prometheus exporter, health check) is a container port."""
    container = _container(MANIFESTS, kind, name)
    assert container["image"] == f"otel/opentelemetry-collector-contrib:{pinned.pinned()['otelcol-contrib']}"
    (mount,) = container["volumeMounts"]
    (volume,) = _pod_spec(find(MANIFESTS, kind, name))["volumes"]
    assert mount["name"] == volume["name"]
    (item,) = volume["configMap"]["items"]
    assert container["args"] == [f"--config={mount['mountPath']}/{item['path']}"]
    config = collector_config(MANIFESTS, volume["configMap"]["name"])
    listens = [p["endpoint"] for p in config["receivers"]["otlp"]["protocols"].values()]
    listens += [config["extensions"]["health_check"]["endpoint"]]
    listens += [e["endpoint"] for n, e in config["exporters"].items() if n.split("/")[0] == "prometheus"]
    assert all(e.startswith("0.0.0.0:") for e in listens), listens  # reachable on the pod IP
    assert {_port_of(e) for e in listens} == {p["containerPort"] for p in container["ports"]}
    health = _port_of(config["extensions"]["health_check"]["endpoint"])
    for probe in ("readinessProbe", "livenessProbe"):
        http_get = container[probe]["httpGet"]
        assert _ports(container)[http_get["port"]]["containerPort"] == health
        assert http_get["path"] == config["extensions"]["health_check"]["path"]


@pytest.mark.parametrize("configmap", ["otel-agent-config", "otel-gateway-config"])
def test_collector_configmaps_use_only_options_of_the_pinned_collector(configmap: str) -> None:
    config = collector_config(MANIFESTS, configmap)
    assert collector_config_errors(config) == []
    assert pipeline_errors(config) == []
    assert set(config["service"]["pipelines"]) == {"metrics", "traces", "logs"}


def test_collector_check_reads_the_configmaps() -> None:
    """Negative control: an unknown key inside the ConfigMap's embedded YAML is found."""
    docs = copy.deepcopy(MANIFESTS)
    data = find(docs, "ConfigMap", "otel-agent-config")["data"]
    data[COLLECTOR_KEY] = data[COLLECTOR_KEY].replace(
        "check_interval: 1s", "check_interval: 1s\n    limit_mb: 1", 1
    )
    config = collector_config(docs, "otel-agent-config")
    assert collector_config_errors(config) == ["processors.memory_limiter.limit_mb"]
    config["service"]["pipelines"]["metrics"]["exporters"] = ["otlp_grpc/gatway"]
    assert pipeline_errors(config) == ["metrics: exporters otlp_grpc/gatway"]


def test_agent_reads_only_variables_its_pod_sets() -> None:
    text = find(MANIFESTS, "ConfigMap", "otel-agent-config")["data"][COLLECTOR_KEY]
    env = {e["name"] for e in _container(MANIFESTS, "DaemonSet", "otel-agent")["env"]}
    assert env_references(text) == {"K8S_NODE_NAME"} <= env


def test_agent_publishes_its_receivers_on_the_node_and_forwards_to_the_gateway() -> None:
    agent = _container(MANIFESTS, "DaemonSet", "otel-agent")
    published = {p["hostPort"] for p in agent["ports"] if "hostPort" in p}
    assert all(p["hostPort"] == p["containerPort"] for p in agent["ports"] if "hostPort" in p)
    assert published == {4317, 4318}  # OTLP only: the health port stays inside the pod network
    config = collector_config(MANIFESTS, "otel-agent-config")
    (exporter,) = {e for p in config["service"]["pipelines"].values() for e in p["exporters"]}
    host, port = config["exporters"][exporter]["endpoint"].rsplit(":", 1)
    service = find(MANIFESTS, "Service", "otel-gateway")
    assert host == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    (target,) = [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == int(port)]
    gateway = collector_config(MANIFESTS, "otel-gateway-config")
    container_port = _ports(_container(MANIFESTS, "Deployment", "otel-gateway"))[target]["containerPort"]
    assert container_port == _port_of(gateway["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])


def test_gateway_serves_metrics_as_the_single_host_collector_does() -> None:
    """Same metrics processors and Prometheus exporter as deploy/otelcol.yaml (whose labels the
    alert rules and dashboards are tested against)."""
    gateway = collector_config(MANIFESTS, "otel-gateway-config")
    single = yaml.safe_load((DEPLOY / "otelcol.yaml").read_text())
    pipeline = gateway["service"]["pipelines"]["metrics"]
    # ... but the scrape of a Ray head on the host (single-host only: on Kubernetes, KubeRay's
    # own PodMonitor serves Ray's node metrics to Prometheus)
    single_metrics = dict(single["service"]["pipelines"]["metrics"])
    single_metrics["receivers"] = [r for r in single_metrics["receivers"] if r != "prometheus/ray"]
    assert pipeline == single_metrics
    assert gateway["exporters"]["prometheus"] == single["exporters"]["prometheus"]
    for name in pipeline["processors"]:
        if name != "memory_limiter":  # sized from the container limit here
            assert gateway["processors"][name] == single["processors"][name], name
    deployment = find(MANIFESTS, "Deployment", "otel-gateway")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert "memory" in _container(MANIFESTS, "Deployment", "otel-gateway")["resources"]["limits"]


# --- the training pod example -----------------------------------------------------------------------
def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def test_training_pod_exports_to_the_agent_on_its_node() -> None:
    trainer = _container(MANIFESTS, "Job", "train-demo")
    env = _env(trainer)
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    agent_http = _ports(_container(MANIFESTS, "DaemonSet", "otel-agent"))["otlp-http"]["hostPort"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == f"http://$(HOST_IP):{agent_http}"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Kubernetes expands $(VAR) only for variables defined earlier in the list.
    names = [e["name"] for e in trainer["env"]]
    for i, entry in enumerate(trainer["env"]):
        for ref in re.findall(r"\$\(([A-Z_]+)\)", entry.get("value", "")):
            assert ref in names[:i], f"{entry['name']} uses $({ref}) before it is defined"
    for ref in re.findall(r"\$\(([A-Z_]+)\)", " ".join(trainer["args"])):
        assert ref in names, ref


def test_training_pod_environment_is_what_otel_train_reads() -> None:
    """The example's variables, expanded as Kubernetes would, give the library the agent's
    endpoint and the pod's attributes (through otel_train's own config loader)."""
    from otel_train.config_loading import load_config

    values = {"HOST_IP": "10.1.2.3", "POD_NAME": "train-demo-0-abcde", "POD_NAMESPACE": "default"}
    values["OTEL_TRAIN_RUN_ID"] = "6f1c1f1e-0000-4000-8000-000000000000"
    environ = {}
    for entry in _container(MANIFESTS, "Job", "train-demo")["env"]:
        raw = entry.get("value", values.get(entry["name"], ""))
        environ[entry["name"]] = re.sub(r"\$\(([A-Z_]+)\)", lambda m: environ[m.group(1)], raw)
    config = load_config(environ=environ)
    assert config.otlp_endpoint == "http://10.1.2.3:4318"
    assert config.resource_attributes == {
        "k8s.pod.name": "train-demo-0-abcde",
        "k8s.namespace.name": "default",
    }
    assert config.run_id == values["OTEL_TRAIN_RUN_ID"]


def test_training_job_rendezvous_matches_its_headless_service() -> None:
    job = find(MANIFESTS, "Job", "train-demo")
    service = find(MANIFESTS, "Service", "train-demo")
    assert service["spec"]["clusterIP"] == "None"
    assert _pod_spec(job)["subdomain"] == service["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"
    args = _container(MANIFESTS, "Job", "train-demo")["args"]
    assert f"--master-addr={job['metadata']['name']}-0.{service['metadata']['name']}" in args
    assert f"--nnodes={job['spec']['completions']}" in args
    (port,) = service["spec"]["ports"]
    assert f"--master-port={port['port']}" in args


# --- Prometheus in the cluster ----------------------------------------------------------------------
def test_in_cluster_scrape_job_is_valid_and_keeps_the_gateway(tmp_path: Path) -> None:
    """The scrape job checked by the pinned promtool inside a config that loads the alert pack,
    and it keeps exactly the gateway Service's metrics port, honouring the exported labels."""
    jobs = yaml.safe_load((KUBE / "prometheus" / "additional-scrape-configs.yml").read_text())
    config = {
        "rule_files": [str(DEPLOY / "prometheus" / "rules" / "*.yml")],
        "scrape_configs": jobs,
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [require_binary("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = jobs
    assert job["honor_labels"] is True
    service = find(MANIFESTS, "Service", "otel-gateway")
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["namespaces"]["names"] == [service["metadata"]["namespace"]]
    (keep,) = job["relabel_configs"]
    assert keep["action"] == "keep"
    metrics_port = [p["name"] for p in service["spec"]["ports"] if p["port"] == 8889]
    assert keep["regex"] == f"{service['metadata']['name']};{metrics_port[0]}"


# --- the docs say what the manifests do ------------------------------------------------------------
def test_readme_env_block_is_the_example_jobs() -> None:
    """The env block the docs' Running at scale page tells users to copy is the example Job's
    (without its own torchrun NODE_RANK), and its validation command uses the tested schema version."""
    section = (DEPLOY.parent / "docs" / "scale.md").read_text()
    block = re.search(r"```yaml\n(env:\n.*?)```", section, re.S)
    assert block, "the docs' Running at scale lost its env block"
    documented = yaml.safe_load(block.group(1))["env"]
    example = [e for e in _container(MANIFESTS, "Job", "train-demo")["env"] if e["name"] != "NODE_RANK"]
    assert documented == example
    assert f"kubernetes-validate --strict -k {KUBERNETES_VERSION} deploy/kubernetes/*.yaml" in section
