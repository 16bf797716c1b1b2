"""End to end: fake rank endpoints -> real Prometheus (the alert pack, windows 30x shorter) -> real Alertmanager.

Seven fake runs serve pull endpoints with prometheus_client on 127.0.0.1 (one endpoint per
rank, series named from otel_train.semconv as the in-process exporter names them):
  run "slow":     rank 3 arrives late (relative straggler score 0.6) while, as under DDP, the ranks
                  that wait for it have the longer phase times   -> TrainingStraggler for rank 3 only
  run "balanced": every rank alike                                  -> no alert at all
  run "frozen":   rank 1's steps counter stops after a few seconds and, a stall timeout later, its
                  watchdog's train.stall.duration rises                 -> TrainingRankStalled for rank 1
  run "eval":     every rank stops stepping to evaluate; their eval batches keep train.stall.duration
                  at 0                                                  -> no alert at all
  run "eval0":    rank 0 alone evaluates (eval batches) while rank 1 waits for it in a barrier, past
                  its stall timeout: its train.collective.last_seconds rises as in "hung"
                                                                        -> no alert at all
  run "solo":     a single process stops stepping; its watchdog judges it stalled
                                                                    -> TrainingStalled, never TrainingRankStalled
  run "hung":     both ranks stop in a collective: train.collective.last_seconds rises on each
                  (100 s per second: its threshold is a value, not a window)
                                                                    -> TrainingCollectiveHang for both
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.ports import free_port
from helpers.promstack import alertmanager, prometheus, shorten_rules, wait_until
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from otel_train import semconv

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules"
LABELS = ["run_id", "rank", "local_rank", "host_name", "otel_scope_name"]
TICK_S = 0.1  # one fake step per tick on every rank
STALL_TIMEOUT_S = 1.0  # the fake ranks' stall_timeout_s


@dataclass
class FakeRank:
    run_id: str
    rank: int
    step_s: float
    freeze_after_s: float | None = None
    score: float = 1.0  # relative straggler score, as the in-process detector exports it
    hang_after_s: float | None = None  # then stuck in a collective: no steps, last_seconds rising
    heartbeats: bool = False  # no steps after freeze_after_s, but eval batches: never stalled
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = {
            "run_id": self.run_id,
            "rank": str(self.rank),
            "local_rank": str(self.rank),
            "host_name": "node0",
            "otel_scope_name": "otel_train",
        }
        self.steps = Counter(semconv.STEPS.prometheus_name, "steps", LABELS, registry=self.registry).labels(
            **labels
        )
        self.step_hist = Histogram(
            semconv.STEP_DURATION.prometheus_name,
            "step",
            LABELS,
            buckets=semconv.STEP_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.phase_hist = Histogram(
            semconv.PHASE_DURATION.prometheus_name,
            "phase",
            [*LABELS, "train_phase"],
            buckets=semconv.PHASE_BUCKETS,
            registry=self.registry,
        ).labels(**labels, train_phase="forward")
        Gauge(
            semconv.STRAGGLER_SCORE.prometheus_name,
            "score",
            [*LABELS, "straggler_kind", "train_phase"],
            registry=self.registry,
        ).labels(**labels, straggler_kind="relative", train_phase="all").set(self.score)
        self.last_collective = Gauge(
            semconv.COLLECTIVE_LAST.prometheus_name, "last", LABELS, registry=self.registry
        ).labels(**labels)
        self.stalled = Gauge(
            semconv.STALL_DURATION.prometheus_name, "stalled", LABELS, registry=self.registry
        ).labels(**labels)
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)

    def tick(self, elapsed_s: float) -> None:
        stopped = min(x for x in (self.hang_after_s, self.freeze_after_s, float("inf")) if x is not None)
        idle_s = elapsed_s - stopped
        # the in-process watchdog's verdict, as the library exports it
        self.stalled.set(idle_s if idle_s >= STALL_TIMEOUT_S and not self.heartbeats else 0.0)
        if self.hang_after_s is not None and elapsed_s > self.hang_after_s:
            self.last_collective.set((elapsed_s - self.hang_after_s) * 100)
            return
        self.last_collective.set(TICK_S)
        if self.freeze_after_s is not None and elapsed_s > self.freeze_after_s:
            return
        self.steps.inc()
        self.step_hist.observe(self.step_s)
        self.phase_hist.observe(self.step_s * 0.6)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_ranks() -> Iterator[list[FakeRank]]:
    # run "slow" is synchronized: every rank's step takes as long as rank 3's, and the waiting ranks
    # (0-2) spend longer in their phase (the collective): only the score says who is late
    ranks = [FakeRank("slow", r, 0.2, score=0.6 if r == 3 else 1.0) for r in range(4)]
    ranks += [FakeRank("balanced", r, 0.1) for r in range(4)]
    ranks += [FakeRank("frozen", r, 0.1, freeze_after_s=3.0 if r == 1 else None) for r in range(4)]
    ranks += [FakeRank("hung", r, 0.1, hang_after_s=3.0) for r in range(2)]
    ranks += [FakeRank("eval", r, 0.1, freeze_after_s=3.0, heartbeats=True) for r in range(2)]
    ranks += [FakeRank("eval0", 0, 0.1, freeze_after_s=3.0, heartbeats=True)]
    ranks += [FakeRank("eval0", 1, 0.1, hang_after_s=3.0)]  # in the barrier rank 0 comes to at the end
    ranks += [FakeRank("solo", 0, 0.1, freeze_after_s=3.0)]
    stop = threading.Event()
    start = time.monotonic()

    def loop() -> None:
        while not stop.wait(TICK_S):
            for fake in ranks:
                fake.tick(time.monotonic() - start)

    worker = threading.Thread(target=loop, name="fake-ranks", daemon=True)
    worker.start()
    try:
        yield ranks
    finally:
        stop.set()
        worker.join(timeout=5)
        for fake in ranks:
            fake.close()


def _firing(am, **labels: str) -> list[dict]:
    return [a for a in am.alerts(**labels) if a["status"]["state"] == "active"]


@pytest.mark.integration
def test_straggler_and_rank_stall_reach_alertmanager(fake_ranks: list[FakeRank], tmp_path: Path) -> None:
    rules = shorten_rules(sorted(RULES_DIR.glob("*.yml")), tmp_path, for_="5s", scale=30)
    targets = [f"127.0.0.1:{f.port}" for f in fake_ranks]
    started = time.monotonic()
    with alertmanager() as am, prometheus(targets=targets, rule_files=rules, alertmanager_url=am.url) as prom:
        wait_until(lambda: prom.targets_up() == len(targets), timeout=20, what="all fake ranks scraped")

        straggler = wait_until(
            lambda: _firing(am, alertname="TrainingStraggler", run_id="slow"),
            timeout=60,
            what=f"TrainingStraggler in Alertmanager\n{prom.log()}",
        )
        stalled = wait_until(
            lambda: _firing(am, alertname="TrainingRankStalled", run_id="frozen"),
            timeout=60,
            what="TrainingRankStalled in Alertmanager",
        )

        # the late rank and only it (never the waiters, whose phase times are the same or longer)
        assert {a["labels"]["rank"] for a in straggler} == {"3"}
        slow = straggler[0]
        assert slow["labels"]["severity"] == "warning" and slow["labels"]["host_name"] == "node0"
        assert "rank 3 of run slow" in slow["annotations"]["summary"]
        assert {a["labels"]["rank"] for a in stalled} == {"1"}
        assert stalled[0]["labels"]["severity"] == "critical"

        # the balanced run: nothing at all, not even pending; no straggler in the other runs
        assert not prom.alerts(run_id="balanced")
        assert not _firing(am, run_id="balanced")
        # the evaluating runs: nothing, long after a stall would have fired (stop, window, `for:`)
        time.sleep(max(0.0, 3.0 + 10.0 + 5.0 + 5.0 - (time.monotonic() - started)))
        for run_id in ("eval", "eval0"):
            assert not prom.alerts(run_id=run_id), run_id
            assert not _firing(am, run_id=run_id), run_id
        assert {a["labels"]["run_id"] for a in _firing(am, alertname="TrainingStraggler")} == {"slow"}
        assert {a["labels"]["run_id"] for a in _firing(am, alertname="TrainingStalled")} <= {"hung", "solo"}
        # the single process: the run's stall (its own earlier steps are no other rank stepping)
        wait_until(
            lambda: _firing(am, alertname="TrainingStalled", run_id="solo"),
            timeout=30,
            what="TrainingStalled for the single process in Alertmanager",
        )
        assert not prom.alerts(alertname="TrainingRankStalled", run_id="solo")
        assert {a["labels"]["run_id"] for a in _firing(am, alertname="TrainingRankStalled")} == {"frozen"}

        # Each rank's alert reaches Alertmanager on its own: wait until both ranks of the hung run
        # are there (a rank that never fires times out), then check that no healthy rank is.
        def hung_alerts() -> list[dict]:
            alerts = _firing(am, alertname="TrainingCollectiveHang")
            ranks = {(a["labels"]["run_id"], a["labels"]["rank"]) for a in alerts}
            return alerts if {("hung", "0"), ("hung", "1")} <= ranks else []

        hung = wait_until(
            hung_alerts, timeout=60, what="TrainingCollectiveHang in Alertmanager on both hung ranks"
        )
        # on every rank of the hung run (all stuck in the collective), on no healthy rank
        assert {(a["labels"]["run_id"], a["labels"]["rank"]) for a in hung} == {("hung", "0"), ("hung", "1")}
        # every rank of the slow run has the same step time: the phase-time recording rules see no outlier
        median = prom.value(
            'otel_train:phase_seconds:median_over_ranks5m{run_id="slow",train_phase="forward"}'
        )
        assert median == pytest.approx(0.12, rel=0.01)
