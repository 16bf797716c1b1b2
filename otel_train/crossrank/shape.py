"""The exchange's shape, decided once for the whole job: the fan-in and where the nodes begin.

Every rank computes the same shape from the same gathered facts, never from its own environment,
because the shape sets every message's size. Design: docs/design/crossrank.md#shape.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from otel_train.crossrank.exchange import StarExchange
from otel_train.crossrank.tree_exchange import TreeExchange, exchange_for
from otel_train.distributed import Identity, create_telemetry_group

logger = logging.getLogger("otel_train")


@dataclass(frozen=True)
class ExchangeShape:
    """The job's exchange settings, the same on every rank: `fanin` (rank 0's) and `nodes` (the
    first rank of each node, ascending; () when every rank is on one node or nothing is known)."""

    fanin: int
    nodes: tuple[int, ...] = ()


def node_key(host: str, node_rank: int) -> int:
    """A rank's node as a signed 64-bit number (the same in every process: not Python's hash).
    A node rank no launcher gave (`distributed.NODE_UNKNOWN`) leaves the host alone to say it."""
    digest = hashlib.blake2b(f"{host}\0{node_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def decide(fanins: Sequence[int], keys: Sequence[int]) -> ExchangeShape:
    """The shape from every rank's facts, by rank (module doc)."""
    starts = tuple(rank for rank in range(1, len(keys)) if keys[rank] != keys[rank - 1])
    return ExchangeShape(int(fanins[0]) if fanins else 16, starts)


def node_ranks(keys: Sequence[int]) -> list[int]:
    """Each rank's node rank from every rank's `node_key`, by rank: its node's place among the
    job's nodes in the order of their lowest rank (how a launcher numbers them)."""
    first = {key: node for node, key in enumerate(dict.fromkeys(keys))}
    return [first[key] for key in keys]


def agree(group: Any, world: int, fanin: int, key: int) -> ExchangeShape:
    """Every rank's (fan-in, node key) on every rank (one all_gather on `group`), decided. Raises
    when the gather fails (the caller turns the exchange off: no shape, no exchange)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([fanin, key], dtype=torch.int64)
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return decide([int(t[0]) for t in gathered], [int(t[1]) for t in gathered])


def telemetry_group(
    identity: Identity, group: Any | None, exchange: bool, timeout_s: float
) -> tuple[Any | None, int]:
    """The group a reducer exchanges on (`group`, or a new one when none was given and the job is
    distributed; None when `exchange` is off) and this rank's world on it."""
    if exchange and group is None and identity.distributed:
        group = create_telemetry_group(identity, timeout_s)
    if not exchange or group is None:
        return None, identity.world_size
    import torch.distributed as dist

    return group, int(dist.get_world_size(group))


def shaped_exchange(
    group: Any | None,
    identity: Identity,
    world: int,
    timeout_s: float,
    grace_s: float,
    fanin: int,
    shape: ExchangeShape | None,
) -> tuple[StarExchange | TreeExchange, int, str | None]:
    """The exchange of the job's shape (`shape`, agreed at init; None: agreed here, on `group`),
    the fan-in it uses, and why it cannot run (None: it can)."""
    failed = None
    if shape is None and group is not None and world > 1:
        try:
            shape = agree(group, world, fanin, node_key(identity.host, identity.node_rank))
        except Exception as exc:  # a peer gone at init: never guess a shape a peer may not share
            failed = f"the ranks could not agree on the exchange's shape ({exc})"
    shape = shape or ExchangeShape(fanin)
    built = exchange_for(group, identity.rank, world, timeout_s, grace_s, shape.fanin, shape.nodes)
    return built, shape.fanin, failed
