"""A real 4-rank gloo job with every planted fault the alert pack is for (issue #47), in one run:

  straggler   rank 2's forward takes 1.5x (DDP: the others wait for it in backward)
  NaN         rank 1 records one non-finite loss
  divergence  rank 3 nudges a weight outside DDP once: its replica drifts from the others
  GPU         rank 0's (fake NVML) GPU runs hot, thermally throttled, 97 % full, with ECC errors
              that keep coming
  eval        (with eval_s) after training every rank evaluates, its batches calling
              adapters.heartbeat(), for longer than the stall alert's window: no stall alert
  stall       then every rank stays alive but stops stepping (a whole-run stall: each rank's
              watchdog judges it after stall_timeout_s)

Every rank runs the same loop as tests/deploy/test_stack_e2e.py's (four timed phases, loss, lr,
grad norm, eval metrics, ot.watch with activations and a GradScaler), so every dashboard panel has
its data, with `rank_series` as the test asks.
"""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path
from typing import Any

from helpers.dashboard_queries import assert_all_queries_return_data, query_failures

from dashboards.build import TIER_FULL, DashboardQuery, all_queries, specs_in

STRAGGLER, NAN_RANK, DIVERGENT, HOT_GPU_RANK = 2, 1, 3, 0
NAN_STEP, NUDGE_STEP = 30, 20

# What torch's CUDA and MPS allocators and NCCL's timing report: these gloo ranks have none (their
# GPUs are the fake NVML's, so every NVML panel has data).
DEVICE_ONLY = ("train.cuda.", "train.mps.", "train.collective.time")

# alert -> the ranks it must name (None: a run-wide alert, no rank label)
EXPECTED: dict[str, set[str] | None] = {
    "TrainingStraggler": {str(STRAGGLER)},
    "TrainingNonFiniteLoss": {str(NAN_RANK)},
    "TrainingReplicaDivergence": {"0"},  # rank 0 compares the replicas and reports
    "GPUHighTemperature": {str(HOT_GPU_RANK)},
    "GPUThermalThrottling": {str(HOT_GPU_RANK)},
    "GPUMemoryNearLimit": {str(HOT_GPU_RANK)},
    "GPUErrors": {str(HOT_GPU_RANK)},
    "TrainingStalled": None,
}


def _fake_gpus(world: int) -> Any:
    """One fake NVML GPU per rank; rank 0's is in trouble. ECC errors keep rising on it (a thread),
    so `increase(hw_errors_total[...])` stays above 0."""
    from helpers.fake_nvml import FakeGpu, FakeNvml, gpu_uuid

    gpus = [FakeGpu(uuid=gpu_uuid(i), pci_bus_id=f"00000000:{i + 1:02x}:00.0") for i in range(world)]
    hot = gpus[HOT_GPU_RANK]
    hot.temperature = 92
    hot.clock_reasons = 0x40  # HwThermalSlowdown
    hot.memory_used = int(hot.memory_total * 0.97)

    def errors() -> None:
        while True:
            time.sleep(0.5)
            hot.ecc_uncorrected += 1

    threading.Thread(target=errors, name="fake-ecc", daemon=True).start()
    return FakeNvml(gpus)


def planted_rank(rank: int, world: int, out_dir: str, seconds: float, stall_s: float, run_id: str,
                 tier: str, otlp_metrics_url: str = "", base_port: int = 0, eval_s: float = 0.0) -> int:  # fmt: skip
    """One rank: pushes OTLP to `otlp_metrics_url`, or serves its pull endpoint on base_port + rank.
    With `eval_s`, the wall time its evaluation ended is in `<out_dir>/eval_end.rank<k>`."""
    import os
    import sys

    sys.modules["pynvml"] = _fake_gpus(world)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
    import torch
    import torch.distributed as dist

    import otel_train as ot
    from otel_train import adapters

    export: dict[str, Any] = (
        {"otlp_metrics_endpoint": otlp_metrics_url, "metric_export_interval_s": 1.0, "prometheus_port": 0}
        if otlp_metrics_url
        else {"prometheus_port": base_port}
    )
    ot.init(
        **export, run_id=run_id, output_dir=out_dir, verbosity=0, log_interval=2, total_steps=100_000,
        collective_timeout_s=5.0, peak_flops=1e12, flops_per_token=1e6, hardware_interval_s=1.0,
        rank_series=tier, stall_timeout_s=5.0,  # the stall alerts read the watchdog's verdict
    )  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    scaler = torch.amp.GradScaler("cpu")
    ot.watch(model, every=5, activations=True, scaler=scaler)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    deadline = time.monotonic() + seconds
    step = 0
    while True:
        slow = 1.5 if rank == STRAGGLER else 1.0
        with ot.step(step, tokens=256, samples=8):
            with ot.timer("data"):
                time.sleep(0.004)
            ddp.zero_grad()
            with ot.timer("forward"):
                time.sleep(0.02 * slow)
                out = ddp(torch.randn(2, 4)).pow(2).mean()
            with ot.timer("backward"):
                time.sleep(0.02)
                scaler.scale(out).backward()
            with ot.timer("optimizer"):
                scaler.step(optimizer)
                scaler.update()
            if rank == DIVERGENT and step == NUDGE_STEP:  # a parameter update the others never see
                with torch.no_grad():
                    model[0].weight.add_(0.05)
            done = torch.tensor([1.0 if time.monotonic() >= deadline else 0.0])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            loss = float("nan") if rank == NAN_RANK and step == NAN_STEP else 3.0 / (1 + 0.01 * step)
            ot.record("loss", loss)
            ot.record("lr", 1e-3)
            ot.record("grad_norm", 1.0)
        if step % 50 == 0:
            ot.log_metrics({"eval/loss": 2.0, "eval/perplexity": 7.4, "eval/accuracy": 0.4})
        step += 1
        if done.item() > 0:
            break
    if eval_s:
        evaluating = time.monotonic()
        while time.monotonic() - evaluating < eval_s:
            adapters.heartbeat()  # an eval batch, as the framework integrations report them
            time.sleep(0.05)
        Path(out_dir, f"eval_end.rank{rank}").write_text(str(time.time()))
    stalled, stop = time.monotonic(), Path(out_dir, "stop")  # the test has seen every alert: end early
    while time.monotonic() - stalled < stall_s and not stop.exists():
        time.sleep(0.2)  # alive and exporting, no step: the whole run stalls
    ot.shutdown()
    return step


def collect_alerts(
    am: Any, until: float, seen: dict[str, set[str | None]], fired_at: dict[str, float] | None = None
) -> None:
    """Every alert Alertmanager has held so far, by name, with the ranks it named (alerts without
    `for:` resolve again within their short window, so they are gathered as they come); in
    `fired_at`, the earliest time (Unix seconds) each alert name began firing."""
    while time.monotonic() < until and not all(name in seen for name in EXPECTED):
        for alert in am.alerts():
            name = alert["labels"]["alertname"]
            seen.setdefault(name, set()).add(alert["labels"].get("rank"))
            if fired_at is not None:
                began = datetime.datetime.fromisoformat(alert["startsAt"]).timestamp()
                fired_at[name] = min(fired_at.get(name, began), began)
        time.sleep(0.5)


def check_alerts(seen: dict[str, set[str | None]], log: str = "") -> None:
    """Each planted fault's alert fired, naming its rank and no other."""
    assert set(EXPECTED) <= set(seen), f"never fired: {set(EXPECTED) - set(seen)}\n{log}"
    for name, ranks in EXPECTED.items():
        assert seen[name] == (ranks if ranks is not None else {None}), name


def _device_only(query: DashboardQuery) -> bool:
    specs = specs_in(query.expr)
    return bool(specs) and all(spec.name.startswith(DEVICE_ONLY) for spec in specs)


def check_dashboards(url: str, tier: str, run_id: str) -> None:
    """Every panel that works in `tier` has data, the GPU panels from the fake NVML's readings; in
    `essential`, those that need `full` have none (so the tier each panel says it needs is the
    truth)."""
    variables = {"run_id": run_id}
    device_only = {q.title for q in all_queries() if _device_only(q)}
    if tier == TIER_FULL:
        assert_all_queries_return_data(
            url, exclude_gpu=False, variables=variables, skip_titles=device_only, wait_s=20
        )
        return
    full_only = [q for q in all_queries() if q.tier == TIER_FULL]
    skip = device_only | {q.title for q in full_only}
    assert_all_queries_return_data(url, exclude_gpu=False, variables=variables, skip_titles=skip, wait_s=20)
    queries = [q for q in full_only if not _device_only(q) and not q.deepspeed_only]
    empty = {q.title for q, _ in query_failures(url, queries, variables=variables, exclude_gpu=False)}
    assert queries and {q.title for q in queries} == empty
