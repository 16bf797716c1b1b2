"""The wire schema (crossrank/wire.py): records laid out from their declaration, text carried as
its UTF-8 bytes, and a rank of another wire version refused on real gloo ranks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from helpers.multirank import run_ranks

from otel_train.core.buffer import Interval
from otel_train.crossrank import wire
from otel_train.crossrank.up_row import TimerTable, pack, unpack
from otel_train.distributed import Identity


def _interval(seq: int = 0) -> Interval:
    return Interval(
        seq=seq, step=(seq + 1) * 10 - 1, wall_time=time.time(), elapsed_s=1.0, steps=10, tokens=0,
        samples=0, step_durations=[0.1] * 10, phases={"forward": [0.03] * 10},
        arrivals={"forward": [0.03] * 10},
    )  # fmt: skip


def test_fields_lie_where_the_declaration_puts_them_and_a_too_long_value_is_refused() -> None:
    record = wire.Record(("a",), ("b", 3), ("name", wire.Text(16)), ("inner", wire.BATCH, 2), ("z",))
    assert record.words == 1 + 3 + 2 + 2 * wire.BATCH.words + 1
    assert [record.at(n) for n in ("a", "b", "name", "inner", "z")] == [0, 1, 4, 6, 12]
    assert record.at("inner", 1) == 9 and record.span("inner") == slice(6, 12)
    row = record.new(a=7, b=[1.0, 2.0], name="hé", z=-1)
    wire.BATCH.put(row, record.at("inner", 1), step=5, sums=[0.5, 0.25])
    assert record.get(row, "a") == 7.0 and record.get(row, "b") == [1.0, 2.0, 0.0]
    assert record.get(row, "name") == "hé" and record.get(row, "z") == -1.0
    assert wire.BATCH.get(row, "sums", record.at("inner", 1)) == [0.5, 0.25]
    with pytest.raises(ValueError, match="do not fit field 'b'"):
        record.put(row, b=[0.0] * 4)
    assert len(row) == record.words


def test_host_and_timer_names_travel_as_their_utf8_bytes() -> None:
    host, timer = "nœud-07.example", "forward_ä" + "x" * 60  # the timer name is cut at 48 bytes
    table = TimerTable(4)
    interval = _interval()
    interval.phases[timer] = [0.01] * 10
    row = pack(interval, Identity("r", rank=3, world_size=4, host=host), table)
    raw = bytes(row.view(torch.uint8).tolist())
    up = wire.up(4)
    assert raw[8 * up.at("host") :].startswith(host.encode() + b"\x00")
    assert timer.encode()[: wire.NAME.size] in raw  # announced in the same row
    (record,) = unpack(row, 4)
    assert record.host == host and record.rank == 3
    assert sorted(record.announced.values()) == ["forward", timer.encode()[:48].decode()]
    assert row[up.at("version")].item() == wire.VERSION


def refused_target(rank: int, world: int, fanin: int, odd: int) -> dict[str, Any]:
    """Rank `odd` runs another wire version (as another otel_train release would); every rank
    flushes three times, meeting in a barrier after each."""
    import torch.distributed as dist

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    if rank == odd:
        wire.VERSION = 3.0
    identity = detect_identity(None)
    config = Config(collective_timeout_s=20.0, exchange_fanin=fanin)
    group = create_telemetry_group(identity, config.collective_timeout_s)
    reducer = CrossRankReducer(identity, None, None, config, group=group)
    for seq in range(3):
        reducer.on_flush(_interval(seq))
        dist.barrier()
    return {"disabled": reducer.disabled_reason, "tree": type(reducer.exchange).__name__}


# The star, and a tree of fan-in 2 (rank 0 -> 1, 3; 1 -> 2: rank 0 takes rank 3's bundle, the
# ABORT reaches rank 2 through rank 1, `tree_exchange`).
@pytest.mark.multirank
@pytest.mark.parametrize(("world", "fanin", "odd"), [(3, 16, 1), (4, 2, 3)], ids=["star", "fanin2"])
def test_a_rank_of_another_wire_version_turns_the_exchange_off_on_every_rank(
    world: int, fanin: int, odd: int
) -> None:
    results = run_ranks(world, refused_target, (fanin, odd), timeout=120)
    assert results[0]["tree"] == ("StarExchange" if fanin == 16 else "TreeExchange")
    reasons = [r["disabled"] for r in results]
    assert all(reasons), reasons
    assert f"rank {odd} sends cross-rank wire version 3, this rank reads 4" in reasons[0]
    assert "rank 0 sends cross-rank wire version 4, this rank reads 3" in reasons[odd]
    same = [reason for rank, reason in enumerate(reasons) if rank not in (0, odd)]
    assert all("found a failed peer" in r for r in same), reasons  # rank 0's ABORT reached them
