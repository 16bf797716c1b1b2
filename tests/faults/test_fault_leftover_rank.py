"""Launcher variables without a process group (issue #48): a rank variable that describes no job
(`RANK=3` alone, a rank past its world size) is ignored and said once, the process keeping its
console and TensorBoard as rank 0; a launcher's consistent rank and world size (srun, mpirun,
whose process group may start after `ot.init()`) are kept, and a non-zero rank says at init why it
shows no console or TensorBoard and how to change that."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers.readback import read_tensorboard

import otel_train as ot
from otel_train import distributed

LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "SLURM_PROCID",
    "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
    "PMI_SIZE", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_said", set(), raising=False)  # what this process was told, per test
    return monkeypatch


def _train(tmp_path: Path, steps: int = 6) -> tuple[int, int, Path]:
    ot.init(output_dir=str(tmp_path), run_name="r", prometheus_port=0, verbosity=1, hardware=False,
            log_interval=2, tensorboard=True)  # fmt: skip
    info = ot.run_info()
    assert info is not None and info.run_dir is not None
    for i in range(steps):
        with ot.step(i):
            ot.record("loss", 1.0 / (i + 1))
    ot.shutdown()
    return info.rank, info.world_size, Path(info.run_dir)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"RANK": "3"}, "RANK=3 without WORLD_SIZE"),  # an `export RANK=3` left in the shell
        ({"RANK": "5", "WORLD_SIZE": "4"}, "RANK=5 with WORLD_SIZE=4"),  # past its world size
    ],
)
def test_a_rank_that_describes_no_job_runs_as_rank_0_with_console_and_tensorboard(
    tmp_path, launcher_env, capfd, caplog, env, said
) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    for name, value in env.items():
        launcher_env.setenv(name, value)
    rank, world, run_dir = _train(tmp_path)
    out, _ = capfd.readouterr()
    assert (rank, world) == (0, 1)
    assert (run_dir / "metrics.rank0.jsonl").is_file()
    assert "loss" in out  # the console's lines and final table
    scalars = read_tensorboard(run_dir / "tensorboard").scalars
    assert any("loss" in tag for tag in scalars), sorted(scalars)
    (message,) = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert "single process, rank 0" in message and "Unset" in message
    caplog.clear()
    _train(tmp_path / "again")  # said once per process
    assert not [r for r in caplog.records if said in r.getMessage()]


@pytest.mark.parametrize(
    ("env", "rank", "world", "source"),
    [
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, 2, 4, "SLURM_PROCID=2, SLURM_NTASKS=4"),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, 1, 2, "OMPI_COMM_WORLD_RANK=1"),
    ],
)
def test_a_launchers_nonzero_rank_says_at_init_why_it_shows_no_console(
    tmp_path, launcher_env, capfd, caplog, env, rank, world, source
) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    for name, value in env.items():
        launcher_env.setenv(name, value)
    got_rank, got_world, run_dir = _train(tmp_path)
    out, _ = capfd.readouterr()
    # kept: srun / mpirun start every rank, and a process group may start after ot.init()
    assert (got_rank, got_world) == (rank, world)
    assert (run_dir / f"metrics.rank{rank}.jsonl").is_file()
    assert "loss" not in out and not (run_dir / "tensorboard").exists()  # rank 0's, as the message says
    (message,) = [r.getMessage() for r in caplog.records if f"rank {rank} of {world}" in r.getMessage()]
    assert source in message and "TensorBoard" in message and "console" in message
    assert "init_process_group() before ot.init()" in message and "unset those variables" in message


def test_consistent_launcher_variables_still_give_the_rank() -> None:
    # torchrun's set, read without a process group (ot.init() before init_process_group())
    ident = distributed.detect_identity(None, environ={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (ident.rank, ident.world_size, ident.local_rank) == (3, 4, 1)
    # an sbatch script's single process: rank 0 of the allocation's tasks, as before
    ident = distributed.detect_identity(None, environ={"SLURM_NTASKS": "4"})
    assert (ident.rank, ident.world_size) == (0, 4)
    # torchrun inside an srun step: torchrun's variables win over SLURM's
    env = {"RANK": "5", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert distributed.detect_identity(None, environ=env).rank == 5
