"""Histograms numpy cannot bin in 64 bins (a narrow range of huge values, a constant past 2**53, a
range wider than the largest float) still reach every backend, binned alike, and never raise: a
raise counted toward the bridge's consecutive failures, and five disabled W&B and MLflow."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.readback import read_mlflow, read_tensorboard, read_wandb_offline

from otel_train.bridges.base import HISTOGRAM_BINS, histogram_bins

BIG = sys.float_info.max
HARD = {
    "ts_ns": [1.7e16 + k for k in range(8)],  # nanosecond timestamps: 4 floats apart in all
    "const_huge": [1e21] * 5,  # value +- 0.5 is the value itself
    "const_max": [BIG] * 3,  # and one float up is inf
    "widest": [-BIG, 0.0, BIG, float("nan")],  # max - min overflows
}


@pytest.mark.parametrize("values", [*HARD.values(), [1.0, 2.0, 2.0, 3.0], [3.0], [5e-324, 1e-323]])
def test_finite_values_are_always_binned(values: list[float]) -> None:
    binned = histogram_bins(values)
    assert binned is not None
    array, counts, edges = binned
    finite = [v for v in values if np.isfinite(v)]
    assert int(counts.sum()) == len(finite) == array.size
    assert 1 <= counts.size <= HISTOGRAM_BINS and edges.size == counts.size + 1
    assert np.all(np.isfinite(edges)) and np.all(edges[1:] > edges[:-1])
    assert edges[0] <= min(finite) and max(finite) <= edges[-1]


def test_ordinary_values_get_numpys_64_bins_and_nothing_finite_is_none() -> None:
    values = np.random.default_rng(0).normal(size=1000)
    _, counts, edges = histogram_bins(values.tolist()) or (None, None, None)
    expected_counts, expected_edges = np.histogram(values, bins=64)
    assert counts is not None and edges is not None
    assert counts.tolist() == expected_counts.tolist() and edges.tolist() == expected_edges.tolist()
    assert histogram_bins([float("nan"), float("inf")]) is None and histogram_bins([]) is None


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # TensorBoard's reader: float32 edges
def test_every_backend_shows_them_and_keeps_its_scalars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from otel_train.bridges.mlflow import MlflowSink, default_tracking_uri
    from otel_train.bridges.tensorboard import TensorBoardSink
    from otel_train.bridges.wandb import WandbSink

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    sinks = [
        TensorBoardSink(run_dir / "tensorboard"),
        WandbSink(run_dir, {}, project="p", mode="offline", run_name="hist", run_id="hist"),
        MlflowSink(run_dir, None, "exp", "hist"),
    ]
    for sink in sinks:
        for key, values in HARD.items():
            sink.write_histogram(f"h/{key}", values, 3)  # raised on the old bins
        sink.write_scalars(4, time.time(), {"train/loss": 0.5})
        sink.close({})
    counts = {key: sum(np.isfinite(values)) for key, values in HARD.items()}

    tb = read_tensorboard(run_dir / "tensorboard")
    assert {k: sum(c for _, _, c in tb.histograms[f"h/{k}"][0][1]) for k in HARD} == counts
    assert tb.scalars["train/loss"] == [(4, 0.5)]

    wb = read_wandb_offline(run_dir)
    shown = {k: wb.series(f"h/{k}") for k in HARD}
    assert {k: sum(hist["values"]) for k, [(_, hist)] in shown.items()} == counts
    assert wb.series("train/loss") == [(4, 0.5)]

    ml = read_mlflow(default_tracking_uri(run_dir), "exp")
    docs = {k: json.loads(ml.artifacts[f"histograms/h/{k}/step_000000003.json"]) for k in HARD}
    assert {k: sum(doc["counts"]) for k, doc in docs.items()} == counts
    assert docs["ts_ns"]["min"] == 1.7e16 and docs["widest"]["max"] == BIG
    assert docs["ts_ns"]["mean"] == pytest.approx(1.7e16) and docs["const_max"]["mean"] is None  # no Infinity
    assert ml.metrics["train/loss"] == [(4, 0.5)]
