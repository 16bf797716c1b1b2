"""The training-bug detectors (`data_not_sharded`, `no_gradient`, `replica_divergence`) through the
entry points a user has, on real gloo ranks with the pinned frameworks: the Lightning callback
(`watch_every`), the Hugging Face Trainer callback (`watch_every`), and `ot.step` + `ot.watch` under
FSDP2 (`fully_shard`). Plain `ot.step` + `ot.watch` under DDP is in tests/crossrank/test_replicas.py, one rank in
tests/test_gradient_flow.py.

Each multi-rank run plants the bugs it expects and asserts the events it does not: a run with
unsharded data and a detached layer, and a properly sharded run (the framework's own
DistributedSampler) that is healthy or has one replica perturbed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from helpers.events import run_events
from helpers.multirank import run_ranks

DETECTORS = ("data_not_sharded", "no_gradient", "replica_divergence")
WATCH_EVERY = 2  # watched steps 0, 2, 4, ...: no_gradient after 3 of them (step 4)
LOG_INTERVAL = 4  # a flush (and an exchange) every 4 steps
STEPS = 16


def _events(out: str, run_name: str, rank: int) -> list[dict[str, Any]]:
    return [e for e in run_events(Path(out) / run_name, rank) if e["event"] in DETECTORS]


def _metrics(out: Path, run_name: str, rank: int = 0) -> dict[str, Any]:
    """Every value the rank's flushes wrote (the latest of each): what was compared, and to what."""
    merged: dict[str, Any] = {}
    for line in (out / run_name / f"metrics.rank{rank}.jsonl").read_text().splitlines():
        merged.update(json.loads(line))
    return merged


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


# --- Lightning: OtelTrainCallback(watch_every=...) under strategy="ddp" -----------------------------
def _lightning_rank(rank: int, world: int, out: str, mode: str) -> list[dict[str, Any]]:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    from otel_train.integrations.lightning import OtelTrainCallback

    detached = mode == "unsharded_detached"

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(8, 16)
            self.side = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            # calls the layers, not self(x): the root module's forward never sees the batch, so only
            # the callback's ot.watch_batch fingerprints it
            x, y = batch
            h = torch.tanh(self.embed(x))
            side = self.side(h)
            out = self.head(h + (side.detach() if detached else side))
            return torch.nn.functional.mse_loss(out, y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class PerturbRank1(Callback):  # a replica that drifts: rank 1's weights change after step 5
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if mode == "perturbed" and rank == 1 and trainer.global_step == 5:
                with torch.no_grad():
                    pl_module.head.weight.mul_(1.01)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(256, 8, generator=generator), torch.randn(256, 1, generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    callback = OtelTrainCallback(
        watch_every=WATCH_EVERY, output_dir=out, run_name=mode, verbosity=0, hardware=False,
        log_interval=LOG_INTERVAL, prometheus_port=0,
    )  # fmt: skip
    trainer = Trainer(
        max_steps=STEPS, accelerator="cpu", devices=world, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        # the detached layer gets no gradient: DDP must be told, as for any unused parameter
        strategy="auto" if world == 1 else "ddp_find_unused_parameters_true" if detached else "ddp",
        # False: Lightning does not add its DistributedSampler, every rank reads the same batches
        use_distributed_sampler=not mode.startswith("unsharded"),
        callbacks=[PerturbRank1(), callback],
    )  # fmt: skip
    trainer.fit(Module(), loader)
    return _events(out, mode, rank)


@pytest.mark.multirank
def test_lightning_unsharded_data_and_a_detached_layer_are_named(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    results = run_ranks(2, _lightning_rank, (str(tmp_path), "unsharded_detached"), timeout=300)
    [data] = _named(results[0], "data_not_sharded")
    assert data["ranks"] == "0,1" and data["step"] in (0, 2)  # named at the first flush
    for events in results:  # every rank judges its own gradients
        [flow] = _named(events, "no_gradient")
        assert flow["train.layer"] == "side" and flow["layers"] == 1 and flow["step"] == 4
    assert _named(results[0], "replica_divergence") == []  # DDP keeps the replicas identical ...
    assert _metrics(tmp_path, "unsharded_detached")["data/replica_divergence"] == 0.0  # ... compared


@pytest.mark.multirank
def test_lightning_sharded_data_is_quiet_and_a_perturbed_replica_is_named(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    results = run_ranks(2, _lightning_rank, (str(tmp_path), "perturbed"), timeout=300)
    assert _named(results[0], "data_not_sharded") == []  # Lightning's own DistributedSampler
    assert _metrics(tmp_path, "perturbed")["data/duplicate_ranks"] == 0.0  # compared, all distinct
    assert _named(results[0], "no_gradient") == [] and _named(results[1], "no_gradient") == []
    [drift] = _named(results[0], "replica_divergence")
    assert drift["ranks"] == "0,1" and drift["train.layer"] == "head" and 6 <= drift["step"] <= 8


# --- Hugging Face Trainer: OtelTrainCallback(watch_every=...) under DDP (gloo) ---------------------
def _hf_rank(rank: int, world: int, out: str, mode: str) -> list[dict[str, Any]]:
    import torch
    from helpers.integration_models import VOCAB, TokenDataset
    from transformers import Trainer, TrainingArguments

    import otel_train as ot
    from otel_train.integrations.transformers import OtelTrainCallback

    detached = mode == "unsharded_detached"

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(VOCAB, 16)
            self.side = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, VOCAB)

        def forward(self, input_ids: Any, labels: Any = None) -> dict[str, Any]:
            h = self.embed(input_ids)
            side = self.side(h)
            logits = self.head(h + (side.detach() if detached else side))
            return {"loss": torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))}

    class PlainLoaderTrainer(Trainer):
        """A user's own train loader, not given to the Accelerator: every rank reads every batch."""

        def get_train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=2, shuffle=False)

    callback = OtelTrainCallback(
        watch_every=WATCH_EVERY, output_dir=out, run_name=mode, verbosity=0, hardware=False,
        log_interval=LOG_INTERVAL, prometheus_port=0,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(Path(out) / f"hf{rank}"), max_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
        logging_steps=STEPS, dataloader_num_workers=0, ddp_backend="gloo" if world > 1 else None, ddp_find_unused_parameters=detached,
    )  # fmt: skip
    trainer_class = PlainLoaderTrainer if mode.startswith("unsharded") else Trainer
    trainer = trainer_class(model=TinyLM(), args=args, train_dataset=TokenDataset(64), callbacks=[callback])
    trainer.train()
    ot.shutdown()  # the callback's run idles after train(), until process exit
    return _events(out, mode, rank)


@pytest.mark.multirank
def test_hf_unsharded_data_and_a_detached_layer_are_named(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    results = run_ranks(2, _hf_rank, (str(tmp_path), "unsharded_detached"), timeout=300)
    [data] = _named(results[0], "data_not_sharded")
    assert data["ranks"] == "0,1" and data["step"] in (0, 2)
    for events in results:  # gradients read before the Trainer zeroes them: only `side` has none
        [flow] = _named(events, "no_gradient")
        assert flow["train.layer"] == "side" and flow["layers"] == 1 and flow["step"] == 4
    assert _named(results[0], "replica_divergence") == []


@pytest.mark.multirank
def test_hf_sharded_healthy_ddp_raises_nothing(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    results = run_ranks(2, _hf_rank, (str(tmp_path), "sharded"), timeout=300)
    assert results[0] == [] and results[1] == []  # the Accelerator shards the Trainer's own loader
    seen = _metrics(tmp_path, "sharded")  # ... and the checks ran: batches and replicas compared
    assert seen["data/duplicate_ranks"] == 0.0 and seen["data/replica_divergence"] == 0.0
    assert all(
        f"grad_norm/{layer}" in _metrics(tmp_path, "sharded", r) for layer in ("side", "head") for r in (0, 1)
    )


# --- one rank: the same callbacks, no exchange (no_gradient is judged on every rank alone) -----------
def test_lightning_one_rank_names_a_detached_layer(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    [flow] = _named(_lightning_rank(0, 1, str(tmp_path), "unsharded_detached"), "no_gradient")
    assert flow["train.layer"] == "side" and flow["step"] == 4


def test_hf_one_rank_names_a_detached_layer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    [flow] = _named(_hf_rank(0, 1, str(tmp_path), "unsharded_detached"), "no_gradient")
    assert flow["train.layer"] == "side" and flow["step"] == 4


# --- ot.step + ot.watch under FSDP2 -------------------------------------------------------------------
class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fsdp2_rank(rank: int, world: int, out: str, mode: str) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import otel_train as ot

    said = _Said()
    logging.getLogger("otel_train").addHandler(said)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = DistributedSampler(data, shuffle=True, seed=0) if mode == "sharded" else None
    loader = DataLoader(data, batch_size=8, sampler=sampler, shuffle=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ot.init(
        output_dir=out,
        run_name=mode,
        prometheus_port=0,
        verbosity=0,
        hardware=False,
        log_interval=LOG_INTERVAL,
    )
    ot.watch(model, every=WATCH_EVERY)
    for step, (x, y) in zip(range(STEPS), loader, strict=False):
        with ot.step(step):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    ot.shutdown()
    logging.getLogger("otel_train").removeHandler(said)
    return {"events": _events(out, mode, rank), "said": [m for m in said.messages if "sharded (FSDP)" in m]}


@pytest.mark.multirank
def test_fsdp2_unsharded_data_is_named_and_the_replica_check_is_skipped_once(tmp_path: Path) -> None:
    results = run_ranks(2, _fsdp2_rank, (str(tmp_path), "unsharded"), timeout=240)
    [data] = _named(results[0]["events"], "data_not_sharded")
    assert data["ranks"] == "0,1"
    # each rank's parameter norms are of its own shard: not compared, and said once (rank 0) for the job
    assert _named(results[0]["events"], "replica_divergence") == []
    assert len(results[0]["said"]) == 1 and results[1]["said"] == []
    # a rank whose shard of a layer is empty (Linear(16, 1) on 2 ranks) is not a layer without gradient
    assert all(_named(r["events"], "no_gradient") == [] for r in results)


@pytest.mark.multirank
def test_fsdp2_sharded_data_is_quiet(tmp_path: Path) -> None:
    results = run_ranks(2, _fsdp2_rank, (str(tmp_path), "sharded"), timeout=240)
    assert results[0]["events"] == [] and results[1]["events"] == []
    seen = _metrics(tmp_path, "sharded")
    assert seen["data/duplicate_ranks"] == 0.0 and "data/replica_divergence" not in seen
