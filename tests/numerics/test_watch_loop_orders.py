"""ot.watch with the loops people write: wherever `zero_grad` is, with GradScaler, accumulation,
several optimizers or none. Each watched step's per-layer gradient norms must be the ones the
optimizer applied (computed here from snapshots the test takes itself), with no "no gradients" hint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import otel_train as ot
from otel_train import adapters
from otel_train import semconv as sc
from otel_train.testing import Capture, capture_metrics, current_session

LABELS = ["embed", "blocks.0.0", "blocks.1.0", "head"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _seeded_net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 * step + micro))


def _layer_norms(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per layer (owning module), sqrt of the sum of its gradients' squared L2 norms, in float64."""
    sums = dict.fromkeys(LABELS, 0.0)
    for name, grad in grads.items():
        sums[name.rpartition(".")[0]] += float(grad.double().norm()) ** 2
    return {label: math.sqrt(total) for label, total in sums.items()}


def _snapshot(model: nn.Module, divide_by: float = 1.0) -> dict[str, float]:
    return _layer_norms({n: p.grad / divide_by for n, p in model.named_parameters() if p.grad is not None})


def _flush_at(cap: Capture, step: int) -> dict[str, float]:
    return next(scalars for at, scalars in cap.flushes if at == step)


def _assert_exported(cap: Capture, refs: dict[int, dict[str, float]], rel: float = 1e-5) -> None:
    """Every watched step's flush holds the per-layer norms and the total of its reference."""
    assert refs
    for step, ref in refs.items():
        scalars = _flush_at(cap, step)
        for label in LABELS:
            assert scalars[f"grad_norm/{label}"] == pytest.approx(ref[label], rel=rel), (step, label)
        total = math.sqrt(sum(v * v for v in ref.values()))
        assert scalars["train/grad_norm"] == pytest.approx(total, rel=rel), step


def _watch_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ot.watch")]


@pytest.fixture
def cap(caplog: pytest.LogCaptureFixture) -> Iterator[Capture]:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=1, run_dir_enabled=False, hardware=False) as capture:
        yield capture


@pytest.mark.parametrize(
    ("use_scaler", "micro_batches"),
    [(False, 1), (True, 1), (False, 3), (True, 3)],
    ids=["plain", "grad_scaler", "accumulation", "grad_scaler_accumulation"],
)
def test_nanogpt_order_exports_every_watched_step(
    cap: Capture, caplog: pytest.LogCaptureFixture, use_scaler: bool, micro_batches: int
) -> None:
    """nanoGPT's train.py loop: micro-batch backward passes (scaled), unscale_, clip, scaler.step,
    update, zero_grad(set_to_none=True), all inside the step."""
    model = _seeded_net()
    ot.watch(model, every=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=use_scaler)
    refs: dict[int, dict[str, float]] = {}
    for step in range(5):
        with ot.step(step):
            for micro in range(micro_batches):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_scaler):
                    loss = model(_batch(step, micro)).pow(2).mean() / micro_batches
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if step % 2 == 0:
                refs[step] = _snapshot(model)  # what the optimizer applies: unscaled, clipped
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    if use_scaler:  # the gradients were scaled: a read of the scaled ones would be far off
        assert scaler.get_scale() >= 2.0**15
    ot.shutdown()
    _assert_exported(cap, refs)
    assert _watch_warnings(caplog) == []


@pytest.mark.parametrize("fused", [False, True], ids=["unscaled_in_step", "fused_adam_unscales_in_kernel"])
def test_grad_scaler_without_unscale_reads_unscaled_gradients(
    cap: Capture, caplog: pytest.LogCaptureFixture, fused: bool
) -> None:
    """No `unscale_` call: scaler.step unscales before optimizer.step, or (an optimizer with
    `_step_supports_amp_scaling`, fused Adam) hands the scale to the optimizer, whose gradients are
    still scaled when its step begins."""
    model = _seeded_net()
    ot.watch(model, every=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    assert getattr(opt, "_step_supports_amp_scaling", False) is fused
    scaler = torch.amp.GradScaler("cpu")
    refs: dict[int, dict[str, float]] = {}
    for step in range(3):
        with ot.step(step):
            scaler.scale(model(_batch(step)).pow(2).mean()).backward()
            refs[step] = _snapshot(model, divide_by=scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    ot.shutdown()
    _assert_exported(cap, refs)
    assert _watch_warnings(caplog) == []


def test_a_step_grad_scaler_skips_still_reports_its_gradients(
    cap: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    """An inf gradient: scaler.step never calls optimizer.step (no pre-hook runs) and zero_grad sets
    the gradients to None; they are read when the step ends, unscaled, and the inf is named."""
    session = current_session()
    assert session is not None
    events: list[tuple[str, dict[str, Any]]] = []
    session.events.add_callback(lambda event, message, attrs: events.append((event, dict(attrs))))
    model = _seeded_net()
    ot.watch(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    before = scaler.get_scale()
    refs: dict[int, dict[str, float]] = {}
    for step in range(2):
        with ot.step(step):
            scaler.scale(model(_batch(step)).pow(2).mean()).backward()
            if step == 1:
                with torch.no_grad():
                    model.embed.bias.grad[0] = float("inf")
            refs[step] = _snapshot(model, divide_by=scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    assert scaler.get_scale() < before  # the scaler did skip step 1
    ot.shutdown()
    _assert_exported(cap, {0: refs[0]})
    at_1 = _flush_at(cap, 1)
    for label in ("blocks.0.0", "blocks.1.0", "head"):  # the finite layers, unscaled
        assert at_1[f"grad_norm/{label}"] == pytest.approx(refs[1][label], rel=1e-5)
    assert [a[sc.LAYER] for e, a in events if e == "nonfinite_grad" and a["step"] == 1] == ["embed"]
    assert _watch_warnings(caplog) == []


def test_zero_grad_without_set_to_none_after_the_step(cap: Capture, caplog: pytest.LogCaptureFixture) -> None:
    """`zero_grad(set_to_none=False)` at the end zeroes the gradients in place: the step's end would
    read zeros (a false `no_gradient`); the read before the optimizer step has the real ones."""
    model = _seeded_net()
    ot.watch(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    refs: dict[int, dict[str, float]] = {}
    for step in range(2):
        with ot.step(step):
            model(_batch(step)).pow(2).mean().backward()
            refs[step] = _snapshot(model)
            opt.step()
            opt.zero_grad(set_to_none=False)
    ot.shutdown()
    _assert_exported(cap, refs)
    assert all(v > 0 for v in refs[1].values())
    assert _watch_warnings(caplog) == []


def test_no_optimizer_and_gradients_cleared_before_the_step_ends(
    cap: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand-written update (no torch.optim step for a pre-hook) and `model.zero_grad()` (None) at
    the end: the gradients each backward left are read when the step ends."""
    model = _seeded_net()
    ot.watch(model, every=1)
    refs: dict[int, dict[str, float]] = {}
    for step in range(2):
        with ot.step(step):
            model(_batch(step)).pow(2).mean().backward()
            refs[step] = _snapshot(model)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            model.zero_grad(set_to_none=True)
    ot.shutdown()
    _assert_exported(cap, refs)
    assert _watch_warnings(caplog) == []


def test_two_optimizers_each_read_before_their_own_step(
    cap: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    """Each optimizer's step reads its own parameters' gradients; the second read does not replace
    the first one's layers with the None its zero_grad left."""
    model = _seeded_net()
    ot.watch(model, every=1)
    body = torch.optim.SGD([*model.embed.parameters(), *model.blocks.parameters()], lr=1e-2)
    head = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    other = nn.Linear(2, 1)  # an optimizer of an unwatched model steps too: none of ours
    other_opt = torch.optim.SGD(other.parameters(), lr=1e-2)
    refs: dict[int, dict[str, float]] = {}
    for step in range(2):
        with ot.step(step):
            model(_batch(step)).pow(2).mean().backward()
            other(torch.ones(1, 2)).sum().backward()
            refs[step] = _snapshot(model)
            body.step()
            body.zero_grad(set_to_none=True)
            other_opt.step()
            head.step()
            head.zero_grad(set_to_none=True)
    ot.shutdown()
    _assert_exported(cap, refs)
    assert _watch_warnings(caplog) == []


def test_watch_read_after_the_gradients_are_cleared(cap: Capture, caplog: pytest.LogCaptureFixture) -> None:
    """A framework hook that calls ot.watch_read after its loop zeroed the gradients (the Hugging Face
    Trainer's on_step_end) gets what the optimizer step read."""
    model = _seeded_net()
    ot.watch(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    refs: dict[int, dict[str, float]] = {}
    for step in range(2):
        with ot.step(step):
            model(_batch(step)).pow(2).mean().backward()
            refs[step] = _snapshot(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            adapters.watch_read()
    ot.shutdown()
    _assert_exported(cap, refs)
    assert _watch_warnings(caplog) == []


def test_gradient_hooks_exist_only_during_watched_steps(cap: Capture) -> None:
    """Unwatched steps keep their cost: no optimizer pre-hook, no per-parameter hook."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    model = _seeded_net()
    handle = ot.watch(model, every=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    counts: list[tuple[int, int]] = []

    def hooks() -> tuple[int, int]:
        per_param = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
        return len(_global_optimizer_pre_hooks), per_param

    assert hooks() == (0, 0)
    for step in range(4):
        with ot.step(step):
            counts.append(hooks())
            model(_batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert hooks() == (0, 0)  # removed when the step ends
    n_params = len(list(model.parameters()))
    assert counts == [(1, n_params), (0, 0), (1, n_params), (0, 0)]
    handle.remove()
    assert hooks() == (0, 0)


def test_backward_outside_the_step_still_gets_the_hint(
    cap: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    """The honest negative: the step holds only the forward; backward, the optimizer step and
    zero_grad run after it ends, so no gradient ever exists inside a watched step."""
    model = _seeded_net()
    ot.watch(model, every=1, params=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(3):
        with ot.step(step):
            loss = model(_batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ot.shutdown()
    warnings = _watch_warnings(caplog)
    assert len(warnings) == 1 and "no gradients in step 0" in warnings[0] and "backward" in warnings[0]
    assert not any(key.startswith("grad_norm/") for _, scalars in cap.flushes for key in scalars)
