"""The shipped collectors pass a rank's series tier through as it is (issue #47, part 4): the single
host's (deploy/otelcol.yaml), the Kubernetes node agent and gateway, the SLURM node collector. Their
metrics pipelines hold only processors that neither drop, merge nor make series (memory_limiter,
batch, and resource processors whose actions delete per-process attributes or insert one that is
constant per rank), and no connector: what `rank_series` sent is what reaches the store."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.test_kubernetes import MANIFESTS, collector_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# processor type -> why it keeps every series of the tier, and no more
SERIES_NEUTRAL = {
    "memory_limiter": "refuses a whole export under memory pressure (the SDK retries it); drops no series",
    "batch": "regroups exports; every data point passes",
    "resource": "edits Resource attributes (checked below: no new series per rank)",
}
# resource actions that keep one series set per rank: dropping per-process attributes (which would
# otherwise start new series per restart) and inserting a value fixed for the rank's lifetime
NEUTRAL_RESOURCE_ACTIONS = {("delete", r"^process\."), ("insert", "k8s.node.name")}
# receivers of other sources' own series (Ray's node metrics), not of the ranks'
OTHER_SOURCES = {"prometheus/ray"}


def configs() -> dict[str, dict[str, Any]]:
    return {
        "single host": yaml.safe_load((DEPLOY / "otelcol.yaml").read_text()),
        "kubernetes agent": collector_config(MANIFESTS, "otel-agent-config"),
        "kubernetes gateway": collector_config(MANIFESTS, "otel-gateway-config"),
        "slurm node": yaml.safe_load((DEPLOY / "slurm" / "otelcol-node.yaml").read_text()),
    }


def tier_problems(config: dict[str, Any]) -> list[str]:
    """Why a collector config would change the series a rank's tier sends (empty: it does not)."""
    problems = []
    pipeline = config["service"]["pipelines"]["metrics"]
    for receiver in pipeline["receivers"]:
        if receiver != "otlp" and receiver not in OTHER_SOURCES:
            problems.append(f"receiver {receiver}: a connector or another source in the ranks' pipeline")
    for name in pipeline.get("processors", []):
        kind = name.split("/", 1)[0]
        if kind not in SERIES_NEUTRAL:
            problems.append(f"processor {name}: may drop, merge or add series")
            continue
        if kind == "resource":
            for action in config["processors"][name]["attributes"]:
                key = (action["action"], action.get("pattern") or action.get("key"))
                if key not in NEUTRAL_RESOURCE_ACTIONS:
                    problems.append(f"processor {name}: {key} changes the series set per rank")
    return problems


@pytest.mark.parametrize("where", list(configs()))
def test_the_collector_keeps_the_tier_series_unchanged(where: str) -> None:
    config = configs()[where]
    assert tier_problems(config) == []
    assert "otlp" in config["service"]["pipelines"]["metrics"]["receivers"]


@pytest.mark.parametrize(
    ("processor", "spec", "finding"),
    [
        ("filter/ranks", {"metrics": {"metric": ['name == "train_loss"']}}, "may drop, merge or add series"),
        ("groupbyattrs/node", {"keys": ["host.name"]}, "may drop, merge or add series"),
        ("resource/pod", {"attributes": [{"key": "k8s.pod.uid", "action": "upsert", "value": "x"}]},
         "changes the series set per rank"),
    ],
)  # fmt: skip
def test_a_series_changing_processor_is_found(processor: str, spec: dict[str, Any], finding: str) -> None:
    config = copy.deepcopy(configs()["kubernetes gateway"])
    config["processors"][processor] = spec
    config["service"]["pipelines"]["metrics"]["processors"].insert(1, processor)
    assert any(finding in p for p in tier_problems(config))


def test_the_configs_state_the_per_rank_cost() -> None:
    """Each collector config says what a rank costs in each tier, and where the numbers come from."""
    texts = {
        "single host": (DEPLOY / "otelcol.yaml").read_text(),
        "kubernetes agent": (DEPLOY / "kubernetes" / "agent-config.yaml").read_text(),
        "kubernetes gateway": (DEPLOY / "kubernetes" / "gateway-config.yaml").read_text(),
        "slurm node": (DEPLOY / "slurm" / "otelcol-node.yaml").read_text(),
    }
    for where, text in texts.items():
        assert 'rank_series="essential"' in text and "docs/scale.md" in text, where
