"""The launch doctor: at `init()`, is the distributed launch what the process group says it is?
Design: docs/design/diagnostics.md#launch-check.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from otel_train.distributed import Identity, env_int
from otel_train.health import EventChannel

log = logging.getLogger("otel_train")

# Launcher variables whose values say where a rank runs (none is a secret), plus the settings that
# change how NCCL and torch.distributed behave: recorded so a failed run can be compared with a good one.
LAUNCH_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID", "SLURM_PROCID",
    "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_FR_BUFFER_SIZE", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
    "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS",
)  # fmt: skip


@dataclass(frozen=True)
class RankFacts:
    """What one rank knows about its own placement (travels to rank 0 at init)."""

    rank: int  # from the process group when there is one, else the launcher's
    world_size: int  # likewise
    local_rank: int
    host: str
    gpu_uuid: str | None
    process_group: bool  # was torch.distributed initialised when ot.init() ran?
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchProblem:
    check: str  # short id: world_size, rank, local_world_size, duplicate_local_rank, shared_gpu, ...
    ranks: tuple[int, ...]
    message: str  # what is wrong and how to fix it


def local_facts(identity: Identity, gpu_uuid: str | None, process_group: bool) -> RankFacts:
    recorded = {k: os.environ[k] for k in LAUNCH_ENV if k in os.environ}
    placement = (identity.rank, identity.world_size, identity.local_rank, identity.host)
    return RankFacts(*placement, gpu_uuid, process_group, recorded)


def find_problems(facts: Sequence[RankFacts]) -> list[LaunchProblem]:
    """Every inconsistency between the launcher's variables, the process group and the GPUs."""
    problems = [problem for f in facts for problem in _own_problems(f)]
    if len(facts) > 1:
        problems.extend(_host_problems(facts))
    return problems


def _own_problems(f: RankFacts) -> Iterator[LaunchProblem]:
    env_world = env_int(f.env.get("WORLD_SIZE"))
    env_rank = env_int(f.env.get("RANK"))
    if not f.process_group:
        if env_world is not None and env_world > 1:
            yield LaunchProblem(
                "no_process_group",
                (f.rank,),
                f"WORLD_SIZE={env_world} but torch.distributed was not initialised when ot.init() "
                f"ran on rank {f.rank}, so cross-rank telemetry (stragglers, job series, one run "
                "directory) is off. Call torch.distributed.init_process_group() before ot.init() (or "
                "the framework's equivalent); without a process group at all the ranks also train "
                "independently (no gradient sync).",
            )
        return
    if env_world is not None and env_world != f.world_size:
        yield LaunchProblem(
            "world_size",
            (f.rank,),
            f"rank {f.rank}: WORLD_SIZE={env_world} but the process group has {f.world_size} ranks. "
            "A stale or hand-set WORLD_SIZE (a script exporting it, a launcher wrapper) misleads "
            "every library that reads it: let the launcher set it.",
        )
    if env_rank is not None and env_rank != f.rank:
        yield LaunchProblem(
            "rank",
            (f.rank,),
            f"process-group rank {f.rank} runs with RANK={env_rank}: the launcher's variables do "
            "not describe this process (data sharding and checkpoint names that read RANK go wrong).",
        )
    slurm_tasks, slurm_id = env_int(f.env.get("SLURM_NTASKS")), env_int(f.env.get("SLURM_PROCID"))
    # srun starting every rank itself (no torchrun): SLURM's numbering must be the group's.
    if slurm_tasks == f.world_size and slurm_id is not None and slurm_id != f.rank and env_rank is None:
        yield LaunchProblem(
            "slurm_rank",
            (f.rank,),
            f"process-group rank {f.rank} is SLURM task {slurm_id}: pass RANK=$SLURM_PROCID (and "
            "LOCAL_RANK=$SLURM_LOCALID) to the process group, or launch with torchrun.",
        )


def _host_problems(facts: Sequence[RankFacts]) -> Iterator[LaunchProblem]:
    by_host: dict[str, list[RankFacts]] = defaultdict(list)
    for f in facts:
        by_host[f.host].append(f)
    for host, ranks in sorted(by_host.items()):
        names = tuple(sorted(f.rank for f in ranks))
        for local_rank, count in sorted(Counter(f.local_rank for f in ranks).items()):
            if count > 1:
                dup = tuple(sorted(f.rank for f in ranks if f.local_rank == local_rank))
                yield LaunchProblem(
                    "duplicate_local_rank",
                    dup,
                    f"ranks {_list(dup)} on host {host} all have LOCAL_RANK={local_rank}: they pick the "
                    "same GPU and the same per-node files. Let the launcher set LOCAL_RANK "
                    "(torchrun does; under srun use SLURM_LOCALID).",
                )
        declared = {env_int(f.env.get("LOCAL_WORLD_SIZE")) for f in ranks} - {None}
        if declared and declared != {len(ranks)}:
            shown = ", ".join(str(d) for d in sorted(d for d in declared if d is not None))
            yield LaunchProblem(
                "local_world_size",
                names,
                f"host {host} runs {len(ranks)} rank(s) ({_list(names)}) but LOCAL_WORLD_SIZE says "
                f"{shown}: check --nproc-per-node / --ntasks-per-node against the GPUs per node.",
            )
        gpus: dict[str, list[int]] = defaultdict(list)
        for f in ranks:
            if f.gpu_uuid:
                gpus[f.gpu_uuid].append(f.rank)
        for uuid, sharing in sorted(gpus.items()):
            if len(sharing) > 1:
                dup = tuple(sorted(sharing))
                yield LaunchProblem(
                    "shared_gpu",
                    dup,
                    f"ranks {_list(dup)} on host {host} use the same GPU ({uuid}): they compete for its "
                    "memory and compute. Call torch.cuda.set_device(LOCAL_RANK) before creating "
                    "the model, and check CUDA_VISIBLE_DEVICES (one entry per rank, or all GPUs).",
                )


def gather_facts(mine: RankFacts, group: Any | None, world_size: int) -> list[RankFacts] | None:
    """Every rank's facts on every rank (one all_gather_object on the telemetry group at init);
    None when there is no group or the gather failed (logged)."""
    if group is None:
        return None
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    try:
        dist.all_gather_object(gathered, asdict(mine), group=group)
    except RuntimeError as exc:  # torch.distributed's errors (a timeout, a peer gone)
        log.warning("otel_train: the launch check could not gather the ranks' placement (%s)", exc)
        return None
    return [RankFacts(**item) for item in gathered if isinstance(item, dict)]


def check_launch(mine: RankFacts, group: Any | None, events: EventChannel) -> dict[str, Any]:
    """Run the launch doctor (collective when `group` is given: every rank calls it at init).
    Problems become `launch_config` events (on rank 0 when the ranks were gathered, else on this
    process). Returns the report for env.json."""
    gathered = gather_facts(mine, group, mine.world_size)
    facts = gathered if gathered is not None else [mine]
    problems = find_problems(facts)
    if gathered is None or mine.rank == 0:
        for problem in problems:
            events.emit(
                "launch_config",
                problem.message,
                {"check": problem.check, "ranks": ",".join(map(str, problem.ranks))},
            )
    return {
        "checked_ranks": len(facts),
        "problems": [asdict(p) for p in problems],
        "ranks": [asdict(f) for f in facts],
    }


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
