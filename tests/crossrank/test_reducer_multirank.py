"""CrossRankReducer on REAL torch.distributed gloo ranks (4 processes, and 2 for the counts).

Each child calls the reducer's `on_flush` directly with synthetic per-rank Intervals, counts every
torch.distributed collective and point-to-point entry point it calls (monkeypatched inside the
child) and reports back.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import pytest
from helpers.multirank import run_ranks

pytestmark = pytest.mark.multirank

COLLECTIVES = (
    "isend",
    "irecv",
    "send",
    "recv",
    "batch_isend_irecv",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_reduce",
    "broadcast",
    "gather",
    "reduce",
    "barrier",
)

BASE = {"data": 0.002, "forward": 0.030, "backward": 0.060, "optimizer": 0.005}
STEP = 0.25  # the gradient all-reduce equalises step time across ranks


def _count_collectives() -> dict[str, int]:
    """Wrap torch.distributed's collective entry points in this process; returns the live counts."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def wrapper(*args: Any, _name: str = name, _orig: Any = original, **kwargs: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapper)
    return counts


def _interval(seq: int, phases: Mapping[str, float]) -> Any:
    """Ten identical steps; each timer's arrival is the sum of the phases up to its end (in order)."""
    from otel_train.core.buffer import Interval

    arrivals: dict[str, list[float]] = {}
    elapsed = 0.0
    for name, value in phases.items():
        elapsed += value
        arrivals[name] = [elapsed] * 10
    return Interval(
        seq=seq,
        step=(seq + 1) * 10 - 1,
        wall_time=time.time(),
        elapsed_s=10 * STEP,
        steps=10,
        tokens=0,
        samples=0,
        step_durations=[STEP] * 10,
        phases={name: [value] * 10 for name, value in phases.items()},
        arrivals=arrivals,
    )


def _phases(rank: int, seq: int, scenario: str) -> dict[str, float]:
    jitter = 1.0 + 0.01 * ((rank * 7 + seq * 3) % 5 - 2)  # deterministic ±2 %
    phases = {name: value * jitter for name, value in BASE.items()}
    if scenario == "compute" and rank == 2:
        phases["forward"] *= 1.5
        phases["backward"] *= 1.5
    if scenario == "data" and rank == 1:
        phases["data"] = 0.050
    if scenario == "timersets":
        if rank == 3:
            phases["rank3_only"] = 0.5
        if rank == 1 and seq == 0:
            del phases["optimizer"]  # rank 1 first runs "optimizer" at the second flush
    phases["allreduce"] = STEP - sum(phases.values())  # fast ranks wait longer in the collective
    return phases


class _Events:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(
        self, event: str, message: str, attributes: Mapping[str, str | int | float] | None = None
    ) -> None:
        self.events.append((event, dict(attributes or {})))


def _gauges(reader: Any) -> dict[str, dict[tuple[tuple[str, Any], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, Any], ...], float]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    out.setdefault(metric.name, {})[tuple(sorted(point.attributes.items()))] = point.value
    return out


def _record_reports(sink: list[list[tuple[int, str, str, str]]], reports: list[Any]) -> None:
    sink.append([(r.rank, r.pattern, r.phase, r.category) for r in reports])


def scenarios_target(
    rank: int, world: int, scenarios: list[str], flushes: int, fanin: int = 16
) -> dict[str, Any]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    assert identity.rank == rank and identity.world_size == world
    config = Config(timing_log_option="all", collective_timeout_s=20.0, exchange_fanin=fanin)
    results: dict[str, Any] = {}
    for scenario in scenarios:
        group = create_telemetry_group(identity, config.collective_timeout_s)
        reader = InMemoryMetricReader()
        meter = MeterProvider(metric_readers=[reader]).get_meter("test")
        events = _Events()
        flagged: list[list[tuple[int, str, str, str]]] = []
        reducer = CrossRankReducer(
            identity,
            meter,
            events,
            config,
            group=group,
            on_straggler=functools.partial(_record_reports, flagged),
        )
        counts = _count_collectives()
        per_flush: list[dict[str, int]] = []
        exchanges: list[int] = []
        first_flag: int | None = None
        for seq in range(flushes):
            before = dict(counts)
            issued = reducer.collectives
            n_flagged = len(flagged)
            reducer.on_flush(_interval(seq, _phases(rank, seq, scenario)))
            per_flush.append({k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)})
            exchanges.append(reducer.collectives - issued)
            if first_flag is None and len(flagged) > n_flagged:
                first_flag = seq
        reductions = reducer.last_reductions
        results[scenario] = {
            "per_flush": per_flush,
            "exchanges": exchanges,
            "counts": dict(counts),
            "first_flag": first_flag,
            "flagged": flagged[-1] if flagged else [],
            "events": events.events,
            "gauges": _gauges(reader),
            "forward_values": reductions["forward"].values,
            "bytes": (reducer.exchange.sent_bytes, reducer.exchange.received_bytes),
            "reductions": {n: (r.n, r.argmin, r.argmax, r.values) for n, r in reductions.items()},
            "disabled": reducer.disabled_reason,
            "fanin": fanin,
        }
        reducer.close()
        import torch.distributed as dist

        for name in COLLECTIVES:  # unwrap before the next scenario
            original = getattr(dist, name, None)
            if original is not None and hasattr(original, "__wrapped__"):
                setattr(dist, name, original.__wrapped__)
    return results


# The star (the default fan-in reaches every rank) and a tree of fan-in 2 (rank 0 -> 1, 3; 1 -> 2):
# four ranks travel whole in the tree's bundles (merge.K_EXACT), so the verdicts are the star's.
@pytest.fixture(scope="module", params=[16, 2], ids=["star", "fanin2"])
def scenario_results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    scenarios = (["balanced", "compute", "data", "timersets"], 5, request.param)
    return run_ranks(4, scenarios_target, scenarios, timeout=90)


def _assert_one_exchange_per_flush(results: list[dict[str, Any]], flushes: int) -> None:
    """Per flush, every rank runs ONE exchange: a rank r > 0 posts one send to and one receive from
    rank 0, rank 0 one of each per peer; no torch collective at all. Bytes: O(1) off rank 0."""
    from otel_train.crossrank.arrival_block import BLOCK_LEN
    from otel_train.crossrank.down_row import DOWN_LEN
    from otel_train.crossrank.exchange import TRAILER_LEN
    from otel_train.crossrank.job_block import JOB_LEN
    from otel_train.crossrank.replicas import EXT_LEN
    from otel_train.crossrank.up_row import pack_len

    world = len(results)
    fanin = next(iter(results[0].values()))["fanin"]
    if fanin < world - 1:
        _assert_one_tree_exchange_per_flush(results, flushes)
        return
    for rank, rank_result in enumerate(results):
        peers = world - 1 if rank == 0 else 1
        for scenario, res in rank_result.items():
            assert res["exchanges"] == [1] * flushes, (scenario, res["exchanges"])
            assert res["per_flush"] == [{"isend": peers, "irecv": peers}] * flushes, (scenario, res["counts"])
            assert res["disabled"] is None
            # the timers' row, the replica block, the job block and the collective arrivals block
            # up, the answer down, each with the exchange's trailer
            up = 8 * (pack_len() + EXT_LEN + JOB_LEN + BLOCK_LEN + TRAILER_LEN)
            down = 8 * (DOWN_LEN + TRAILER_LEN)
            sent, received = (up, down) if rank else (peers * down, peers * up)
            assert res["bytes"] == (flushes * sent, flushes * received), (rank, res["bytes"])


def _assert_one_tree_exchange_per_flush(results: list[dict[str, Any]], flushes: int) -> None:
    """In the tree, per flush: each rank one send and one receive per child (answer and bundle)
    and one of each to its parent; every message a fixed size (merge.bundle_len, TREE_DOWN_LEN)."""
    from otel_train.crossrank.arrival_block import BLOCK_LEN
    from otel_train.crossrank.down_row import TREE_DOWN_LEN
    from otel_train.crossrank.exchange import TRAILER_LEN
    from otel_train.crossrank.merge import bundle_len
    from otel_train.crossrank.replicas import EXT_LEN
    from otel_train.crossrank.tree import layout
    from otel_train.crossrank.up_row import pack_len

    shape = layout(len(results), next(iter(results[0].values()))["fanin"])

    def up(rank: int) -> int:  # a bundle's size depends only on its subtree's size
        ranks = shape.span[rank][1] - shape.span[rank][0]
        return 8 * (bundle_len(pack_len() + EXT_LEN + BLOCK_LEN, pack_len(), ranks) + TRAILER_LEN)

    down = 8 * (TREE_DOWN_LEN + TRAILER_LEN)
    for rank, rank_result in enumerate(results):
        children, parents = shape.children[rank], int(shape.parent[rank] >= 0)
        for scenario, res in rank_result.items():
            assert res["exchanges"] == [1] * flushes, (scenario, res["exchanges"])
            n = len(children) + parents
            assert res["per_flush"] == [{"isend": n, "irecv": n}] * flushes, (scenario, res["counts"])
            assert res["disabled"] is None
            from_children = sum(up(c) for c in children)
            sent, received = len(children) * down + parents * up(rank), from_children + parents * down
            assert res["bytes"] == (flushes * sent, flushes * received), (rank, res["bytes"])


def test_exactly_one_exchange_per_flush(scenario_results: list[dict[str, Any]]) -> None:
    _assert_one_exchange_per_flush(scenario_results, 5)


def test_exactly_one_exchange_per_flush_on_two_ranks() -> None:
    results = run_ranks(2, scenarios_target, (["data"], 4), timeout=90)
    _assert_one_exchange_per_flush(results, 4)
    # rank 1 is slow in data: the verdict reaches both ranks' callbacks, one flush after rank 0 found it
    assert [r["data"]["flagged"] for r in results] == [[(1, "chronic", "data", "data")]] * 2
    assert results[0]["data"]["events"][0][1]["rank"] == 1 and results[1]["data"]["events"] == []


def test_balanced_flags_nothing(scenario_results: list[dict[str, Any]]) -> None:
    for res in (r["balanced"] for r in scenario_results):
        assert res["first_flag"] is None and res["events"] == []


def test_compute_straggler_flagged_with_compute_phase(scenario_results: list[dict[str, Any]]) -> None:
    for rank, rank_result in enumerate(scenario_results):
        res = rank_result["compute"]
        assert res["first_flag"] is not None and res["first_flag"] <= 2  # within 3 flushes
        # every rank's callback sees the same verdict: rank 2 is late by the end of backward (its
        # forward and backward are 1.5x); the others' longer all-reduce (their wait) is never blamed
        assert res["flagged"] == [(2, "chronic", "backward", "compute")]
        if rank == 0:
            (event,) = res["events"]
            assert event[0] == "straggler"
            assert event[1]["rank"] == 2 and event[1]["category"] == "compute" and event[1]["host.name"]
            assert event[1]["sync_phase"] == "allreduce" and event[1]["waiting_ranks"] == "0,1,3"
            cross = res["gauges"]["train.phase.cross_rank"]
            assert cross[(("stat", "argmax_rank"), ("train.phase", "forward"))] == 2
            assert cross[(("stat", "argmin_rank"), ("train.phase", "allreduce"))] == 2  # it waits least
            assert cross[(("stat", "max"), ("train.phase", "forward"))] == pytest.approx(0.045, rel=0.03)
        else:
            assert res["events"] == []
            assert "train.phase.cross_rank" not in res["gauges"]  # rank 0 only
        score = res["gauges"]["train.straggler.score"][
            (("straggler.kind", "relative"), ("train.phase", "all"))
        ]
        assert (score < 0.9) == (rank == 2)
        lateness = res["gauges"]["train.straggler.lateness"][()]
        wait = res["gauges"]["train.straggler.wait"][()]
        if rank == 2:
            assert lateness == pytest.approx(0.045, rel=0.1) and wait == 0.0
        else:
            assert lateness < 0.003 and wait == pytest.approx(0.045, rel=0.1)  # jitter: ±2 %


def test_data_straggler_attributed_to_data(scenario_results: list[dict[str, Any]]) -> None:
    res0 = scenario_results[0]["data"]
    assert res0["flagged"] == [(1, "chronic", "data", "data")]
    (event,) = res0["events"]
    assert event[1]["rank"] == 1 and event[1]["category"] == "data" and event[1]["train.phase"] == "data"


def test_differing_timer_sets_reduce_by_name(scenario_results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(r["timersets"] for r in scenario_results):
        assert res["first_flag"] is None
        if rank != 0:  # only rank 0 holds every rank's row; the others reduce their own timers
            assert {n for n, red in res["reductions"].items() if red[0] != 1} == set()
            assert ("rank3_only" in res["reductions"]) == (rank == 3)
            continue
        reds = res["reductions"]
        n, argmin, argmax, values = reds["rank3_only"]
        assert (n, argmin, argmax, list(values)) == (1, 3, 3, [3])
        assert reds["optimizer"][0] == 4  # rank 1's late timer joined without misalignment
        fwd = reds["forward"][3]
        assert sorted(fwd) == [0, 1, 2, 3]
        assert all(v == pytest.approx(0.030, rel=0.03) for v in fwd.values())


def single_rank_target(rank: int, world: int) -> dict[str, Any]:
    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    counts = _count_collectives()
    group = create_telemetry_group(identity, 5.0)
    reducer = CrossRankReducer(identity, None, None, Config(), group=group)
    for seq in range(3):
        reducer.on_flush(_interval(seq, _phases(rank, seq, "balanced")))
    return {"counts": counts, "collectives": reducer.collectives, "group": group is not None}


def test_world_size_one_issues_no_collective() -> None:
    (res,) = run_ranks(1, single_rank_target, (), timeout=60)
    assert res == {"counts": {}, "collectives": 0, "group": False}


def dead_peer_target(
    rank: int, world: int, mode: str, timeout_s: float, fanin: int = 16, dead: int = 3
) -> dict[str, Any]:
    from otel_train.config import Config
    from otel_train.crossrank.reducer import CrossRankReducer
    from otel_train.distributed import create_telemetry_group, detect_identity

    identity = detect_identity(None)
    config = Config(collective_timeout_s=timeout_s, exchange_grace_s=0.2, exchange_fanin=fanin)
    group = create_telemetry_group(identity, timeout_s)
    reducer = CrossRankReducer(identity, None, None, config, group=group)
    reducer.on_flush(_interval(0, _phases(rank, 0, "balanced")))
    assert reducer.disabled_reason is None
    if rank == dead:
        if mode == "silent":  # alive, but never flushes again (hung training, or finished early)
            time.sleep(timeout_s + 4)
        return {"rank": dead}
    # The others keep flushing: no flush waits for rank 3 past the grace, and once rank 3 has sent
    # nothing for timeout_s, rank 0 turns the exchange off and tells the others in its answers.
    longest, seq, deadline = 0.0, 1, time.monotonic() + 2 * timeout_s + 5
    while reducer.disabled_reason is None and time.monotonic() < deadline:
        time.sleep(0.3)
        start = time.monotonic()
        reducer.on_flush(_interval(seq, _phases(rank, seq, "balanced")))
        longest = max(longest, time.monotonic() - start)
        seq += 1
    collectives = reducer.collectives
    reducer.on_flush(_interval(seq, _phases(rank, seq, "balanced")))  # disabled: no further exchange
    if rank == 0:
        time.sleep(2.0)  # training goes on: the others get the ABORT rank 0 posted at their next flush
    return {
        "longest": longest,
        "disabled": reducer.disabled_reason,
        "collectives_before": collectives,
        "collectives_after": reducer.collectives,
        "partial": reducer.partial_flushes,
    }


# fan-in 2: rank 0 -> 1, 3 and 1 -> 2; rank 1 passes rank 0's ABORT down to rank 2
@pytest.mark.parametrize("fanin", [16, 2], ids=["star", "fanin2"])
@pytest.mark.parametrize("mode", ["exit", "silent"])
def test_dead_peer_disables_instead_of_hanging(mode: str, fanin: int) -> None:
    timeout_s = 3.0
    results = run_ranks(4, dead_peer_target, (mode, timeout_s, fanin), timeout=90)
    for res in results[:3]:
        assert res["disabled"] is not None and "exchange failed" in res["disabled"], results
        assert res["longest"] < timeout_s  # bounded by the grace, never by a peer (generous on CI)
        assert res["collectives_after"] == res["collectives_before"] >= 2
    # rank 0 found rank 3 gone (exit: its connection closed when rank 0 posted the next receive, at
    # once; silent: no row for the timeout, rank 0 going on without it meanwhile) and told the
    # others in its answers
    assert "no row from rank(s) [3]" in results[0]["disabled"]
    if mode == "exit":
        assert "Connection closed" in results[0]["disabled"] and results[0]["partial"] == 0
    else:
        assert "no row for 3 s" in results[0]["disabled"] and results[0]["partial"] >= 1
    # each names the rank that is gone (rank 2 under fan-in 2 hears it from its parent, rank 1)
    assert all("found a failed peer" in res["disabled"] for res in results[1:3])
    assert all(res["disabled"].endswith("rank 3 is gone") for res in results[:3]), results


def test_a_dead_rank_below_an_inner_rank_turns_the_whole_tree_off() -> None:
    """Fan-in 2: rank 2's parent is rank 1, which finds it gone, tells rank 0 at once (a FAILED
    bundle) and rank 0 tells rank 3: nobody waits out a timeout for a rank it does not talk to."""
    timeout_s = 3.0
    results = run_ranks(4, dead_peer_target, ("exit", timeout_s, 2, 2), timeout=90)
    live = [results[r] for r in (0, 1, 3)]
    for res in live:
        assert res["disabled"] is not None and "exchange failed" in res["disabled"], results
        assert res["longest"] < timeout_s
        assert res["collectives_after"] == res["collectives_before"] >= 2
    assert "no row from rank(s) [2]" in results[1]["disabled"]
    assert "a rank below found a failed peer" in results[0]["disabled"]
    assert all(res["disabled"].endswith("rank 2 is gone") for res in live), live


def test_a_mid_tree_rank_that_leaves_is_named_on_every_rank() -> None:
    """Fan-in 2 on 6 ranks: rank 0 -> 1 (its deputy) -> 2, 4; 2 -> 3 and 4 -> 5. Rank 4, in the
    middle of the tree, leaves: its parent (rank 1), rank 0 through rank 1's FAILED bundle, rank 2
    and rank 3 through the ABORT passed down, and its own child (rank 5) all name rank 4."""
    from otel_train.crossrank.tree import layout

    assert layout(6, 2).parent == (-1, 0, 1, 2, 1, 4)
    results = run_ranks(6, dead_peer_target, ("exit", 3.0, 2, 4), timeout=120)
    live = [results[r] for r in (0, 1, 2, 3, 5)]
    for res in live:
        assert res["disabled"] is not None and "exchange failed" in res["disabled"], results
        assert res["disabled"].endswith("rank 4 is gone"), results
