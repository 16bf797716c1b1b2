"""ZeRO optimizer-state partitioning checked across ranks (`zero_partition` events), on the one
exchange: each rank's partition is its share of the model, and no rank holds the whole state.
Design: docs/design/crossrank.md#zero-partition.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.crossrank.wire import ZERO

logger = logging.getLogger("otel_train")
Facts = dict[str, float]  # one rank's block (`wire.ZERO`) by field name

# The block's fields (`wire.ZERO`) and the catalogue names the adapter records them under.
_FIELDS = {
    "stage": semconv.ZERO_STAGE.name,
    "dp_size": semconv.ZERO_DP_SIZE.name,
    "model_numel": semconv.ZERO_MODEL_NUMEL.name,
    "partition_numel": semconv.ZERO_PARTITION_NUMEL.name,
    "state_bytes": semconv.ZERO_OPTIMIZER_STATE_BYTES.name,
    "shard_numel": semconv.ZERO_PARAM_SHARD_NUMEL.name,
}
ZLEN = ZERO.words
ABSENT = -1.0
# DeepSpeed pads each parameter group's flat buffer to a multiple of the dp size times its
# alignment (2 * world elements for ZeRO-1/2, a few hundred at most for NCCL's 4-byte start
# alignment): a rank's share may differ from model / dp by that much, never by a whole share.
SHARE_TOL = 0.05
PAD_ELEMENTS = 512
FULL_STATE = 0.75  # of the whole model's state: a rank at stage >= 1 holding this much holds it all
_SHOWN = 8


def encode(interval: Interval, previous: Sequence[float] | None = None) -> list[float]:
    """This rank's block: the latest value of each ZeRO fact recorded in the interval, else the
    `previous` block (the adapter records the facts when they change, not at every step)."""
    block = [ABSENT] * ZLEN
    recorded = {field: interval.scalars.get(name) for field, name in _FIELDS.items()}
    ZERO.put(block, **{field: values[-1] for field, values in recorded.items() if values})
    if recorded["stage"]:  # the stage is recorded with the rest: this rank trains with ZeRO
        ZERO.put(block, present=1)
    elif previous is not None:
        return list(previous)
    return block


class ZeroPartitionCheck:
    """Rank 0: compares every rank's ZeRO block and reports a violation once per kind."""

    def __init__(self, events: Any) -> None:
        self.events = events
        self._reported: set[str] = set()

    def compare(self, blocks: Sequence[Sequence[float]], ranks: Sequence[int]) -> None:
        rows = [(rank, dict(zip(ZERO.fields, b, strict=True))) for rank, b in zip(ranks, blocks, strict=True)]
        rows = [(rank, b) for rank, b in rows if b["present"] == 1 and all(map(math.isfinite, b.values()))]
        if len(rows) < 2:
            return
        stage = int(max(b["stage"] for _, b in rows))
        if stage < 1:
            return
        # ZeRO-3: each rank's parameter shard must be its share too
        held = ("partition_numel", "shard_numel") if stage >= 3 else ("partition_numel",)
        ranks = sorted({rank for rank, b in rows if any(_off_share(b, b[name]) for name in held)})
        if ranks:
            self._report("partition", ranks, stage, (
                f"ZeRO-{stage} partitions are not each rank's share of the model (model / data-parallel "
                f"size): ranks {shown(ranks)} ({_detail(rows, ranks)}). Every data-parallel rank must run "
                "deepspeed.initialize with the same model, config and data-parallel group (mpu): check that "
                "no rank builds a different model or passes its own zero_optimization section."
            ))  # fmt: skip
        full = _full_state(rows)
        if full:
            self._report("full_state", full, stage, (
                f"ranks {shown(full)} hold about the whole model's optimizer state although ZeRO-{stage} "
                f"partitions it ({_detail(rows, full)}). Create the optimizer state through the engine "
                "only (no torch optimizer stepped outside it, no state loaded in full into "
                "engine.optimizer), and load checkpoints with the engine's load_checkpoint so each rank "
                "keeps its own partition."
            ))  # fmt: skip

    def _report(self, kind: str, ranks: list[int], stage: int, message: str) -> None:
        if kind in self._reported:
            return
        self._reported.add(kind)
        if self.events is None:
            logger.warning("otel_train: %s", message)
        else:
            attributes = {"ranks": ",".join(map(str, ranks)), "zero.stage": stage, "kind": kind}
            self.events.emit("zero_partition", message, attributes)


def shown(ranks: Sequence[int]) -> str:
    """The ranks for a message: the first _SHOWN, then how many more."""
    more = f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else ""
    return ", ".join(map(str, ranks[:_SHOWN])) + more


def _detail(rows: Sequence[tuple[int, Facts]], ranks: Sequence[int]) -> str:
    return "; ".join(
        f"rank {rank}: partition {int(b['partition_numel'])} of {int(b['model_numel'])} elements, "
        f"optimizer state {int(b['state_bytes'])} B"
        for rank, b in rows
        if rank in ranks[:_SHOWN]
    )


def _off_share(block: Facts, held: float) -> bool:
    dp, model = block["dp_size"], block["model_numel"]
    if dp < 2 or model <= 0 or held < 0:
        return False
    share = model / dp
    return abs(held - share) > SHARE_TOL * share + PAD_ELEMENTS


def _full_state(rows: Sequence[tuple[int, Facts]]) -> list[int]:
    """Ranks whose optimizer state is about the whole model's (judged by the leanest rank's bytes
    per partition element: a rank without state yet, before its first step, proves nothing)."""
    per_element = [
        b["state_bytes"] / b["partition_numel"]
        for _, b in rows
        if b["state_bytes"] > 0 and b["partition_numel"] > 0 and b["dp_size"] >= 2
    ]
    if not per_element:
        return []
    lean = min(per_element)
    return sorted(
        rank
        for rank, b in rows
        if b["dp_size"] >= 2 and b["state_bytes"] >= FULL_STATE * lean * b["model_numel"]
    )
