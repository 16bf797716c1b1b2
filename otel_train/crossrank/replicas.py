"""Data-parallel replicas checked against each other: unsharded data (`data_not_sharded`) and
replicas drifting apart (`replica_divergence`), on the one per-flush exchange.
Design: docs/design/crossrank.md#replicas.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.crossrank import zero_partition
from otel_train.crossrank.up_row import floats, name_id
from otel_train.crossrank.wire import BATCH, MAX_FINGERPRINTS, MAX_LAYERS, REPLICAS
from otel_train.crossrank.zero_partition import shown
from otel_train.health import EventChannel

logger = logging.getLogger("otel_train")

# Internal name of ot.watch's batch fingerprint record (never a metric: the worker routes it into
# `Interval.batch_fingerprints`).
FINGERPRINT = "otel_train.batch.fingerprint"
# Largest relative difference of a layer's parameter norm between DDP replicas that is still float
# noise (measured: docs/design/crossrank.md#replicas).
REL_TOL = 1e-4
ALL_RANKS = -1.0  # data-parallel key when no group was named: every rank is a peer
EXT_LEN = REPLICAS.words  # `wire.REPLICAS`; the ZeRO partition facts (zero_partition.py) ride it too
_ZERO = REPLICAS.span("zero")


@dataclass
class ReplicaRow:
    """One rank's block, decoded on rank 0."""

    rank: int
    key: float
    fingerprints: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (weighted sums)
    param_step: int = -1  # -1: no parameter norms in this interval
    labels_id: int = 0
    norms: list[float] = field(default_factory=list)


def encode(interval: Interval, key: float, zero: Sequence[float] | None = None) -> list[float]:
    """This rank's block (the latest fingerprints and parameter norms of the interval, the ZeRO
    facts of the interval or else `zero`, the block's last ZeRO part)."""
    fingerprints = [(s, v) for s, v in interval.batch_fingerprints if len(v) >= 2][-MAX_FINGERPRINTS:]
    block = REPLICAS.new(
        present=1, key=key, n_fingerprints=len(fingerprints), param_step=-1,
        fingerprints=[float(x) for step, values in fingerprints for x in (step, values[0], values[1])],
    )  # fmt: skip
    if interval.layer_param_norms:
        step, labels, norms = interval.layer_param_norms[-1]
        kept = list(norms[:MAX_LAYERS])
        layers = name_id("\x00".join(labels[:MAX_LAYERS]))  # rows compare norms only for the same layers
        REPLICAS.put(block, param_step=step, n_layers=len(kept), labels_id=layers, norms=kept)
    block[_ZERO] = zero_partition.encode(interval, zero)
    return block


def decode(rank: int, block: Sequence[float]) -> ReplicaRow:
    row = ReplicaRow(rank, REPLICAS.get(block, "key"))
    if not REPLICAS.get(block, "present"):
        return row
    for i in range(min(int(REPLICAS.get(block, "n_fingerprints")), MAX_FINGERPRINTS)):
        step, sums = (BATCH.get(block, name, REPLICAS.at("fingerprints", i)) for name in ("step", "sums"))
        row.fingerprints[int(step)] = (sums[0], sums[1])
    row.param_step = int(REPLICAS.get(block, "param_step"))
    if row.param_step >= 0:
        n = min(int(REPLICAS.get(block, "n_layers")), MAX_LAYERS)
        row.labels_id = int(REPLICAS.get(block, "labels_id"))
        row.norms = REPLICAS.get(block, "norms")[:n]
    return row


def duplicate_batches(rows: Sequence[ReplicaRow]) -> tuple[int, dict[tuple[int, ...], int]]:
    """(latest step compared or -1, {ranks with identical batches at one common step: that step})."""
    steps = sorted({s for r in rows for s in r.fingerprints}, reverse=True)
    found: dict[tuple[int, ...], int] = {}
    compared = -1
    for step in steps:
        classes: dict[tuple[float, float], list[int]] = {}
        for row in rows:
            fp = row.fingerprints.get(step)
            if fp is None or not all(math.isfinite(v) for v in fp) or fp[1] == 0.0:
                continue  # an all-zero (or non-finite) batch proves nothing
            classes.setdefault(fp, []).append(row.rank)
        if sum(len(ranks) for ranks in classes.values()) < 2:
            continue
        compared = max(compared, step)
        for ranks in classes.values():
            if len(ranks) > 1:
                found.setdefault(tuple(sorted(ranks)), step)
    return compared, found


def divergence(rows: Sequence[ReplicaRow]) -> tuple[float | None, int | None, list[int]]:
    """(largest relative norm difference, None when no two rows could be compared; first layer
    index above REL_TOL or None; ranks that disagree with the lowest rank there): rows of one group
    at their latest watched step with parameter norms."""
    with_norms = [r for r in rows if r.param_step >= 0]
    if len(with_norms) < 2:
        return None, None, []
    step = max(r.param_step for r in with_norms)
    same = sorted((r for r in with_norms if r.param_step == step), key=lambda r: r.rank)
    ref = same[0]
    peers = [r for r in same[1:] if r.labels_id == ref.labels_id and len(r.norms) == len(ref.norms)]
    if not peers:
        return None, None, []
    worst, first, ranks = 0.0, None, []
    for layer, value in enumerate(ref.norms):
        off: list[int] = []
        for r in peers:
            scale = max(abs(value), abs(r.norms[layer]))
            d = 0.0 if scale == 0.0 else abs(value - r.norms[layer]) / scale
            if math.isfinite(d):  # NaN/Inf norms are nonfinite_grad's business, not a divergence
                worst = max(worst, d)
                if d > REL_TOL:
                    off.append(r.rank)
        if off and first is None:
            first, ranks = layer, [ref.rank, *off]
    return worst, first, ranks


class ReplicaCheck:
    """Encodes this rank's block at every flush; on rank 0, compares every rank's (module doc)."""

    def __init__(self, rank: int, meter: Any | None, events: EventChannel | None) -> None:
        self.rank = rank
        self.events = events
        self.key = ALL_RANKS  # the data-parallel group's lowest global rank, once named
        self._reported_data: set[tuple[int, ...]] = set()
        self._diverged = False
        self._sharded_said = False
        self.max_divergence = 0.0  # rank 0: the largest relative difference seen (tests, tuning)
        self._dup_gauge = self._div_gauge = None
        self.zero = zero_partition.ZeroPartitionCheck(events)
        self._zero_sent: list[float] | None = None  # this rank's last ZeRO facts (sent until new ones)
        if meter is not None and rank == 0:
            self._dup_gauge = semconv.DATA_DUPLICATE_RANKS.create(meter)
            self._div_gauge = semconv.REPLICA_DIVERGENCE.create(meter)

    def set_data_parallel_group(self, group: Any) -> None:
        """A torch ProcessGroup or the global ranks of this rank's data-parallel group."""
        ranks = _group_ranks(group)
        if self.rank not in ranks:
            raise ValueError(f"data_parallel_group {sorted(ranks)} does not contain this rank ({self.rank}).")
        self.key = float(min(ranks))

    def block(self, interval: Interval) -> Any:
        block = encode(interval, self.key, self._zero_sent)
        self._zero_sent = block[_ZERO]
        return floats(block)

    def compare(self, blocks: Any, ranks: Sequence[int], sharded: bool, labels: Sequence[str]) -> None:
        """Rank 0: every rank's block ([world, EXT_LEN], row i from rank `ranks[i]`)."""
        values = blocks.tolist()
        self.zero.compare([v[_ZERO] for v in values], ranks)
        rows = [decode(rank, v) for rank, v in zip(ranks, values, strict=True)]
        groups: dict[float, list[ReplicaRow]] = {}
        for row in rows:
            groups.setdefault(row.key, []).append(row)
        # The gauges are set only at flushes that compared something (most flushes hold no
        # watched step): a flush without one leaves the last verdict standing.
        duplicated: int | None = None
        worst: float | None = None
        for members in groups.values():
            if len(members) < 2:
                continue
            compared, found = duplicate_batches(members)
            if compared >= 0:
                duplicated = (duplicated or 0) + len({rank for ranks_set in found for rank in ranks_set})
            for ranks_set, step in found.items():
                self._report_data(ranks_set, step)
            if sharded:
                if not self._sharded_said:  # a warning, once (rank 0): a check they may rely on is off
                    self._sharded_said = True
                    logger.warning(
                        "otel_train: parameters are sharded (FSDP): replicas' parameter norms are of "
                        "different shards, so replica_divergence is not checked (data_not_sharded still is)"
                    )
                continue
            diff, first, diverging = divergence(members)
            if diff is not None:
                worst = max(worst or 0.0, diff)
                self.max_divergence = max(self.max_divergence, diff)
                self._report_divergence(first, diverging, labels, members)
        if self._dup_gauge is not None and duplicated is not None:
            self._dup_gauge.set(duplicated)
        if self._div_gauge is not None and worst is not None:
            self._div_gauge.set(worst)

    def _report_data(self, ranks: tuple[int, ...], step: int) -> None:
        if ranks in self._reported_data:
            return
        self._reported_data.add(ranks)
        message = (
            f"ranks {shown(ranks)} trained on identical batches (same fingerprint at watched step "
            f"{step}): the data is not sharded across data-parallel ranks, so they repeat each other's "
            "work. Use a DistributedSampler (or shard the dataset by rank); ranks that share batches on "
            "purpose (tensor/pipeline parallel) name their data-parallel group with "
            "ot.watch(model, data_parallel_group=...)."
        )
        if self.events is None:
            logger.warning("otel_train: %s", message)
        else:
            self.events.emit("data_not_sharded", message, {"step": step, "ranks": ",".join(map(str, ranks))})

    def _report_divergence(
        self, first: int | None, ranks: list[int], labels: Sequence[str], members: Sequence[ReplicaRow]
    ) -> None:
        if first is None:
            self._diverged = False  # re-armed: a later divergence is reported again
            return
        if self._diverged:
            return
        self._diverged = True
        step = max(r.param_step for r in members)
        layer = labels[first] if first < len(labels) else f"#{first}"
        message = (
            f"data-parallel replicas diverged: the parameter norm of layer {layer!r} (the first in module "
            f"order) differs between ranks {shown(ranks)} by more than {REL_TOL:g} relative at watched "
            f"step {step}. Replicated parameters must stay identical: a gradient synchronization was "
            "skipped or failed (no_sync() left on, a custom all-reduce, a rank-dependent optimizer or "
            "parameter update)."
        )
        if self.events is None:
            logger.warning("otel_train: %s", message)
        else:
            ranks_text = ",".join(map(str, ranks))
            self.events.emit(
                "replica_divergence", message, {"step": step, semconv.LAYER: layer, "ranks": ranks_text}
            )


def _group_ranks(group: Any) -> list[int]:
    if isinstance(group, Iterable) and not isinstance(group, (str, bytes)):
        ranks = [int(r) for r in group]
    else:
        import torch.distributed as dist

        ranks = list(dist.get_process_group_ranks(group))
    if not ranks:
        raise ValueError("data_parallel_group is empty.")
    return ranks


def fsdp_in_use() -> bool:
    """FSDP2 registers a state for every `fully_shard`ed module in torch's composable-state map."""
    states = sys.modules.get("torch.distributed._composable_state")
    mapping = getattr(states, "_module_state_mapping", None)
    if mapping is None:
        return False
    try:
        refs = list(mapping.values())
    except RuntimeError:  # changed size while the training thread shards a module: look again next flush
        return False
    return any(type(ref()).__name__ == "FSDPState" for ref in refs)
