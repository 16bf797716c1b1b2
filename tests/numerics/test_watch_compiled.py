"""ot.watch on a torch.compile'd model: no recompile because of the watch (Dynamo guards on a
module's hooks, so hooks added and removed on watched steps would compile a second graph), and the
gradient norms are still exported."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import otel_train as ot
from otel_train.testing import capture_metrics


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
