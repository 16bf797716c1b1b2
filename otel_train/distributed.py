"""Rank identity, run id agreement and the dedicated telemetry process group.

Every rank calls these at init, in the same order (`new_group` is collective); the wiring:
docs/design/core.md#distributed.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger("otel_train")

# Where the run id came from. "agreed" = taken from rank 0 through the telemetry group.
RunIdSource = str  # explicit | env | torchelastic | slurm | pbs | lsf | generated | agreed

NODE_UNKNOWN = -1  # Identity.node_rank when no launcher names the node and the job spans several hosts
RUN_ID_MAX_BYTES = 255  # run id and run name each travel in at most this many UTF-8 bytes


@dataclass(frozen=True)
class Identity:
    run_id: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # The launcher's node rank (GROUP_RANK, NODE_RANK, SLURM_NODEID); NODE_UNKNOWN when none gives
    # it on a job of several hosts: each rank knows only its own host's shape, so the node is then
    # decided from every rank's host at init (`crossrank.shape.node_ranks`).
    node_rank: int = 0
    host: str = ""
    run_id_source: RunIdSource = "generated"
    role: str = ""  # empty: no role (the identity is run id and rank alone)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def instance_id(self) -> str:
        return f"{self.run_id}-{self.role}-rank{self.rank}" if self.role else f"{self.run_id}-rank{self.rank}"


@dataclass(frozen=True)
class RunInfo:
    """What `ot.run_info()` tells an adapter or a user about the running session."""

    run_id: str
    run_name: str
    run_dir: str | None  # None when the run directory is off
    rank: int
    local_rank: int
    world_size: int
    step: int  # the last completed step (-1 before the first)
    role: str = ""  # the role setting (empty: none)
    # What other processes need to join this run (otel_train.integrations.ray.runtime_env); OTLP
    # headers are left out on purpose (they may hold secrets).
    output_dir: str = ""
    service_name: str = ""
    otlp_endpoint: str | None = None
    otlp_metrics_endpoint: str | None = None
    otlp_traces_endpoint: str | None = None
    otlp_logs_endpoint: str | None = None
    # The timing_log_level setting as the user gave it (None: unset), so an adapter whose framework
    # has its own timer level (Megatron's Timers) knows whether the user chose otel_train's.
    timing_log_level: int | None = None
    # The step begun and not yet ended (None outside a step), so an adapter can tell the user's own
    # ot.step from its own and file a framework's logged values where they belong.
    open_step: int | None = None
    # The tracker bridges on ("tensorboard", "wandb", "mlflow"), so an adapter never opens a
    # framework's own writer for a backend otel_train already feeds.
    bridges: tuple[str, ...] = ()
    # The series tier this rank sends to the metrics store ("full" or "essential"): the
    # rank_series setting resolved at init from rank 0's setting and the world size.
    rank_series: str = "full"


def env_int(raw: str | None) -> int | None:
    """A launcher variable's integer; None for anything else (`str.isdigit` alone takes "²")."""
    return int(raw) if raw is not None and re.fullmatch(r"\s*-?[0-9]+\s*", raw) else None


def _first_int(environ: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int | None:
    """The integer of the first of `names` that holds one, else `default`."""
    for name in names:
        value = env_int(environ.get(name))
        if value is not None:
            return value
    return default


# (rank, world size) as each launcher sets them: torchrun / env://, srun, Open MPI, MPICH's PMI.
_LAUNCHER_RANKS = (
    ("RANK", "WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)
_said: set[str] = set()  # what detect_identity told this process already (said once per process)


def _launcher_rank_world(env: Mapping[str, str]) -> tuple[int, int, str, str]:
    """(rank, world size, their variables, what was ignored and why), from the first launcher whose
    rank variable is set. A rank without its world size, or outside it (an `export RANK=3` left in a
    shell, two launchers mixed), describes no job: ignored, the process is rank 0 of 1."""
    for rank_name, world_name in _LAUNCHER_RANKS:
        rank = env_int(env.get(rank_name))
        if rank is None:
            continue
        world = env_int(env.get(world_name))
        if world is not None and 0 <= rank < world:
            return rank, world, f"{rank_name}={rank}, {world_name}={world}", ""
        given = f"{rank_name}={env[rank_name].strip()}" + (
            f" with {world_name}={env[world_name].strip()}" if world is not None else f" without {world_name}"
        )
        return 0, 1, "", given
    # No rank variable: rank 0, of the world size a launcher gives (an sbatch script's one process)
    return 0, _first_int(env, tuple(world for _, world in _LAUNCHER_RANKS), 1) or 1, "", ""


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning("otel_train: %s", message)


def _explain_rank(rank: int, world: int, source: str, ignored: str) -> None:
    """Say why a process without a process group is not the job's rank 0, or why it is."""
    if ignored:
        _say_once(
            f"{ignored} describes no job and torch.distributed has no process group: this process runs "
            "as a single process, rank 0 (console and bridges on). Unset the leftover variable, or "
            "launch with torchrun / srun / mpirun, which set a rank and its world size together."
        )
    elif rank != 0:
        _say_once(
            f"this process is rank {rank} of {world} ({source}) and torch.distributed has no process "
            "group yet: the console and the TensorBoard / W&B / MLflow bridges are rank 0's, so this "
            f"process shows none (its metrics still go to its own rank-{rank} files and OTLP). If it runs "
            "alone, unset those variables; in a distributed job, call "
            "torch.distributed.init_process_group() before ot.init() (or set bridge_all_ranks=True for "
            "its own bridges)."
        )


def _scheduler_run_id(env: Mapping[str, str]) -> tuple[str, RunIdSource] | None:
    """A run id shared by every rank and stable across restarts, when the launcher gives one."""
    # torchrun sets TORCHELASTIC_RUN_ID="none" unless --rdzv-id is given: treat that as absent.
    candidates = {"OTEL_TRAIN_RUN_ID": "env", "TORCHELASTIC_RUN_ID": "torchelastic", "SLURM_JOB_ID": "slurm",
                  "PBS_JOBID": "pbs", "LSB_JOBID": "lsf"}  # fmt: skip
    for name, source in candidates.items():
        value = (env.get(name) or "").strip()
        if value and value.lower() != "none":
            # as a run_id setting must be (it names files and series): `--rdzv-id` is free text
            return re.sub(r"[^A-Za-z0-9_.:-]", "_", value)[:128].lstrip("_.:-") or "job", source
    return None


def _process_group_rank_world() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist
    except ImportError:  # no torch: the environment says
        return None
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return None


def process_group_initialized() -> bool:
    return _process_group_rank_world() is not None


def detect_identity(run_id: str | None, environ: Mapping[str, str] | None = None, role: str = "") -> Identity:
    """Rank identity from torchrun / SLURM / Open MPI / PMI variables, or from an initialized process
    group (only when `environ` is None). Without a group, what `_launcher_rank_world` ignores is said
    once, as is a non-zero rank's missing console.

    The run id: an explicit `run_id`, then OTEL_TRAIN_RUN_ID, a scheduler id, else a fresh uuid (per
    rank until `agree_job` replaces it with rank 0's).
    """
    env = os.environ if environ is None else environ
    local_names = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    local_rank = _first_int(env, local_names, 0) or 0
    rank, world, source, ignored = _launcher_rank_world(env)
    pg = _process_group_rank_world() if environ is None else None
    if pg is not None:
        rank, world = pg
    else:
        _explain_rank(rank, world, source, ignored)
    local_world = _first_int(env, ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"), None)
    node = _first_int(env, ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"), None)
    if node is None:
        # rank // LOCAL_WORLD_SIZE would need every host to run as many ranks as this one: on a
        # 1-rank and a 3-rank host it puts the second host's ranks on nodes 0, 0 and 1.
        one_host = world <= 1 or (local_world is not None and local_world >= world)
        node = 0 if one_host else NODE_UNKNOWN
    if run_id:
        job, source = run_id, "explicit"
    else:
        found = _scheduler_run_id(env)
        job, source = found if found is not None else (uuid.uuid4().hex[:12], "generated")
    return Identity(str(job), rank, local_rank, max(world, 1), node, socket.gethostname(), source, role)


def create_telemetry_group(
    identity: Identity, timeout_s: float, ranks: list[int] | None = None
) -> Any | None:
    """The dedicated gloo group the telemetry exchange runs on (never the training's default group).

    Collective: every rank calls it, in the same order relative to other `new_group` calls. None
    when not distributed or when it fails (logged; cross-rank telemetry off on this rank). `ranks`:
    a group among these global ranks only (after a peer died), and only they call it.
    """
    if _process_group_rank_world() is None or not identity.distributed:
        return None
    import torch.distributed as dist

    try:
        timeout = datetime.timedelta(seconds=float(timeout_s))
        if ranks is not None:
            return dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        return dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, ValueError) as exc:  # torch.distributed's errors: no gloo, a peer gone
        logger.warning(
            "otel_train: cannot create the gloo telemetry group (%s); cross-rank stats are off", exc
        )
        return None


@dataclass(frozen=True)
class Agreement:
    """What every rank takes from rank 0 at init (`agree_job`)."""

    identity: Identity
    run_name: str
    log_interval: int | None  # rank 0's (None: adaptive) in lockstep; else this rank's own
    cross_rank: bool  # rank 0's
    differs: tuple[str, ...] = ()  # the settings this rank asked for differently from rank 0


def agree_job(
    identity: Identity, group: Any | None, run_name: str, log_interval: int | None, cross_rank: bool = True
) -> Agreement:
    """Every rank adopts rank 0's run id, run name, cross_rank and (in lockstep) log_interval, in
    one broadcast at init: one run directory per job, and lockstep ranks flush at the same steps
    (each flush's exchange pairs the same steps on every rank).

    With a `group` it always broadcasts, whatever the environment says, so ranks never disagree on
    whether to communicate; without one the inputs come back unchanged. A failure keeps the local
    values (warned).
    """
    local = Agreement(identity, run_name, log_interval, cross_rank)
    if group is None or not identity.distributed:
        return local
    cadence = "" if log_interval is None else str(log_interval)
    # The role travels too: ranks are compared only within one role, so a process group whose
    # ranks name different roles is refused at init (agree_run_place raises on "role" in differs).
    texts = (identity.run_id, run_name, cadence, "1" if cross_rank else "0", identity.role)
    fields = _broadcast_texts(group, identity.rank, texts)
    if fields is None:
        return local
    agreed_id, agreed_name, agreed_cadence, agreed_cross, agreed_role = fields
    lockstep = agreed_cross == "1"
    interval = (int(agreed_cadence) if agreed_cadence.isdigit() else None) if lockstep else log_interval
    checks = (
        ("role", agreed_role == identity.role),
        ("cross_rank", lockstep == cross_rank),
        ("log_interval", interval == log_interval),
    )
    differs = tuple(name for name, same in checks if not same)
    if agreed_id and identity.rank != 0 and agreed_id != identity.run_id:
        identity = replace(identity, run_id=agreed_id, run_id_source="agreed")
    return Agreement(identity, agreed_name or run_name, interval, lockstep, differs)


def _broadcast_texts(group: Any, rank: int, texts: tuple[str, ...]) -> list[str] | None:
    """Rank 0's `texts` on every rank (each cut to RUN_ID_MAX_BYTES UTF-8 bytes): one broadcast.
    None when it failed (logged)."""
    import torch
    import torch.distributed as dist

    width = RUN_ID_MAX_BYTES + 1  # a length byte, then the bytes
    buf = torch.zeros(len(texts) * width, dtype=torch.uint8)
    if rank == 0:
        for index, text in enumerate(texts):
            raw = text.encode("utf-8")[:RUN_ID_MAX_BYTES]
            buf[index * width] = len(raw)
            if raw:
                at = index * width + 1
                buf[at : at + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    try:
        dist.broadcast(buf, src=0, group=group)
    except RuntimeError as exc:  # torch.distributed's errors (a timeout, a peer gone)
        logger.warning(
            "otel_train: run agreement with rank 0 failed (%s); this rank keeps its own run id, run name "
            "and log_interval",
            exc,
        )
        return None
    return [
        bytes(buf[at + 1 : at + 1 + int(buf[at])].tolist()).decode("utf-8", errors="replace")
        for at in range(0, len(texts) * width, width)
    ]
