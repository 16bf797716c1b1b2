"""Lightning straggler detection under DDP with the callback only (issue #23), or the logger only
(it adds the callback): two real gloo ranks,
`strategy="ddp"` on CPU, rank 1's dataset `__getitem__` chronically slow. The slow rank arrives last
at the gradient all-reduce inside backward; the callback begins each step at the previous batch's
end, so its `data` phase carries the lateness: one straggler event names rank 1 (`data`), none
names rank 0, and the detector never abstains."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

pytest.importorskip("lightning")
pytestmark = [pytest.mark.multirank]

STEPS = 30
LOG_INTERVAL = 5
SLOW_ITEM_S = 0.008  # x 4 rows per batch: ~30 ms more data loading per step on rank 1


def train(rank: int, world: int, out_dir: str, entry: str) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    import otel_train as ot
    from otel_train.integrations.lightning import OtelTrainCallback, OtelTrainLogger
    from otel_train.testing import current_session

    class SlowOnRank1(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(0)
            self.x = torch.randn(4 * STEPS * world, 16, generator=generator)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, index: int) -> Any:
            if rank == 1:
                time.sleep(SLOW_ITEM_S)  # a slow disk / decode on this rank only
            return self.x[index], self.x[index].sum(0, keepdim=True)

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    events: list[dict[str, Any]] = []
    seen: dict[str, Any] = {}

    class Listen(Callback):  # test-only: read the session the integration started
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            session = current_session()
            assert session is not None
            seen["session"] = session
            session.events.add_callback(lambda e, m, a: events.append(dict(a)) if e == "straggler" else None)

    settings = dict(output_dir=out_dir, run_name="pl-ddp", verbosity=0, hardware=False,
                    log_interval=LOG_INTERVAL, collective_timeout_s=60.0)  # fmt: skip
    ours = OtelTrainCallback(**settings) if entry == "callback" else OtelTrainLogger(**settings)
    trainer = Trainer(
        max_steps=STEPS, accelerator="cpu", devices=world, strategy="ddp",
        logger=ours if entry == "logger" else False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, callbacks=[ours, Listen()] if entry == "callback" else [Listen()],
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(SlowOnRank1(), batch_size=4)
    trainer.fit(Module(), loader)
    ot.shutdown()  # the logger's run outlives the fit (a test may follow): its last flush is drained here
    reducer = seen["session"].reducer
    return {"events": events, "abstain": reducer.abstain_reason, "collectives": reducer.collectives}


@pytest.mark.parametrize("entry", ["callback", "logger"])
def test_callback_or_logger_alone_names_the_slow_data_rank(tmp_path: Path, entry: str) -> None:
    results = run_ranks(2, train, (str(tmp_path), entry), timeout=240)
    reported = results[0]["events"]
    assert reported, "the chronically slow rank was never reported"
    assert [(a["rank"], a["train.phase"], a["category"]) for a in reported] == [(1, "data", "data")]
    assert all(r["abstain"] is None for r in results)  # arrivals exist: no abstain message
    assert results[0]["collectives"] == STEPS // LOG_INTERVAL
