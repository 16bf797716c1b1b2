"""The scale-out store variant on real components (issue #18, part 4): 4 real torch.distributed
(gloo) ranks push their metrics over OTLP straight into a real VictoriaMetrics (the pinned 1.145,
flags as in deploy/docker-compose.victoriametrics.yml); a real vmalert evaluates the shipped alert
pack, as it is (test-only copy with short windows), against it and notifies a real Alertmanager.
Then every dashboard query is evaluated against VictoriaMetrics."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers.dashboard_queries import assert_all_queries_return_data
from helpers.multirank import run_ranks
from helpers.promstack import alertmanager, shorten_rules, wait_until
from helpers.vmstack import victoriametrics, vmalert

from deploy.test_stack_e2e import RULES_DIR, WORLD, _rank

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

RUN_ID = "vm"
SLOW_RANK = 2


def _failing_rules(groups: list[dict]) -> list[str]:
    """Rules vmalert could not evaluate (MetricsQL rejected the expression, or a query failed)."""
    return [
        f"{rule['name']}: {rule.get('lastError')}"
        for group in groups
        for rule in group["rules"]
        if rule.get("lastError") or rule.get("health") not in ("ok", None)
    ]


def test_ranks_push_otlp_into_victoriametrics_and_vmalert_pages_the_straggler(tmp_path: Path) -> None:
    rules = shorten_rules(sorted(RULES_DIR.glob("*.yml")), tmp_path / "rules", for_="5s", scale=30)
    results: list[int] = []
    errors: list[BaseException] = []
    with alertmanager() as am, victoriametrics() as vm, vmalert(vm.url, rules, notifier_url=am.url) as va:
        args = (0, str(tmp_path), 30.0, SLOW_RANK, -1, RUN_ID, vm.otlp_metrics_url)

        def train() -> None:
            try:
                results.extend(
                    run_ranks(
                        WORLD,
                        _rank,
                        args,
                        timeout=160,
                        env={"LOCAL_WORLD_SIZE": str(WORLD), "TORCH_FR_BUFFER_SIZE": "2000"},
                    )
                )
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=train)
        thread.start()
        try:
            firing = wait_until(
                lambda: am.alerts(alertname="TrainingStraggler"),
                timeout=75,
                what=f"TrainingStraggler from vmalert\n{va.log()}",
            )
            assert {a["labels"]["rank"] for a in firing} == {str(SLOW_RANK)}
            assert all(a["labels"]["run_id"] == RUN_ID for a in firing)
            assert_all_queries_return_data(vm.url, exclude_gpu=True, variables={"run_id": RUN_ID}, wait_s=20)
            # every rule of the pack, recording and alerting, evaluates under MetricsQL
            groups = va.rule_groups()
            assert sum(len(g["rules"]) for g in groups) == _rule_count(rules)
            assert _failing_rules(groups) == []
        finally:
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
