"""Rank identity, run id agreement and the dedicated telemetry process group.

Cross-rank reductions and straggler scoring live in `otel_train.straggler` (`CrossRankReducer`).

Wiring (every rank calls this at init, in the same order, because `new_group` is collective)::

    identity = detect_identity(config.run_id)
    group = create_telemetry_group(identity, config.collective_timeout_s)   # None when not distributed
    identity, run_name = agree_run(identity, group, run_name)               # one broadcast at init
    reducer = CrossRankReducer(identity, meter, events, config, group=group)
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger("otel_train")

# Where the run id came from. "agreed" = taken from rank 0 through the telemetry group.
RunIdSource = str  # explicit | env | torchelastic | slurm | pbs | lsf | generated | agreed

RUN_ID_MAX_BYTES = 255  # run id and run name each travel in at most this many UTF-8 bytes


@dataclass(frozen=True)
class Identity:
    run_id: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node_rank: int = 0
    host: str = ""
    run_id_source: RunIdSource = "generated"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def instance_id(self) -> str:
        return f"{self.run_id}-rank{self.rank}"


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


def _first_int(environ: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        raw = environ.get(name)
        if raw is not None and raw.strip().lstrip("-").isdigit():
            return int(raw)
    return default


def _scheduler_run_id(env: Mapping[str, str]) -> tuple[str, RunIdSource] | None:
    """A run id shared by every rank and stable across restarts, when the launcher gives one."""
    candidates: tuple[tuple[str, RunIdSource], ...] = (
        ("OTEL_TRAIN_RUN_ID", "env"),
        # torchrun sets TORCHELASTIC_RUN_ID="none" unless --rdzv-id is given: treat that as absent.
        ("TORCHELASTIC_RUN_ID", "torchelastic"),
        ("SLURM_JOB_ID", "slurm"),
        ("PBS_JOBID", "pbs"),
        ("LSB_JOBID", "lsf"),
    )
    for name, source in candidates:
        value = (env.get(name) or "").strip()
        if value and value.lower() != "none":
            return value, source
    return None


def _process_group_rank_world() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # torch missing or broken: fall back to the environment
        return None
    return None


def process_group_initialized() -> bool:
    """Is there an initialised torch.distributed process group (torch imported only if loaded)?"""
    return _process_group_rank_world() is not None


def detect_identity(
    run_id: str | None,
    environ: Mapping[str, str] | None = None,
    use_process_group: bool | None = None,
) -> Identity:
    """Rank identity from torchrun / SLURM / Open MPI / PMI variables or an initialized process group.

    An explicit `run_id` wins, then OTEL_TRAIN_RUN_ID, a scheduler id (TORCHELASTIC_RUN_ID unless
    "none", SLURM_JOB_ID, PBS_JOBID, LSB_JOBID), else a fresh uuid (which differs per rank until
    `agree_run_id` replaces it with rank 0's). Rank and world size come from an initialized
    `torch.distributed` process group when there is one (default: only when `environ` is None).
    """
    env = os.environ if environ is None else environ
    rank = _first_int(env, ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"), 0) or 0
    local_rank = (
        _first_int(env, ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"), 0)
        or 0
    )
    world = _first_int(env, ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), 1) or 1
    if use_process_group if use_process_group is not None else environ is None:
        pg = _process_group_rank_world()
        if pg is not None:
            rank, world = pg
    local_world = _first_int(env, ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"), None)
    node = _first_int(env, ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"), None)
    if node is None:
        node = rank // local_world if local_world and local_world > 0 else 0
    if run_id:
        job, source = run_id, "explicit"
    else:
        found = _scheduler_run_id(env)
        job, source = found if found is not None else (uuid.uuid4().hex[:12], "generated")
    return Identity(str(job), rank, local_rank, max(world, 1), node, socket.gethostname(), source)


def create_telemetry_group(identity: Identity, timeout_s: float) -> Any | None:
    """The dedicated gloo group the telemetry exchange runs on (never the training's default group).

    Collective: every rank must call it, in the same order relative to other `new_group` calls
    (otel_train calls it once, from `init()`). Returns None when not distributed or when the group
    cannot be created (logged; cross-rank telemetry is then off on this rank).
    """
    if _process_group_rank_world() is None or not identity.distributed:
        return None
    import torch.distributed as dist

    try:
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=float(timeout_s)))
    except Exception as exc:
        logger.warning(
            "otel_train: cannot create the gloo telemetry group (%s); cross-rank stats are off", exc
        )
        return None


def agree_run_id(identity: Identity, group: Any | None) -> Identity:
    """Every rank adopts rank 0's run id (see `agree_run`, which also agrees the run name)."""
    return agree_run(identity, group, "")[0]


def agree_run(identity: Identity, group: Any | None, run_name: str) -> tuple[Identity, str]:
    """Every rank adopts rank 0's run id AND run name: one broadcast on the telemetry group at init,
    so every rank of a job writes into one run directory (a generated name differs per process).

    Always broadcasts when `group` is given (every rank issues the same collective whatever its
    environment says), so ranks can never disagree on whether to communicate. Without a group
    (single process, or no process group) the inputs are returned unchanged. A failure (peer gone,
    timeout) keeps the local values and logs a warning.
    """
    if group is None or not identity.distributed:
        return identity, run_name
    import torch
    import torch.distributed as dist

    fields = 2  # run id, run name: each a length byte and up to RUN_ID_MAX_BYTES bytes
    buf = torch.zeros(fields * (RUN_ID_MAX_BYTES + 1), dtype=torch.uint8)
    if identity.rank == 0:
        for index, text in enumerate((identity.run_id, run_name)):
            raw = text.encode("utf-8")[:RUN_ID_MAX_BYTES]
            at = index * (RUN_ID_MAX_BYTES + 1)
            buf[at] = len(raw)
            if raw:
                buf[at + 1 : at + 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    try:
        dist.broadcast(buf, src=0, group=group)
    except Exception as exc:
        logger.warning(
            "otel_train: run id agreement failed (%s); using the local run id %s", exc, identity.run_id
        )
        return identity, run_name
    agreed_id, agreed_name = (
        bytes(buf[at + 1 : at + 1 + int(buf[at])].tolist()).decode("utf-8", errors="replace")
        for at in (0, RUN_ID_MAX_BYTES + 1)
    )
    name = agreed_name or run_name
    if not agreed_id or identity.rank == 0 or agreed_id == identity.run_id:
        return identity, name
    return replace(identity, run_id=agreed_id, run_id_source="agreed"), name
