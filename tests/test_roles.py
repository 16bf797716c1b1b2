"""Roles in the identity (issue #25, part 1): a single-controller job (NeMo RL, Ray Train) runs a
controller process and worker groups that each number their ranks from 0, so (run_id, role, rank)
is the identity. Two roles with the same rank never share a file or a series."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from helpers.otlp_receiver import http_receiver
from helpers.ports import free_port
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train import semconv
from otel_train.config import ConfigError
from otel_train.config_loading import load_config
from otel_train.run_directory import RunFiles

# One role's process: a few steps, a sample and an event-producing NaN loss, then shutdown.
_CHILD = textwrap.dedent(
    """
    import otel_train as ot
    ot.init(verbosity=0, log_interval=2, prometheus_port=0, metric_export_interval_s=0.2)
    for step in range(4):
        with ot.step(step, tokens=8, samples=2):
            ot.record("loss", float("nan") if step == 2 else 1.0)
    ot.log_samples([("prompt", "output")], name="val")
    ot.shutdown()
    """
)


def _run_role(role: str, out: Path, endpoint: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OTEL_TRAIN_ROLE": role,
        "OTEL_TRAIN_RUN_ID": "roles-run",
        "OTEL_TRAIN_RUN_NAME": "roles",
        "OTEL_TRAIN_OUTPUT_DIR": str(out),
        "OTEL_TRAIN_OTLP_ENDPOINT": endpoint,
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    return subprocess.Popen([sys.executable, "-c", _CHILD], env=env)


def test_two_roles_with_rank0_share_neither_a_file_nor_a_series(tmp_path: Path) -> None:
    with http_receiver() as (endpoint, received):
        children = [_run_role(role, tmp_path, endpoint) for role in ("controller", "policy")]
        assert [child.wait(timeout=120) for child in children] == [0, 0]
    run_dir = tmp_path / "roles"
    names = sorted(p.name for p in run_dir.iterdir())
    for role in ("controller", "policy"):
        files = RunFiles(run_dir, 0, role)
        for path in (files.metrics, files.owner, files.events, files.goodput, files.config, files.samples):
            assert path.exists(), (path.name, names)
        rows = [json.loads(line) for line in files.metrics.read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 3]  # each role's own 4 steps, not 8 interleaved
        assert '"event": "nonfinite"' in files.events.read_text()
        assert json.loads(files.config.read_text())["role"] == role
    assert "metrics.controller.rank0.jsonl" in names and "metrics.rank0.jsonl" not in names
    assert not [n for n in names if n.startswith(("progress.txt", "samples.jsonl", "config.json"))]
    # OTLP: one series identity per role (the role is a resource attribute, hence a label)
    points = received.metric_points()[semconv.STEPS.name]
    identities = {(r[semconv.RUN_ID], r[semconv.ROLE], r[semconv.RANK]) for r, _, _ in points}
    assert identities == {("roles-run", "controller", 0), ("roles-run", "policy", 0)}
    instance_ids = {r["service.instance.id"] for r, _, _ in points}
    assert instance_ids == {"roles-run-controller-rank0", "roles-run-policy-rank0"}


def test_role_is_a_label_on_every_pulled_series(tmp_path: Path) -> None:
    port = free_port()
    ot.init(role="policy", prometheus_port=port, run_id="role-pull", verbosity=0, log_interval=2,
            output_dir=str(tmp_path))  # fmt: skip
    try:
        for step in range(4):
            with ot.step(step, tokens=8, samples=2):
                ot.record("loss", 1.0)
        info = ot.run_info()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        ot.shutdown()
    assert info is not None and info.role == "policy"
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name != "target_info"]
    assert samples
    assert {s.labels.get("role") for s in samples} == {"policy"}


def test_no_role_keeps_the_identity_of_a_job_without_roles(tmp_path: Path) -> None:
    with http_receiver() as (endpoint, received):
        ot.init(otlp_endpoint=endpoint, prometheus_port=0, run_id="no-role", run_name="plain", verbosity=0,
                log_interval=2, metric_export_interval_s=0.2, output_dir=str(tmp_path))  # fmt: skip
        for step in range(2):
            with ot.step(step):
                ot.record("loss", 1.0)
        ot.shutdown()
    resources = [r for r, _, _ in received.metric_points()[semconv.STEPS.name]]
    assert resources and all(semconv.ROLE not in r for r in resources)
    assert {r["service.instance.id"] for r in resources} == {"no-role-rank0"}
    assert (tmp_path / "plain" / "metrics.rank0.jsonl").exists()
    assert (tmp_path / "plain" / "config.json").exists()


@pytest.mark.parametrize("bad", ["a.b", "-x", "x" * 65, "a b"])
def test_a_role_that_cannot_be_a_file_name_part_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="role"):
        load_config({"role": bad}, environ={})


def test_role_comes_from_the_environment() -> None:
    assert load_config(environ={"OTEL_TRAIN_ROLE": "generation"}).role == "generation"
    assert load_config(environ={}).role == ""


def _init_with_role(rank: int, world_size: int, out: str) -> str:
    """Rank 0 is a policy worker; rank 1 says it is a generation worker, in the same group."""
    try:
        ot.init(role="policy" if rank == 0 else "generation", output_dir=out, run_name="mixed", verbosity=0,
                prometheus_port=0, hardware=False)  # fmt: skip
    except ConfigError as exc:
        return f"refused: {exc}"
    ot.shutdown()
    return "started"


def test_one_process_group_never_mixes_two_roles(tmp_path: Path) -> None:
    """Ranks are compared (straggler exchange) only within one role: a torch process group whose
    ranks name different roles is refused, on every rank at once (naming the rank that differs)."""
    from helpers.multirank import run_ranks

    results = run_ranks(2, _init_with_role, (str(tmp_path),), timeout=90)
    assert results[0].startswith("refused: role: rank 1 of this process group name another role")
    assert results[1].startswith("refused: role: rank 1 has role 'generation'")


def test_each_role_gets_its_own_wandb_run_grouped_under_the_run(tmp_path: Path) -> None:
    from otel_train.core.assemble import RunPlace, bridge_specs
    from otel_train.distributed import Identity

    def wandb_args(role: str) -> dict:
        place = RunPlace(Identity("job7", role=role), None, "sft", True, tmp_path, False, None, True)
        [(_, _, args)] = bridge_specs(load_config({"wandb": True}), place)
        return args

    controller, policy, plain = wandb_args("controller"), wandb_args("policy"), wandb_args("")
    assert (controller["run_id"], policy["run_id"], plain["run_id"]) == (
        "job7-controller",
        "job7-policy",
        "job7",
    )
    assert controller["run_name"] == "sft-controller" and controller["group"] == policy["group"] == "sft"
    assert plain["run_name"] == "sft" and plain["group"] is None
    # the run-info file each W&B run writes is the role's own
    assert (
        RunFiles(tmp_path, role="policy").wandb_run_info
        != RunFiles(tmp_path, role="controller").wandb_run_info
    )
