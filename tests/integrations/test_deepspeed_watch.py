"""ot.watch(model) in a plain DeepSpeed loop (real DeepSpeed 0.19.8, gloo ranks, CPU accelerator):
ZeRO moves each gradient into its own partitioned buffers and sets `p.grad` to None during backward
by design (issue #44), so the watch reports no per-layer gradient norms, prints no hint about
missing gradients, says so once (info), and still reports what it can."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train import semconv
from otel_train.testing import current_session

from .test_deepspeed import RANK_ENV, TIMEOUT

pytest.importorskip("deepspeed")

MICRO, GAS, STEPS = 4, 2, 6


class Seen:
    """Flush listener: the watch's per-layer records and the recorded scalars of this rank."""

    def __init__(self) -> None:
        self.layer_grads: list[Any] = []
        self.layer_params: list[Any] = []
        self.scalars: dict[str, list[float]] = {}

    def on_flush(self, interval: Any) -> None:
        self.layer_grads += [(s, tuple(labels)) for s, labels, _ in interval.layer_grad_norms]
        self.layer_params += [(s, tuple(labels), list(v)) for s, labels, v in interval.layer_param_norms]
        for name, values in interval.scalars.items():
            self.scalars.setdefault(name, []).extend(values)

    def close(self) -> None:
        pass


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def watch_job(rank: int, world: int, out_dir: str, case: dict[str, Any]) -> dict[str, Any]:
    """`case`: zero (stage), watch ("model": before initialize, "engine": engine.module after)."""
    import deepspeed
    import torch

    from otel_train.integrations.deepspeed import instrument

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ot.init(output_dir=out_dir, run_name="w", verbosity=0, log_interval=2, hardware=False, prometheus_port=0)
    session = current_session()
    seen = Seen()
    session.worker.add_listener(seen)
    events: list[tuple[str, str]] = []
    session.events.add_callback(lambda e, m, a: events.append((e, m)))
    logs = Records()
    logging.getLogger("otel_train").addHandler(logs)
    logging.getLogger("otel_train").setLevel(logging.DEBUG)
    if case["watch"] == "model":
        ot.watch(model, every=1)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": case["zero"]},
        "zero_force_ds_cpu_optimizer": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    instrument(engine)
    if case["watch"] == "engine":
        ot.watch(engine.module, every=1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS * GAS):
        loss = engine(torch.randn(MICRO, 64, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    time.sleep(0.5)
    ot.shutdown()
    logging.getLogger("otel_train").removeHandler(logs)
    params = [p.detach().float() for p in engine.module.parameters()]
    return {
        "layer_grads": seen.layer_grads,
        "layer_params": seen.layer_params,
        "scalars": seen.scalars,
        "events": events,
        "logs": logs.records,
        "zero_attrs": [
            sorted(a for a in ("ds_id", "_hp_mapping") if hasattr(p, a)) for p in engine.module.parameters()
        ],
        "param_norms": [float(p.norm()) for p in params],
    }


def _zero_info(res: dict[str, Any]) -> list[tuple[int, str]]:
    return [(level, m) for level, m in res["logs"] if "DeepSpeed ZeRO" in m and "ot.watch" in m]


@pytest.mark.multirank
@pytest.mark.parametrize(("zero", "watch"), [(1, "model"), (2, "engine"), (3, "engine"), (3, "model")])
def test_watch_under_zero_reports_no_layer_gradients_and_says_so_once(
    tmp_path: Path, zero: int, watch: str
) -> None:
    """One rank (gloo): DeepSpeed's attributes on the parameters are seen whether the model was
    watched before `deepspeed.initialize` or `engine.module` after it."""
    (res,) = run_ranks(
        1, watch_job, (str(tmp_path), {"zero": zero, "watch": watch}), timeout=TIMEOUT, env=RANK_ENV
    )
    expected = ["ds_id"] if zero == 3 else ["_hp_mapping"]
    assert all(attrs == expected for attrs in res["zero_attrs"])  # what the detection relies on
    assert res["layer_grads"] == []  # p.grad is None by design: no per-layer gradient norms
    hints = [m for _, m in res["logs"] if "gradient" in m and "ot.watch" in m and "ZeRO" not in m]
    assert hints == []  # no hint about a missing backward pass
    assert [e for e in res["events"] if e[0] == "no_gradient"] == []
    info = _zero_info(res)
    assert len(info) == 1 and info[0][0] == logging.INFO, res["logs"]
    assert len(res["scalars"][semconv.GRAD_NORM.name]) == STEPS  # the adapter's global norm, each step
    if zero == 3:  # partitioned parameters: no parameter statistics rather than norms of nothing
        assert res["layer_params"] == []
    else:  # the parameters are whole on every rank: their norms per layer, as the engine holds them
        step, labels, norms = res["layer_params"][-1]
        assert step == STEPS - 1 and labels == ("0", "2")
        weights = res["param_norms"]
        want = [(weights[0] ** 2 + weights[1] ** 2) ** 0.5, (weights[2] ** 2 + weights[3] ** 2) ** 0.5]
        assert norms == pytest.approx(want, rel=1e-5)
