"""Every bridge receives the same three flushes and gives back the same keys, steps and values."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers.readback import read_mlflow, read_tensorboard, read_wandb_offline

from otel_train.bridges.base import Sink
from otel_train.bridges.threaded import ThreadedSink

FLUSHES: list[tuple[int, dict[str, float]]] = [
    (10, {"train/loss": 2.5, "timers/forward/mean": 0.012, "throughput/tokens_per_s": 51234.5}),
    (20, {"train/loss": 1.75, "timers/forward/mean": 0.0115, "throughput/tokens_per_s": 52001.0}),
    (
        30,
        {
            "train/loss": 1.125,
            "timers/forward/mean": 0.011,
            "throughput/tokens_per_s": 52999.25,
            "eval/loss": 1.5,
        },
    ),
]


def _expected() -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step, scalars in FLUSHES:
        for key, value in scalars.items():
            out.setdefault(key, []).append((step, value))
    return out


def _make(backend: str, run_dir: Path) -> Sink:
    if backend == "tensorboard":
        from otel_train.bridges.tensorboard import TensorBoardSink

        return TensorBoardSink(run_dir / "tensorboard")
    if backend == "wandb":
        from otel_train.bridges.wandb import WandbSink

        return WandbSink(run_dir, {"lr": 0.1}, project="otel-train-tests", mode="offline", run_name="conf")
    from otel_train.bridges.mlflow import MlflowSink

    return MlflowSink(run_dir, None, "conformance", "conf")


def _read(backend: str, run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    if backend == "tensorboard":
        return read_tensorboard(run_dir / "tensorboard").scalars
    if backend == "wandb":
        run = read_wandb_offline(run_dir)
        keys = {k for row in run.history for k in row if not k.startswith("_") and k != "train/step"}
        return {k: run.series(k) for k in keys}
    from otel_train.bridges.mlflow import default_tracking_uri

    return read_mlflow(default_tracking_uri(run_dir), "conformance").metrics


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "mlflow"])
def test_same_scalars_read_back(backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip({"tensorboard": "torch.utils.tensorboard"}.get(backend, backend))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "runs" / "conf"
    # through ThreadedSink, as the session wires it
    sink = ThreadedSink(_make(backend, run_dir), queue_size=8, name=backend)
    for step, scalars in FLUSHES:
        sink.write_scalars(step, time.time(), scalars)
    sink.close(FLUSHES[-1][1], timeout=30)
    assert sink.closed_cleanly and sink.errors == 0 and sink.dropped == 0

    got = _read(backend, run_dir)
    expected = _expected()
    assert sorted(got) == sorted(expected)
    for key, series in expected.items():
        assert [s for s, _ in got[key]] == [s for s, _ in series], key
        # TensorBoard stores float32; W&B and MLflow keep float64
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in series], rel=1e-6), key


@pytest.mark.parametrize(
    ("backend", "module", "extra"),
    [
        ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow", "mlflow"),
    ],
)
def test_missing_package_names_the_extra(
    backend: str, module: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_train.bridges.errors import BridgeImportError

    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` raise ImportError
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ImportError) as info:  # an ImportError subclass: `except ImportError` works
        _make(backend, tmp_path / "run")
    assert isinstance(info.value, BridgeImportError)
    assert f"pip install 'otel-train[{extra}]'" in str(info.value)
