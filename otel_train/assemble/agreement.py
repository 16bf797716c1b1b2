"""What every rank of a process group decides together at init, from facts each rank reports in
one all_gather: a refusal anywhere is every rank's, and the exchange's shape.
Design: docs/design/core.md#agreement.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from otel_train.config import ConfigError
from otel_train.crossrank import ExchangeShape, decide_shape, node_key
from otel_train.distributed import (
    Identity,
    create_telemetry_group,
    detect_identity,
    process_group_initialized,
)

logger = logging.getLogger("otel_train")

REASON_BYTES = 240  # a refusal's message travels in at most this many UTF-8 bytes
_REFUSED, _FANIN, _NODE, _ROLE, _REASON_LEN, _RANK_SERIES = range(6)  # int64 fields, then the reason's bytes
_INTS = 6
RANK_SERIES_CODES = ("auto", "full", "essential")  # Config.rank_series as it travels in the row
ROW_LEN = _INTS * 8 + REASON_BYTES


@dataclass(frozen=True)
class JobFacts:
    """Every rank's reported facts, by rank, and what they decide."""

    fanins: tuple[int, ...]
    roles: tuple[int, ...]  # role fingerprints (`_role_key`)
    refusals: tuple[tuple[int, str], ...]  # (rank, its message), for each rank that refused
    shape: ExchangeShape
    rank_series: tuple[str, ...] = ()  # the rank_series setting each rank asked for (rank 0's wins)


def gather_job_facts(
    group: Any, identity: Identity, fanin: int, refusal: str | None = None, rank_series: str = "auto"
) -> JobFacts | None:
    """Every rank's facts on every rank (one all_gather on the telemetry group); None when it
    failed (logged: this rank then keeps to itself, as when the group could not be made)."""
    import torch
    import torch.distributed as dist

    reason = (refusal or "").encode("utf-8")[:REASON_BYTES]
    ints = [int(refusal is not None), fanin, node_key(identity.host, identity.node_rank)]
    ints += [_role_key(identity.role), len(reason), RANK_SERIES_CODES.index(rank_series)]
    mine = torch.zeros(ROW_LEN, dtype=torch.uint8)
    mine[: _INTS * 8] = torch.tensor(ints, dtype=torch.int64).view(torch.uint8)
    if reason:
        mine[_INTS * 8 : _INTS * 8 + len(reason)] = torch.frombuffer(bytearray(reason), dtype=torch.uint8)
    rows = [torch.zeros(ROW_LEN, dtype=torch.uint8) for _ in range(identity.world_size)]
    try:
        dist.all_gather(rows, mine, group=group)
    except RuntimeError as exc:  # torch.distributed's errors (a timeout, a peer gone)
        logger.warning("otel_train: the ranks could not agree at init (%s); this rank keeps to itself", exc)
        return None
    fields = [row[: _INTS * 8].view(torch.int64).tolist() for row in rows]
    refusals = tuple(
        (rank, bytes(rows[rank][_INTS * 8 : _INTS * 8 + f[_REASON_LEN]].tolist()).decode("utf-8", "replace"))
        for rank, f in enumerate(fields)
        if f[_REFUSED]
    )
    fanins = tuple(f[_FANIN] for f in fields)
    shape = decide_shape(fanins, [f[_NODE] for f in fields])
    tiers = tuple(RANK_SERIES_CODES[f[_RANK_SERIES]] for f in fields)
    return JobFacts(fanins, tuple(f[_ROLE] for f in fields), refusals, shape, tiers)


def refuse_if_any(facts: JobFacts, identity: Identity) -> None:
    """Raise ConfigError on every rank when any rank refused or names another role than rank 0."""
    others = [(rank, reason) for rank, reason in facts.refusals if rank != identity.rank]
    if len(others) < len(facts.refusals):
        return  # this rank refused itself: its caller raises its own error
    if others:
        rank, reason = others[0]
        more = f" (and rank(s) {[r for r, _ in others[1:]]})" if len(others) > 1 else ""
        raise ConfigError(
            f"rank {rank} of this process group refused ot.init(){more}: {reason}. Every rank refuses "
            f"with it (the ranks of one process group are one job): fix the setting on rank {rank}."
        )
    differ = [rank for rank, role in enumerate(facts.roles) if role != facts.roles[0]]
    if not differ:
        return
    if identity.rank in differ:
        raise ConfigError(
            f"role: rank {identity.rank} has role {identity.role!r} but rank 0 of its process group "
            "another; ranks are compared only within one role, so one torch process group holds one "
            "role. Give every rank of the group the same OTEL_TRAIN_ROLE (each role with its own "
            "process group)."
        )
    who = f"rank {differ[0]}" if len(differ) == 1 else f"ranks {', '.join(str(r) for r in differ)}"
    raise ConfigError(
        f"role: {who} of this process group name another role than rank 0; ranks are "
        "compared only within one role, so one torch process group holds one role and every rank "
        "refuses. Give every rank of the group the same OTEL_TRAIN_ROLE (each role with its own "
        "process group)."
    )


def refuse_together(reason: str, collective_timeout_s: float = 60.0) -> None:
    """This rank refuses ot.init() (`reason`: its ConfigError): where it is one rank of a process
    group, it joins the telemetry group and the facts gather first, so that every other rank
    refuses with it at once. The caller raises its own error after this."""
    if not process_group_initialized():
        return
    identity = detect_identity(None)
    if not identity.distributed:
        return
    group = create_telemetry_group(identity, collective_timeout_s)
    if group is not None:
        gather_job_facts(group, identity, 0, reason)


def _role_key(role: str) -> int:
    return int.from_bytes(hashlib.blake2b(role.encode(), digest_size=8).digest(), "little", signed=True)
