"""ot.watch on a torch.compile'd model: no recompile because of the watch (Dynamo guards on a
module's hooks, so hooks added and removed on watched steps would compile a second graph), and the
gradient norms are still exported."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.events import run_events
from torch import nn

import otel_train as ot
from otel_train.testing import capture_metrics, current_session


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.block = Block()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


@pytest.mark.parametrize("how", ["wrapper", "in_place", "submodule"])
@pytest.mark.parametrize("activations", [False, True])
def test_compiled_model_is_not_recompiled_by_watch(how: str, activations: bool) -> None:
    torch._dynamo.reset()
    compiles: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        compiles.append(1)
        return gm.forward

    torch.manual_seed(0)
    net = Net()
    if how == "wrapper":
        model: nn.Module = torch.compile(net, backend=counting_backend)  # type: ignore[assignment]
    elif how == "in_place":
        net.compile(backend=counting_backend)
        model = net
    else:
        net.block.compile(backend=counting_backend)
        model = net
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with capture_metrics(log_interval=1, run_dir_enabled=False, hardware=False) as cap:
        handle = ot.watch(model, every=2, activations=activations)
        handle.fingerprints = True  # as in a multi-process run: the batch fingerprint's hook too
        for i in range(6):
            with ot.step(i):
                opt.zero_grad()
                loss = model(torch.randn(4, 6, generator=gen)).pow(2).mean()
                loss.backward()
                opt.step()
    assert len(compiles) == 1  # the first compile only: watched and unwatched steps share it
    for step in (0, 2, 4):  # every watched step: each layer's gradient norm, and the global one
        scalars = next(s for st, s in cap.flushes if st == step)
        for layer in ("embed", "block.inner", "head"):
            assert scalars[f"grad_norm/{layer}"] > 0, (step, layer)
        assert scalars["train/grad_norm"] > 0


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return (self.head_a if task == 0 else self.head_b)(torch.tanh(self.trunk(x)))


def test_a_compiled_models_layer_that_did_not_run_is_left_out_not_zero(tmp_path: Any) -> None:
    """No forward hook runs in a compiled model: the layers that got a gradient are the ones that
    ran. A task head that sits a step out is absent that step, never a made-up 0.0 or a
    `no_gradient` event (as in eager mode, where the hooks tell)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = TwoHeads()
    model = torch.compile(net, backend=lambda gm, inputs: gm.forward)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with capture_metrics(log_interval=1, output_dir=str(tmp_path), hardware=False) as cap:
        ot.watch(model, every=1)
        for i in range(8):
            with ot.step(i):
                opt.zero_grad(set_to_none=True)
                model(torch.randn(4, 6), i % 2).pow(2).mean().backward()
                opt.step()
        run_dir = current_session().run_dir
    for step, scalars in cap.flushes:
        ran, sat_out = ("head_a", "head_b") if step % 2 == 0 else ("head_b", "head_a")
        assert scalars[f"grad_norm/{ran}"] > 0, (step, scalars)
        # the gauge keeps its last value between points: no new point is what "absent" means
        assert step < 2 or scalars.get(f"grad_norm/{sat_out}") != 0.0, (step, scalars)
    events = [e["event"] for e in run_events(run_dir)]
    assert "no_gradient" not in events, events
