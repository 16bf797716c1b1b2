"""Rank identity from launcher environments, and run id agreement over a real gloo group."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from helpers.multirank import run_ranks

from otel_train.crossrank import decide_shape, node_key, node_ranks
from otel_train.distributed import NODE_UNKNOWN, Identity, agree_job, detect_identity


def test_single_process_defaults() -> None:
    ident = detect_identity(None, environ={})
    assert (ident.rank, ident.local_rank, ident.world_size, ident.node_rank) == (0, 0, 1, 0)
    assert not ident.distributed and ident.run_id_source == "generated" and len(ident.run_id) == 12
    assert ident.host and ident.instance_id == f"{ident.run_id}-rank0"


def test_torchrun_env() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "GROUP_RANK": "2",
        "TORCHELASTIC_RUN_ID": "job-42",
    }
    ident = detect_identity(None, environ=env)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.node_rank) == (5, 1, 8, 2)
    assert (ident.run_id, ident.run_id_source) == ("job-42", "torchelastic")


def test_torchrun_default_run_id_none_is_absent() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "1"}
    ident = detect_identity(None, environ=env)
    assert ident.run_id != "none" and ident.run_id_source == "generated"
    # No launcher names the node on a job of several hosts: the hosts decide it at init
    assert ident.node_rank == NODE_UNKNOWN


@pytest.mark.parametrize(
    ("given", "run_id"),
    [("../../evil\n", "evil"), ("my job/2024 #3", "my_job_2024__3"), ("x" * 300, "x" * 128), ("///", "job")],
)
def test_a_launchers_run_id_is_made_one_a_run_id_setting_may_be(given: str, run_id: str) -> None:
    """`torchrun --rdzv-id` is free text; the run id names files and series (as the run_id setting's
    own pattern requires): the same text on every rank gives the same id."""
    from otel_train.config import _RUN_NAME

    ident = detect_identity(None, environ={"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": given})
    assert ident.run_id == run_id and re.fullmatch(_RUN_NAME, ident.run_id)


def test_slurm_env() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "777",
    }
    ident = detect_identity(None, environ=env)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.node_rank) == (3, 1, 4, 1)
    assert (ident.run_id, ident.run_id_source) == ("777", "slurm")


def test_open_mpi_env() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    ident = detect_identity(None, environ=env)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.node_rank) == (2, 0, 4, NODE_UNKNOWN)


def test_one_host_needs_no_launcher_node_rank() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert detect_identity(None, environ=env).node_rank == 0


def test_uneven_hosts_without_a_launcher_node_rank_are_one_node_each() -> None:
    # mpirun on a 1-rank and a 3-rank host: each rank's environment gives its own host's shape
    # only, so its node cannot be rank // local size (that splits the 3-rank host in two).
    hosts = [("host0", 1, 0), ("host1", 3, 0), ("host1", 3, 1), ("host1", 3, 2)]
    keys = []
    for rank, (host, local_world, local_rank) in enumerate(hosts):
        env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
               "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_world), "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank)}  # fmt: skip
        ident = replace(detect_identity(None, environ=env), host=host)
        keys.append(node_key(ident.host, ident.node_rank))
    assert decide_shape([16] * 4, keys).nodes == (1,)  # the tree groups ranks 1..3 as one node
    assert node_ranks(keys) == [0, 1, 1, 1]  # the node rank every rank reports once agreed


@pytest.mark.parametrize("bad", ["²", "--1", "3a", ""])
def test_a_launcher_variable_that_is_no_integer_is_passed_over(bad: str) -> None:
    # "²".isdigit() is True and int("²") raises: init must not fail on a launcher's odd value
    env = {"RANK": bad, "WORLD_SIZE": "8", "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "LOCAL_RANK": bad}
    ident = detect_identity(None, environ=env)
    assert (ident.rank, ident.local_rank, ident.world_size) == (2, 0, 4)


def test_precedence_explicit_then_env_then_scheduler() -> None:
    env = {"OTEL_TRAIN_RUN_ID": "mine", "SLURM_JOB_ID": "777"}
    assert detect_identity("given", environ=env).run_id_source == "explicit"
    assert detect_identity(None, environ=env).run_id == "mine"


def test_agree_without_group_is_identity() -> None:
    ident = Identity("abc", rank=1, world_size=2)
    agreed = agree_job(ident, None, "mine", None)
    assert agreed.identity is ident and agreed.run_name == "mine"


def agree_target(rank: int, world: int, env_run_id: str | None) -> dict[str, Any]:
    import os

    from otel_train.distributed import create_telemetry_group

    if env_run_id is None:
        os.environ.pop("TORCHELASTIC_RUN_ID", None)
    else:
        os.environ["TORCHELASTIC_RUN_ID"] = env_run_id
    os.environ.pop("SLURM_JOB_ID", None)
    os.environ.pop("OTEL_TRAIN_RUN_ID", None)
    ident = detect_identity(None)
    group = create_telemetry_group(ident, 10.0)
    # one run per job: every rank adopts rank 0's run name too (generated names differ per process)
    agreed = agree_job(ident, group, f"name-of-rank-{rank}-" + "é" * 200, None)
    return {
        "name": agreed.run_name,
        "before": ident.run_id,
        "after": agreed.identity.run_id,
        "source": agreed.identity.run_id_source,
        "rank": agreed.identity.rank,
    }


@pytest.mark.multirank
@pytest.mark.parametrize("env_run_id", [None, "none", "rdzv-7"])
def test_agree_run_id_over_gloo(env_run_id: str | None) -> None:
    results = run_ranks(4, agree_target, (env_run_id,), timeout=60)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    afters = {r["after"] for r in results}
    assert {r["name"] for r in results} == {
        ("name-of-rank-0-" + "é" * 200).encode()[:255].decode(errors="replace")
    }
    assert afters == {results[0]["before"]}  # everyone has rank 0's id
    if env_run_id == "rdzv-7":
        assert afters == {"rdzv-7"} and {r["source"] for r in results} == {"torchelastic"}
    else:
        assert len({r["before"] for r in results}) == 4  # generated ids differed before agreement
        assert [r["source"] for r in results] == ["generated", "agreed", "agreed", "agreed"]
