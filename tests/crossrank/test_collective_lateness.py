"""Straggler culprits from arrival lateness at collectives (PyTorch's Flight Recorder), without
user timers: the clock-offset estimator and its bound, the matching on rank 0, and real FSDP2 /
HF Trainer jobs on gloo ranks."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.multirank import DEFAULT_FR, run_ranks

from otel_train.crossrank.arrival_block import (
    BLOCK_LEN,
    MAX_ARRIVALS,
    Arrival,
    Row,
    decode,
    encode,
    sample,
    span,
    window,
)
from otel_train.crossrank.collective_lateness import (
    PENDING_FLUSHES,
    PENDING_S,
    ClockEstimator,
    LatenessTracker,
    Verdict,
    apply,
    judge,
    lost_in,
)
from otel_train.crossrank.spread import Spread
from otel_train.crossrank.up_row import TimerStats, name_id
from otel_train.crossrank.verdicts import Lateness, RankAssessment, RankView

FR_ON = {"TORCH_FR_BUFFER_SIZE": "200"}
# Real jobs here are seconds long: reads may take 2 % of wall time (not 0.2 %) so that a verdict
# comes within them. Each read holds the GIL (~17 us an entry): rank by rank, that is lateness.
READ_SHARE = 0.02


# --- the clock ---------------------------------------------------------------------------------------


def test_offset_lies_within_the_round_trip_bound_and_the_tightest_is_kept() -> None:
    """Leaf clock 5 s behind rank 0 (offset +5 s); one-way delays 1 ms / 3 ms, then 0.1 / 0.1 ms."""
    est = ClockEstimator()
    assert est.estimate(0.0) == (0.0, math.inf)  # nothing measured: no bound at all
    t1 = 100.0
    est.add(t1, t1 + 5.0 + 0.001, t1 + 5.0 + 0.002, t1 + 0.002 + 0.003)
    offset, bound = est.estimate(t1 + 0.005)
    assert offset - bound <= 5.0 <= offset + bound and bound == pytest.approx(0.002)
    t1 = 110.0
    est.add(t1, t1 + 5.0 + 0.0001, t1 + 5.0 + 0.0002, t1 + 0.0003)
    offset, bound = est.estimate(t1 + 0.0003)
    assert offset == pytest.approx(5.0) and bound == pytest.approx(0.0001)
    est.add(120.0, 125.01, 125.02, 120.03)  # a slow round trip: looser, not kept
    assert est.estimate(120.03)[1] < 0.001
    est.add(1.0, math.nan, 2.0, 3.0)  # rank 0 sent no stamp (an aborted exchange): ignored
    assert est.estimate(120.03)[1] < 0.001


def _rows(arrivals: dict[int, list[float]], offsets: dict[int, float], bounds: dict[int, float]) -> list[Row]:
    """Rows of one read: rank -> its arrival (own clock) at collectives seq 1..n of group '0'."""
    group = name_id("0")
    return [
        Row(
            rank,
            7,
            offsets[rank],
            bounds[rank],
            len(times),
            1,
            {(group, i + 1): t for i, t in enumerate(times)},
        )
        for rank, times in arrivals.items()
    ]


def _arrivals(late_rank: int, late_s: float, skews: dict[int, float], n: int = 8) -> dict[int, list[float]]:
    """4 ranks; collective i at 1000 + i/10 s on rank 0's clock; `late_rank` that much later;
    each rank's clock reads `skews[rank]` ahead of rank 0's; a little noise (< FLOOR_S)."""
    return {
        rank: [
            1000.0
            + i / 10
            + skews.get(rank, 0.0)
            + (late_s if rank == late_rank else 0.0)
            + 1e-5 * ((rank * 7 + i) % 5)
            for i in range(n)
        ]
        for rank in range(4)
    }


def test_an_injected_clock_offset_is_corrected_and_the_late_rank_named() -> None:
    skews = {3: 2.5, 1: -0.7}  # rank 3's host clock 2.5 s ahead, rank 1's 0.7 s behind
    offsets = {rank: -skews.get(rank, 0.0) for rank in range(4)}  # what the estimator measures
    bounds = {0: 0.0, 1: 0.0002, 2: 0.0002, 3: 0.0002}
    verdict = judge(_rows(_arrivals(2, 0.012, skews), offsets, bounds), 4)
    assert verdict is not None and verdict.abstain is None
    assert verdict.culprit == 2 and verdict.seconds == pytest.approx(8 * 0.012, rel=0.01)
    assert verdict.waits is not None and sorted(verdict.waits) == [0, 1, 3] and verdict.waiting == (0, 1, 3)
    assert all(w == pytest.approx(8 * 0.012, rel=0.01) for w in verdict.waits.values())
    # The same rows without the correction blame rank 3, whose clock runs ahead: the test has teeth.
    uncorrected = judge(_rows(_arrivals(2, 0.012, skews), dict.fromkeys(range(4), 0.0), bounds), 4)
    assert uncorrected is not None and uncorrected.culprit == 3


def test_one_long_stall_does_not_outweigh_a_rank_late_at_every_collective() -> None:
    arrivals = _arrivals(2, 0.004, {})
    arrivals[3][5] += 0.300  # rank 3 stalled once, 300 ms (its other collectives on time)
    arrivals[3][6] += 0.002
    arrivals[3][7] += 0.002
    verdict = judge(_rows(arrivals, dict.fromkeys(range(4), 0.0), dict.fromkeys(range(4), 0.0)), 4)
    assert verdict is not None and verdict.culprit == 2


def test_a_clock_bound_wider_than_the_lateness_abstains() -> None:
    bounds = {0: 0.0, 1: 0.020, 2: 0.020, 3: 0.020}  # hosts known only to +-20 ms; lateness 12 ms
    verdict = judge(_rows(_arrivals(2, 0.012, {}), dict.fromkeys(range(4), 0.0), bounds), 4)
    assert verdict is not None and verdict.culprit == -1 and verdict.unclear == 8
    assert verdict.abstain is not None and "clocks" in verdict.abstain
    tighter = judge(
        _rows(
            _arrivals(2, 0.012, {}), dict.fromkeys(range(4), 0.0), {**bounds, 1: 0.001, 2: 0.001, 3: 0.001}
        ),
        4,
    )
    assert tighter is not None and tighter.culprit == 2  # the same lateness with tight clocks: named


def test_a_collective_enqueued_without_waiting_does_not_count_the_wait_again() -> None:
    """HF Trainer under DDP, one rank 30 ms slower in each of 2 micro-batches: per step a gather
    on time, a gather where the others wait 30 ms for it, DDP's gradient all_reduce 30 ms late and a
    small all_reduce the others enqueue 0.1 ms after it without waiting (both asynchronous). The
    rank is late 60 ms a step, not 90: the last one is judged after the all_reduce before it."""
    group, steps = name_id("0"), 8
    times: dict[int, list[float]] = {rank: [] for rank in range(4)}
    for step in range(steps):
        base = 1000.0 + 0.2 * step
        for rank in range(4):
            slow = 0.03 if rank == 1 else 0.0
            times[rank] += [base, base + 0.05 + slow, base + 0.13 + slow, base + 0.1301 + slow]
    rows = [
        Row(rank, 7, 0.0, 0.0, len(t), steps, {(group, i + 1): at for i, at in enumerate(t)})
        for rank, t in times.items()
    ]
    verdict = judge(rows, 4)
    assert verdict is not None and verdict.culprit == 1
    assert verdict.seconds == pytest.approx(0.060, rel=0.05)
    assert verdict.waits is not None and all(
        w == pytest.approx(0.060, rel=0.05) for w in verdict.waits.values()
    )


@pytest.mark.parametrize(
    "lateness",
    [
        [0.030, 0.0006, 0.030, 0.0006, 0.030, 0.0006, 0.030, 0.0],  # mostly 30 ms
        [0.030, 0.0006, 0.030, 0.0006, 0.0006, 0.0006, 0.030, 0.0006],  # mostly 0.6 ms (a loaded host)
    ],
)
def test_collectives_where_the_culprit_was_barely_last_weigh_what_it_lost_there(
    lateness: list[float],
) -> None:
    """Rank 2 is 30 ms late at some collectives and 0.6 ms (just above FLOOR_S) at others: the read
    holds their sum, not every one at the median (210 ms for the first, 4.8 ms for the second)."""
    arrivals = _arrivals(2, 0.0, {})
    for i, late in enumerate(lateness):
        arrivals[2][i] += late
    verdict = judge(_rows(arrivals, dict.fromkeys(range(4), 0.0), dict.fromkeys(range(4), 0.0)), 4)
    assert verdict is not None and verdict.culprit == 2
    assert verdict.seconds == pytest.approx(sum(lateness), abs=0.002)


def test_ranks_arriving_in_noise_or_a_partial_read_name_nobody() -> None:
    bounds = {0: 0.0, 1: 0.0001, 2: 0.0001, 3: 0.0001}
    verdict = judge(_rows(_arrivals(2, 0.0, {}), dict.fromkeys(range(4), 0.0), bounds), 4)
    assert verdict is not None and verdict.culprit == -1 and verdict.abstain is None and verdict.matched == 8
    rows = _rows(_arrivals(2, 0.012, {}), dict.fromkeys(range(4), 0.0), bounds)
    assert judge(rows[:3], 4) is None  # a rank's row of that read is missing


# --- the block -----------------------------------------------------------------------------------


def _entry(seq: int, at_ns: int, group: str = "0", op: str = "gloo:all_gather") -> dict[str, Any]:
    return {
        "process_group": [group, "default_pg"], "collective_seq_id": seq, "profiling_name": op,
        "time_created_ns": at_ns, "is_p2p": False,
    }  # fmt: skip


def test_ranks_pick_the_same_collectives_and_the_block_round_trips() -> None:
    """Two ranks whose windows hold the same 100 collectives (enqueued at different times) pick
    the same ids; the telemetry group and collectives outside the window are left out."""
    entries = [_entry(s, 10**9 * 5 + s * 10**6) for s in range(1, 101)]
    later = [_entry(s, 10**9 * 5 + s * 10**6 + 777_000) for s in range(1, 101)]
    extra = [_entry(1, 10**9 * 5, group="telemetry"), _entry(200, 10**9 * 9)]
    mine = window(entries + extra, {"telemetry"}, after=4.0, until=6.0)
    theirs = window(later + extra, {"telemetry"}, after=4.0, until=6.0)
    assert len(mine) == len(theirs) == 100
    a, b = sample(mine, read_seq=3), sample(theirs, read_seq=3)
    assert [x.seq for x in a] == [x.seq for x in b] and 0 < len(a) <= MAX_ARRIVALS
    assert [x.seq for x in sample(mine, read_seq=4)] != [x.seq for x in a]  # rotates with the read
    runs = sum(1 for x, y in pairwise(a) if y.seq != x.seq + 1)
    assert runs < len(a) // 4, [x.seq for x in a]  # mostly consecutive: each judged after the one before
    block = encode(3, -0.25, 0.001, len(mine), 5, a)
    assert len(block) == BLOCK_LEN
    row = decode(2, block)
    assert row is not None and (row.rank, row.read_seq, row.offset, row.bound, row.window, row.steps) == (
        2, 3, -0.25, 0.001, 100, 5,
    )  # fmt: skip
    assert row.arrivals == {x.key: x.at for x in a}
    assert decode(2, [0.0] * BLOCK_LEN) is None  # nothing read yet


def test_a_wrapped_ring_buffer_on_one_rank_picks_the_same_collectives() -> None:
    """Rank A still holds the whole window of 1000 collectives; rank B's buffer lost the first 400."""
    full = window([_entry(s, 10**9 * 5 + s * 10**6) for s in range(1, 1001)], set(), 4.0, 7.0)
    wrapped = full[400:]
    a, b = sample(span(full), read_seq=2), sample(span(wrapped), read_seq=2)
    assert [x.key for x in a] == [x.key for x in b] and len(a) == MAX_ARRIVALS


class _Budget:
    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self.excluded: set[str] = set()

    def may_read(self) -> bool:
        return self.allowed


def test_rank_0_asks_every_rank_to_read_after_the_first_answer_within_the_read_budget() -> None:
    """The first answer only starts the window (setup and warm-up lie before it): a read then would
    spend the budget on nothing."""
    tracker = LatenessTracker(0)
    tracker.monitor = _Budget(True)  # type: ignore[assignment]
    assert not tracker.wants_read()
    first = SimpleNamespace(read_recorder=False, root_times=(0.0, 0.0))
    tracker.after_exchange(SimpleNamespace(steps=5, wall_time=100.0, seq=0), first, (0.0, 0.0))  # type: ignore[arg-type]
    assert tracker.wants_read()
    tracker.monitor = _Budget(False)  # type: ignore[assignment]
    assert not tracker.wants_read()


def test_the_collective_is_named_by_op_place_in_the_step_and_timer() -> None:
    """Rank 0's window: 2 steps of [all_gather, all_gather, reduce_scatter]; the last step began at
    t=10 s; timers forward (ends 0.05 s into the step) and backward (0.2 s)."""
    tracker = LatenessTracker(0)
    ops = ["all_gather", "all_gather", "reduce_scatter"]
    times = [9.0, 9.06, 9.3, 10.0, 10.07, 10.1]
    arrivals = [Arrival("0", "default_pg", i + 1, ops[i % 3], t) for i, t in enumerate(times)]
    tracker._own = {5: (arrivals, 2, 10.0, {})}
    ends = {"forward": 0.05, "backward": 0.2}
    assert tracker.name(5, (name_id("0"), 2), ends) == (
        "all_gather #2 in 'backward' (default_pg)",
        "backward",
    )
    assert tracker.name(5, (name_id("0"), 4), ends) == ("all_gather #1 in 'forward' (default_pg)", "forward")
    assert tracker.name(5, (name_id("0"), 6), {}) == ("reduce_scatter #1 of the step (default_pg)", None)
    assert tracker.name(6, (name_id("0"), 6), {}) == ("a collective", None)  # not that read's window
    # the last step's own forward ended at 0.04 s, before its second all_gather (0.07 s): that
    # step's timers place it, whatever the forward's typical end
    tracker._own = {5: (arrivals, 2, 10.0, {"forward": 0.04, "backward": 0.2})}
    assert tracker.name(5, (name_id("0"), 5), {"forward": 0.09}) == (
        "all_gather #2 in 'backward' (default_pg)",
        "backward",
    )


def test_rank_0_keeps_the_timer_ends_of_its_reads_last_step() -> None:
    """Only timers that ran once in every step of the interval: their last arrival is the last
    step's (one run in some steps only could be an earlier step's); with that step's start."""
    tracker = LatenessTracker(0)
    tracker.monitor = SimpleNamespace(read=lambda seq, force: {"entries": []}, excluded=set())  # type: ignore[assignment]
    answer = SimpleNamespace(read_recorder=True, root_times=(0.0, 0.0))
    tracker.after_exchange(SimpleNamespace(steps=4, wall_time=99.0, seq=0), answer, (0.0, 0.0))  # type: ignore[arg-type]
    interval = SimpleNamespace(
        steps=3,
        wall_time=100.0,
        seq=1,
        step_durations=[0.5, 0.5, 0.4],
        last_step_start=99.5,  # the flush ran 0.1 s after the last step's end
        arrivals={"forward": [0.2, 0.3, 0.1], "backward": [0.45, 0.45, 0.35], "eval": [0.3]},
    )
    tracker.after_exchange(interval, answer, (0.0, 0.0))  # type: ignore[arg-type]
    assert tracker._own[1][2:] == (99.5, {"forward": 0.1, "backward": 0.35})


def test_the_culprit_is_placed_in_the_timer_it_spends_longer_in_than_the_others() -> None:
    """4 micro-batches a step: rank 1's backward takes 30 ms a step longer; rank 0 waits for it in
    `data` (a broadcast at each batch's start). Its lateness at that collective is 40 ms a step."""

    def view(rank: int, seconds: dict[str, float]) -> RankView:
        timers = {n: TimerStats(32, s / 4, Spread(8, 0.1, 0.1, 0.0)) for n, s in seconds.items()}  # 8 steps
        return RankView(rank, "h", rank, Spread(8, 0.2, 0.2, 0.0), {}, timers=timers)

    views = [
        view(0, {"data": 0.045, "forward": 0.04, "backward": 0.05}),
        view(1, {"data": 0.015, "forward": 0.04, "backward": 0.08}),
        view(2, {"data": 0.044, "forward": 0.041, "backward": 0.051}),
    ]
    assert lost_in(views, 1, 0.040) == "backward"
    assert lost_in(views, 1, 0.150) is None  # explains under a quarter: the collective's timer stays
    assert lost_in(views, 5, 0.040) is None  # a culprit whose row is not among the views
    assert lost_in(views, 1, 0.0) is None  # no lateness to explain


@pytest.mark.parametrize(("timers_s", "phase"), [(0.0, "backward"), (0.003, "backward"), (0.030, "forward")])
def test_the_timers_phase_stands_only_when_they_saw_most_of_the_lateness(timers_s: float, phase: str) -> None:
    """Rank 1 is 40 ms late a step at the collectives. Timers that saw 3 ms of it in `forward` saw
    noise beside it: the phase given (its slowest timer's) stands. Timers that saw 30 ms: theirs."""
    seen = Lateness(timers_s, "forward", "backward") if timers_s else Lateness()
    assessments = [RankAssessment(0, 0, "h", 0, 0.2), RankAssessment(1, 1, "h", 1, 0.2, chronic=seen)]
    verdict = Verdict(7, 40, 30, 0, culprit=1, seconds=0.040, key=(1, 2), waits={0: 0.04}, waiting=(0,))
    apply(assessments, verdict, "broadcast #1 in 'data' (default_pg)", "backward")
    culprit = assessments[1].chronic
    assert (culprit.late_in, culprit.seconds) == (phase, pytest.approx(max(0.040, timers_s)))
    assert culprit.collective == "broadcast #1 in 'data' (default_pg)"
    assert (assessments[1].waiting_ranks, assessments[0].chronic.seconds) == ((0,), 0.0)


def test_new_reports_wait_for_a_verdict_that_names_a_culprit_or_abstains() -> None:
    """A read whose window names nobody (too few collectives where a rank was late) does not let the
    timers' reports out without the collective; a verdict that names a culprit, says why it
    cannot, or found no collective common to the ranks does; and PENDING_FLUSHES exchanges and
    PENDING_S seconds from the first, whichever ends later, bound the wait."""
    tracker = LatenessTracker(0)
    assert not tracker.pending()  # no recorder: nothing to wait for
    tracker.monitor = _Budget(True)  # type: ignore[assignment]
    assert tracker.pending()  # the first read is on its way
    tracker.verdict = Verdict(read_seq=1, matched=22, resolved=21, unclear=0)  # nobody named
    assert tracker.pending()
    tracker.verdict = replace(tracker.verdict, abstain="the clocks")
    assert not tracker.pending()
    tracker.verdict = Verdict(read_seq=2, matched=22, resolved=22, unclear=0, culprit=2)
    assert not tracker.pending()
    tracker.verdict = Verdict(read_seq=3, matched=0, resolved=0, unclear=0)  # independent ranks
    assert not tracker.pending()
    tracker.verdict = Verdict(read_seq=4, matched=22, resolved=21, unclear=0)
    assert tracker.pending()
    tracker._exchanges = PENDING_FLUSHES + 1
    assert tracker.pending()  # flushes every step: more than 8 may pass before the second read
    tracker._first_exchange = time.monotonic() - PENDING_S
    assert not tracker.pending()
    tracker._exchanges = PENDING_FLUSHES
    assert tracker.pending()  # long flushes: 8 of them may outlast PENDING_S


def test_without_a_recorder_rank_0_never_asks_for_reads_and_sends_an_empty_block() -> None:
    tracker = LatenessTracker(0)
    assert not tracker.wants_read()
    assert decode(0, tracker.block().tolist()) is None
    assert tracker.abstain("the timers' reason") == "the timers' reason"  # today's behaviour


# --- real jobs -------------------------------------------------------------------------------------

STEPS = 60
LAYERS = 3
# Rank 2's extra compute per layer. With 4 ms, rank 2 went unnamed in 2 of 6 runs beside one busy
# process (4 ranks on 2 cores, a CI machine's own load); with 8 ms, in none of 8.
EXTRA_S = 0.008


def _fsdp_rank(rank: int, world: int, timers: bool, skew_s: float, out: str) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    import otel_train as ot
    from otel_train.diagnostics import collectives
    from otel_train.testing import current_session

    collectives.MAX_READ_SHARE = READ_SHARE
    events: list[dict[str, Any]] = []
    if rank == 3 and skew_s:
        import socket

        socket.gethostname = lambda: "other-host"  # another host: its own clock, offset estimated
    ot.init(
        output_dir=out,
        run_name="fsdp",
        verbosity=0,
        log_interval=5,
        hardware=False,
        collective_timeout_s=60.0,
    )
    session = current_session()
    session.events.add_callback(lambda e, m, a: events.append({"event": e, "message": m, **a}))
    if rank == 3 and skew_s:
        session.reducer.lateness.skew_s = skew_s  # this host's clock reads off: recorder and exchange
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(LAYERS)]
    model = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer)
        if rank == 2:  # a slower device: slower in every layer, between the all-gathers
            layer.register_forward_hook(lambda *_: time.sleep(EXTRA_S))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 64)
    for step in range(STEPS):
        with ot.step(step, samples=8):
            if not timers:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                continue
            with ot.timer("data"):
                batch = x.clone()
            with ot.timer("forward"):
                loss = model(batch).pow(2).mean()
            with ot.timer("backward"):
                loss.backward()
            with ot.timer("optimizer"):
                opt.step()
                opt.zero_grad()
    reducer = session.reducer
    ot.shutdown()
    verdict = reducer.lateness.verdict
    return {
        "stragglers": [e for e in events if e["event"] == "straggler"],
        "abstain": reducer.abstain_reason,
        "matched": verdict.matched if verdict else 0,
        "offset": reducer.lateness.estimator.estimate(time.time() + skew_s)[0] if rank == 3 else 0.0,
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("timers", "skew_s", "fanin"),
    [(False, 3.0, 16), (True, 0.0, 16), (False, 3.0, 2)],
    ids=["only-step-skewed-clock", "timers", "only-step-skewed-clock-fanin2"],
)
def test_fsdp2_slow_rank_named_from_collective_arrivals(
    timers: bool, skew_s: float, fanin: int, tmp_path: Path
) -> None:
    """4 gloo ranks, FSDP2, rank 2 slower in every layer's forward: only rank 2 is named (chronic),
    the collective where the others wait is named, and rank 3's clock (3 s ahead in the first
    case, whose ring buffer also wraps between reads) is corrected rather than blamed. The
    timer-only detector abstains here ("sharded")."""
    # Without timers, a ring buffer smaller than a flush's collectives: it wraps between reads.
    env = FR_ON if timers else {"TORCH_FR_BUFFER_SIZE": "40"}
    # fan-in 2: rank 0 -> 1, 3 and 1 -> 2 (rank 3, on the other host, answers to rank 0 itself)
    env = {**env, "OTEL_TRAIN_EXCHANGE_FANIN": str(fanin)}
    results = run_ranks(4, _fsdp_rank, (timers, skew_s, str(tmp_path)), timeout=300, env=env)
    root = results[0]
    reported = root["stragglers"]
    assert root["matched"] > 0 and root["abstain"] is None, root
    assert reported and {e["rank"] for e in reported} == {2}, reported
    first = reported[0]
    assert first["pattern"] == "chronic" and first["waiting_ranks"] == "0,1,3", first
    assert first["collective"].split(" ")[0] in ("all_gather", "reduce_scatter", "all_reduce"), first
    if timers:  # the window holds whole steps: the collective is placed in rank 0's timers
        assert " in 'forward' " in first["collective"] or " in 'backward' " in first["collective"], first
    if skew_s:
        assert results[3]["offset"] == pytest.approx(-skew_s, abs=0.05)


def _hf_rank(rank: int, world: int, out: str) -> dict[str, Any]:
    from integrations.test_transformers import SlowRows, _trainer

    import otel_train as ot
    from otel_train.diagnostics import collectives
    from otel_train.integrations.transformers import OtelTrainCallback
    from otel_train.testing import current_session

    collectives.MAX_READ_SHARE = READ_SHARE
    ot.init(verbosity=0, log_interval=4, hardware=False, prometheus_port=0, collective_timeout_s=60.0)
    session = current_session()
    events: list[dict[str, Any]] = []
    session.events.add_callback(
        lambda event, message, attrs: events.append({"event": event, "message": message, **attrs})
    )
    dataset = SlowRows(256, 0.015 if rank == 1 else 0.0)  # +60 ms per step on rank 1
    trainer = _trainer(
        Path(out) / f"hf-out{rank}", OtelTrainCallback(), max_steps=24, ddp=True,
        dataset=dataset, eval_strategy="no", save_strategy="no",
    )  # fmt: skip
    trainer.train()
    ot.shutdown()
    return {"stragglers": [e for e in events if e["event"] == "straggler"]}


@pytest.mark.multirank
def test_hf_trainer_ddp_names_the_slow_rank_and_the_collective_where_the_others_wait(tmp_path: Path) -> None:
    """2 gloo ranks, the callback alone, rank 1's dataset slow: rank 1 named, once, and its event
    names the collective where rank 0 waits for it."""
    results = run_ranks(2, _hf_rank, (str(tmp_path),), timeout=240, env=FR_ON)
    reported = results[0]["stragglers"]
    assert reported and {e["rank"] for e in reported} == {1}, reported
    first = reported[0]
    # The first collective after the data: the Trainer's gather of the tokens seen
    # (include_num_input_tokens_seen), in the callback's `data_sync`; DDP's all-reduce comes later.
    assert first["collective"].startswith("all_gather"), first
    assert first["collective"] in first["message"], first


def _lightning_rank(rank: int, world: int, out: str) -> list[dict[str, Any]]:
    from integrations.test_lightning import TinyRegression, _loader
    from lightning.pytorch import Trainer

    import otel_train as ot
    from otel_train.diagnostics import collectives
    from otel_train.integrations.lightning import OtelTrainLogger
    from otel_train.testing import current_session

    class SlowBackward(TinyRegression):
        def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
            if rank == 1:
                time.sleep(0.010)  # a slower device's backward, before DDP's all-reduce
            super().backward(loss, *args, **kwargs)

    collectives.MAX_READ_SHARE = READ_SHARE
    ot.init(output_dir=out, run_name="pl", verbosity=0, log_interval=5, hardware=False,
            prometheus_port=0, collective_timeout_s=60.0)  # fmt: skip
    events: list[dict[str, Any]] = []
    current_session().events.add_callback(
        lambda event, message, attrs: (
            events.append({"message": message, **attrs}) if event == "straggler" else None
        )
    )
    trainer = Trainer(
        max_steps=40, accumulate_grad_batches=4, accelerator="cpu", devices=world, strategy="ddp",
        logger=OtelTrainLogger(), limit_val_batches=0, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(SlowBackward(), _loader(2048))
    ot.shutdown()
    return events


@pytest.mark.multirank
def test_lightning_ddp_names_a_rank_slow_in_backward_from_collective_arrivals(tmp_path: Path) -> None:
    """2 gloo ranks, the logger alone, 4 micro-batches a step, rank 1 slower in every backward.
    Lightning broadcasts at every batch's start (its SIGTERM check), so rank 0 waits for rank 1
    there, inside the logger's `data`, as well as in DDP's all-reduce: the timers' arrivals at their
    last ends are even, and only the collectives' arrivals name rank 1."""
    reported = run_ranks(2, _lightning_rank, (str(tmp_path),), timeout=240, env=FR_ON)[0]
    assert reported and {e["rank"] for e in reported} == {1}, reported
    first = reported[0]
    assert first["pattern"] == "chronic" and first["waiting_ranks"] == "0", first
    assert first["collective"] and first["collective"] in first["message"], first
    # where it lost the time: its backward takes longer per step than rank 0's, whatever the
    # collective (the broadcast in `data` or DDP's all-reduce in `backward`)
    assert (first["train.phase"], first["category"]) == ("backward", "compute"), first


def _ddp_rank(
    rank: int,
    world: int,
    out: str,
    log_interval: int,
    read_share: float | None,
    short_last: bool,
    flush_lag_s: float = 0.0,
) -> list[dict[str, Any]]:
    """DDP, rank 1 20 ms slower in forward; the default recorder, and the default read budget
    unless `read_share`. `short_last`: rank 0's forward takes under a millisecond in the last step
    of each flush interval, not 10 ms (inputs of uneven length). `flush_lag_s`: rank 0's flushes
    run that long after their step's end (a loaded machine)."""
    import torch

    import otel_train as ot
    from otel_train.core.buffer import Buffer
    from otel_train.diagnostics import collectives
    from otel_train.testing import current_session

    if read_share is not None:
        collectives.MAX_READ_SHARE = read_share
    if rank == 0 and flush_lag_s:
        take = Buffer.take

        def late_take(self: Buffer, *args: Any) -> Any:
            time.sleep(flush_lag_s)
            return take(self, *args)

        Buffer.take = late_take  # type: ignore[method-assign]

    ot.init(output_dir=out, run_name="ddp", verbosity=0, log_interval=log_interval, hardware=False,
            prometheus_port=0, collective_timeout_s=60.0)  # fmt: skip
    events: list[dict[str, Any]] = []
    current_session().events.add_callback(
        lambda event, message, attrs: events.append(dict(attrs)) if event == "straggler" else None
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(80):
        short = short_last and step % log_interval == log_interval - 1
        with ot.step(step):
            with ot.timer("forward"):
                loss = model(torch.randn(8, 16)).pow(2).mean()
                time.sleep(0.03 if rank == 1 else 0.0 if short else 0.01)
            with ot.timer("backward"):
                loss.backward()  # DDP's all-reduce: rank 0 waits here
            with ot.timer("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    ot.shutdown()
    return events


@pytest.mark.multirank
def test_a_job_flushing_every_step_still_names_the_collective(tmp_path: Path) -> None:
    """The first read's window is one step, one all-reduce: too few to name anyone, and the read
    budget spaces the next one out past 8 flushes. The report waits (PENDING_S) for it."""
    (first,) = run_ranks(2, _ddp_rank, (str(tmp_path), 1, None, False), timeout=240, env=DEFAULT_FR)[0]
    assert (first["rank"], first["train.phase"], first["pattern"]) == (1, "forward", "chronic"), first
    # enqueued a fraction of a millisecond after rank 0's forward ends, placed by the step's exact start
    assert first["collective"] == "all_reduce #1 in 'backward' (default_pg)", first
    assert first["lateness_ms"] == pytest.approx(20, rel=0.35), first


@pytest.mark.multirank
def test_a_report_waiting_for_a_verdict_that_never_comes_goes_out_at_the_last_flush(tmp_path: Path) -> None:
    """No read after the first (a budget that allows none): the verdict never names anyone, and the
    job ends before PENDING_S. Its last flush holds nothing back: the timers' report goes out."""
    (first,) = run_ranks(2, _ddp_rank, (str(tmp_path), 1, 1e-12, False), timeout=240, env=DEFAULT_FR)[0]
    assert (first["rank"], first["train.phase"], first["pattern"]) == (1, "forward", "chronic"), first
    assert first["collective"] == "", first


@pytest.mark.multirank
def test_the_collective_is_placed_by_the_timers_of_its_own_step(tmp_path: Path) -> None:
    """A flush every 4 steps, rank 0's forward short in the last: the all-reduce of the read's
    last step comes a fraction of a millisecond after rank 0's forward ends in that step, long
    before the forward usually ends. Its own step's timers place it in `backward`; the window's
    typical (median) forward end would place it in `forward`. Rank 0's flushes run 5 ms after
    their step's end: the step's start, taken as the flush's time less the step's duration, would
    be 5 ms late and place it in `forward` too."""
    args = (str(tmp_path), 4, READ_SHARE, True, 0.005)
    (first,) = run_ranks(2, _ddp_rank, args, timeout=240, env=DEFAULT_FR)[0]
    assert (first["rank"], first["train.phase"], first["pattern"]) == (1, "forward", "chronic"), first
    assert first["collective"] == "all_reduce #1 in 'backward' (default_pg)", first


def test_the_answer_carries_rank_0s_clock_stamps_and_the_read_request() -> None:
    from otel_train.crossrank import down_row

    rows = down_row.answers(3, 5, None, read_recorder=True)
    rows[2, down_row.D_T2], rows[2, down_row.D_T3] = 1000.25, 1000.5
    down = down_row.decode(rows[2], 2)
    assert down.read_recorder and down.root_times == (1000.25, 1000.5)
    plain = down_row.decode(down_row.answers(3, 5, None)[1], 1)
    assert not plain.read_recorder and all(math.isnan(t) for t in plain.root_times)
