"""Gradient flow (gradient_flow.py): layers without gradient, exploding and vanishing layers, from
the norms ot.watch computes. The monitor on synthetic norms, then real models trained with ot.watch."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers.events import Events
from torch import nn

import otel_train as ot
from otel_train import semconv as sc
from otel_train.core.buffer import Interval
from otel_train.numerics.gradient_flow import (
    EXPLODE,
    IMMEDIATE,
    SUSTAIN,
    VANISH,
    WARMUP,
    ZERO_STEPS,
    GradientFlowMonitor,
)
from otel_train.testing import current_session

LABELS = ("embed", "mid", "head")
FLOW_EVENTS = ("no_gradient", "gradient_explosion", "gradient_vanishing")


def _feed(monitor: GradientFlowMonitor, rows: list[tuple[float, float, float]], first_step: int = 0) -> None:
    interval = Interval(seq=0, step=first_step + len(rows) - 1, wall_time=0.0, elapsed_s=1.0, steps=len(rows),
                        tokens=0, samples=0)  # fmt: skip
    interval.layer_grad_norms = [(first_step + i, LABELS, list(row)) for i, row in enumerate(rows)]
    monitor.on_flush(interval)


def test_a_layer_without_gradient_is_named_once_after_n_watched_steps() -> None:
    events = Events()
    monitor = GradientFlowMonitor(events)
    _feed(monitor, [(1.0, 0.0, 1.0)] * (ZERO_STEPS - 1))
    assert events.items == []
    _feed(monitor, [(1.0, 0.0, 1.0)] * 5, first_step=ZERO_STEPS - 1)  # spread over flushes
    [(_, message, attrs)] = events.named("no_gradient")
    assert attrs[sc.LAYER] == "mid" and attrs["step"] == ZERO_STEPS - 1
    assert "1 layer(s)" in message and "detached" in message


def test_every_layer_without_gradient_points_at_backward_and_clearing() -> None:
    events = Events()
    _feed(GradientFlowMonitor(events), [(0.0, 0.0, 0.0)] * ZERO_STEPS)
    [(_, message, attrs)] = events.named("no_gradient")
    assert attrs["layers"] == 3 and "between backward and the optimizer step" in message


def test_explosion_and_vanishing_against_each_layers_own_level() -> None:
    events = Events()
    monitor = GradientFlowMonitor(events)
    # three layers on very different scales: each is judged against its own history
    _feed(monitor, [(1e-4, 1.0, 1e3)] * (WARMUP + 2))
    assert events.items == []
    jump = (1e-4 * EXPLODE * 3, 1.0 / (VANISH * 3), 1e3 * 2)
    _feed(monitor, [jump] * (SUSTAIN - 1), first_step=20)
    assert events.items == []  # not yet: one batch's gradient is noisy
    _feed(monitor, [jump], first_step=20 + SUSTAIN - 1)
    [(_, up, up_attrs)] = events.named("gradient_explosion")
    [(_, down, down_attrs)] = events.named("gradient_vanishing")
    assert up_attrs[sc.LAYER] == "embed" and up_attrs["step"] == 20 + SUSTAIN - 1
    assert up_attrs["factor"] == pytest.approx(30) and down_attrs[sc.LAYER] == "mid"
    assert "below" in down and "above" in up
    # still anomalous: not reported again; normal, then anomalous again: reported again
    _feed(monitor, [jump] * 4, first_step=30)
    assert len(events.items) == 2
    _feed(monitor, [(1e-4, 1.0, 1e3)] + [jump] * SUSTAIN, first_step=40)
    assert [a["step"] for _, _, a in events.named("gradient_explosion")] == [20 + SUSTAIN - 1, 40 + SUSTAIN]


def test_a_single_spike_is_noise_unless_extreme() -> None:
    events = Events()
    monitor = GradientFlowMonitor(events)
    _feed(monitor, [(1.0, 1.0, 1.0)] * WARMUP)
    _feed(monitor, [(50.0, 1.0, 1.0), (1.0, 1.0, 1.0)] * 3, first_step=10)  # 50x, once at a time
    assert events.items == []
    _feed(monitor, [(1.0, IMMEDIATE * 2, 1.0)], first_step=20)
    [(_, _, attrs)] = events.named("gradient_explosion")
    assert (attrs[sc.LAYER], attrs["step"]) == ("mid", 20)


def test_a_slow_drift_and_noise_are_not_anomalies() -> None:
    events = Events()
    monitor = GradientFlowMonitor(events)
    rows = []
    for i in range(400):  # x0.98 per watched step: 3000x smaller over the run, 1.5x noise
        level = 0.98**i * (1.5 if i % 2 else 1.0)
        rows.append((level, 1.0 + 0.5 * math.sin(i), 5.0))
    _feed(monitor, rows)
    assert events.items == []


def test_nonfinite_norms_are_left_to_the_nonfinite_grad_event() -> None:
    events = Events()
    _feed(GradientFlowMonitor(events), [(1.0, 1.0, 1.0)] * WARMUP + [(math.inf, math.nan, 1.0)] * 5)
    assert events.items == []


# --- real models, real ot.watch ----------------------------------------------------------------------
class SideBranch(nn.Module):
    """`side`'s output is detached before use: it never gets a gradient (a classic silent bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(h + self.side(h).detach())


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _train(
    model: nn.Module, steps: int, every: int = 1, on_backward: Any = None
) -> list[tuple[str, str, dict]]:
    ot.init(prometheus_port=0, verbosity=0, hardware=False, run_dir_enabled=False, log_interval=5)
    session = current_session()
    seen: list[tuple[str, str, dict]] = []
    session.events.add_callback(lambda e, m, a: seen.append((e, m, dict(a))))
    ot.watch(model, every=every)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        with ot.step(i):
            opt.zero_grad()
            x = torch.randn(16, 6, generator=gen)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            loss.backward()
            if on_backward is not None:
                on_backward(i, model)
            opt.step()
            ot.record("loss", loss)
    ot.shutdown()
    return [e for e in seen if e[0] in FLOW_EVENTS]


def test_a_detached_layer_is_named() -> None:
    events = _train(SideBranch(), 12)
    [(name, message, attrs)] = events
    assert name == "no_gradient" and attrs[sc.LAYER] == "side" and "side" in message
    assert attrs["step"] == ZERO_STEPS - 1


def test_healthy_training_raises_nothing() -> None:
    assert _train(Healthy(), 300, every=2) == []


def test_an_exploding_layer_is_named_at_its_step() -> None:
    def blow_up(step: int, model: nn.Module) -> None:
        if step == 40:
            with torch.no_grad():
                model.net[2].weight.grad.mul_(1e4)

    events = _train(Healthy(), 50, on_backward=blow_up)
    [(name, _, attrs)] = events
    assert (name, attrs[sc.LAYER], attrs["step"]) == ("gradient_explosion", "net.2", 40)


# --- layers that do not run at every step: no gradient there is no fault ------------------------------
class AlternateHeads(nn.Module):
    """Two heads used on alternate steps (e.g. two losses or two data sources taking turns)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.heads = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = self.heads[self.calls % 2]
        self.calls += 1
        return head(torch.tanh(self.trunk(x)))


class RandomTaskHeads(nn.Module):
    """Three task heads, one chosen at random per step (multi-task training); `detach_side`: a side
    layer that runs every step with its output detached (the bug no_gradient is for)."""

    def __init__(self, detach_side: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.side = nn.Linear(16, 16)
        self.tasks = nn.ModuleList([nn.Linear(16, 1) for _ in range(3)])
        self.detach_side = detach_side
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        side = self.side(h)
        h = h + (side.detach() if self.detach_side else side)
        task = int(torch.randint(3, (1,), generator=self.gen))
        return self.tasks[task](h)


class TopOneMoE(nn.Module):
    """A top-1 mixture of 8 experts over 16 tokens: an expert that gets no token does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.router = nn.Linear(16, 8)
        self.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(8)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        probs = torch.softmax(self.router(h), dim=-1)
        choice = probs.argmax(dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = expert(h[mask]) * probs[mask, e : e + 1]
        return self.head(h + out)


@pytest.mark.parametrize("shape", [AlternateHeads, RandomTaskHeads, TopOneMoE])
def test_layers_that_did_not_run_are_not_missing_a_gradient(shape: type[nn.Module]) -> None:
    """Healthy runs where some layers sit out steps: no event (each raised no_gradient before)."""
    assert _train(shape(), 60, every=2) == []


def test_a_detached_layer_is_named_beside_heads_that_take_turns() -> None:
    [(name, _, attrs)] = _train(RandomTaskHeads(detach_side=True), 30, every=2)
    assert (name, attrs[sc.LAYER], attrs["layers"]) == ("no_gradient", "side", 1)
    assert attrs["step"] == 2 * (ZERO_STEPS - 1)


def test_the_gradient_norms_of_a_step_are_of_the_layers_that_ran() -> None:
    """The watch's gradient norms at a watched step: only the head that ran, next to the trunk."""
    from otel_train.core.buffer import Buffer
    from otel_train.numerics.model_watch import ModelWatch

    model = AlternateHeads()
    buffer = Buffer(max_names=100, max_values=100)
    watch = ModelWatch(buffer, model, 1, grads=True, params=False, activations=False, histograms=False,
                       max_layers=8)  # fmt: skip
    watch.fingerprints = False
    for step in range(2):
        watch.begin_step(step)
        model.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        watch.end_step(step, failed=False)
    grads = [r for r in buffer.layer_stats if r.instrument == sc.LAYER_GRAD_NORM.name]
    assert [(r.step, r.labels) for r in grads] == [(0, ("trunk", "heads.0")), (1, ("trunk", "heads.1"))]
    assert all(float(v) > 0 for r in grads for v in r.values)
