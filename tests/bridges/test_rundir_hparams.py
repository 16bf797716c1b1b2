"""hparams.json holds what W&B's config and MLflow's params get for the same values: numpy and
torch scalars are read back as JSON bools, ints, floats (NaN as null) or, for complex numbers, the
text the bridge process sends (`bridges.framing.plain`, which feeds W&B's `config.update` and,
flattened by `flatten_params`, MLflow's params), with no warning on the user's console."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import otel_train as ot
from otel_train.bridges.base import flatten_params
from otel_train.bridges.framing import plain
from otel_train.bridges.rundir import RunDirSink
from otel_train.testing import current_session


def params() -> dict[str, Any]:
    return {
        "flag": np.bool_(True),
        "off": np.bool_(False),
        "z": np.complex128(1 + 2j),
        "seed": np.int64(7),
        "bits": np.uint8(3),
        "dropout": np.float32(0.5),
        "lr": np.float64(3e-4),
        "nan": np.float64("nan"),
        "scale": np.array(2.5),  # a 0-d array
        "layers": torch.tensor(3),  # 0-d tensors
        "tied": torch.tensor(True),
        "beta": torch.tensor(0.25, dtype=torch.float64),
        "nested": {"heads": np.int32(4), "phase": np.complex64(1 - 1j), "fused": np.bool_(False)},
        "sizes": [np.int64(1), np.bool_(True)],
    }


EXPECTED = {
    "flag": True,
    "off": False,
    "z": "(1+2j)",
    "seed": 7,
    "bits": 3,
    "dropout": 0.5,
    "lr": 3e-4,
    "nan": None,  # strict JSON has no NaN
    "scale": 2.5,
    "layers": 3,
    "tied": True,
    "beta": 0.25,
    "nested": {"heads": 4, "phase": "(1-1j)", "fused": False},
    "sizes": [1, True],
}


def _kinds(value: Any) -> Any:
    """The JSON type of every leaf (`1 == True == 1.0` in Python, so values alone cannot tell)."""
    if isinstance(value, dict):
        return {k: _kinds(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_kinds(v) for v in value]
    return type(value).__name__


def _without_nan(value: Any) -> Any:
    """The bridge payload keeps NaN (W&B's config stores it as null, MLflow's param as "nan")."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nan(v) for v in value]
    return value


def test_hparams_json_reads_back_numpy_and_torch_scalars_as_the_bridges_get_them(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # also the worker thread's: filters are process-wide
        ot.init(output_dir=str(tmp_path), run_name="hp", prometheus_port=0, verbosity=0, hardware=False)
        ot.log_hyperparams(params())
        ot.shutdown()
    text = (tmp_path / "hp" / "hparams.json").read_text()
    read = json.loads(text)
    assert read == EXPECTED, text
    assert _kinds(read) == _kinds(EXPECTED), text  # true, not 1.0; 7, not 7.0
    assert not [w for w in caught if "complex" in str(w.message).lower() or "hparams" in str(w.filename)]
    # What W&B's config.update receives (the bridge process's payload) ...
    bridged = plain(params())
    assert read == _without_nan(bridged)
    assert _kinds(read) == _kinds(_without_nan(bridged))
    # ... and MLflow's params (text) from it: the same strings, NaN aside ("nan" there, null here).
    mlflow_here, mlflow_there = flatten_params(read), flatten_params(bridged)
    assert (mlflow_here.pop("nan"), mlflow_there.pop("nan")) == ("None", "nan")
    assert mlflow_here == mlflow_there


def test_sink_merges_later_hparams_without_a_warning(tmp_path: Path) -> None:
    sink = RunDirSink(tmp_path, rank=0, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.write_hparams({"z": np.complex128(3 - 4j), "flag": np.bool_(False)})
        sink.write_hparams({"steps": np.int64(10), "flag": np.bool_(True)})
    sink.close({})
    assert not caught, [str(w.message) for w in caught]  # numpy's ComplexWarning: float() of a complex
    read = json.loads(sink.files.hparams.read_text())
    assert read == {"z": "(3-4j)", "flag": True, "steps": 10}
    assert _kinds(read) == {"z": "str", "flag": "bool", "steps": "int"}


def test_hparams_json_agrees_with_real_wandb_config_and_mlflow_params(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same params through the real bridge process into W&B (offline) and MLflow (local
    store), read back from each and from hparams.json."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from helpers.readback import read_mlflow, read_wandb_offline

    from otel_train.bridges.mlflow import default_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ot.init(output_dir=str(tmp_path), run_name="hpb", wandb=True, wandb_mode="offline", mlflow=True,
            prometheus_port=0, verbosity=0, hardware=False)  # fmt: skip
    session = current_session()
    ot.log_hyperparams(params())
    ot.shutdown()
    # shutdown() waits shutdown_timeout_s for the bridges; on a busy host they finish later
    assert session is not None and session.bridges is not None and session.bridges.wait(120)
    run_dir = tmp_path / "hpb"
    read = json.loads((run_dir / "hparams.json").read_text())
    assert read == EXPECTED
    config = read_wandb_offline(run_dir).config  # nested keys read back as `nested/heads`
    flat = {f"nested/{k}": v for k, v in read["nested"].items()}
    flat.update((k, v) for k, v in read.items() if k != "nested")
    for key, value in flat.items():  # NaN included: W&B's config holds null too
        assert config[key] == value and _kinds(config[key]) == _kinds(value), key
    mlflow = read_mlflow(default_tracking_uri(run_dir), "otel-train", "hpb").params
    here = flatten_params(read)
    assert here.pop("nan") == "None" and mlflow["nan"] == "nan"
    assert {k: mlflow[k] for k in here} == here


NESTED_FIRST = {"optim": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}, "seed": 1}
NESTED_LATER = {"optim": {"lr": 2e-3}}
NESTED_MERGED = {"optim": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}, "seed": 1}


def test_a_later_nested_update_keeps_its_siblings_in_hparams_json(tmp_path: Path) -> None:
    sink = RunDirSink(tmp_path, rank=0, progress=False)
    sink.write_hparams(NESTED_FIRST)
    sink.write_hparams(NESTED_LATER)
    sink.close({})
    assert json.loads(sink.files.hparams.read_text()) == NESTED_MERGED


def test_a_later_nested_update_keeps_its_siblings_in_wandbs_config(tmp_path: Path) -> None:
    """W&B's config.update replaces a top-level key whole (online, the server keeps the last
    value of each key): the last config record of `optim` must hold its siblings too."""
    pytest.importorskip("wandb")
    import glob

    from helpers.readback import iter_wandb_records, read_wandb_offline

    from otel_train.bridges.wandb import WandbSink

    sink = WandbSink(tmp_path / "run", {}, project="p", run_name="nested", mode="offline")
    sink.write_hparams(NESTED_FIRST)
    sink.write_scalars(0, 0.0, {"train/loss": 1.0})
    sink.write_hparams(NESTED_LATER)
    sink.close({})
    run = read_wandb_offline(tmp_path / "run")
    assert run.exited
    (log,) = glob.glob(str(run.run_dir / "run-*.wandb"))
    last: dict[str, Any] = {}
    for record in iter_wandb_records(log):
        if record.WhichOneof("record_type") == "config":
            last.update((i.key, json.loads(i.value_json)) for i in record.config.update)
    assert last["optim"] == NESTED_MERGED["optim"] and last["seed"] == 1
