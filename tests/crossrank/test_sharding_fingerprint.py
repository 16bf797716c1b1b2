"""`data_not_sharded` on sharded data whose first tensor has the same sums on every rank: one-hot
inputs (DNA as [B, 4, L]) and an all-ones attention_mask ahead of the input ids. Real DDP on real
gloo ranks with DistributedSampler: no event; the same jobs without the sampler: named."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train import adapters

LENGTH = 32  # bases per sequence / tokens per row
STEPS = 20  # a flush every 10 steps, a watched step every 5: two flushes compare four steps


class DnaConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 5, padding=2)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(dim=2))


class MaskedBag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return self.head(h.sum(dim=1) / attention_mask.sum(dim=1, keepdim=True))


def _rank(rank: int, world: int, output_dir: str, data: str, sharded: bool) -> list[dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    os.environ["OTEL_TRAIN_OUTPUT_DIR"] = output_dir
    gen = torch.Generator().manual_seed(0)  # the same dataset on every rank, as a job's would be
    bases = torch.randint(4, (256, LENGTH), generator=gen)
    if data == "dna":  # one-hot: every batch sums to 8 * LENGTH, its squares too
        dataset = TensorDataset(torch.nn.functional.one_hot(bases, 4).transpose(1, 2).float())
        inner: torch.nn.Module = DnaConv()
    else:  # an all-ones mask first: the same on every rank whatever the rows
        dataset = TensorDataset(torch.ones(256, LENGTH), bases + 4)
        inner = MaskedBag()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0) if sharded else None
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, shuffle=False)
    torch.manual_seed(0)
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ot.init(prometheus_port=0, verbosity=0, hardware=False, log_interval=10, run_name="sharding")
    ot.watch(model, every=5)
    for step, batch in zip(range(STEPS), loader, strict=False):
        with ot.step(step):
            opt.zero_grad()
            if data == "dna":  # fingerprinted by the forward pre-hook: the argument
                out = model(batch[0])
            else:  # as the integrations do: the batch as it left the loader, mask first
                adapters.watch_batch({"attention_mask": batch[0], "input_ids": batch[1]})
                out = model(batch[0], batch[1])
            out.pow(2).mean().backward()
            opt.step()
    ot.shutdown()
    path = Path(output_dir) / "sharding" / f"events.rank{rank}.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in events if e["event"] == "data_not_sharded"]


@pytest.mark.multirank
@pytest.mark.parametrize("data", ["dna", "mask_first"])
def test_sharded_batches_with_shape_only_sums_are_not_named(data: str, tmp_path: Path) -> None:
    results = run_ranks(2, _rank, (str(tmp_path), data, True), timeout=180)
    assert results == [[], []]


@pytest.mark.multirank
@pytest.mark.parametrize("data", ["dna", "mask_first"])
def test_the_same_batches_without_a_sampler_are_named(data: str, tmp_path: Path) -> None:
    results = run_ranks(2, _rank, (str(tmp_path), data, False), timeout=180)
    [event] = results[0]
    assert event["ranks"] == "0,1" and event["step"] in (5, 10, 15), event
