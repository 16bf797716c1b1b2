"""The scale-out store variant on real components (issue #18, part 4; issue #47, part 3): 4 real
torch.distributed (gloo) ranks push their metrics over OTLP straight into a real VictoriaMetrics
(the pinned 1.145, flags as in deploy/docker-compose.victoriametrics.yml); a real vmalert
evaluates the shipped alert pack, as it is (test-only copy with short windows), against it and
notifies a real Alertmanager. The job carries every planted fault (tests/deploy/planted.py:
straggler, NaN, replica divergence, GPU, whole-run stall), in both series tiers: every alert
fires on its case, for the right rank only. Then every dashboard query is evaluated against
VictoriaMetrics: in `essential`, the panels that need `full` are empty and all others have data."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers.multirank import run_ranks
from helpers.promstack import alertmanager, shorten_rules
from helpers.vmstack import victoriametrics, vmalert

from deploy.planted import check_alerts, check_dashboards, collect_alerts, planted_rank
from deploy.test_stack_e2e import RULES_DIR, WORLD

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

RUN_ID = "vm"
TRAIN_S, STALL_S = 30.0, 28.0


def _failing_rules(groups: list[dict]) -> list[str]:
    """Rules vmalert could not evaluate (MetricsQL rejected the expression, or a query failed)."""
    return [
        f"{rule['name']}: {rule.get('lastError')}"
        for group in groups
        for rule in group["rules"]
        if rule.get("lastError") or rule.get("health") not in ("ok", None)
    ]


@pytest.mark.parametrize("tier", ["essential", "full"])
def test_every_planted_fault_pages_through_vmalert_in_both_tiers(tier: str, tmp_path: Path) -> None:
    rules = shorten_rules(sorted(RULES_DIR.glob("*.yml")), tmp_path / "rules", for_="5s", scale=30)
    results: list[int] = []
    errors: list[BaseException] = []
    seen: dict[str, set[str | None]] = {}
    with alertmanager() as am, victoriametrics() as vm, vmalert(vm.url, rules, notifier_url=am.url) as va:
        args = (str(tmp_path), TRAIN_S, STALL_S, RUN_ID, tier, vm.otlp_metrics_url)

        def train() -> None:
            try:
                env = {"LOCAL_WORLD_SIZE": str(WORLD), "TORCH_FR_BUFFER_SIZE": "2000"}
                results.extend(run_ranks(WORLD, planted_rank, args, timeout=TRAIN_S + STALL_S + 90, env=env))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=train)
        thread.start()
        try:
            collect_alerts(am, time.monotonic() + TRAIN_S + STALL_S + 30, seen)
            check_alerts(seen, va.log())
            check_dashboards(vm.url, tier, RUN_ID)
            # every rule of the pack, recording and alerting, evaluates under MetricsQL
            groups = va.rule_groups()
            assert sum(len(g["rules"]) for g in groups) == _rule_count(rules)
            assert _failing_rules(groups) == []
        finally:
            (tmp_path / "stop").touch()  # the ranks' stall ends here (deploy/planted.py)
            thread.join()
        assert not errors, errors
        assert min(results) > 50  # it trained
        # one series set per rank; nothing per-launch among the labels (issue #18, part 2)
        series = vm.series(f'train_steps_total{{run_id="{RUN_ID}"}}')
        assert sorted(s["rank"] for s in series) == [str(r) for r in range(WORLD)]
        labels = {key for s in vm.series(f'{{run_id="{RUN_ID}"}}') for key in s}
        assert {"run_id", "rank", "local_rank", "host_name"} <= labels
        assert not [k for k in labels if k.startswith("process_") or k == "otel_train_run_name"]


def _rule_count(rule_files: list[Path]) -> int:
    import yaml

    return sum(len(g["rules"]) for f in rule_files for g in yaml.safe_load(f.read_text())["groups"])
