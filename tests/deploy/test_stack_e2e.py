"""The whole path on real components: 4 real torch.distributed (gloo) ranks training on CPU with
their pull endpoints, a real Prometheus (the pinned 3.5) evaluating the shipped alert pack (test-only
copy with short windows) and a real Alertmanager. The job with every planted fault
(tests/deploy/planted.py) runs in the essential series tier (the full tier's run is the
VictoriaMetrics test's, tests/deploy/test_victoriametrics_e2e.py): every alert fires for the right
rank, and every dashboard query is evaluated against that Prometheus."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from helpers.multirank import run_ranks
from helpers.promstack import alertmanager, prometheus, shorten_rules, wait_until

from dashboards.build import TIER_ESSENTIAL
from deploy.planted import check_alerts, check_dashboards, collect_alerts, planted_rank

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules"
WORLD = 4


def _free_base_port(count: int) -> int:
    for base in range(21000, 30000, 17):
        try:
            socks = []
            for i in range(count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", base + i))
                socks.append(sock)
            for sock in socks:
                sock.close()
            return base
        except OSError:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range")


def _rank(rank: int, world: int, base_port: int, out_dir: str, seconds: float, slow_rank: int,
          freeze_rank: int, run_id: str, otlp_metrics_url: str = "") -> int:  # fmt: skip
    """One rank's training; its metrics are pulled from base_port + rank, or, with
    `otlp_metrics_url`, pushed there over OTLP (tests/deploy/test_victoriametrics_e2e.py)."""
    import torch
    import torch.distributed as dist

    import otel_train as ot

    push = (
        {"otlp_metrics_endpoint": otlp_metrics_url, "metric_export_interval_s": 1.0}
        if otlp_metrics_url
        else {}
    )
    ot.init(
        prometheus_port=0 if push else base_port, run_id=run_id, output_dir=out_dir, verbosity=0,
        log_interval=2, total_steps=100_000, collective_timeout_s=5.0, peak_flops=1e12,
        flops_per_token=1e6, hardware_interval_s=1.0, stall_timeout_s=3.0, **push,
    )  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    scaler = torch.amp.GradScaler("cpu")  # feeds the mixed-precision panels
    ot.watch(model, every=5, activations=True, scaler=scaler)  # and the dashboards' ot.watch panels
    synced = freeze_rank < 0  # a frozen peer would hang the training's own collectives
    if synced:  # a real DDP job: the gradient all-reduce runs inside backward, the waiters wait there
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    deadline = time.monotonic() + seconds
    step = 0
    stop = Path(out_dir, "stop")  # the test has seen what it waited for: end early
    while True:
        if not synced and (time.monotonic() >= deadline or stop.exists()):
            break
        if rank == freeze_rank and step >= 40:
            time.sleep(0.05)  # alive (endpoint still served), but no more steps
            continue
        slow = 1.5 if rank == slow_rank else 1.0
        with ot.step(step, tokens=256, samples=8):
            with ot.timer("data"):
                time.sleep(0.004)
            model.zero_grad()
            with ot.timer("forward"):
                time.sleep(0.02 * slow)
                out = model(torch.randn(2, 4)).pow(2).mean()
            with ot.timer("backward"):
                time.sleep(0.02)
                scaler.scale(out).backward()  # DDP's all-reduce: the other ranks wait here for rank 2
            with ot.timer("optimizer"):
                scaler.step(optimizer)
                scaler.update()
            if synced:
                # agree on when to stop, so no rank is left waiting in an all_reduce its peers never join
                done = torch.tensor([1.0 if time.monotonic() >= deadline else 0.0])
                dist.all_reduce(done, op=dist.ReduceOp.MAX)
            ot.record("loss", 3.0 / (1 + 0.01 * step))
            ot.record("lr", 1e-3)
            ot.record("grad_norm", 1.0)
        if step % 50 == 0:
            ot.log_metrics({"eval/loss": 2.0, "eval/perplexity": 7.4, "eval/accuracy": 0.4})
        step += 1
        if synced and done.item() > 0:
            break
    ot.shutdown()
    return step


def _scenario(tmp_path: Path, name: str, seconds: float, slow_rank: int = -1, freeze_rank: int = -1):
    base = _free_base_port(WORLD)
    targets = [f"127.0.0.1:{base + r}" for r in range(WORLD)]
    rules = shorten_rules(sorted(RULES_DIR.glob("*.yml")), tmp_path / f"rules-{name}", for_="5s", scale=30)
    results: list[int] = []
    errors: list[BaseException] = []

    def train() -> None:
        try:
            results.extend(run_ranks(WORLD, _rank, (base, str(tmp_path), seconds, slow_rank, freeze_rank, name),
                                     timeout=seconds + 120, env={"LOCAL_WORLD_SIZE": str(WORLD), "TORCH_FR_BUFFER_SIZE": "2000"}))  # fmt: skip
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=train)
    return thread, targets, rules, results, errors


def test_every_planted_fault_pages_in_the_essential_tier_and_dashboards_have_data(tmp_path) -> None:
    base = _free_base_port(WORLD)
    targets = [f"127.0.0.1:{base + r}" for r in range(WORLD)]
    rules = shorten_rules(sorted(RULES_DIR.glob("*.yml")), tmp_path / "rules", for_="5s", scale=30)
    # The evaluation outlasts what TrainingStalled needs on steps alone (the stall timeout, the 10 s
    # window, `for:`): only the ranks' eval batches keep it quiet.
    train_s, eval_s, stall_s = 30.0, 24.0, 28.0
    args = (str(tmp_path), train_s, stall_s, "planted", TIER_ESSENTIAL, "", base, eval_s)
    results: list[int] = []
    errors: list[BaseException] = []

    def train() -> None:
        try:
            env = {"LOCAL_WORLD_SIZE": str(WORLD), "TORCH_FR_BUFFER_SIZE": "2000"}
            timeout = train_s + eval_s + stall_s + 90
            results.extend(run_ranks(WORLD, planted_rank, args, timeout=timeout, env=env))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=train)
    seen: dict[str, set[str | None]] = {}
    fired_at: dict[str, float] = {}
    with alertmanager() as am, prometheus(targets=targets, rule_files=rules, alertmanager_url=am.url) as prom:
        thread.start()
        try:
            collect_alerts(am, time.monotonic() + train_s + eval_s + stall_s + 30, seen, fired_at)
            check_alerts(seen, prom.log())
            check_dashboards(prom.url, TIER_ESSENTIAL, "planted")
        finally:
            (tmp_path / "stop").touch()  # the ranks' stall ends here (deploy/planted.py)
            thread.join()
    assert not errors, errors
    assert min(results) > 50  # it trained
    eval_ends = [float(p.read_text()) for p in tmp_path.glob("eval_end.rank*")]
    assert len(eval_ends) == WORLD
    assert fired_at["TrainingStalled"] > max(eval_ends), "the stall alert fired during the evaluation"


def test_balanced_run_fires_no_straggler_alert(tmp_path) -> None:
    thread, targets, rules, results, errors = _scenario(tmp_path, "balanced", seconds=45)
    with alertmanager() as am, prometheus(targets=targets, rule_files=rules, alertmanager_url=am.url) as prom:
        thread.start()
        thread.join()
        assert not errors, errors
        assert min(results) > 100  # it trained
        assert prom.query('ALERTS{alertname="TrainingStraggler"}') == []
        assert am.alerts(alertname="TrainingStraggler") == []


def test_frozen_rank_fires_rank_stalled(tmp_path) -> None:
    thread, targets, rules, _, errors = _scenario(tmp_path, "frozen", seconds=60, freeze_rank=1)
    with alertmanager() as am, prometheus(targets=targets, rule_files=rules, alertmanager_url=am.url):
        thread.start()
        try:
            stalled = wait_until(
                lambda: am.alerts(alertname="TrainingRankStalled"), timeout=55, what="rank stalled"
            )
            assert {a["labels"]["rank"] for a in stalled} == {"1"}
        finally:
            (tmp_path / "stop").touch()
            thread.join()
    assert not errors, errors
