"""Cross-rank reductions, the wire format and the flush listener: no process group (the straggler
model itself is tested in test_verdicts.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from helpers.events import Events

from otel_train import semconv
from otel_train.config import Config
from otel_train.core.buffer import Interval
from otel_train.crossrank import down_row, job_block
from otel_train.crossrank.collective_lateness import LatenessTracker
from otel_train.crossrank.exchange import Exchanged
from otel_train.crossrank.reducer import CrossRankReducer
from otel_train.crossrank.replicas import ReplicaCheck
from otel_train.crossrank.shape import ExchangeShape
from otel_train.crossrank.timer_stats import (
    own_reductions,
    per_rank_timings,
    reduce_timings,
    stats_for_option,
)
from otel_train.crossrank.up_row import (
    ANNOUNCE_SLOTS,
    NAME_BYTES,
    TimerTable,
    local_record,
    name_id,
    pack,
    pack_len,
    unpack,
)
from otel_train.distributed import Identity


def interval(
    seq: int,
    phases: Mapping[str, list[float]],
    steps: list[float] | None = None,
    arrivals: Mapping[str, list[float]] | None = None,
) -> Interval:
    return Interval(
        seq=seq,
        step=(seq + 1) * 10 - 1,
        wall_time=0.0,
        elapsed_s=1.0,
        steps=10,
        tokens=0,
        samples=0,
        step_durations=list(steps if steps is not None else [0.1] * 10),
        phases={k: list(v) for k, v in phases.items()},
        arrivals={k: list(v) for k, v in (arrivals or {}).items()},
    )


# --- reduce_timings ------------------------------------------------------------------------------


def test_reduce_known_values_with_argmin_argmax() -> None:
    per_rank: list[dict[str, float | None]] = [
        {"forward": 0.010, "data": 0.002},
        {"forward": 0.012, "data": 0.001},
        {"forward": 0.030, "data": 0.002},
        {"forward": 0.011, "data": 0.004},
    ]
    red = reduce_timings(per_rank)
    fwd = red["forward"]
    assert (fwd.min, fwd.max, fwd.argmin, fwd.argmax, fwd.n) == (0.010, 0.030, 0, 2, 4)
    assert fwd.mean == pytest.approx(0.01575)
    assert fwd.median == pytest.approx(0.0115)  # even count: mean of the two middle values
    data = red["data"]
    assert (data.argmin, data.argmax) == (1, 3)
    assert data.median == pytest.approx(0.002)
    assert fwd.values == {0: 0.010, 1: 0.012, 2: 0.030, 3: 0.011}


def test_reduce_by_rank_costs_the_ranks_given_not_the_world() -> None:
    """Rank 0 of a tree holds a few ranks of a large world whole: the reduction names their ranks
    and holds only them."""
    red = reduce_timings({9999: {"a": 3.0}, 0: {"a": 1.0}, 4711: {"a": 2.0, "b": 5.0}})
    assert (red["a"].argmin, red["a"].argmax, red["a"].n, red["a"].median) == (0, 9999, 3, 2.0)
    assert red["a"].values == {0: 1.0, 4711: 2.0, 9999: 3.0}
    assert (red["b"].argmin, red["b"].argmax, red["b"].values) == (4711, 4711, {4711: 5.0})


def test_a_ranks_own_reductions_name_that_rank() -> None:
    record = local_record(interval(0, {"forward": [0.02, 0.04]}), Identity("run", rank=3, world_size=4))
    forward = own_reductions(record)["forward"]
    assert (forward.argmin, forward.argmax, forward.n, forward.values) == (3, 3, 1, {3: pytest.approx(0.03)})


def test_reduce_ties_pick_lowest_rank() -> None:
    red = reduce_timings([{"a": 1.0}, {"a": 2.0}, {"a": 2.0}, {"a": 1.0}])["a"]
    assert (red.argmin, red.argmax) == (0, 1)


def test_reduce_differing_timer_sets_by_name() -> None:
    per_rank: list[dict[str, float | None]] = [
        {"forward": 1.0, "backward": 2.0},
        {"backward": 2.5, "forward": 1.5, "only_rank1": 9.0},  # other insertion order, extra timer
        {"forward": 1.2, "backward": None},  # did not run backward
        {"forward": math.nan},  # non-finite: did not run
    ]
    red = reduce_timings(per_rank)
    assert red["forward"].n == 3 and red["forward"].values == {0: 1.0, 1: 1.5, 2: 1.2}
    assert red["forward"].argmax == 1 and red["forward"].max == 1.5
    assert red["backward"].n == 2 and red["backward"].argmax == 1 and red["backward"].min == 2.0
    only = red["only_rank1"]
    assert (only.n, only.argmin, only.argmax, only.min, only.max, only.median) == (1, 1, 1, 9.0, 9.0, 9.0)


def test_stats_for_option() -> None:
    assert stats_for_option("max") == ("max", "argmax_rank")
    assert set(stats_for_option("minmax")) == {"min", "max", "argmin_rank", "argmax_rank"}
    assert {"mean", "median"} <= set(stats_for_option("all"))


# --- packing -------------------------------------------------------------------------------------


def test_pack_unpack_roundtrip() -> None:
    ident = Identity("run", rank=3, world_size=4, node_rank=1, host="node-α.example", local_rank=2)
    table = TimerTable()
    iv = interval(
        7,
        {"forward": [0.01, 0.03, 0.02], "data": [0.5], "empty": []},
        steps=[0.2, 0.4, 0.3],
        arrivals={"forward": [0.05, 0.06, 0.9]},
    )
    row = pack(iv, ident, table)
    assert row.dtype == torch.float64 and row.numel() == pack_len()
    (rec,) = unpack(row)
    assert (rec.rank, rec.seq, rec.step, rec.node_rank, rec.host) == (3, 7, 79, 1, "node-α.example")
    assert rec.local_rank == 2
    assert (rec.step_count, rec.step_stats.median, rec.step_stats.max) == (3, 0.3, 0.4)
    fwd = rec.timers[name_id("forward")]
    assert (fwd.count, fwd.mean) == (3, pytest.approx(0.02))
    # arrival: lower median, max (the one-off), MAD (own noise)
    assert (fwd.arrival.count, fwd.arrival.median, fwd.arrival.max) == (3, 0.06, 0.9)
    assert fwd.arrival.mad == pytest.approx(0.01)
    assert rec.timers[name_id("data")].arrival.count == 0  # ran outside a step: no arrival
    assert set(rec.timers) == {name_id("forward"), name_id("data")}
    assert rec.announced == {name_id("forward"): "forward", name_id("data"): "data"}
    # the next flush announces nothing new, values still travel
    (rec2,) = unpack(pack(interval(8, {"forward": [0.04]}), ident, table))
    assert rec2.announced == {} and rec2.timers[name_id("forward")].mean == 0.04


def test_name_ids_are_exact_in_float64_and_stable() -> None:
    for name in ("forward", "backward", "data", "x" * 300):
        ident = name_id(name)
        assert 0 < ident < 2**48 and int(float(ident)) == ident
    assert name_id("forward") == name_id("forward") != name_id("Forward")


def test_long_names_are_truncated_in_announcements_but_keep_their_id() -> None:
    long = "layer." + "x" * 100
    table = TimerTable()
    (rec,) = unpack(pack(interval(0, {long: [1.0]}), Identity("r"), table))
    assert rec.announced[name_id(long)] == long.encode()[:NAME_BYTES].decode()
    # a receiver that knows the full name locally keeps it
    receiver = TimerTable()
    receiver.names.update(rec.announced)
    receiver.add(long)
    assert receiver.names[name_id(long)] == long


def test_different_first_seen_order_never_misaligns() -> None:
    """Each rank assigns slots in its own order; receivers match by id, so values stay with names."""
    idents = [Identity("r", rank=r, world_size=3) for r in range(3)]
    tables = [TimerTable() for _ in range(3)]
    flushes = [
        # rank 0 sees a, b; rank 1 sees b first, then a late; rank 2 sees only c, then a
        [{"a": [1.0], "b": [2.0]}, {"b": [20.0]}, {"c": [300.0]}],
        [{"a": [1.1], "b": [2.1]}, {"b": [20.1], "a": [10.1]}, {"c": [300.1], "a": [30.1]}],
    ]
    for seq, phases_by_rank in enumerate(flushes):
        rows = [pack(interval(seq, phases_by_rank[r]), idents[r], tables[r]) for r in range(3)]
        records = unpack(torch.cat(rows))
        for rec in records:  # rank 0 learns peers' names once, as the reducer does
            for ident, name in rec.announced.items():
                tables[0].names.setdefault(ident, name)
        red = reduce_timings(per_rank_timings(records, tables[0].names))
        for name in ("a", "b", "c"):
            for r in range(3):
                expected = phases_by_rank[r].get(name)
                assert red[name].values.get(r) == (expected[0] if expected else None), (seq, name, r)
    # slot positions really differ between ranks
    assert tables[0].slots["a"] != tables[2].slots["a"]


def test_hash_collision_is_dropped_not_merged(caplog: pytest.LogCaptureFixture) -> None:
    table = TimerTable(hash_fn=lambda name: 42)  # every name collides
    caplog.set_level(logging.WARNING, "otel_train")
    (rec,) = unpack(pack(interval(0, {"forward": [1.0], "backward": [5.0]}), Identity("r"), table))
    assert list(rec.timers) == [42] and rec.timers[42].mean == 1.0  # backward is not merged
    assert table.dropped == {"backward"} and "collides" in caplog.text
    caplog.clear()
    pack(interval(1, {"forward": [1.0], "backward": [5.0]}), Identity("r"), table)
    assert "collides" not in caplog.text  # warned once


def test_capacity_overflow_is_bounded() -> None:
    table = TimerTable(capacity=4)
    phases = {f"t{i}": [float(i + 1)] for i in range(10)}
    row = pack(interval(0, phases), Identity("r"), table)
    assert row.numel() == pack_len(4)
    (rec,) = unpack(row, capacity=4)
    assert len(rec.timers) == 4 and len(table.dropped) == 6
    assert len(rec.announced) == min(4, ANNOUNCE_SLOTS)


def test_announcements_spread_over_flushes() -> None:
    table = TimerTable()
    phases = {f"t{i}": [1.0] for i in range(ANNOUNCE_SLOTS + 2)}
    first = unpack(pack(interval(0, phases), Identity("r"), table))[0]
    second = unpack(pack(interval(1, phases), Identity("r"), table))[0]
    assert len(first.announced) == ANNOUNCE_SLOTS and len(second.announced) == 2
    assert set(first.announced.values()) | set(second.announced.values()) == set(phases)


# --- the listener without a process group --------------------------------------------------------


def _gauges(reader: object) -> dict[tuple[str, tuple[tuple[str, object], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, object], ...]], float] = {}
    data = reader.get_metrics_data()  # type: ignore[attr-defined]
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    out[(metric.name, tuple(sorted(point.attributes.items())))] = point.value
    return out


def test_not_distributed_issues_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    calls: list[str] = []
    for fn in (
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_object",
        "broadcast",
        "isend",
        "irecv",
        "new_group",
    ):
        if hasattr(dist, fn):
            monkeypatch.setattr(dist, fn, lambda *a, _fn=fn, **k: calls.append(_fn))
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    events = Events()
    # world_size 2 in the environment but no process group: still no collective
    for ident in (Identity("r"), Identity("r", rank=0, world_size=2)):
        reducer = CrossRankReducer(ident, meter, events, Config())
        for seq in range(3):
            steps = [0.1 * (seq + 1)] * 10
            reducer.on_flush(interval(seq, {"forward": [0.01 * (seq + 1)], "data": [0.001]}, steps))
        assert reducer.collectives == 0 and not reducer.distributed
        assert reducer.last_reductions["forward"].values == {0: 0.03}
        assert reducer.last_scores is not None
        assert reducer.last_scores.raw_individual == pytest.approx(1 / 3)  # own best / own now
        assert reducer.last_scores.relative is None and reducer.last_reports == []
        reducer.close()
    assert calls == [] and events.items == []
    gauges = _gauges(reader)
    key = (semconv.STRAGGLER_SCORE.name, ((semconv.STRAGGLER_KIND, "individual"), (semconv.PHASE, "all")))
    assert key in gauges
    assert not any(name == semconv.PHASE_CROSS_RANK.name for name, _ in gauges)


def test_reducer_closed_is_a_no_op() -> None:
    reducer = CrossRankReducer(Identity("r"), None, None, Config())
    reducer.close()
    reducer.on_flush(interval(0, {"forward": [1.0]}))
    assert reducer.last_reductions == {}


# --- the listener's distributed path, with an in-process fake exchange -----------------------------


class _FakeGroup:
    def __init__(self, world: int) -> None:
        self.world = world

    def size(self) -> int:
        return self.world


class _FakeExchange:
    """Rank 0's side of the star exchange for `world` simulated ranks: the rows they would send up
    (`interval_for(rank, seq)`), and rank 0's own answer row back down."""

    def __init__(self, world: int, interval_for: Callable[[int, int], Interval], fail: list[bool]) -> None:
        self.world = world
        self.interval_for = interval_for
        self.fail = fail
        self.tables = [TimerTable() for _ in range(world)]
        self.answers: list[torch.Tensor] = []

    def run(
        self,
        up: torch.Tensor,
        answers: torch.Tensor | None,
        expect: set[int] | None = None,
        current: Any = None,
    ) -> Exchanged:
        if self.fail[0]:
            raise RuntimeError("Connection closed by peer")
        assert answers is not None and answers.shape == (self.world, down_row.DOWN_LEN)
        self.answers.append(answers.clone())
        (mine,) = unpack(up[: pack_len()])  # the replica-check block (replicas.py) follows
        rows = [
            torch.cat(
                [
                    pack(
                        self.interval_for(r, mine.seq),
                        Identity("r", rank=r, world_size=self.world, host=f"h{r}", local_rank=r % 8),
                        self.tables[r],
                        from_step=mine.from_step,  # every simulated rank covers rank 0's steps
                    ),
                    ReplicaCheck(r, None, None).block(self.interval_for(r, mine.seq)),
                    job_block.empty(),  # the star's rows hold a job block (wire.row); none here
                    LatenessTracker(r).block(),  # no recorder read: an empty block
                ]
            )
            for r in range(self.world)
        ]
        return Exchanged(torch.stack(rows), answers[0], list(range(self.world)))


def _fake_world(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    interval_for: Callable[[int, int], Interval],
    fail: list[bool],
    config: Config | None = None,
) -> CrossRankReducer:
    """A rank-0 reducer whose exchange returns rows packed for `world` simulated ranks;
    `interval_for(rank, seq)` is each rank's interval."""
    reducer = CrossRankReducer(
        Identity("r", rank=0, world_size=world, host="h0"),
        None,
        Events(),
        config or Config(),
        group=_FakeGroup(world),
        shape=ExchangeShape((config or Config()).exchange_fanin),  # agreed at init (assemble.agreement)
    )
    reducer.exchange = _FakeExchange(world, interval_for, fail)  # type: ignore[assignment]
    return reducer


def _ddp_interval(rank: int, seq: int, slow: dict[int, float], steps: int = 6) -> Interval:
    """A DDP-like interval: data 4 ms, forward 30 ms (x slow), backward holds the all-reduce, so
    every rank's step takes the slowest rank's time."""
    forward = {r: 0.030 * f for r, f in slow.items()}
    latest = 0.004 + max([0.030, *forward.values()])
    fwd = forward.get(rank, 0.030)
    phases = {
        "data": [0.004] * steps,
        "forward": [fwd] * steps,
        "backward": [latest - 0.004 - fwd + 0.03] * steps,
    }
    arrivals = {
        "data": [0.004] * steps,
        "forward": [0.004 + fwd] * steps,
        "backward": [latest + 0.03] * steps,
    }
    return interval(seq, phases, [latest + 0.03] * steps, arrivals)


def test_rank0_reports_at_most_five_new_stragglers_per_flush(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def independent(r: int, seq: int) -> Interval:  # no collective: slow ranks' steps are longer
        fwd = 0.1 * (2.0 if r >= 10 else 1.0)
        return interval(seq, {"forward": [fwd]}, [fwd + 0.01] * 10, {"forward": [fwd]})

    reducer = _fake_world(monkeypatch, 16, independent, [False])
    caplog.set_level(logging.WARNING, "otel_train")
    for seq in range(5):
        reducer.on_flush(interval(seq, {}))
    events = reducer.events.items  # type: ignore[union-attr]
    assert reducer.collectives == 5
    assert sorted(e[2]["rank"] for e in events) == [10, 11, 12, 13, 14]  # capped (ties: lowest first)
    assert "6 new stragglers" in caplog.text
    assert reducer.last_reductions["forward"].argmax == 10 and reducer.last_reductions["forward"].n == 16


def test_chronic_straggler_event_names_culprit_phase_and_cost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    flagged: list[list[int]] = []
    reducer = _fake_world(monkeypatch, 4, lambda r, seq: _ddp_interval(r, seq, {2: 1.5}), [False])
    reducer.on_straggler = lambda reports: flagged.append([r.rank for r in reports])
    caplog.set_level(logging.WARNING, "otel_train")
    for seq in range(5):
        reducer.on_flush(interval(seq, {}))
    events = reducer.events.items  # type: ignore[union-attr]
    assert len(events) == 1  # reported once while it stays flagged
    name, message, attrs = events[0]
    assert name == "straggler"
    assert attrs["rank"] == 2 and attrs["host.name"] == "h2" and attrs["gpu"] == 2
    assert (attrs["train.phase"], attrs["category"], attrs["pattern"]) == ("forward", "compute", "chronic")
    assert attrs["sync_phase"] == "backward" and attrs["waiting_ranks"] == "0,1,3"
    assert attrs["wait_ms"] == pytest.approx(15.0, abs=0.5) and attrs["lateness_ms"] == pytest.approx(
        15.0, abs=0.5
    )
    assert "ranks 0, 1, 3 wait 15.0 ms per step for rank 2 in 'backward'" in message
    assert flagged and all(f == [2] for f in flagged)
    assert reducer.last_scores is not None and reducer.last_scores.wait_s == pytest.approx(0.015, abs=1e-3)


def test_rank0_answers_carry_cadence_now_and_verdicts_one_flush_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reducer = _fake_world(monkeypatch, 4, lambda r, seq: _ddp_interval(r, seq, {2: 1.5}), [False])
    flagged: list[list[object]] = []
    adopted: list[tuple[int, int]] = []
    reducer.on_straggler = flagged.append
    reducer.on_cadence = lambda steps, anchor: adopted.append((steps, anchor))
    verdicts: list[down_row.Verdict] = []
    for seq in range(5):
        iv = interval(seq, {})
        iv.flush_interval, iv.flush_anchor = 20 * (seq + 1), 10 * seq + 19
        reducer.on_flush(iv)
        assert reducer._verdict is not None
        verdicts.append(reducer._verdict)
    assert adopted == []  # rank 0 adopts its own schedule at the flush (cadence.py), never from an answer
    sent = reducer.exchange.answers  # type: ignore[attr-defined]
    assert all(down_row.decode(row, r).verdict_seq == -1 for r, row in enumerate(sent[0]))
    for seq in range(1, 5):
        before = verdicts[seq - 1]
        for r, row in enumerate(sent[seq]):
            down = down_row.decode(row, r)
            assert (down.status, down.verdict_seq) == (0, seq - 1)
            assert (down.flush_interval, down.flush_anchor) == (20 * (seq + 1), 10 * seq + 19)  # not delayed
            assert down.scores == before.scores[r]  # this rank's own scores, exactly
            assert down.chronic == list(before.chronic)  # the same list for every rank
    chronic = [list(v.chronic) for v in verdicts[:-1] if v.chronic]
    assert chronic and [[r.rank for r in c] for c in chronic] == [[2]] * len(chronic)
    assert flagged == chronic  # rank 0's own callback: its decoded answer, one flush later


def test_abstains_once_when_only_the_step_is_timed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reducer = _fake_world(monkeypatch, 4, lambda r, seq: interval(seq, {}, [0.1] * 10), [False])
    caplog.set_level(logging.WARNING, "otel_train")
    for seq in range(3):
        reducer.on_flush(interval(seq, {}))
    assert caplog.text.count("straggler detection abstains: only ot.step is timed") == 1
    assert "ot.timer('forward')" in caplog.text
    assert reducer.abstain_reason is not None and reducer.events.items == []  # type: ignore[union-attr]


def test_failed_collective_disables_and_falls_back_to_local(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fail = [False]
    reducer = _fake_world(monkeypatch, 4, lambda r, seq: interval(seq, {"forward": [0.1]}), fail)
    reducer.on_flush(interval(0, {"forward": [0.1]}))
    assert reducer.last_reductions["forward"].n == 4
    fail[0] = True
    caplog.set_level(logging.ERROR, "otel_train")
    reducer.on_flush(interval(1, {"forward": [0.1]}))
    assert reducer.disabled_reason is not None and "Connection closed" in reducer.disabled_reason
    [disabled] = [e for e in reducer.events.items if e[0] == "cross_rank_disabled"]  # type: ignore[union-attr]
    assert disabled[1].startswith("cross-rank telemetry disabled on rank 0: ") and disabled[2]["rank"] == 0
    fail[0] = False
    for seq in (2, 3):
        reducer.on_flush(interval(seq, {"forward": [0.2]}, [0.2] * 10))
    assert reducer.collectives == 2  # never retried
    assert reducer.last_reductions["forward"].n == 1  # local stats only
    assert reducer.last_scores is not None and reducer.last_scores.raw_individual == pytest.approx(0.5)


def test_an_exchange_that_fails_any_other_way_turns_off_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure mid-exchange that is not gloo's (here the answer row cannot be decoded) leaves the
    exchange's state unknown: it turns off like a failed collective, not retried at every flush."""
    reducer = _fake_world(monkeypatch, 4, lambda r, seq: interval(seq, {"forward": [0.1]}), [False])

    def garbled(row: Any, rank: int) -> Any:
        raise IndexError("answer row too short")

    monkeypatch.setattr(down_row, "decode", garbled)
    reducer.on_flush(interval(0, {"forward": [0.1]}))
    assert reducer.disabled_reason is not None and "answer row too short" in reducer.disabled_reason
    reducer.on_flush(interval(1, {"forward": [0.1]}))
    assert reducer.collectives == 1  # never retried
    assert reducer.last_reductions["forward"].n == 1  # local stats only


def test_ewma_default_comes_from_config() -> None:
    reducer = CrossRankReducer(
        Identity("r"), None, None, Config(straggler_ewma=0.25, straggler_threshold=0.7)
    )
    assert (reducer.settings.ewma, reducer.settings.threshold) == (0.25, 0.7)
    assert (reducer.settings.ewma, reducer.settings.threshold) != (0.3, 0.8)
    default = CrossRankReducer(Identity("r"), None, None, Config()).settings
    assert (default.ewma, default.threshold) == (Config().straggler_ewma, Config().straggler_threshold)


def test_the_cross_rank_step_series_is_over_lower_medians_as_documented() -> None:
    interval = Interval(0, 3, 0.0, 13.0, 4, 0, 0, step_durations=[1.0, 1.0, 1.0, 10.0])
    record = unpack(pack(interval, Identity("run", world_size=2), TimerTable()).unsqueeze(0))[0]
    assert per_rank_timings([record], {})[0]["step"] == 1.0  # not the mean, 3.25
    assert "lower-median step time" in semconv.PHASE_CROSS_RANK.description


def test_a_held_flush_reports_one_offs_and_holds_only_new_chronic_stragglers() -> None:
    """While the collective verdict is pending (reducer), a one-off goes out at once (the next
    interval will not hold it) and a new chronic straggler waits; one already reported stays
    flagged, so it is neither reported again nor said to have recovered."""
    from otel_train.crossrank.scores import StragglerReport, StragglerReporter

    def report(rank: int, pattern: str) -> StragglerReport:
        return StragglerReport(rank, "h", rank, pattern, "data", "data", 0.5, 0.5, 0.5, None)  # type: ignore[arg-type]

    events = Events()
    reporter = StragglerReporter(events)
    reporter.report([report(1, "chronic")], step=9, threshold=0.9)
    held = [report(1, "chronic"), report(2, "chronic"), report(3, "one_off")]
    reporter.report(held, step=19, threshold=0.9, hold_new_chronic=True)
    assert [(e[2]["rank"], e[2]["pattern"]) for e in events.items] == [(1, "chronic"), (3, "one_off")]
    reporter.report(held[:2], step=29, threshold=0.9)  # no longer held: rank 2 goes out now
    assert [(e[2]["rank"], e[2]["pattern"]) for e in events.items[2:]] == [(2, "chronic")]


def test_a_straggler_is_one_console_line(caplog: pytest.LogCaptureFixture) -> None:
    """The events echo each event on the console; the reporter adds no line of its own (a line
    of its own only where there are no events)."""
    from otel_train.crossrank.scores import StragglerReport, StragglerReporter
    from otel_train.health import HealthEvents

    counter = type("Counter", (), {"add": lambda self, *a, **k: None})()
    report = StragglerReport(3, "hostB", 0, "chronic", "forward", "compute", 0.5, 0.03, 0.5, None)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="otel_train")
    StragglerReporter(HealthEvents(counter, None, None, {}, echo=True)).report(
        [report], step=9, threshold=0.9
    )
    StragglerReporter(None).report([report], step=9, threshold=0.9)
    lines = [r.getMessage() for r in caplog.records if "rank 3 (hostB" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("otel_train straggler: "), lines
