"""Recording never raises: bad values and names are dropped or sanitized, counted, warned once,
and the series count stays within the cardinality budget."""

from __future__ import annotations

import logging
import math

import torch
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train.testing import capture_metrics

SERIES_BUDGET = 200


def test_bad_values_never_raise_and_are_counted(caplog) -> None:
    with capture_metrics(log_interval=100) as cap, ot.step(0):
        for value in (float("nan"), float("inf"), -math.inf, None, "1.5", b"x", True, object(),
                      torch.ones(3), torch.tensor([float("nan")]), torch.tensor(2.5, requires_grad=True) * 2,
                      torch.tensor(1 + 2j)):  # fmt: skip
            ot.record("loss", value)
        ot.record("loss", 0.75)
        ot.log_metrics(None)  # type: ignore[arg-type]
        ot.log_metrics({"ok": 1.0, 3: 2.0})  # type: ignore[dict-item]
    flushed = cap.flushes[-1][1]
    assert flushed["train/loss"] == (5.0 + 0.75) / 2  # the mean of the two good values
    assert flushed["train/loss_last"] == 0.75
    assert flushed["train/ok"] == 1.0
    assert flushed["health/nonfinite_loss"] == 4  # nan, inf, -inf, tensor(nan)
    assert flushed["otel_train/dropped/nonfinite"] == 4
    assert (
        flushed["otel_train/dropped/invalid_type"] >= 6
    )  # None, str, bytes, bool, object, complex, bad dict
    assert flushed["otel_train/dropped/non_scalar_tensor"] == 1
    assert flushed["otel_train/dropped/invalid_name"] == 1  # the int key


def test_grad_tensor_is_detached_and_resolved() -> None:
    weight = torch.tensor(3.0, requires_grad=True)
    with capture_metrics(log_interval=1) as cap, ot.step(0):
        loss = weight * 2
        ot.record("loss", loss)
        loss.backward()  # the recorded value must not hold the graph or break backward
    assert cap.last("train/loss") == 6.0


def test_invalid_and_colliding_names_warn_once(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=100) as cap:
        for i in range(3):
            with ot.step(i):
                ot.record("9 bad name!", 1.0)
                ot.record("steps", 1.0)  # collides with the train.steps counter
                ot.record("loss", 1.0)
                ot.record("train/loss", 2.0)  # same instrument as "loss": merged
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("9 bad name!" in w for w in warnings) == 1
    assert sum("'steps'" in w and "collides" in w for w in warnings) == 1
    assert sum("merged" in w for w in warnings) == 1
    flushed = cap.flushes[-1][1]
    assert flushed["otel_train/dropped/invalid_name"] == 6
    assert flushed["train/loss"] == 1.5  # one instrument: the mean of both names' values


def test_ten_thousand_names_stay_within_series_budget(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=1, max_metric_names=64) as cap:
        for i in range(10_000):
            ot.record(f"metric_{i}", float(i))
            if i % 1000 == 999:
                with ot.step():
                    pass
    keys = set().union(*(scalars for _, scalars in cap.flushes))
    user_keys = {k for k in keys if k.startswith("train/metric_")}
    assert len(user_keys) == 64 * 4  # each with its interval's min, max and last beside it
    assert sum(v for _, v in cap.series("otel_train/dropped/invalid_name")) == 10_000 - 64
    assert sum("max_metric_names" in r.getMessage() for r in caplog.records) == 1


def test_pull_endpoint_series_budget(tmp_path) -> None:
    import time
    import urllib.request

    from helpers.ports import free_port

    port = free_port()
    ot.init(prometheus_port=port, verbosity=0, log_interval=5, output_dir=str(tmp_path))
    session = ot.current_session()
    for i in range(50):
        with ot.step(i, tokens=10):
            for phase in ("data", "forward", "backward", "optimizer"):
                with ot.timer(phase):
                    pass
            for j in range(300):
                ot.record(f"custom_{j}", 1.0)
            ot.record("loss", 1.0)
    time.sleep(0.5)  # let the worker feed the SDK for the last flush
    text = urllib.request.urlopen(session.prometheus_url, timeout=5).read().decode()
    ot.shutdown()
    series = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert len(series) <= SERIES_BUDGET, len(series)
    assert all(
        s.labels.get("run_id") and s.labels.get("rank") == "0" for s in series if s.name != "target_info"
    )
