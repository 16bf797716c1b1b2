"""The whole session feeding TensorBoard, W&B (offline) and MLflow, read back with each backend's
own reader: the same keys and values everywhere, user instruments included, no secrets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.readback import read_mlflow, read_tensorboard, read_wandb_offline

import otel_train as ot
from otel_train.testing import current_session

SECRET = "SESSION-SECRET-3141"


def test_session_feeds_every_bridge_the_same_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ot.init(output_dir=str(tmp_path), run_name="bridged", tensorboard=True, wandb=True, mlflow=True,
                      prometheus_port=0, verbosity=0, log_interval=5,
                      otlp_headers={"authorization": SECRET})  # fmt: skip
    session = current_session()
    ot.log_hyperparams({"lr": 3e-4, "layers": 2, "api_key": SECRET})
    meter = ot.get_meter()
    widgets = meter.create_counter("my.widgets")
    latency = meter.create_histogram("my.latency", unit="s")
    for step in range(10):
        with ot.step(step, tokens=100, samples=4):
            with ot.timer("forward"):
                pass
            ot.record("loss", 2.0 - 0.1 * step)
            # The user's keys keep their case in every bridge, as every built-in logger keeps them.
            ot.record("FloatTensor", float(step))
            ot.record("Acc", 0.25)
            ot.record("acc", 0.75)
            widgets.add(1)
            latency.record(0.25)
    ot.log_metrics({"eval/loss": 1.5, "eval/perplexity": 4.5, "eval/F1": 0.5}, step=9)
    ot.log_text("notes", "**hello** from the run", step=9)
    ot.log_histogram("weights", [0.1, 0.2, 0.2, 0.9], step=9)
    ot.log_samples([("def ", "main():"), ("import ", "os")], step=9)
    ot.shutdown()
    # The bridges run in their own process, which finishes writing on its own past shutdown's budget.
    assert session.bridges is not None and session.bridges.wait(120)
    run_dir = session.run_dir
    assert run_dir is not None

    jsonl = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    expected: dict[str, dict[int, float]] = {}
    for row in jsonl:
        for key, value in row.items():
            if key not in ("step", "time") and value is not None:
                expected.setdefault(key, {})[row["step"]] = value
    for key in ("train/loss", "timers/forward/mean", "throughput/tokens_per_s", "my/widgets", "my/latency/mean",
                "eval/loss", "eval/perplexity", "train/FloatTensor", "eval/F1", "train/Acc", "train/acc"):  # fmt: skip
        assert key in expected, key
    assert not {"train/floattensor", "eval/f1"} & expected.keys()
    assert set(expected["train/Acc"].values()) == {0.25} and set(expected["train/acc"].values()) == {0.75}

    tb = read_tensorboard(run_dir / "tensorboard")
    wb = read_wandb_offline(run_dir)
    from otel_train.bridges.mlflow import default_tracking_uri

    ml = read_mlflow(default_tracking_uri(run_dir), "otel-train", "bridged")
    readers = {
        "tensorboard": {k: dict(v) for k, v in tb.scalars.items()},
        "wandb": {k: dict(wb.series(k)) for k in expected},
        "mlflow": {k: dict(v) for k, v in ml.metrics.items()},
    }
    for backend, got in readers.items():
        for key, series in expected.items():
            assert got.get(key), (backend, key)
            assert sorted(got[key]) == sorted(series), (backend, key)
            for step, value in series.items():
                assert got[key][step] == pytest.approx(value, rel=1e-6, abs=1e-9), (backend, key, step)

    # text, histograms and hparams reached each backend
    assert any("hello" in text for series in tb.text.values() for _, text in series)
    assert tb.histograms and tb.hparams.get("lr") == pytest.approx(3e-4)
    assert any(
        name.endswith(".json") or name.endswith(".md") or name.endswith(".txt") for name in ml.artifacts
    )
    assert ml.params.get("lr") == "0.0003"
    assert wb.history and wb.exited
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
