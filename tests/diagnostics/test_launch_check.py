"""The launch doctor (launch_check.py): inconsistent launcher variables, a missing process group,
two local ranks on one GPU — found at init() and reported as `launch_config` events naming the ranks,
recorded in env.json. Unit cases per check, one process without a group, and real gloo ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers.events import run_events
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train.diagnostics.launch_check import RankFacts, find_problems


def _facts(rank: int, world: int = 2, local: int | None = None, host: str = "h0", gpu: str | None = None,
           pg: bool = True, **env: str) -> RankFacts:  # fmt: skip
    base = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank if local is None else local)}
    return RankFacts(rank, world, rank if local is None else local, host, gpu, pg, {**base, **env})


def _checks(facts: list[RankFacts]) -> list[tuple[str, tuple[int, ...]]]:
    return [(p.check, p.ranks) for p in find_problems(facts)]


def test_a_consistent_launch_has_no_problem() -> None:
    facts = [_facts(r, 4, local=r % 2, host=f"h{r // 2}", gpu=f"GPU-{r % 2}-{r // 2}", LOCAL_WORLD_SIZE="2")
             for r in range(4)]  # fmt: skip
    assert _checks(facts) == []


def test_world_size_and_rank_disagreeing_with_the_process_group() -> None:
    assert _checks([_facts(0, WORLD_SIZE="4"), _facts(1, WORLD_SIZE="4")]) == [
        ("world_size", (0,)), ("world_size", (1,))
    ]  # fmt: skip
    assert _checks([_facts(0), _facts(1, RANK="0")]) == [("rank", (1,))]


def test_no_process_group_with_a_world_size_above_one() -> None:
    [problem] = find_problems([_facts(0, pg=False)])
    assert problem.check == "no_process_group" and "init_process_group" in problem.message


def test_srun_numbering_that_is_not_the_groups() -> None:
    facts = [RankFacts(r, 2, 0, f"h{r}", None, True, {"SLURM_NTASKS": "2", "SLURM_PROCID": str(1 - r)})
             for r in range(2)]  # fmt: skip
    assert _checks(facts) == [("slurm_rank", (0,)), ("slurm_rank", (1,))]


def test_launcher_values_that_are_no_integers_are_not_checked() -> None:
    # "²".isdigit() is True and int("²") raises; the doctor runs inside init() and must not
    facts = [_facts(0, WORLD_SIZE="²", SLURM_NTASKS="--2", LOCAL_WORLD_SIZE="²"), _facts(1, RANK="²")]
    assert _checks(facts) == []


def test_per_host_checks_duplicates_local_world_size_and_shared_gpus() -> None:
    facts = [_facts(0, 3, local=0, gpu="GPU-a", LOCAL_WORLD_SIZE="2"),
             _facts(1, 3, local=0, gpu="GPU-a", LOCAL_WORLD_SIZE="2"),
             _facts(2, 3, local=2, gpu="GPU-c", LOCAL_WORLD_SIZE="2")]  # fmt: skip
    assert _checks(facts) == [
        ("duplicate_local_rank", (0, 1)), ("local_world_size", (0, 1, 2)), ("shared_gpu", (0, 1))
    ]  # fmt: skip
    # the same GPU UUID on two hosts is two GPUs' worth of nothing: not a problem
    other_host = [_facts(0, gpu="GPU-a", host="h0", local=0), _facts(1, gpu="GPU-a", host="h1", local=0)]
    assert _checks(other_host) == []


def _run_dir(output_dir: Path) -> Path:
    (run_dir,) = [p for p in output_dir.iterdir() if p.is_dir()]
    return run_dir


def test_a_process_without_its_process_group_is_told_at_init(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ot.init(prometheus_port=0, verbosity=0, hardware=False, collective_timeout_s=5)
    ot.shutdown()
    run_dir = _run_dir(tmp_path / "runs")
    [event] = run_events(run_dir, event="launch_config")
    assert event["check"] == "no_process_group" and event["ranks"] == "0"
    launch = json.loads((run_dir / "env.json").read_text())["launch"]
    assert [p["check"] for p in launch["problems"]] == ["no_process_group"]
    assert launch["ranks"][0]["env"]["WORLD_SIZE"] == "2"


def _launch_rank(rank: int, world: int, output_dir: str, stale_world: str | None, one_gpu: bool) -> dict:
    if stale_world is not None:  # a wrapper script exported its own WORLD_SIZE after the group formed
        os.environ["WORLD_SIZE"] = stale_world
    if one_gpu:  # two GPUs on the node, but CUDA_VISIBLE_DEVICES shows each rank only the first
        from helpers.fake_nvml import FakeGpu, FakeNvml, gpu_uuid

        sys.modules["pynvml"] = FakeNvml([FakeGpu(uuid=gpu_uuid(0)), FakeGpu(uuid=gpu_uuid(1))])  # type: ignore[assignment]
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    os.environ["OTEL_TRAIN_OUTPUT_DIR"] = output_dir
    ot.init(prometheus_port=0, verbosity=0, hardware=one_gpu, hardware_interval_s=60, run_name="launch")
    for step in range(3):
        with ot.step(step):
            pass
    ot.shutdown()
    run_dir = Path(output_dir) / "launch"
    env = json.loads((run_dir / "env.json").read_text()) if rank == 0 else {}
    return {"events": run_events(run_dir, rank, event="launch_config"),
            "launch": env.get("launch")}  # fmt: skip


@pytest.mark.multirank
def test_ranks_with_a_stale_world_size_are_named(tmp_path: Path) -> None:
    results = run_ranks(2, _launch_rank, (str(tmp_path), "4", False), timeout=120)
    assert results[1]["events"] == []  # rank 0 reports for the job
    checks = sorted((e["check"], e["ranks"]) for e in results[0]["events"])
    assert checks == [("world_size", "0"), ("world_size", "1")]
    assert "WORLD_SIZE=4" in results[0]["events"][0]["message"]
    assert results[0]["launch"]["checked_ranks"] == 2


@pytest.mark.multirank
def test_two_local_ranks_on_one_gpu_are_named(tmp_path: Path) -> None:
    results = run_ranks(2, _launch_rank, (str(tmp_path), None, True), timeout=120)
    [event] = results[0]["events"]
    assert (event["check"], event["ranks"]) == ("shared_gpu", "0,1")
    assert "GPU-00000000" in event["message"]


@pytest.mark.multirank
def test_a_clean_launch_reports_nothing(tmp_path: Path) -> None:
    results = run_ranks(2, _launch_rank, (str(tmp_path), None, False), timeout=120)
    assert results[0]["events"] == [] and results[1]["events"] == []
    assert results[0]["launch"]["problems"] == []
    assert [r["rank"] for r in results[0]["launch"]["ranks"]] == [0, 1]
