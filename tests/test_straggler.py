"""Cross-rank reductions, packing and straggler scoring: pure functions, no process group."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import pytest
import torch
from conftest import Events

from otel_train import semconv
from otel_train.config import Config
from otel_train.distributed import Identity
from otel_train.interval import Interval
from otel_train.straggler import (
    ANNOUNCE_SLOTS,
    NAME_BYTES,
    OVERALL_PHASE,
    STEP_PHASE,
    CrossRankReducer,
    Reduction,
    StragglerScorer,
    TimerTable,
    format_timers,
    name_id,
    pack,
    pack_len,
    per_rank_timings,
    phase_category,
    reduce_timings,
    stats_for_option,
    unpack,
)


def interval(seq: int, phases: Mapping[str, list[float]], steps: list[float] | None = None) -> Interval:
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
    assert fwd.values == (0.010, 0.012, 0.030, 0.011)


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
    assert red["forward"].n == 3 and red["forward"].values == (1.0, 1.5, 1.2, None)
    assert red["forward"].argmax == 1 and red["forward"].max == 1.5
    assert red["backward"].n == 2 and red["backward"].argmax == 1 and red["backward"].min == 2.0
    only = red["only_rank1"]
    assert (only.n, only.argmin, only.argmax, only.min, only.max, only.median) == (1, 1, 1, 9.0, 9.0, 9.0)


# --- format_timers -------------------------------------------------------------------------------


def _reds() -> dict[str, Reduction]:
    return reduce_timings([{"forward": 0.010}, {"forward": 0.020}, {"forward": 0.015}, {}])


def test_format_max() -> None:
    text = format_timers(_reds(), "max")
    assert text.splitlines()[0] == "(max) time across ranks (ms):"
    assert "forward" in text and "20.00 (rank 1)" in text and "10.00" not in text


def test_format_minmax() -> None:
    text = format_timers(_reds(), "minmax")
    assert text.splitlines()[0] == "(min, max) time across ranks (ms):"
    assert "(10.00, 20.00) (ranks 0, 1)" in text


def test_format_all_lists_every_rank() -> None:
    text = format_timers(_reds(), "all")
    assert text.splitlines()[0] == "times across ranks (ms):"
    assert "[10.00, 20.00, 15.00, -]" in text
    assert format_timers({}, "all") == ""


def test_stats_for_option() -> None:
    assert stats_for_option("max") == ("max", "argmax_rank")
    assert set(stats_for_option("minmax")) == {"min", "max", "argmin_rank", "argmax_rank"}
    assert {"mean", "median"} <= set(stats_for_option("all"))


# --- packing -------------------------------------------------------------------------------------


def test_pack_unpack_roundtrip() -> None:
    ident = Identity("run", rank=3, world_size=4, node_rank=1, host="node-α.example")
    table = TimerTable()
    iv = interval(7, {"forward": [0.01, 0.03], "data": [0.5], "empty": []}, steps=[0.2, 0.4])
    row = pack(iv, ident, table)
    assert row.dtype == torch.float64 and row.numel() == pack_len()
    (rec,) = unpack(row)
    assert (rec.rank, rec.seq, rec.step, rec.node_rank, rec.host) == (3, 7, 79, 1, "node-α.example")
    assert rec.step_count == 2 and rec.step_mean == pytest.approx(0.3)
    assert rec.timers == {name_id("forward"): (2, pytest.approx(0.02)), name_id("data"): (1, 0.5)}
    assert rec.announced == {name_id("forward"): "forward", name_id("data"): "data"}
    # the next flush announces nothing new, values still travel
    (rec2,) = unpack(pack(interval(8, {"forward": [0.04]}), ident, table))
    assert rec2.announced == {} and rec2.timers == {name_id("forward"): (1, 0.04)}


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
                assert red[name].values[r] == (expected[0] if expected else None), (seq, name, r)
    # slot positions really differ between ranks
    assert tables[0].slots["a"] != tables[2].slots["a"]


def test_hash_collision_is_dropped_not_merged(caplog: pytest.LogCaptureFixture) -> None:
    table = TimerTable(hash_fn=lambda name: 42)  # every name collides
    caplog.set_level(logging.WARNING, "otel_train")
    (rec,) = unpack(pack(interval(0, {"forward": [1.0], "backward": [5.0]}), Identity("r"), table))
    assert rec.timers == {42: (1, 1.0)}  # backward is not merged into forward's slot
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


# --- categories and scoring ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("data", "data"),
        ("dataloader", "data"),
        ("data_wait", "data"),
        ("get_batch", "data"),
        ("forward", "compute"),
        ("backward", "compute"),
        ("forward-compute", "compute"),
        ("optimizer", "compute"),
        ("optimizer.step", "compute"),
        ("allreduce", "communication"),
        ("grad_sync", "communication"),
        ("comm", "communication"),
        ("communication", "communication"),
        ("checkpoint_save", "other"),
    ],
)
def test_phase_category(name: str, category: str) -> None:
    assert phase_category(name) == category


def _per_rank(
    slow_rank: int | None, slow: Mapping[str, float], world: int = 4
) -> list[dict[str, float | None]]:
    base = {"data": 0.002, "forward": 0.030, "backward": 0.060, "optimizer": 0.005}
    out: list[dict[str, float | None]] = []
    for r in range(world):
        t: dict[str, float | None] = {
            k: v * (slow.get(k, 1.0) if r == slow_rank else 1.0) for k, v in base.items()
        }
        compute = sum(v for v in t.values() if v is not None)
        t["allreduce"] = 0.25 - compute  # the DDP barrier: fast ranks wait longer
        t[STEP_PHASE] = 0.25  # step time is equalised by the collective
        out.append(t)
    return out


def test_relative_compute_straggler_flagged_within_three_intervals() -> None:
    scorer = StragglerScorer(threshold=0.8, alpha=0.3)
    first_flag = None
    for i in range(6):
        scores = scorer.update(reduce_timings(_per_rank(2, {"forward": 1.5, "backward": 1.5})), 4)
        reports = [rep for s in scores for rep in s.reports if rep.chronic]
        assert all(rep.rank == 2 for rep in reports)
        if reports and first_flag is None:
            first_flag = i
            rep = reports[0]
            assert (
                rep.kind == "relative" and rep.category == "compute" and rep.phase in ("forward", "backward")
            )
    assert first_flag is not None and first_flag <= 2
    # the healthy ranks stay healthy; communication (waiting) never counts against them
    assert scores[0].relative[OVERALL_PHASE] > 0.95
    assert "allreduce" not in scores[0].relative


def test_relative_data_straggler_attributed_to_data() -> None:
    scorer = StragglerScorer()
    for _ in range(4):
        scores = scorer.update(reduce_timings(_per_rank(1, {"data": 30.0})), 4)
    reports = [rep for s in scores for rep in s.reports if rep.chronic]
    assert [(r.rank, r.phase, r.category) for r in reports] == [(1, "data", "data")]


def test_balanced_nothing_flagged() -> None:
    scorer = StragglerScorer()
    for _ in range(10):
        scores = scorer.update(reduce_timings(_per_rank(None, {})), 4)
        assert not [rep for s in scores for rep in s.reports]
    assert all(abs(s.relative[OVERALL_PHASE] - 1.0) < 1e-9 for s in scores)


def test_one_off_is_not_chronic() -> None:
    scorer = StragglerScorer(threshold=0.8, alpha=0.3)
    scorer.update(reduce_timings(_per_rank(None, {})), 4)
    scores = scorer.update(reduce_timings(_per_rank(3, {"forward": 3.0, "backward": 3.0})), 4)
    (rep,) = [rep for s in scores for rep in s.reports]
    assert rep.rank == 3 and not rep.chronic and rep.raw_score < 0.8 <= rep.score
    for _ in range(3):
        scores = scorer.update(reduce_timings(_per_rank(None, {})), 4)
    assert not [rep for s in scores for rep in s.reports]


def test_individual_score_against_own_best() -> None:
    scorer = StragglerScorer()
    scorer.update(reduce_timings([{"forward": 1.0, STEP_PHASE: 1.0}]), 1, relative=False)
    (s,) = scorer.update(reduce_timings([{"forward": 2.0, STEP_PHASE: 2.0}]), 1, relative=False)
    assert s.raw_individual[OVERALL_PHASE] == pytest.approx(0.5)
    assert s.raw_individual["forward"] == pytest.approx(0.5)
    assert s.individual[OVERALL_PHASE] == pytest.approx(0.3 * 0.5 + 0.7 * 1.0)
    assert not s.relative and not s.reports  # no relative score, no events when single-process


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
            reducer.on_flush(interval(seq, {"forward": [0.01 * (seq + 1)], "data": [0.001]}))
        assert reducer.collectives == 0 and not reducer.distributed
        assert reducer.last_reductions["forward"].values == (0.03,)
        assert reducer.last_scores is not None
        assert reducer.last_scores.raw_individual["forward"] == pytest.approx(1 / 3)
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


# --- the listener's distributed path, with an in-process fake all_gather -------------------------


class _FakeGroup:
    def __init__(self, world: int) -> None:
        self.world = world

    def size(self) -> int:
        return self.world


def _fake_world(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    phases_for: Callable[[int], dict[str, list[float]]],
    fail: list[bool],
) -> CrossRankReducer:
    """A rank-0 reducer whose all_gather returns rows packed for `world` simulated ranks."""
    import otel_train.straggler as mod

    tables = [TimerTable() for _ in range(world)]

    def gather(out: torch.Tensor, row: torch.Tensor, group: object = None) -> None:
        if fail[0]:
            raise RuntimeError("Connection closed by peer")
        (mine,) = unpack(row)
        rows = [
            pack(
                interval(mine.seq, phases_for(r)),
                Identity("r", rank=r, world_size=world, host=f"h{r}"),
                tables[r],
            )
            for r in range(world)
        ]
        out.copy_(torch.cat(rows))

    monkeypatch.setattr(mod, "_all_gather_fn", lambda: gather)
    reducer = CrossRankReducer(
        Identity("r", rank=0, world_size=world, host="h0"), None, Events(), Config(), group=_FakeGroup(world)
    )
    return reducer


def test_rank0_reports_at_most_five_new_stragglers_per_flush(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def phases(r: int) -> dict[str, list[float]]:
        return {"forward": [0.1 * (2.0 if r >= 10 else 1.0)], "data": [0.001]}

    reducer = _fake_world(monkeypatch, 16, phases, [False])
    caplog.set_level(logging.WARNING, "otel_train")
    for seq in range(5):
        reducer.on_flush(interval(seq, phases(0)))
    events = reducer.events.items  # type: ignore[union-attr]
    assert reducer.collectives == 5
    assert sorted(e[2]["rank"] for e in events) == [
        10,
        11,
        12,
        13,
        14,
    ]  # capped, slowest (ties: lowest) first
    assert "6 new stragglers" in caplog.text
    assert reducer.last_reductions["forward"].argmax == 10 and reducer.last_reductions["forward"].n == 16


def test_failed_collective_disables_and_falls_back_to_local(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fail = [False]
    reducer = _fake_world(monkeypatch, 4, lambda r: {"forward": [0.1]}, fail)
    reducer.on_flush(interval(0, {"forward": [0.1]}))
    assert reducer.last_reductions["forward"].n == 4
    fail[0] = True
    caplog.set_level(logging.ERROR, "otel_train")
    reducer.on_flush(interval(1, {"forward": [0.1]}))
    assert reducer.disabled_reason is not None and "Connection closed" in reducer.disabled_reason
    assert caplog.text.count("cross-rank telemetry disabled") == 1
    fail[0] = False
    for seq in (2, 3):
        reducer.on_flush(interval(seq, {"forward": [0.2]}))
    assert reducer.collectives == 2  # never retried
    assert reducer.last_reductions["forward"].n == 1  # local stats only
    assert reducer.last_scores is not None and reducer.last_scores.raw_individual["forward"] == pytest.approx(
        0.5
    )
