"""crossrank/zero_partition.py: the ZeRO facts a rank records ride its replica block, and rank 0's
check of every rank's block (one `zero_partition` event per kind of violation, none when healthy)."""

from __future__ import annotations

from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.crossrank import replicas, zero_partition

MODEL = 9610


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def emit(self, event: str, message: str, attributes: Any = None, severity: str = "WARNING") -> None:
        self.seen.append((event, message, dict(attributes or {})))


def _interval(stage: int, partition: int, state: int, dp: int = 2, shard: int | None = None) -> Interval:
    interval = Interval(seq=1, step=3, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=0, samples=0)
    interval.scalars = {
        semconv.ZERO_STAGE.name: [float(stage)],
        semconv.ZERO_DP_SIZE.name: [float(dp)],
        semconv.ZERO_MODEL_NUMEL.name: [float(MODEL)],
        semconv.ZERO_PARTITION_NUMEL.name: [float(partition)],
        semconv.ZERO_OPTIMIZER_STATE_BYTES.name: [float(state)],
    }
    if shard is not None:
        interval.scalars[semconv.ZERO_PARAM_SHARD_NUMEL.name] = [float(shard)]
    return interval


def _compare(intervals: list[Interval], events: Events, check: replicas.ReplicaCheck | None = None) -> None:
    import torch

    check = check or replicas.ReplicaCheck(0, None, events)
    blocks = torch.stack([check.block(i) for i in intervals])
    assert blocks.shape[1] == replicas.EXT_LEN
    check.compare(blocks, list(range(len(intervals))), False, ())


def test_healthy_zero2_ranks_raise_nothing() -> None:
    events = Events()
    _compare([_interval(2, 4806, 38448), _interval(2, 4806, 38448)], events)
    assert events.seen == []


def test_a_rank_holding_the_whole_state_is_one_event_over_flushes() -> None:
    events = Events()
    check = replicas.ReplicaCheck(0, None, events)
    rows = [_interval(1, 4806, 38448), _interval(1, 4806, 38448 + 8 * MODEL)]
    for _ in range(3):  # every flush carries the facts: still one event
        _compare(rows, events, check)
    [(name, message, attrs)] = events.seen
    assert (name, attrs["ranks"], attrs["kind"], attrs["zero.stage"]) == (
        "zero_partition",
        "1",
        "full_state",
        1,
    )
    assert "rank 1" in message and "rank 0" not in message


def test_a_rank_with_the_whole_partition_is_named() -> None:
    events = Events()
    _compare([_interval(2, 4806, 38448), _interval(2, MODEL, 8 * MODEL)], events)
    kinds = {attrs["kind"]: attrs["ranks"] for _, _, attrs in events.seen}
    assert kinds["partition"] == "1"


def test_zero3_shard_off_its_share_is_named_and_stage_0_is_not_checked() -> None:
    events = Events()
    _compare([_interval(3, 4805, 38440, shard=4805), _interval(3, 4805, 38440, shard=MODEL)], events)
    assert [a["ranks"] for _, _, a in events.seen] == ["1"]
    events = Events()
    _compare([_interval(0, MODEL, 8 * MODEL), _interval(0, MODEL, 8 * MODEL)], events)
    assert events.seen == []


def test_ranks_without_zero_facts_send_an_empty_block() -> None:
    interval = Interval(seq=1, step=3, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=0, samples=0)
    assert zero_partition.encode(interval) == [zero_partition.ABSENT] * zero_partition.ZLEN
    events = Events()
    _compare([interval, interval], events)
    assert events.seen == []


def test_an_interval_without_facts_sends_the_last_ones() -> None:
    """The adapter records the facts when they change: a later flush's block still carries them
    (ReplicaCheck keeps the last), so rank 0 compares every rank at every flush."""
    check = replicas.ReplicaCheck(rank=1, meter=None, events=None)
    with_facts = Interval(seq=1, step=3, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=0, samples=0)
    with_facts.scalars = {semconv.ZERO_STAGE.name: [2.0], semconv.ZERO_PARTITION_NUMEL.name: [500.0]}
    without = Interval(seq=2, step=7, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=0, samples=0)
    first = check.block(with_facts).tolist()[replicas.EXT_LEN - zero_partition.ZLEN :]
    later = check.block(without).tolist()[replicas.EXT_LEN - zero_partition.ZLEN :]
    assert first[1] == 2.0 and later == first
    assert (
        zero_partition.encode(without) == [zero_partition.ABSENT] * zero_partition.ZLEN
    )  # no memory of its own
