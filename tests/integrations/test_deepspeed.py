"""otel_train.integrations.deepspeed against real DeepSpeed 0.19.8 on 2 gloo ranks (CPU accelerator).

Each run is a real `deepspeed.initialize` on real ranks (`helpers.multirank`), a few steps of a
small model, and what otel_train exported read back: the flush intervals (what every rank sends to
its sinks), the run directory's events file, and DeepSpeed's own csv monitor files. The first run on
a fresh clone JIT-builds DeepSpeed's small C++ comm op (about 90 s, once): it is cached in
`.tools/torch_extensions` (git-ignored, kept by `make test` between runs) unless
`TORCH_EXTENSIONS_DIR` says otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train import semconv
from otel_train.integrations.deepspeed import size_class
from otel_train.testing import current_session

if importlib.util.find_spec("deepspeed") is None:
    if os.environ.get("CI"):  # make test installs it (pyproject's deepspeed extra): missing is a failure
        raise ImportError("deepspeed==0.19.8 is not installed (DS_BUILD_OPS=0 pip install '.[deepspeed]')")
    pytest.skip("deepspeed==0.19.8 not installed (make test installs it)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
# Next to the pinned tools (`make test` keeps .tools/ between runs, CI caches it)
TOOLS = Path(os.environ.get("OTEL_TRAIN_TOOLS") or REPO / ".tools")
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR") or str(TOOLS / "torch_extensions")
RANK_ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": EXTENSIONS, "DS_BUILD_OPS": "0"}
TIMEOUT = 420.0  # the first run on a fresh clone builds DeepSpeed's comm op (~90 s on 2 cores)
MICRO, GAS = 4, 2
MODEL_NUMEL = 64 * 128 + 128 + 128 * 10 + 10  # 9,610
ZERO_NAMES = (
    semconv.ZERO_STAGE.name,
    semconv.ZERO_DP_SIZE.name,
    semconv.ZERO_MODEL_NUMEL.name,
    semconv.ZERO_PARTITION_NUMEL.name,
    semconv.ZERO_OPTIMIZER_STATE_BYTES.name,
    semconv.ZERO_PARAM_SHARD_NUMEL.name,
)


class Intervals:
    """Flush listener: every interval's phases, arrivals and recorded scalars on this rank."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.phases: dict[str, float] = {}
        self.arrivals: dict[str, int] = {}
        self.scalars: dict[str, list[float]] = {}
        self.samples = 0
        self.steps = 0

    def on_flush(self, interval: Any) -> None:
        for name, values in interval.phases.items():
            self.counts[name] = self.counts.get(name, 0) + len(values)
            self.phases[name] = self.phases.get(name, 0.0) + sum(values)
        for name, values in interval.arrivals.items():
            self.arrivals[name] = self.arrivals.get(name, 0) + len(values)
        for name, values in interval.scalars.items():
            self.scalars.setdefault(name, []).extend(values)
        self.samples += interval.samples
        self.steps += interval.steps

    def close(self) -> None:
        pass


class Sleep:
    """A forward that lasts `seconds` longer on this rank (a chronically slow rank)."""

    def __new__(cls, seconds: float) -> Any:
        import torch

        class _Sleep(torch.nn.Module):
            def forward(self, x: Any) -> Any:
                if seconds:
                    time.sleep(seconds)
                return x

        return _Sleep()


def allow_fp16_on_this_cpu() -> None:
    """TEST ONLY: DeepSpeed's CPU accelerator allows fp16 only where oneDNN reports fp16 kernels
    (`torch.ops.mkldnn._is_mkldnn_fp16_supported()`, false on CPUs without AVX512-FP16/AMX, as on
    some CI machines). torch's own CPU fp16 kernels run the tiny model anyway; exactly that one
    check is replaced, in this rank only."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True  # type: ignore[method-assign]


def ds_job(rank: int, world: int, out_dir: str, case: dict[str, Any]) -> dict[str, Any]:
    """`case`: zero (stage), offload ("cpu"/"nvme"/None), fp16, breakdown, comms, csv (a dir),
    slow_rank, torch_backward, plant_full_state, steps, eval_batches, save_s (a save and a load
    mid-training, each file write that much slower), stall_timeout_s, unmanaged
    (managed_gradient_accumulation=false)."""
    import deepspeed
    import torch
    from deepspeed.comm import comms_logger

    from otel_train.integrations.deepspeed import instrument

    deepspeed.init_distributed(dist_backend="gloo")
    if case.get("fp16"):
        allow_fp16_on_this_cpu()
    torch.manual_seed(0)
    steps = case.get("steps", 6)
    zero: dict[str, Any] = {"stage": case["zero"]}
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": case["offload"], "pin_memory": False}
        if case["offload"] == "nvme":
            zero["offload_optimizer"]["nvme_path"] = str(Path(out_dir) / "nvme")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "wall_clock_breakdown": bool(case.get("breakdown")),
    }
    if case.get("fp16"):
        config["fp16"] = {"enabled": True, "initial_scale_power": 32}
    if case.get("unmanaged"):  # the caller accumulates and calls step() at its own boundaries
        config["managed_gradient_accumulation"] = False
        zero["overlap_comm"] = False
    if case.get("comms"):
        config["comms_logger"] = {"enabled": True}
    if case.get("csv"):
        config["csv_monitor"] = {"enabled": True, "output_path": case["csv"], "job_name": "job"}
    slow = 0.03 if rank == case.get("slow_rank") else 0.0
    model = torch.nn.Sequential(
        Sleep(slow), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    ot.init(
        output_dir=out_dir, run_name=f"ds{case['zero']}", verbosity=0, log_interval=2, hardware=False,
        prometheus_port=0, collective_timeout_s=60.0, stall_timeout_s=case.get("stall_timeout_s", 300.0),
    )  # fmt: skip
    session = current_session()
    seen = Intervals()
    session.worker.add_listener(seen)
    events: list[tuple[str, str, dict[str, Any]]] = []
    session.events.add_callback(lambda e, m, a: events.append((e, m, {**a, "time": time.time()})))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    instrument(engine)
    inner = engine.optimizer.optimizer
    if case.get("plant_full_state") == rank:  # a rank that holds the whole model's Adam state
        extra = torch.nn.Parameter(torch.zeros(1))
        inner.state[extra] = {"exp_avg": torch.zeros(MODEL_NUMEL), "exp_avg_sq": torch.zeros(MODEL_NUMEL)}
    gen = torch.Generator().manual_seed(rank)
    progress_after_eval = False
    save_window = (0.0, 0.0)  # when the mid-training save and load ran
    micro_batch_heartbeats = 0  # engine.step() calls inside a step that told the watchdog so
    for i in range(steps * GAS):
        if case.get("eval_batches") and i == steps // 2 * GAS:  # an evaluation mid-training
            engine.eval()
            with torch.no_grad():
                for _ in range(case["eval_batches"]):
                    engine(torch.randn(MICRO, 64, generator=gen))
            engine.train()
            progress_after_eval = session.progress_ns > (session.step_end_ns or 0)
        if case.get("save_s") and i == steps // 2 * GAS:
            save_window = (time.time(), _slow_save_and_load(engine, Path(out_dir) / "ckpt", case["save_s"]))
        out = engine(
            torch.randn(MICRO, 64, generator=gen).to(torch.half if case.get("fp16") else torch.float)
        )
        loss = out.float().pow(2).mean()
        if case.get("torch_backward"):
            loss.backward()
        else:
            engine.backward(loss)
        if case.get("unmanaged") and (i + 1) % GAS:
            continue
        before = session.progress_ns
        inside_step = not engine.is_gradient_accumulation_boundary()
        engine.step()
        micro_batch_heartbeats += inside_step and session.progress_ns > before
    time.sleep(0.5)  # the last aligned flush's exchange
    ot.shutdown()
    # What the engine holds on this rank (ground truth for the exported gauges)
    stage = case["zero"]
    if stage >= 3:
        partition = sum(int(t.numel()) for t in engine.optimizer.fp32_partitioned_groups_flat)
        shard = sum(int(p.ds_tensor.numel()) for p in engine.module.parameters())
    else:
        partition = sum(int(t.numel()) for t in engine.optimizer.single_partition_of_fp32_groups)
        shard = -1
    state = sum(
        int(t.numel()) * t.element_size()
        for s in inner.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    comms = {
        op: {int(size): int(v[0]) for size, v in sizes.items()}
        for op, sizes in comms_logger.comms_dict.items()
    }
    return {
        "comms": comms,
        "counts": seen.counts,
        "phases": seen.phases,
        "arrivals": seen.arrivals,
        "scalars": {k: v for k, v in seen.scalars.items()},
        "samples": seen.samples,
        "steps": seen.steps,
        "events": events,
        "progress_after_eval": progress_after_eval,
        "save_window": save_window,
        "micro_batch_heartbeats": micro_batch_heartbeats,
        "partition": partition,
        "shard": shard,
        "state": state,
        "skipped": int(engine.skipped_steps),
        "loss_scale": float(engine.optimizer.loss_scale) if case.get("fp16") else None,
        "global_steps": int(engine.global_steps),
        "master_device": str(engine.optimizer.single_partition_of_fp32_groups[0].device) if stage < 3 else "",
        "run_dir": ot_run_dir(out_dir, f"ds{case['zero']}"),
    }


def _slow_save_and_load(engine: Any, path: Path, seconds: float) -> float:
    """A save and a load through the engine, each file write `seconds` slower (a slow file system);
    returns when they ended."""
    write = engine.checkpoint_engine.save

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return write(*args, **kwargs)

    engine.checkpoint_engine.save = slow_write
    engine.save_checkpoint(str(path))
    engine.checkpoint_engine.save = write
    engine.load_checkpoint(str(path))
    return time.time()


def ot_run_dir(out_dir: str, run_name: str) -> str:
    return str(Path(out_dir) / run_name)


def _zero_events(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [e for e in result["events"] if e[0] == "zero_partition"]


def _check_zero(results: list[dict[str, Any]], stage: int, offload: str = "none") -> None:
    """Every rank exported its own partition and state, equal to what its engine holds; the stage
    and offload device are hyperparameters in the run directory."""
    hparams = json.loads((Path(results[0]["run_dir"]) / "hparams.json").read_text())["deepspeed"]
    assert (hparams["zero_stage"], hparams["offload_optimizer.device"]) == (stage, offload)
    for rank, res in enumerate(results):
        got = {name: res["scalars"][name][-1] for name in ZERO_NAMES if name in res["scalars"]}
        assert got[semconv.ZERO_STAGE.name] == stage, rank
        assert got[semconv.ZERO_DP_SIZE.name] == 2
        assert got[semconv.ZERO_MODEL_NUMEL.name] == MODEL_NUMEL
        assert got[semconv.ZERO_PARTITION_NUMEL.name] == res["partition"], rank
        assert got[semconv.ZERO_OPTIMIZER_STATE_BYTES.name] == res["state"], rank
        assert res["partition"] < MODEL_NUMEL  # really partitioned: about half each
        if stage >= 3:
            assert got[semconv.ZERO_PARAM_SHARD_NUMEL.name] == res["shard"] > 0
        else:
            assert semconv.ZERO_PARAM_SHARD_NUMEL.name not in got
    assert sum(r["partition"] for r in results) >= MODEL_NUMEL


def _check_steps(results: list[dict[str, Any]], steps: int) -> None:
    for rank, res in enumerate(results):
        assert res["steps"] == steps, rank
        assert res["counts"]["forward"] == steps * GAS, rank
        assert res["counts"]["backward"] == steps * GAS, rank
        assert res["counts"]["optimizer"] == steps, rank  # the accumulation boundary only
        # a micro-batch inside a step tells the stall watchdog the loop is alive: a long step is no stall
        assert res["micro_batch_heartbeats"] == steps * (GAS - 1), rank
        assert res["samples"] == steps * GAS * MICRO
        # one arrival per step: forward's last end in it, where the accumulation boundary's all-reduce runs
        assert res["arrivals"].get("forward", 0) == steps


@pytest.mark.multirank
def test_zero2_offload_phases_straggler_comms_and_csv_monitor(tmp_path: Path) -> None:
    """ZeRO-2 with CPU offload, wall_clock_breakdown, the comms logger and DeepSpeed's csv monitor,
    rank 1 slow in forward: phases on both ranks, DeepSpeed's finer timers, each rank's partition,
    the slow rank named and the other not, comms metrics, no zero_partition event, and DeepSpeed's
    own csv files still written."""
    csv_dir = tmp_path / "ds_csv"
    case = {"zero": 2, "offload": "cpu", "breakdown": True, "comms": True, "csv": str(csv_dir),
            "slow_rank": 1, "steps": 16}  # fmt: skip
    results = run_ranks(2, ds_job, (str(tmp_path), case), timeout=TIMEOUT, env=RANK_ENV)
    _check_steps(results, 16)
    _check_zero(results, 2, "cpu")
    for rank, res in enumerate(results):
        for name in (
            "bwd_inner",
            "bwd_allreduce",
            "optimizer_allgather",
            "optimizer_gradients",
            "optimizer_step",
        ):
            assert res["counts"].get(name) == 16, (rank, name)
        assert res["master_device"] == "cpu"
        loss = res["scalars"]["train.loss"]
        assert len(loss) == 16 * GAS  # every tensor handed to backward
        assert len(res["scalars"]["train.grad.norm"]) == 16
        assert len(res["scalars"]["train.learning_rate"]) == 16
        assert _zero_events(res) == []
    chronic = [a for e, _, a in results[0]["events"] if e == "straggler" and a["pattern"] == "chronic"]
    assert chronic, "the rank slowed in forward was never named"
    assert {a["rank"] for a in chronic} == {1}  # the other rank never (a one-off hiccup is not chronic)
    assert chronic[0]["train.phase"] == "forward"
    # The comms logger's counts and bytes, as exported per flush into the run dir, add up to what
    # DeepSpeed's own logger holds at the end, per op and size class
    for rank, res in enumerate(results):
        rows = [
            json.loads(x)
            for x in (Path(res["run_dir"]) / f"metrics.rank{rank}.jsonl").read_text().splitlines()
        ]
        for op, sizes in res["comms"].items():
            by_class: dict[str, list[int]] = {}
            for size, count in sizes.items():
                got = by_class.setdefault(size_class(size), [0, 0])
                got[0] += count
                got[1] += count * size
            for label, (count, size) in by_class.items():
                key = f"deepspeed/comm/{op}/{label}"
                assert sum(r.get(f"{key}/count", 0) for r in rows) == count, (rank, key)
                assert sum(r.get(f"{key}/bytes", 0) for r in rows) == size, (rank, key)
        assert res["comms"]["all_reduce"], "ZeRO-2 reduced gradients with all_reduce"
        assert any(k.endswith("/busbw") for r in rows for k in r)
    hparams = json.loads((Path(results[0]["run_dir"]) / "hparams.json").read_text())["deepspeed"]
    assert (hparams["zero_stage"], hparams["offload_optimizer.device"], hparams["dp_world_size"]) == (
        2,
        "cpu",
        2,
    )
    assert (hparams["train_batch_size"], hparams["gradient_accumulation_steps"]) == (2 * MICRO * GAS, GAS)
    # DeepSpeed's own csv monitor (rank 0 writes it): one row per optimizer step, as without otel_train
    files = {p.name for p in (csv_dir / "job").glob("*.csv")}
    assert "Train_Samples_lr.csv" in files and "Train_Samples_elapsed_time_ms_forward.csv" in files
    rows = (csv_dir / "job" / "Train_Samples_lr.csv").read_text().splitlines()
    assert rows[0] == "step,lr" and len(rows) == 1 + 16
    # The health events file in the run directory: no zero_partition line
    events = Path(results[0]["run_dir"]) / "events.rank0.jsonl"
    if events.exists():
        assert all(
            json.loads(line).get("event") != "zero_partition" for line in events.read_text().splitlines()
        )


@pytest.mark.multirank
def test_zero1_full_state_on_one_rank_is_one_event_naming_it(tmp_path: Path) -> None:
    """ZeRO-1 where rank 1 holds the whole model's Adam state besides its partition: exactly one
    zero_partition event, naming rank 1 and the fix; the loop uses torch-style loss.backward(),
    whose backward is still a phase and whose steps are still counted."""
    case = {"zero": 1, "plant_full_state": 1, "torch_backward": True, "steps": 6}
    results = run_ranks(2, ds_job, (str(tmp_path), case), timeout=TIMEOUT, env=RANK_ENV)
    _check_steps(results, 6)
    [(_, message, attrs)] = _zero_events(results[0])
    assert attrs["ranks"] == "1" and attrs["kind"] == "full_state"
    assert "rank 1" in message and "load_checkpoint" in message
    assert _zero_events(results[1]) == []
    assert "train.loss" not in results[0]["scalars"]  # no tensor was handed to engine.backward


@pytest.mark.multirank
def test_zero3_reports_partition_and_parameter_shard(tmp_path: Path) -> None:
    """ZeRO-3, with an evaluation (engine.eval(), no_grad) after step 2: its forwards are neither a
    training step, nor forward phases, nor samples, and each tells the stall watchdog the loop is
    alive. Then `engine.save_checkpoint` with slow file writes and `load_checkpoint`, longer than
    stall_timeout_s: each a span (goodput's checkpoint time), and no stall."""
    case = {"zero": 3, "steps": 4, "eval_batches": 3, "save_s": 0.6, "stall_timeout_s": 1.0}
    results = run_ranks(2, ds_job, (str(tmp_path), case), timeout=TIMEOUT, env=RANK_ENV)
    _check_steps(results, 4)
    assert all(r["progress_after_eval"] for r in results)
    for rank, res in enumerate(results):
        assert (res["counts"].get("checkpoint"), res["counts"].get("load_checkpoint")) == (1, 1), rank
        first, last = res["save_window"]
        assert last - first > 1.0  # several slowed writes: longer than the stall timeout
        stalls = [a for e, _, a in res["events"] if e == "stall" and first <= a["time"] <= last]
        assert stalls == [], rank
    _check_zero(results, 3)
    assert all(_zero_events(r) == [] for r in results)


@pytest.mark.multirank
def test_fp16_skipped_steps_and_loss_scale_and_nvme_under_zero2(tmp_path: Path) -> None:
    """fp16 on CPU overflows every step: the skipped steps and the loss scale exported equal the
    engine's. NVMe asked of ZeRO-2 (run as CPU offload, nvme_path never created) is one event."""
    case = {"zero": 2, "offload": "nvme", "fp16": True, "steps": 4}
    results = run_ranks(2, ds_job, (str(tmp_path), case), timeout=TIMEOUT, env=RANK_ENV)
    for res in results:
        assert res["skipped"] == 4 and res["global_steps"] == 4
        scales = res["scalars"][semconv.LOSS_SCALE.name]
        assert scales[-1] == res["loss_scale"] and len(scales) == 4
        assert scales == sorted(scales, reverse=True) and scales[0] > scales[-1]  # halved at each overflow
        assert "train.grad.norm" not in res["scalars"]  # an overflowed step's norm is no value
    [(_, message, attrs)] = _zero_events(results[0])
    assert attrs["kind"] == "nvme_not_used" and "stage 3" in message
    assert _zero_events(results[1]) == []
    assert not (tmp_path / "nvme").exists()
    events = [
        json.loads(line)
        for line in (Path(results[0]["run_dir"]) / "events.rank0.jsonl").read_text().splitlines()
    ]
    assert [e for e in events if e.get("event") == "zero_partition"]


@pytest.mark.multirank
def test_zero3_fp16_every_step_overflowing_with_the_callers_own_accumulation(tmp_path: Path) -> None:
    """managed_gradient_accumulation=false: the engine says "boundary" only while step() runs, so
    no step was recorded at all. ZeRO-3 fp16 whose steps overflow: the torch optimizer holds no
    partition until a step is applied, so the partition read 0 and a false zero_partition event
    said the ranks built different models."""
    case = {"zero": 3, "fp16": True, "steps": 4, "unmanaged": True}
    results = run_ranks(2, ds_job, (str(tmp_path), case), timeout=TIMEOUT, env=RANK_ENV)
    for rank, res in enumerate(results):
        assert res["global_steps"] == 4 and res["skipped"] == 4, rank
        assert res["steps"] == 4 and res["counts"]["optimizer"] == 4, rank
        assert res["counts"]["forward"] == 4 * GAS and res["samples"] == 4 * GAS * MICRO, rank
        assert res["scalars"][semconv.ZERO_PARTITION_NUMEL.name][0] == res["partition"] > 0, rank
    assert all(_zero_events(r) == [] for r in results)


def test_instrument_refuses_what_is_not_an_engine() -> None:
    from otel_train.integrations.deepspeed import instrument

    with pytest.raises(TypeError, match=r"deepspeed\.initialize"):
        instrument(object())


def test_size_class_labels() -> None:
    from otel_train.integrations.deepspeed import size_class

    assert [size_class(n) for n in (4, 37540, 19224, 1 << 20, 3 << 30)] == [
        "4B",
        "64KiB",
        "32KiB",
        "1MiB",
        "4GiB",
    ]


SLOW_OPTIMIZER_S = 0.02


def hf_job(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """The HF Trainer with DeepSpeed ZeRO-2 and optimizer offload to CPU, the otel_train callback
    with watch_every=1. The torch optimizer's step lasts SLOW_OPTIMIZER_S longer (TEST ONLY: a
    class-level wrapper in this rank), so the real optimizer step is measurable."""
    import deepspeed
    import torch
    from transformers import Trainer, TrainingArguments

    from otel_train.integrations.transformers import OtelTrainCallback

    real_step = torch.optim.AdamW.step

    def slow_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_OPTIMIZER_S)
        return real_step(self, *args, **kwargs)

    torch.optim.AdamW.step = slow_step  # type: ignore[method-assign]
    deepspeed.init_distributed(dist_backend="gloo")

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
            )

        def forward(self, x: Any, labels: Any = None) -> Any:
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    gen = torch.Generator().manual_seed(rank)
    data = [{"x": torch.randn(64, generator=gen), "labels": int(i % 10)} for i in range(64)]
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
        "zero_force_ds_cpu_optimizer": False,
    }
    args = TrainingArguments(
        output_dir=str(Path(out_dir) / "hf"), per_device_train_batch_size=4, max_steps=6, logging_steps=2,
        save_strategy="no", report_to=[], deepspeed=ds_config, ddp_backend="gloo", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    ot.init(output_dir=out_dir, run_name="hf", verbosity=0, log_interval=2, hardware=False, prometheus_port=0)
    session = current_session()
    seen = Intervals()
    session.worker.add_listener(seen)
    events: list[tuple[str, str, dict[str, Any]]] = []
    session.events.add_callback(lambda e, m, a: events.append((e, m, {**a, "time": time.time()})))
    trainer = Trainer(
        model=Model(), args=args, train_dataset=data, callbacks=[OtelTrainCallback(watch_every=1)]
    )
    trainer.train()
    engine = trainer.model_wrapped
    time.sleep(0.5)
    ot.shutdown()
    return {
        "counts": seen.counts,
        "phases": seen.phases,
        "scalars": seen.scalars,
        "steps": seen.steps,
        "events": events,
        "partition": sum(int(t.numel()) for t in engine.optimizer.single_partition_of_fp32_groups),
        "run_dir": str(Path(out_dir) / "hf"),
    }


@pytest.mark.multirank
def test_hf_trainer_with_deepspeed_zero2_reports_the_real_optimizer_step(tmp_path: Path) -> None:
    """HF Trainer + DeepSpeed ZeRO-2 (CPU offload) on 2 ranks: `optimizer` is DeepSpeed's real
    optimizer step (it holds the slowed torch step, not the Trainer's no-op), inside
    `forward_backward`; the ZeRO facts are reported; ot.watch prints no no_gradient hint."""
    pytest.importorskip("transformers")
    results = run_ranks(2, hf_job, (str(tmp_path),), timeout=TIMEOUT, env=RANK_ENV)
    for rank, res in enumerate(results):
        assert res["steps"] == 6, rank
        assert res["counts"]["optimizer"] == 6, rank  # once per step: the Trainer's no-op is not timed
        assert res["phases"]["optimizer"] / 6 >= SLOW_OPTIMIZER_S, rank
        assert res["phases"]["forward_backward"] >= res["phases"]["optimizer"]  # DeepSpeed steps inside it
        assert res["counts"]["forward"] == 6 and res["counts"]["backward"] == 6
        assert res["scalars"][semconv.ZERO_PARTITION_NUMEL.name][-1] == res["partition"]
        assert res["scalars"][semconv.ZERO_STAGE.name][-1] == 2
        assert [e for e in res["events"] if e[0] in ("no_gradient", "zero_partition")] == []
        assert "train.loss" in res["scalars"] and "train.grad.norm" in res["scalars"]  # the Trainer's logs
