"""The straggler model on simulated synchronous jobs (no process group): per-step wall clocks of N
ranks with a barrier at the end of chosen phases, turned into each rank's Interval exactly as the
session records it (durations and arrivals), packed and unpacked through the wire format."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from otel_train.core.buffer import Interval
from otel_train.crossrank.scores import StragglerReport, StragglerScorer, describe
from otel_train.crossrank.spread import Spread
from otel_train.crossrank.up_row import TimerTable, pack, unpack
from otel_train.crossrank.verdicts import (
    Lateness,
    RankAssessment,
    RankView,
    Settings,
    _median_without,
    _medians_without,
    abstain_reason,
    assess,
    holds_collective,
    phase_category,
)
from otel_train.distributed import Identity

DDP = (("data", 0.004), ("forward", 0.030), ("backward", 0.030), ("optimizer", 0.006))


@dataclass
class Job:
    """A simulated job: `sync` = phases whose END is a collective every rank waits at."""

    world: int
    phases: Sequence[tuple[str, float]] = DDP
    sync: frozenset[str] = frozenset({"backward"})
    slow: Mapping[tuple[int, str], float] = field(default_factory=dict)  # (rank, phase) -> factor
    stalls: Mapping[tuple[int, int, str], float] = field(default_factory=dict)  # (rank, step, phase) -> s
    # phase -> process groups whose collective ends it (each group waits for its own latest rank)
    groups: Mapping[str, Sequence[Sequence[int]]] = field(default_factory=dict)
    jitter: float = 0.02  # relative noise of every phase
    seed: int = 0
    # Gradient accumulation: `micro` runs a step of the phases in `repeat` (placed before the others),
    # a sync phase synchronizing only in its last run (`no_sync()`); a timer's arrival is its last end.
    micro: int = 1
    repeat: frozenset[str] = frozenset({"data", "forward", "backward"})
    untimed: frozenset[str] = frozenset()  # phases that take time but run in no timer

    def __post_init__(self) -> None:
        self.clock = [0.0] * self.world
        self.step = 0
        self.rng = random.Random(self.seed)

    def interval(self, steps: int, seq: int) -> list[Interval]:
        out = [Interval(seq, 0, 0.0, 0.0, steps, 0, 0) for _ in range(self.world)]
        for _ in range(steps):
            start = list(self.clock)
            runs = [(n, b, True) for n, b in self.phases]
            if self.micro > 1:
                runs = [
                    (n, b, m == self.micro - 1)
                    for m in range(self.micro)
                    for n, b, _ in runs
                    if n in self.repeat
                ]
                runs += [(n, b, True) for n, b in self.phases if n not in self.repeat]
            for name, base, last in runs:
                before = list(self.clock)
                for r in range(self.world):
                    work = base * self.slow.get((r, name), 1.0) * (1 + self.jitter * self.rng.uniform(-1, 1))
                    self.clock[r] += work + self.stalls.get((r, self.step, name), 0.0)
                if name in self.sync and last:
                    latest = max(self.clock)
                    self.clock = [latest] * self.world
                for group in self.groups.get(name, ()):
                    latest = max(self.clock[r] for r in group)
                    for r in group:
                        self.clock[r] = latest
                for r in range(self.world):
                    if name in self.untimed:
                        continue
                    out[r].phases.setdefault(name, []).append(self.clock[r] - before[r])
                    if last:
                        out[r].arrivals.setdefault(name, []).append(self.clock[r] - start[r])
            for r in range(self.world):
                out[r].step_durations.append(self.clock[r] - start[r])
            self.step += 1
        for iv in out:
            iv.step = self.step - 1
        return out


def _views(intervals: Sequence[Interval], tables: list[TimerTable], names: dict[int, str]) -> list[RankView]:
    rows = [
        pack(iv, Identity("r", rank=r, world_size=len(intervals), host=f"h{r}", local_rank=r), tables[r])
        for r, iv in enumerate(intervals)
    ]
    records = unpack(torch.cat(rows))
    for rec in records:
        names.update(rec.announced)
    return [
        RankView(rec.rank, rec.host, rec.local_rank, rec.step_stats,
                 {n: t.arrival for n, t in rec.named_timers(names).items() if t.arrival.count},
                 timers={n: t for n, t in rec.named_timers(names).items() if t.arrival.count})
        for rec in records
    ]  # fmt: skip


def run(
    job: Job, flushes: int, steps: int = 8, settings: Settings | None = None
) -> list[list[StragglerReport]]:
    scorer = StragglerScorer(settings or Settings())
    tables = [TimerTable() for _ in range(job.world)]
    names: dict[int, str] = {}
    out = []
    for seq in range(flushes):
        views = _views(job.interval(steps, seq), tables, names)
        _, reports = scorer.update(assess(views, scorer.settings), one_offs=seq > 0)
        out.append(reports)
    return out


def _flat(per_flush: list[list[StragglerReport]]) -> list[StragglerReport]:
    return [r for reports in per_flush for r in reports]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ddp_forward_straggler_is_the_only_rank_reported(world: int) -> None:
    slow = world - 1
    per_flush = run(Job(world, slow={(slow, "forward"): 1.4}), flushes=6)
    reports = _flat(per_flush)
    assert reports and {r.rank for r in reports} == {slow}
    first = next(i for i, reps in enumerate(per_flush) if reps)
    assert first <= 2
    rep = reports[0]
    assert rep.chronic and rep.phase == "forward" and rep.category == "compute"
    assert rep.sync_phase == "backward"
    assert rep.waiting_ranks == tuple(r for r in range(world) if r != slow)
    assert rep.wait_s == pytest.approx(0.012, rel=0.3)  # 0.4 x 30 ms
    assert rep.lateness_s == pytest.approx(0.012, rel=0.3)


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_data_straggler_is_attributed_to_data(world: int) -> None:
    reports = _flat(run(Job(world, slow={(1, "data"): 4.0}), flushes=6))
    assert reports and {(r.rank, r.phase, r.category) for r in reports} == {(1, "data", "data")}


@pytest.mark.parametrize("world", [2, 4])
def test_slow_after_the_sync_blames_the_late_starter_never_the_waiters(world: int) -> None:
    """Slow optimizer (after DDP's backward sync): the others look late at backward's end because
    they waited there; the culprit is the rank that reached it earliest (it started late)."""
    reports = _flat(run(Job(world, slow={(0, "optimizer"): 4.0}), flushes=6))
    assert reports and {r.rank for r in reports} == {0}
    assert reports[0].phase == "optimizer" and reports[0].sync_phase == "backward"
    assert reports[0].waiting_ranks == tuple(range(1, world))


@pytest.mark.parametrize("world", [2, 4])
def test_one_stall_is_a_one_off_for_that_rank_only(world: int) -> None:
    job = Job(world, stalls={(world - 1, 13, "forward"): 0.4})  # step 13: in the second interval
    per_flush = run(job, flushes=5)
    reports = _flat(per_flush)
    assert [(r.rank, r.pattern, r.phase) for r in reports] == [(world - 1, "one_off", "forward")]
    assert per_flush[1] == reports and reports[0].lateness_s == pytest.approx(0.4, rel=0.1)


def test_a_one_off_claims_no_wait_that_its_attributes_do_not_show() -> None:
    job = Job(2, stalls={(1, 13, "forward"): 0.4})
    (report,) = _flat(run(job, flushes=3))
    assert report.pattern == "one_off" and report.sync_phase == "backward"
    assert report.waiting_ranks == () and report.wait_s == 0.0
    text = describe(report, 13, 0.9)
    assert "wait" not in text and "rejoins the others in 'backward'" in text, text


def test_one_stall_on_top_of_a_chronic_straggler() -> None:
    job = Job(4, slow={(2, "forward"): 1.4}, stalls={(0, 20, "data"): 0.5})
    reports = _flat(run(job, flushes=6))
    assert {r.rank for r in reports if r.chronic} == {2}
    assert [(r.rank, r.phase) for r in reports if not r.chronic] == [(0, "data")]


def test_subgroup_collectives_blame_the_slow_rank_never_its_groups_waiters() -> None:
    """Tensor-parallel pairs [0, 1], [2, 3] then data-parallel pairs [0, 2], [1, 3], rank 3 slow in
    forward: ranks 0 and 1 leave `tp_comm` early (their pair waits for nobody) and lose that time
    waiting in `dp_comm`. Reaching a collective earliest is no blame when the time is lost in a
    later collective: only rank 3 is named."""
    phases = (("data", 0.002), ("forward", 0.010), ("backward", 0.010), ("tp_comm", 0.001),
              ("dp_comm", 0.002), ("optimizer", 0.003))  # fmt: skip
    groups = {"tp_comm": [[0, 1], [2, 3]], "dp_comm": [[0, 2], [1, 3]]}
    job = Job(4, phases, sync=frozenset(), groups=groups, slow={(3, "forward"): 3.0})
    # from the second flush: the first one's rows announce only ANNOUNCE_SLOTS of the 6 timer names
    reports = _flat(run(job, flushes=6)[1:])
    assert reports and {r.rank for r in reports} == {3}
    assert {(r.phase, r.category) for r in reports} == {("forward", "compute")}


def test_independent_ranks_slow_rank_flagged_nobody_waits() -> None:
    reports = _flat(run(Job(4, sync=frozenset(), slow={(3, "forward"): 1.5}), flushes=6))
    assert reports and {r.rank for r in reports} == {3}
    assert reports[0].phase == "forward" and reports[0].sync_phase is None and reports[0].waiting_ranks == ()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balanced_noisy_job_reports_nothing(world: int) -> None:
    assert _flat(run(Job(world, jitter=0.15, seed=world), flushes=10)) == []


def test_waiters_individual_score_uses_own_time() -> None:
    job = Job(4, slow={(2, "forward"): 1.5})
    scorer = StragglerScorer()
    tables = [TimerTable() for _ in range(4)]
    names: dict[int, str] = {}
    base = Job(4)
    for seq in range(3):  # a balanced start sets every rank's best own time
        scorer.update(assess(_views(base.interval(8, seq), tables, names), scorer.settings))
    for seq in range(3, 6):
        scores, _ = scorer.update(assess(_views(job.interval(8, seq), tables, names), scorer.settings))
    by_rank = {s.rank: s for s in scores}
    for r in (0, 1, 3):  # they wait 15 ms per step, yet their own time did not change
        assert by_rank[r].raw_individual == pytest.approx(1.0, abs=0.05)
        assert by_rank[r].wait_s == pytest.approx(0.015, rel=0.3) and by_rank[r].lateness_s == 0.0
        assert by_rank[r].relative == pytest.approx(1.0)
    assert by_rank[2].raw_individual < 0.9 and by_rank[2].wait_s == 0.0
    assert by_rank[2].relative < 0.9


def test_abstains_when_only_the_step_is_timed() -> None:
    views = [RankView(r, "h", r, Spread.of([0.1, 0.1]), {}) for r in range(4)]
    reason = abstain_reason(views, [])
    assert reason is not None and "only ot.step is timed" in reason and "ot.timer('forward')" in reason
    assert "outside" not in reason
    assert "do not run inside ot.step" in (abstain_reason(views, ["forward"]) or "")
    assert abstain_reason([RankView(0, "h", 0, Spread.of([0.1]), {"forward": Spread.of([0.05])})], []) is None


def test_only_step_timed_independent_ranks_still_found() -> None:
    job = Job(4, phases=(("step_work", 0.05),), sync=frozenset(), slow={(1, "step_work"): 1.5})
    scorer = StragglerScorer()
    reports = []
    for seq in range(5):
        views = [
            RankView(v.rank, v.host, v.local_rank, v.step, {})
            for v in _views(job.interval(8, seq), [TimerTable() for _ in range(4)], {})
        ]
        reports += scorer.update(assess(views, scorer.settings))[1]
    assert reports and {(r.rank, r.phase) for r in reports} == {(1, "untimed")}


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


def test_holds_collective() -> None:
    assert holds_collective("backward") and holds_collective("allreduce") and holds_collective("fwd_bwd")
    assert (
        not holds_collective("forward") and not holds_collective("data") and not holds_collective("optimizer")
    )


def test_spread_is_robust() -> None:
    s = Spread.of([0.1, 0.1, 0.1, 5.0])
    assert (s.count, s.median, s.max, s.mad) == (4, 0.1, 5.0, 0.0)
    assert Spread.of([0.1, 5.0]).median == 0.1  # lower median: one outlier never moves it
    assert Spread.of([]).count == 0 and Spread.decode(Spread.of([]).encode()).count == 0


def test_the_binary_search_mad_is_the_median_of_the_sorted_deviations() -> None:
    """Spread.of finds the MAD by a binary search over the two sorted runs of deviations; it must
    be the very float the lower median of `sorted(abs(v - median))` is (ties, repeats, one value)."""
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 30)
        values = [rng.choice([0.1, 0.2, 0.3, 0.5, rng.gauss(1, 1)]) for _ in range(n)]
        ordered = sorted(values)
        median = ordered[(n - 1) // 2]
        deviations = sorted([abs(v - median) for v in ordered])
        assert Spread.of(values).mad == deviations[(n - 1) // 2], values


def test_chronic_verdict_has_hysteresis() -> None:
    """A score hovering just around the threshold is one chronic straggler, not a new one each flush."""
    scorer = StragglerScorer(Settings(threshold=0.9, ewma=1.0))
    verdicts = []
    for lateness in (0.0115, 0.0095, 0.0115, 0.0095, 0.0):  # raw scores 0.885, 0.905, ...; then on time
        a = RankAssessment(0, 1, "h", 1, 0.1)
        a.chronic = Lateness(lateness, "forward", "backward")
        _, reports = scorer.update([RankAssessment(1, 0, "h", 0, 0.1), a])
        verdicts.append([r.rank for r in reports])
    assert verdicts == [[1], [1], [1], [1], []]


def _weighted_median_reference(values: list[float], weights: list[float]) -> float:
    """The leave-one-out median as the verdicts took it before `_median_without`: the others'
    values sorted anew for every rank (all weights 1: the plain median)."""
    if all(w == 1.0 for w in weights):
        ordered = sorted(values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0
    pairs = sorted(zip(values, weights, strict=True))
    half, acc = sum(weights) / 2.0, 0.0
    for i, (value, weight) in enumerate(pairs):
        acc += weight
        if acc > half:
            return value
        if acc == half and i + 1 < len(pairs):
            return (value + pairs[i + 1][0]) / 2.0
    return pairs[-1][0]


def test_the_one_pass_leave_one_out_median_is_the_sorted_one() -> None:
    """Ties, even and odd counts, weights 1 and summary weights (fractional too), every rank left
    out in turn: the one pass over points sorted once agrees with sorting the others each time."""
    rng = random.Random(7)
    for trial in range(3000):
        n = rng.randint(2, 9)
        values = [rng.choice([0.1, 0.2, 0.2, 0.3]) if trial % 3 == 0 else rng.random() for _ in range(n)]
        weights = [1.0] * n
        if trial % 2:
            for i in rng.sample(range(n), rng.randint(1, n)):
                weights[i] = rng.choice([1.0, 2.0, 4.0, 5 / 3, 0.5])
        ordered = sorted((v, w, i) for i, (v, w) in enumerate(zip(values, weights, strict=True)))
        for skip in range(n):
            others = [i for i in range(n) if i != skip]
            half = sum(weights[i] for i in others) / 2.0
            expected = _weighted_median_reference([values[i] for i in others], [weights[i] for i in others])
            assert _median_without(ordered, skip, half) == expected, (values, weights, skip)


def test_every_ranks_leave_one_out_median_at_once_is_the_one_pass_one() -> None:
    """`_medians_without` (all ranks of a phase at once, O(1) a rank with weights 1) gives each
    rank what `_median_without` gives it alone, and with weights 1 the others' plain median."""
    rng = random.Random(11)
    for trial in range(3000):
        n = rng.randint(1, 12)
        values = [rng.choice([0.1, 0.2, 0.2, 0.3]) if trial % 3 == 0 else rng.random() for _ in range(n)]
        weights = [1.0] * n
        if trial % 4 == 1:
            weights[rng.randrange(n)] = rng.choice([2.0, 5 / 3, 0.5])
        ordered = sorted((v, w, i) for i, (v, w) in enumerate(zip(values, weights, strict=True)))
        total = sum(weights)
        got = _medians_without(ordered, weights, total)
        assert sorted(got) == list(range(n))
        for skip in range(n):
            alone = _median_without(ordered, skip, (total - weights[skip]) / 2.0)
            assert got[skip] == alone or (math.isnan(got[skip]) and math.isnan(alone)), (
                values,
                weights,
                skip,
            )
            if n > 1 and all(w == 1.0 for w in weights):
                plain = _weighted_median_reference(
                    [v for i, v in enumerate(values) if i != skip], [1.0] * (n - 1)
                )
                assert got[skip] == plain, (values, skip)


@pytest.mark.parametrize("world", [2, 4])
def test_a_stall_in_a_timer_only_that_rank_runs_names_that_timer(world: int) -> None:
    # Rank 0 alone runs `ot.timer("eval")` at the end of step 13 (the others are past it, in
    # model.join() or a barrier): the time it lost was in "eval", not outside every timer.
    job = Job(world)
    scorer = StragglerScorer(Settings())
    tables = [TimerTable() for _ in range(world)]
    names: dict[int, str] = {}
    per_flush = []
    for seq in range(4):
        intervals = job.interval(8, seq)
        if seq == 1:
            rank0, at = intervals[0], 13 - 8  # step 13's place in the second interval
            rank0.phases["eval"] = [0.3]
            rank0.arrivals["eval"] = [rank0.arrivals["optimizer"][at] + 0.3]
            rank0.step_durations[at] += 0.3
        _, reports = scorer.update(
            assess(_views(intervals, tables, names), scorer.settings), one_offs=seq > 0
        )
        per_flush.append(reports)
    assert [(r.rank, r.pattern, r.phase) for r in _flat(per_flush)] == [(0, "one_off", "eval")]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("phase", ["forward", "data", "backward"])
def test_gradient_accumulation_names_the_phase_a_rank_is_slow_in(world: int, phase: str) -> None:
    """4 micro-batches a step under `no_sync()`: the last end of `data` already holds 3 slower
    micro-batches of any phase, so arrivals alone name `data`; the time per step names the phase
    (backward's with the others' wait there counted back in)."""
    job = Job(world, micro=4, slow={(world - 1, phase): 6.0 if phase == "data" else 2.0})
    reports = _flat(run(job, flushes=6))
    assert reports and {(r.rank, r.pattern, r.phase) for r in reports} == {(world - 1, "chronic", phase)}
    assert reports[0].sync_phase == "backward"


def test_gradient_accumulation_slow_outside_every_timer_is_not_named_backward() -> None:
    """Slower between micro-batches, in no timer: the others' wait in the last backward is all
    that rank brought to it, so backward explains nothing; the arrivals' phase stays."""
    phases = (*DDP[:3], ("between", 0.004), DDP[3])
    job = Job(4, phases=phases, micro=4, repeat=frozenset({"data", "forward", "backward", "between"}),
              untimed=frozenset({"between"}), slow={(3, "between"): 6.0})  # fmt: skip
    reports = _flat(run(job, flushes=6))
    assert reports and {(r.rank, r.pattern, r.phase) for r in reports} == {(3, "chronic", "data")}


def test_gradient_accumulation_a_wait_in_backward_is_not_named_backward() -> None:
    """Rank 0 stalls 3 s at the first step; rank 1, slower in every forward, waits for it in that
    step's backward, so its backward time per step that interval exceeds the other's: waiting, not
    a backward it was slower in (DeepSpeed's first step on a loaded host)."""
    job = Job(2, micro=4, slow={(1, "forward"): 2.0}, stalls={(0, 0, "data"): 3.0})
    reports = _flat(run(job, flushes=6))
    assert reports and {(r.rank, r.pattern, r.phase) for r in reports} == {(1, "chronic", "forward")}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_gradient_accumulation_one_off_names_the_stalled_phase(phase: str) -> None:
    job = Job(4, micro=4, stalls={(3, 13, phase): 0.4})  # step 13: the second interval
    reports = _flat(run(job, flushes=4))
    assert [(r.rank, r.pattern, r.phase) for r in reports] == [(3, "one_off", phase)]
