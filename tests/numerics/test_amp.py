"""ot.watch(model, scaler=...): a real torch.amp.GradScaler on CPU, loss scale exported, skipped
steps counted."""

from __future__ import annotations

import copy
import io
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.events import run_events

import otel_train as ot
from otel_train.testing import capture_metrics, current_session


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1)


def _train(
    scaler: torch.amp.GradScaler,
    steps: int,
    poison: set[int],
    start: int = 0,
    model: torch.nn.Module | None = None,
) -> None:
    model = model if model is not None else _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 8)
    for step in range(start, start + steps):
        with ot.step(step):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            if step in poison:
                loss = loss * float("inf")  # overflow: the scaler must skip this step
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


def test_scale_and_skipped_steps_are_exported() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    with capture_metrics(run_name="amp", log_interval=5, hardware=False) as capture:
        model = _model()
        handle = ot.watch(model, scaler=scaler)
        _train(scaler, 10, poison={3, 7}, model=model)
    assert sum(v for _, v in capture.series("train/skipped_steps")) == 2
    assert capture.last("train/loss_scale") == scaler.get_scale() == 1024.0 * 0.5 * 0.5
    assert handle is not None
    assert "update" not in scaler.__dict__  # shutdown handed the scaler its own update() back


def _events(run_dir: Any) -> list[str]:
    return [e["event"] for e in run_events(run_dir)]


def test_a_step_the_scaler_skips_has_no_gradient_statistics_and_no_nonfinite_grad(tmp_path) -> None:
    """Every step watched; steps 3 and 7 overflow and the scaler skips them, as it is built to: no
    `nonfinite_grad` event (it pages as critical) and no statistics of the discarded, still scaled
    gradients; the other 8 steps have theirs, unscaled."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    # a row per step: the worker's queue holds every flush (a busy host defers none into the next)
    with capture_metrics(log_interval=1, queue_size=100, hardware=False, output_dir=str(tmp_path)) as capture:
        model = _model()
        ot.watch(model, every=1, scaler=scaler)
        _train(scaler, 10, poison={3, 7}, model=model)
        run_dir = current_session().run_dir
    assert sum(v for _, v in capture.series("train/skipped_steps")) == 2
    assert "nonfinite_grad" not in _events(run_dir)
    norms = capture.series("train/grad_norm")
    assert [step for step, _ in norms] == [0, 1, 2, 4, 5, 6, 8, 9]
    assert all(0 < norm < 100 for _, norm in norms), norms  # unscaled (the scale is 1024, then 256)
    assert "otel_train/dropped/nonfinite" not in capture.flushes[-1][1]


@pytest.mark.parametrize("unscale", [False, True], ids=["plain", "unscale_-then-clip"])
@pytest.mark.parametrize("scaler_given", [True, False], ids=["watch-scaler", "watch-only"])
def test_a_fused_optimizers_step_the_scaler_skips_has_no_statistics_and_no_nonfinite_grad(
    tmp_path, caplog, unscale: bool, scaler_given: bool
) -> None:
    """A fused optimizer (nanoGPT's AdamW(fused=True)) runs its step even when the scaler found
    inf/NaN gradients, skipping the update on the device: its statistics are dropped as the
    scaler's business, with no host sync on the step and no `nonfinite_grad` or NaN warning."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    with capture_metrics(log_interval=1, queue_size=100, hardware=False, output_dir=str(tmp_path)) as capture:
        model = _model()
        ot.watch(model, every=1, scaler=scaler if scaler_given else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        x = torch.randn(16, 8)
        with caplog.at_level(logging.WARNING, logger="otel_train"):
            for step in range(10):
                with ot.step(step):
                    optimizer.zero_grad()
                    loss = model(x).float().pow(2).mean()
                    if step in (3, 7):
                        loss = loss * float("inf")
                    scaler.scale(loss).backward()
                    if unscale:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                    scaler.update()
        run_dir = current_session().run_dir
    assert scaler.get_scale() == 1024.0 * 0.5 * 0.5  # the scaler did skip steps 3 and 7
    assert "nonfinite_grad" not in _events(run_dir)
    norms = capture.series("train/grad_norm")
    assert [step for step, _ in norms] == [0, 1, 2, 4, 5, 6, 8, 9]
    assert all(0 < norm < 100 for _, norm in norms), norms
    assert sum(v for _, v in capture.series("otel_train/dropped/scaler_skipped")) > 0
    assert (
        not capture.series("otel_train/dropped/nonfinite")
        or capture.last("otel_train/dropped/nonfinite") == 0
    )
    assert not [r for r in caplog.records if "non-finite" in r.getMessage() or "NaN" in r.getMessage()]


def test_a_scaled_watch_whose_optimizer_steps_outside_the_step_says_so(caplog) -> None:
    """scaler.step(optimizer) after the step's block: no watched step sees its gradients applied,
    so none has statistics, and after 10 such steps a warning names the fix."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with capture_metrics(log_interval=5, hardware=False) as capture:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ot.watch(model, every=1, scaler=scaler)
        for step in range(12):
            with ot.step(step):
                scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert capture.series("train/grad_norm") == []
    warnings = [r.getMessage() for r in caplog.records if "no optimizer step ran inside" in r.getMessage()]
    assert len(warnings) == 1 and "scaler.step(optimizer) inside the step" in warnings[0]


def _host_reads_on_this_thread(run: Callable[[], None]) -> int:
    """How many Tensor.item / tolist / __float__ / cpu calls `run` makes on the calling thread."""
    caller = threading.current_thread()
    reads = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "cpu")}

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is caller:
                reads[0] += 1
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        run()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return reads[0]


def test_watched_update_reads_nothing_on_the_training_thread() -> None:
    """GradScaler's own host reads (CPU `step()` reads found_inf) are the same with the watch."""
    with capture_metrics(run_name="amp-sync", log_interval=1000, hardware=False):
        unwatched = torch.amp.GradScaler("cpu")
        _train(unwatched, 1, poison=set())  # the scaler's lazy state exists before counting
        baseline = _host_reads_on_this_thread(lambda: _train(unwatched, 3, poison={2}, start=1))
        watched, model = torch.amp.GradScaler("cpu"), _model()
        ot.watch(model, scaler=watched)  # steps 1-3 are not the model watch's (every 100)
        _train(watched, 1, poison=set(), model=model)
        with_watch = _host_reads_on_this_thread(lambda: _train(watched, 3, poison={2}, start=1, model=model))
    assert baseline > 0  # the counter works
    assert with_watch == baseline


def test_watch_scaler_rejects_other_objects_and_is_a_no_op_before_init() -> None:
    with pytest.raises(TypeError, match="GradScaler"):
        ot.watch(_model(), scaler=object())
    scaler = torch.amp.GradScaler("cpu")
    ot.watch(_model(), scaler=scaler).remove()  # before init(): a no-op handle
    assert "update" not in scaler.__dict__


def test_removing_the_watch_ends_the_scalers_and_rewatching_replaces_it() -> None:
    """The scaler's watch belongs to the model's: `.remove()` hands the scaler its own `update`
    back (what it did before is still exported); watching the model again replaces both."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    with capture_metrics(run_name="amp-remove", log_interval=1000, hardware=False) as capture:
        model = _model()
        ot.watch(model, scaler=scaler)
        handle = ot.watch(model, scaler=scaler)  # again: one listener, one count per skip
        _train(scaler, 3, poison={1}, model=model)
        handle.remove()
        assert "update" not in scaler.__dict__
        _train(scaler, 3, poison={4}, start=3, model=model)  # unwatched: not counted
    assert sum(v for _, v in capture.series("train/skipped_steps")) == 1
    assert capture.last("train/loss_scale") == 512.0


def test_watched_scaler_copies_pickles_and_checkpoints_unwatched() -> None:
    """Checkpointing a watched scaler (torch.save of a dict holding it, deepcopy, pickle) used to
    raise `cannot pickle '_thread.lock'`: the watch sat in the scaler's __dict__. The copies are
    plain scalers: their skipped steps are not counted, and the original stays watched."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    with capture_metrics(run_name="amp-copy", log_interval=5, hardware=False) as capture:
        model = _model()
        ot.watch(model, scaler=scaler)
        _train(scaler, 5, poison={1}, model=model)
        buffer = io.BytesIO()
        torch.save({"scaler": scaler, "step": 5}, buffer)
        buffer.seek(0)
        copies = [
            copy.deepcopy(scaler),
            pickle.loads(pickle.dumps(scaler)),
            torch.load(buffer, weights_only=False)["scaler"],
        ]
        for other in copies:
            assert other.get_scale() == scaler.get_scale() == 512.0
            _train(other, 5, poison={5, 6}, start=5)  # two skips no one watches
            assert other.get_scale() == 128.0
            assert pickle.loads(pickle.dumps(other)).get_scale() == 128.0  # still a plain scaler
        _train(scaler, 5, poison={7}, start=5, model=model)  # the original is still watched
    assert sum(v for _, v in capture.series("train/skipped_steps")) == 2
    assert capture.last("train/loss_scale") == scaler.get_scale() == 256.0
    assert "update" not in scaler.__dict__
