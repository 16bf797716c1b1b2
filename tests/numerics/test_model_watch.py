"""ot.watch(model): per-layer gradient/parameter/activation statistics, checked against torch."""

from __future__ import annotations

import logging
import math
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers.multirank import run_ranks
from helpers.ports import free_port
from torch import nn

import otel_train as ot
from otel_train import adapters
from otel_train import semconv as sc
from otel_train.core.buffer import Buffer
from otel_train.crossrank.replicas import FINGERPRINT
from otel_train.numerics.model_watch import (
    HISTOGRAM_SAMPLE,
    ROOT_LABEL,
    ModelWatch,
    NullWatch,
    clean_name,
    layer_groups,
)
from otel_train.testing import Capture, capture_metrics, current_session


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # a root parameter: the "(root)" layer
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(8, 1)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)  # never watched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.scale


def _train(model: nn.Module, steps: int, on_step: Any = None, lr: float = 0.05) -> dict[int, dict[str, Any]]:
    """A plain loop (zero_grad first); returns hand-computed references taken at each step's end."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    refs: dict[int, dict[str, Any]] = {}
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        with ot.step(i):
            opt.zero_grad()
            loss = model(torch.randn(5, 6, generator=gen)).pow(2).mean()
            loss.backward()
            if on_step is not None:
                on_step(i, model)
            opt.step()
            ot.record("loss", loss)
            refs[i] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
            refs[i]["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return refs


@pytest.fixture
def cap() -> Iterator[Capture]:
    with capture_metrics(log_interval=1, run_dir_enabled=False, hardware=False) as capture:
        yield capture


def _flush_at(cap: Capture, step: int) -> dict[str, float]:
    """The scalars of the flush after `step` (the final flush at shutdown repeats the last step)."""
    return next(s for st, s in cap.flushes if st == step)


def test_layer_grouping_and_names() -> None:
    names = [
        "scale",
        "embed.weight",
        "embed.bias",
        "blocks.0.0.weight",
        "blocks.0.0.bias",
        "blocks.1.0.weight",
    ]
    assert layer_groups(names, 64) == (["(root)", "embed", "blocks.0.0", "blocks.1.0"], [0, 1, 1, 2, 2, 3])
    # coarsened one path level at a time until the cap holds, keeping module order
    assert layer_groups(names, 3) == (["(root)", "embed", "blocks"], [0, 1, 1, 2, 2, 2])
    assert layer_groups(names, 1) == (["(root)"], [0] * 6)
    assert clean_name("module._orig_mod.blocks.0.attn", ddp=True) == "blocks.0.attn"
    assert clean_name("_orig_mod.module.head", ddp=True) == "head"
    assert clean_name("module.head", ddp=False) == "module.head"  # a real child named "module"
    assert (
        clean_name("layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp", ddp=False)
        == "layers.0.mlp"
    )


def test_norms_match_torch_on_watched_steps_only(cap: Capture) -> None:
    model = Tiny()
    handle = ot.watch(model, every=3)
    assert handle.labels == ["(root)", "embed", "blocks.0.0", "blocks.1.0", "head"]
    refs = _train(model, 5)
    ot.shutdown()  # drains the worker
    for step in (0, 3):
        scalars = _flush_at(cap, step)
        grads = _by_label(refs[step]["grads"], handle.labels)
        params = _by_label(refs[step]["params"], handle.labels)
        for label in handle.labels:
            assert scalars[f"grad_norm/{label}"] == pytest.approx(grads[label], rel=1e-5)
            assert scalars[f"param_norm/{label}"] == pytest.approx(params[label], rel=1e-5)
        assert scalars["train/grad_norm"] == pytest.approx(
            math.sqrt(sum(v**2 for v in grads.values())), rel=1e-5
        )
        assert scalars["train/param_norm"] == pytest.approx(
            math.sqrt(sum(v**2 for v in params.values())), rel=1e-5
        )
    # steps 1, 2 and 4 are not watched: their rows have no layer statistics (the OTel gauges keep
    # the last watched step's values; a bridge shows each layer at its watched steps only)
    for step in (1, 2, 4):
        assert not [k for k in _flush_at(cap, step) if k.startswith(("grad_norm/", "param_norm/"))]
        assert "train/grad_norm" not in _flush_at(cap, step)
    assert not any("frozen" in key for _, scalars in cap.flushes for key in scalars)


def _by_label(tensors: dict[str, torch.Tensor], labels: list[str]) -> dict[str, float]:
    """Hand computation: per layer label, sqrt of the sum of squared per-parameter norms."""
    sums = dict.fromkeys(labels, 0.0)
    for name, tensor in tensors.items():
        if name.startswith("frozen."):
            continue
        module = name.rpartition(".")[0]
        label = next((lab for lab in labels if module == lab or module.startswith(lab + ".")), ROOT_LABEL)
        sums[label] += float(tensor.double().norm()) ** 2
    return {label: math.sqrt(total) for label, total in sums.items()}


def test_watch_on_a_bare_buffer_without_a_session() -> None:
    """The watch needs only a buffer and a remove callback: no session, no worker, no exporter."""
    buffer = Buffer(max_names=100, max_values=100)
    removed: list[ModelWatch] = []
    model = Tiny()
    watch = ModelWatch(buffer, model, 2, True, True, True, True, 64, on_remove=removed.append)
    gen = torch.Generator().manual_seed(0)

    def step(index: int, failed: bool = False) -> dict[str, torch.Tensor]:
        watch.begin_step(index)
        model.zero_grad()
        model(torch.randn(5, 6, generator=gen)).pow(2).mean().backward()
        watch.end_step(index, failed)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    grads = step(0)
    by_name = {r.instrument: r for r in buffer.layer_stats}
    assert set(by_name) == {
        sc.LAYER_GRAD_NORM.name, sc.LAYER_PARAM_NORM.name, sc.LAYER_ACTIVATION_RMS.name,
        sc.LAYER_ACTIVATION_ABSMAX.name, FINGERPRINT,
    }  # fmt: skip
    batch = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))  # step 0's input
    assert by_name[FINGERPRINT].values.tolist() == pytest.approx(_fingerprint_of(batch))
    grad_stats = by_name[sc.LAYER_GRAD_NORM.name]
    assert grad_stats.step == 0 and list(grad_stats.labels) == watch.labels
    expected = _by_label(grads, watch.labels)
    assert grad_stats.values.tolist() == pytest.approx([expected[label] for label in watch.labels], rel=1e-5)
    (total,) = buffer.scalars[sc.GRAD_NORM.name]
    assert float(total) == pytest.approx(math.sqrt(sum(v**2 for v in expected.values())), rel=1e-5)
    assert {key.split("/")[0] for key, _, _ in buffer.histograms} == {"gradients", "parameters"}
    count = len(buffer.layer_stats)
    step(1)  # not a watched step (every=2)
    step(2, failed=True)  # a failed step records nothing
    assert len(buffer.layer_stats) == count
    watch.remove()
    watch.remove()  # idempotent: the owner hears of it once
    assert removed == [watch]
    step(4)  # a watched step, but the watch is removed
    assert len(buffer.layer_stats) == count and not buffer.dropped


def test_read_now_takes_the_statistics_before_the_loop_clears_the_gradients() -> None:
    """ot.watch_read for loops that zero the gradients before the step ends (the HF Trainer)."""
    buffer = Buffer(max_names=100, max_values=100)
    model = Tiny()
    watch = ModelWatch(buffer, model, 2, True, True, False, False, 64)
    gen = torch.Generator().manual_seed(0)
    for index in range(3):
        watch.begin_step(index)
        model(torch.randn(5, 6, generator=gen)).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        watch.read_now()
        watch.read_now()  # once per step
        model.zero_grad(set_to_none=True)  # before the step ends: end_step alone would see no gradient
        watch.end_step(index, False)
        if index == 0:
            [grad_stats] = [r for r in buffer.layer_stats if r.instrument == sc.LAYER_GRAD_NORM.name]
            expected = _by_label(grads, watch.labels)
            assert grad_stats.step == 0
            assert grad_stats.values.tolist() == pytest.approx([expected[x] for x in watch.labels], rel=1e-5)
    # steps 0 and 2 watched (every=2), each read once, step 1 not at all; no "no gradients" failure
    assert [r.step for r in buffer.layer_stats if r.instrument == sc.LAYER_GRAD_NORM.name] == [0, 2]
    assert not buffer.dropped


def _fingerprint_of(*tensors: torch.Tensor) -> list[float]:
    """The batch fingerprint, computed here element by element: sum x * w1(p), sum x^2 * w2(p),
    positions p counted across the tensors, w(p) = (p * a) % m + 1."""
    values = [float(v) for t in tensors for v in t.reshape(-1).tolist()]
    (a1, m1), (a2, m2) = (40503, 65521), (10007, 65519)
    return [
        math.fsum(x * ((p * a1) % m1 + 1) for p, x in enumerate(values)),
        math.fsum(x * x * ((p * a2) % m2 + 1) for p, x in enumerate(values)),
    ]


def test_see_batch_fingerprints_the_batch_the_forward_never_sees() -> None:
    """ot.watch_batch: the tensors of a mapping / tuple batch, the step's first fingerprint wins
    (the forward pre-hook's then stands aside), and only on watched steps."""
    buffer = Buffer(max_names=100, max_values=100)
    model = Tiny()
    watch = ModelWatch(buffer, model, 2, True, False, False, False, 64)
    ids = torch.arange(12).reshape(3, 4)
    for index, batch in enumerate([{"input_ids": ids, "labels": ids + 1}, (ids,), ([ids, None], "text")]):
        watch.begin_step(2 * index)
        watch.see_batch(batch)
        watch.see_batch(torch.ones(3))  # a second call in the step changes nothing
        model(torch.randn(5, 6)).sum().backward()  # nor does the forward's own input
        watch.end_step(2 * index, False)
    prints = [r.values.tolist() for r in buffer.layer_stats if r.instrument == FINGERPRINT]
    # every tensor of the batch in order (up to 4): the mapping's ids and labels, then the ids alone
    assert prints == [pytest.approx(_fingerprint_of(*b)) for b in [(ids, ids + 1), (ids,), (ids,)]]
    watch.begin_step(1)  # unwatched
    watch.see_batch(ids)
    watch.end_step(1, False)
    watch.begin_step(6)
    watch.see_batch({"no": "tensor"})  # nothing to fingerprint: the forward's input is taken
    model(torch.zeros(5, 6)).sum().backward()
    watch.end_step(6, False)
    assert len([r for r in buffer.layer_stats if r.instrument == FINGERPRINT]) == 4 and not buffer.dropped


def test_a_layer_with_no_local_elements_is_left_out() -> None:
    """Under FSDP2 a layer smaller than the world has an empty shard on some ranks (an empty
    tensor here stands for it): its norms would read 0 there, a false no_gradient."""
    buffer = Buffer(max_names=100, max_values=100)
    model = Tiny()
    model.head.weight = nn.Parameter(torch.empty(0))
    model.head.bias = nn.Parameter(torch.empty(0))
    model.forward = lambda x: (
        model.blocks[1](model.blocks[0](model.embed(x))).sum(1, keepdim=True) * model.scale
    )  # type: ignore[method-assign]
    watch = ModelWatch(buffer, model, 1, True, True, False, False, 64)
    watch.begin_step(0)
    model(torch.randn(5, 6)).pow(2).mean().backward()
    watch.end_step(0, False)
    norms = [r for r in buffer.layer_stats if r.instrument != FINGERPRINT]
    assert {r.instrument for r in norms} == {sc.LAYER_GRAD_NORM.name, sc.LAYER_PARAM_NORM.name}
    for record in norms:
        assert "head" not in record.labels and record.values.shape == (len(record.labels),)
        assert record.labels == tuple(x for x in watch.labels if x != "head")


def test_watch_read_and_watch_batch_through_the_public_api(cap: Capture) -> None:
    """A loop that clears gradients before its step ends still gets its gradient norms; both calls
    are harmless without a watch, and without a session."""
    adapters.watch_batch(torch.ones(2))
    adapters.watch_read()
    model = Tiny()
    ot.watch(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(2):
        with ot.step(i):
            adapters.watch_batch({"x": torch.ones(2)})  # a single process: no fingerprint, no failure
            model(torch.randn(5, 6)).pow(2).mean().backward()
            opt.step()
            adapters.watch_read()
            opt.zero_grad(set_to_none=True)
    ot.shutdown()
    assert cap.last("grad_norm/head") is not None and cap.last("grad_norm/head") > 0
    adapters.watch_batch(torch.ones(2))  # no session
    adapters.watch_read()


def test_values_stay_on_device_until_the_flush() -> None:
    """The training thread hands tensors to the buffer; only the worker turns them into floats."""
    with capture_metrics(log_interval=1000, run_dir_enabled=False, hardware=False) as cap:
        session = current_session()
        assert session is not None
        model = Tiny()
        ot.watch(model, every=1, activations=True)
        _train(model, 2)
        records = list(session.buffer.layer_stats)
        # no batch fingerprint in a single process: no exchange would ever compare it
        assert {r.instrument for r in records} == {
            sc.LAYER_GRAD_NORM.name, sc.LAYER_PARAM_NORM.name, sc.LAYER_ACTIVATION_RMS.name,
            sc.LAYER_ACTIVATION_ABSMAX.name,
        }  # fmt: skip
        assert all(isinstance(r.values, torch.Tensor) and r.values.shape == (len(r.labels),) for r in records)
        assert all(isinstance(v, torch.Tensor) for v in session.buffer.scalars[sc.GRAD_NORM.name])
    assert cap.last("grad_norm/head") is not None  # resolved at the final flush


def test_no_hooks_unless_watching_activations_and_only_during_watched_steps(cap: Capture) -> None:
    model = Tiny()

    def hook_count() -> int:
        return sum(len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules())

    ot.watch(model, every=2)  # default: grads and params; only the hooks that mark the layers that ran
    seen: list[tuple[int, int]] = []
    _train(model, 3, on_step=lambda i, m: seen.append((i, hook_count())))
    assert [n > 0 for _, n in seen] == [True, False, True]  # inside watched steps only
    assert hook_count() == 0

    handle = ot.watch(model, every=2, activations=True)  # replaces the first watch
    session = current_session()
    assert session is not None and session.watches == [handle]
    seen.clear()
    _train(model, 3, on_step=lambda i, m: seen.append((i, hook_count())))
    assert [n > 0 for _, n in seen] == [True, False, True]  # hooks only inside watched steps
    assert hook_count() == 0  # and removed when each step ends
    ot.shutdown()
    scalars = cap.flushes[-1][1]
    for label in ("embed", "blocks.0.0", "blocks.1.0", "head"):
        assert scalars[f"activation_rms/{label}"] > 0
        assert scalars[f"activation_absmax/{label}"] >= scalars[f"activation_rms/{label}"]
    handle.remove()
    assert session.watches == [] and hook_count() == 0


def test_activation_values_match_the_module_output(cap: Capture) -> None:
    model = Tiny()
    ot.watch(model, every=1, grads=False, params=False, activations=True)
    x = torch.randn(5, 6)
    with ot.step(0):
        out = model.embed(x).detach()
        model(x)
    ot.shutdown()
    scalars = _flush_at(cap, 0)
    assert scalars["activation_rms/embed"] == pytest.approx(float(out.pow(2).mean().sqrt()), rel=1e-5)
    assert scalars["activation_absmax/embed"] == pytest.approx(float(out.abs().max()), rel=1e-6)


def test_users_own_grad_norm_is_kept(cap: Capture) -> None:
    model = Tiny()
    ot.watch(model, every=1)
    _train(model, 1, on_step=lambda i, m: ot.record("grad_norm", 123.0))
    ot.shutdown()
    assert _flush_at(cap, 0)["train/grad_norm"] == 123.0
    assert _flush_at(cap, 0)["grad_norm/head"] > 0  # per-layer values still come


def test_users_grad_norm_recorded_now_and_then_keeps_the_series_theirs(cap: Capture) -> None:
    """A user who records the (pre-clip) norm only on some steps: from the first one on, the series
    is theirs (flushes without a record of theirs have none), never the watch's post-clip values."""
    model = Tiny()
    ot.watch(model, every=1)
    _train(model, 6, on_step=lambda i, m: ot.record("grad_norm", 123.0) if i in (2, 5) else None)
    ot.shutdown()
    assert _flush_at(cap, 0)["train/grad_norm"] != 123.0  # before the user's first: the watch's
    assert [_flush_at(cap, i).get("train/grad_norm") for i in range(2, 6)] == [123.0, None, None, 123.0]


def test_nonfinite_gradient_names_the_layer(cap: Capture) -> None:
    session = current_session()
    assert session is not None
    events: list[tuple[str, str, dict[str, Any]]] = []
    session.events.add_callback(lambda e, m, a: events.append((e, m, dict(a))))
    model = Tiny()
    ot.watch(model, every=1)

    def poison(step: int, m: nn.Module) -> None:
        if step == 2:
            with torch.no_grad():
                m.embed.bias.grad[0] = float("inf")
                m.blocks[1][0].weight.grad[0, 0] = float("nan")

    _train(model, 3, on_step=poison, lr=0.0)
    ot.shutdown()
    [(_, message, attrs)] = [e for e in events if e[0] == "nonfinite_grad"]
    assert attrs[sc.LAYER] == "blocks.1.0" and attrs["step"] == 2  # the affected layer nearest the output
    assert "2 layer(s): embed, blocks.1.0" in message and "step 2" in message
    assert sum(scalars.get("health/nonfinite_grad", 0) for _, scalars in cap.flushes) == 1
    at_step_2 = _flush_at(cap, 2)
    assert at_step_2["health/nonfinite_grad"] == 1 and at_step_2["otel_train/dropped/nonfinite"] >= 1
    # the finite layers are still reported for step 2 (a new value, not the persisting step-1 gauge)
    assert at_step_2["grad_norm/head"] != _flush_at(cap, 1)["grad_norm/head"]


def test_histograms_are_opt_in_samples_of_the_real_values(cap: Capture) -> None:
    model = Tiny()
    ot.watch(model, every=2)
    _train(model, 2)
    assert cap.histograms == []
    big = nn.Linear(256, 64)
    ot.watch(big, every=2, histograms=True)
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    with ot.step(2):
        opt.zero_grad()
        big(torch.randn(3, 256)).sum().backward()
        grad_values = set(big.weight.grad.reshape(-1).tolist()) | set(big.bias.grad.tolist())
        param_values = set(big.weight.detach().reshape(-1).tolist()) | set(big.bias.detach().tolist())
    ot.shutdown()
    by_key = {key: (values, step) for key, values, step in cap.histograms}
    assert set(by_key) == {"gradients/(root)", "parameters/(root)"}  # nn.Linear: parameters at the root
    grads, step = by_key["gradients/(root)"]
    assert step == 2 and 0 < len(grads) <= HISTOGRAM_SAMPLE
    assert set(grads) <= {float(torch.tensor(v, dtype=torch.float32)) for v in grad_values}
    assert set(by_key["parameters/(root)"][0]) <= param_values


def test_missing_gradients_warn_once(cap: Capture, caplog: pytest.LogCaptureFixture) -> None:
    model = Tiny()
    ot.watch(model, every=1, params=False)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for i in range(3):
            with ot.step(i):
                model(torch.randn(2, 6))  # forward only: no gradients
    warnings = [r.getMessage() for r in caplog.records if "no gradients" in r.getMessage()]
    assert len(warnings) == 1 and "backward" in warnings[0] and "zero_grad" not in warnings[0]


def test_arguments_are_checked_and_a_no_op_before_init() -> None:
    ot.shutdown()
    assert isinstance(ot.watch(Tiny()), NullWatch)
    with pytest.raises(ValueError, match="every=0"):
        ot.watch(Tiny(), every=0)
    with pytest.raises(ValueError, match="max_layers"):
        ot.watch(Tiny(), max_layers=0)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        ot.watch(object())
    with pytest.raises(ValueError, match="nothing to watch"):
        ot.watch(Tiny(), grads=False, params=False, activations=False)
    frozen = Tiny().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):  # as after init() (it was a NullWatch)
        ot.watch(frozen)


def test_a_failing_statistic_never_breaks_the_step(cap: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny()
    ot.watch(model, every=1)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(torch, "_foreach_norm", boom)
    _train(model, 2)  # would raise if the watch let the error through
    ot.shutdown()
    assert _flush_at(cap, 1)["otel_train/dropped/watch_failed"] >= 1


def test_layer_series_on_the_prometheus_endpoint(tmp_path) -> None:
    port = free_port()
    ot.init(
        prometheus_port=port,
        run_id="watch",
        verbosity=0,
        log_interval=1,
        output_dir=str(tmp_path),
        hardware=False,
    )
    try:
        model = Tiny()
        ot.watch(model, every=1)
        _train(model, 2)
        current_session().worker.stop(timeout_s=10)  # type: ignore[union-attr]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        ot.shutdown()
    lines = [line for line in text.splitlines() if line.startswith(sc.LAYER_GRAD_NORM.prometheus_name + "{")]
    assert any('train_layer="blocks.1.0"' in line and 'run_id="watch"' in line for line in lines), lines
    assert len(lines) == 5  # one series per layer


def _layer_series(aggregate: str, tmp_path) -> list[str]:
    """The train_layer_* samples one rank serves on /metrics with `watch_aggregate`."""
    port = free_port()
    ot.init(prometheus_port=port, run_id="agg", verbosity=0, log_interval=1, output_dir=str(tmp_path),
            hardware=False, watch_aggregate=aggregate)  # fmt: skip
    try:
        model = Tiny()
        ot.watch(model, every=1, activations=True, max_layers=64)
        _train(model, 2)
        current_session().worker.stop(timeout_s=10)  # type: ignore[union-attr]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        ot.shutdown()
    return [line for line in text.splitlines() if line.startswith("train_layer_")]


def test_watch_aggregate_model_cuts_the_layer_series(tmp_path) -> None:
    """Series budget (README): one group for the whole model instead of one per layer."""
    per_layer = _layer_series("layer", tmp_path)
    whole = _layer_series("model", tmp_path)
    # grads and params for 5 groups, activations for the 4 that are modules (not the root)
    assert len(per_layer) == 5 + 5 + 4 + 4
    assert len(whole) == 2  # grad and param norm of the one group; activations are per layer only
    assert all(f'train_layer="{ROOT_LABEL}"' in line for line in whole)


def test_watch_aggregate_model_values_are_the_whole_model_norms() -> None:
    with capture_metrics(
        log_interval=1, run_dir_enabled=False, hardware=False, watch_aggregate="model"
    ) as cap:
        model = Tiny()
        handle = ot.watch(model, every=1)  # max_layers defaults to 64: the setting wins
        refs = _train(model, 2)
        ot.shutdown()
    assert handle.labels == [ROOT_LABEL]
    for step in (0, 1):
        scalars = _flush_at(cap, step)
        grads = _by_label(refs[step]["grads"], [ROOT_LABEL, "embed", "blocks.0.0", "blocks.1.0", "head"])
        params = _by_label(refs[step]["params"], [ROOT_LABEL, "embed", "blocks.0.0", "blocks.1.0", "head"])
        whole_grad = math.sqrt(sum(v**2 for v in grads.values()))
        whole_param = math.sqrt(sum(v**2 for v in params.values()))
        assert scalars[f"grad_norm/{ROOT_LABEL}"] == pytest.approx(whole_grad, rel=1e-5)
        assert scalars[f"param_norm/{ROOT_LABEL}"] == pytest.approx(whole_param, rel=1e-5)
        assert scalars["train/grad_norm"] == pytest.approx(whole_grad, rel=1e-5)


def _ddp_rank(rank: int, world: int) -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(Tiny())
    with capture_metrics(log_interval=1, run_dir_enabled=False, hardware=False) as cap:
        handle = ot.watch(model, every=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ot.step(0):
            opt.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
            expected = (
                float(model.module.head.weight.grad.norm() ** 2 + model.module.head.bias.grad.norm() ** 2)
                ** 0.5
            )
            opt.step()
    assert handle.labels == ["(root)", "embed", "blocks.0.0", "blocks.1.0", "head"]  # no "module." prefix
    return {"head": cap.last("grad_norm/head") or -1.0, "expected": expected}


@pytest.mark.multirank
def test_ddp_wrapped_model_on_two_real_ranks() -> None:
    results = run_ranks(2, _ddp_rank, (), timeout=120)
    # DDP averages gradients: every rank reports the same (all-reduced) layer norm, and it is the
    # norm of the gradient the rank actually holds
    assert results[0]["head"] == pytest.approx(results[1]["head"], rel=1e-6)
    for r in results:
        assert r["head"] == pytest.approx(r["expected"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_watched_steps_never_sync_the_device() -> None:
    model = Tiny().cuda()
    with capture_metrics(log_interval=4, run_dir_enabled=False, hardware=False) as cap:
        ot.watch(model, every=2, activations=True, histograms=True)  # setup may copy; steps may not
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 6, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(3):  # steps before the first flush (flush at the 4th step resolves on the worker)
                with ot.step(i):
                    opt.zero_grad()
                    model(x).pow(2).mean().backward()
                    opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert cap.last("grad_norm/head") is not None


def test_two_watches_of_other_periods_each_read_their_own_steps() -> None:
    """The session calls its watches only at steps their periods' gcd divides: every=2 and every=3
    read steps 0, 2, 4, 6 and 0, 3, 6, whatever the steps in between do."""
    tiny, other = Tiny(), nn.Sequential(nn.Linear(6, 3))
    with capture_metrics(log_interval=100, run_dir_enabled=False, hardware=False):
        session = current_session()
        assert session is not None
        ot.watch(tiny, every=2)
        ot.watch(other, every=3)
        assert session.watch_period == 1
        gen = torch.Generator().manual_seed(0)
        for i in range(7):
            with ot.step(i):
                x = torch.randn(5, 6, generator=gen)
                (tiny(x).pow(2).mean() + other(x).pow(2).mean()).backward()
        steps: dict[tuple[str, ...], list[int]] = {}
        for stats in session.buffer.layer_stats:
            if stats.instrument == sc.LAYER_GRAD_NORM.name:
                steps.setdefault(stats.labels, []).append(stats.step)
        assert sorted(steps.values()) == [[0, 2, 4, 6], [0, 3, 6]]
        for handle in list(session.watches):
            handle.remove()
        assert session.watch_period == 1  # never 0: a step may read it while another thread changes it


def test_a_watched_step_never_ended_does_not_lend_its_batch_to_the_next_watched_step() -> None:
    """ot.begin_step on a watched step without ot.end_step, then `with ot.step` steps: the watch is
    not called at the steps between (watch_period), so the next watched step starts afresh: its
    own batch's fingerprint, and no hooks left over once it ends."""

    def hooks(model: nn.Module) -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    model = Tiny()
    first, later = torch.ones(5, 6), torch.full((5, 6), 2.0)
    with capture_metrics(log_interval=100, run_dir_enabled=False, hardware=False):
        session = current_session()
        assert session is not None
        handle = ot.watch(model, every=2, activations=True)
        handle.fingerprints = True  # as on a rank of a distributed job
        adapters.begin_step(0)  # watched, and never ended
        model(first)
        with ot.step(1):
            model(first)
        with ot.step(2):
            model(later).pow(2).mean().backward()
        assert hooks(model) == 0
        [fingerprint] = [r for r in session.buffer.layer_stats if r.instrument == FINGERPRINT]
        assert fingerprint.step == 2
        assert fingerprint.values.tolist() == pytest.approx(_fingerprint_of(later))


def test_a_layer_frozen_after_watch_is_left_out_not_a_layer_without_gradient(cap: Capture) -> None:
    """Freezing part of a watched model mid-run (fine-tuning's `requires_grad_(False)`): its layer
    leaves the gradient statistics; no failed hook registration, no `no_gradient` event."""
    events: list[str] = []
    ot.on_event(lambda event, message, attributes: events.append(event))
    model = Tiny()
    ot.watch(model, every=1)
    _train(model, 8, on_step=lambda i, m: i == 2 and m.embed.requires_grad_(False))
    ot.shutdown()
    before, after = _flush_at(cap, 1), [_flush_at(cap, step) for step in range(4, 8)]
    assert "grad_norm/embed" in before
    for scalars in after:
        assert "grad_norm/embed" not in scalars and "grad_norm/head" in scalars
        assert "param_norm/embed" in scalars  # its parameters are still watched
    assert "otel_train/dropped/watch_failed" not in {key for _, scalars in cap.flushes for key in scalars}
    assert "no_gradient" not in events


def test_two_watched_models_with_the_same_layer_names_are_warned_about(
    cap: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    generator, discriminator = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 1))
    ot.watch(generator)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        ot.watch(discriminator)
    assert "layers 0 are also layers of an already watched model" in caplog.text
    assert "mix the two models' norms" in caplog.text and "nn.ModuleDict" in caplog.text
    caplog.clear()
    ot.watch(nn.ModuleDict({"generator": generator, "discriminator": discriminator}))
    assert "already watched" not in caplog.text  # prefixed labels: generator.0, discriminator.0


def test_a_second_watched_model_is_warned_about_for_the_global_norms(
    cap: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    actor, critic = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        ot.watch(actor)
        assert "another model is watched" not in caplog.text
        ot.watch(critic)  # no shared layer names, but one train.grad_norm for both
    assert "another model is watched" in caplog.text and "already watched" not in caplog.text


def test_a_model_whose_parameters_were_replaced_after_watch_is_warned_about(
    cap: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    """FSDP2's fully_shard (or any wrapper that swaps parameters) after ot.watch: the watch would
    read parameters nobody trains, silently. The first watched step says so, with the fix."""
    model = Tiny()
    ot.watch(model, every=1)
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # as fully_shard does
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        _train(model, 3)
    stale = [r.getMessage() for r in caplog.records if "no longer the model's" in r.getMessage()]
    assert len(stale) == 1 and "1 of the" in stale[0] and "after wrapping" in stale[0], stale
