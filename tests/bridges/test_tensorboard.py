"""TensorBoard bridge: written with torch's SummaryWriter, read back with TensorBoard's own reader."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from helpers.readback import read_tensorboard

from otel_train.bridges.base import flatten_params
from otel_train.bridges.errors import BridgeSetupError
from otel_train.bridges.tensorboard import TensorBoardSink
from otel_train.config import Config, config_as_dict
from otel_train.redaction import redact

pytest.importorskip("torch.utils.tensorboard")


def test_scalars_text_histograms_hparams_round_trip(tmp_path: Path) -> None:
    log_dir = tmp_path / "runs" / "run-a" / "tensorboard"
    sink = TensorBoardSink(log_dir)
    sink.write_hparams({"lr": 3e-4, "batch_size": 32, "model": "gpt2", "amp": True, "sched": {"warmup": 100}})
    for step in (10, 20, 30):
        sink.write_scalars(step, time.time(), {"train/loss": 10.0 / step, "timers/forward/mean": 0.25})
    sink.write_text("samples/note", "**bold** text", 20)
    sink.write_samples("samples/val", [("2+2=", "4"), ("a|b", "line1\nline2")], 30)
    sink.write_histogram("grad/norm", [1.0, 2.0, 2.0, 3.0, float("nan")], 30)
    sink.close({"train/loss": 10.0 / 30, "eval/accuracy": 0.9})

    tb = read_tensorboard(log_dir)
    assert [s for s, _ in tb.scalars["train/loss"]] == [10, 20, 30]
    assert [v for _, v in tb.scalars["train/loss"]] == pytest.approx([1.0, 0.5, 1 / 3], rel=1e-6)
    assert tb.scalars["timers/forward/mean"] == [(10, 0.25), (20, 0.25), (30, 0.25)]
    # a final value that no flush carried is written at the last step (so HParams can show it)
    assert tb.scalars["eval/accuracy"] == [(30, pytest.approx(0.9))]
    assert tb.text["samples/note"] == [(20, "**bold** text")]
    (step, table) = tb.text["samples/val"][0]
    assert step == 30 and "| 2+2= | 4 |" in table and "a\\|b" in table and "line1<br>line2" in table
    (step, buckets) = tb.histograms["grad/norm"][0]
    assert step == 30
    assert sum(count for _, _, count in buckets) == 4  # NaN dropped, 4 finite values binned
    assert min(left for left, _, c in buckets if c) == pytest.approx(1.0)
    # hparams live in the run's own dir (no add_hparams sub-run), numbers come back as floats
    assert tb.hparams == {
        "lr": pytest.approx(3e-4),
        "batch_size": 32.0,
        "model": "gpt2",
        "amp": True,
        "sched.warmup": 100.0,
    }
    assert tb.session_end_status == 1  # STATUS_SUCCESS
    assert not tb.has_experiment_tag  # the HParams dashboard infers columns across runs
    assert [p.name for p in log_dir.iterdir() if p.is_dir()] == []


def test_scalars_keep_double_precision(tmp_path: Path) -> None:
    """Finite values past float32 (exp of a diverging loss) and below it, and every digit of a
    learning rate, read back as the JSONL, W&B and MLflow have them."""
    log_dir = tmp_path / "tb"
    sink = TensorBoardSink(log_dir)
    values = {"train/ppl": 1e39, "train/tiny": 1e-46, "train/lr": 1.23456789012e-4}
    sink.write_scalars(0, time.time(), values)
    sink.close({**values, "eval/ppl": 3e300})  # a final value no flush carried: written at close
    tb = read_tensorboard(log_dir)
    assert {k: tb.scalars[k] for k in values} == {k: [(0, v)] for k, v in values.items()}
    assert tb.scalars["eval/ppl"] == [(0, 3e300)]


def test_two_runs_under_one_root_are_separate_runs(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    root = tmp_path / "runs"
    for name, lr in (("run-a", 0.1), ("run-b", 0.2)):
        sink = TensorBoardSink(root / name / "tensorboard")
        sink.write_hparams({"lr": lr})
        sink.write_scalars(1, time.time(), {"train/loss": lr})
        sink.close({"train/loss": lr})
    mux = EventMultiplexer().AddRunsFromDirectory(str(root))
    mux.Reload()
    assert sorted(mux.Runs()) == ["run-a/tensorboard", "run-b/tensorboard"]


def test_config_hparams_are_flat_and_redacted(tmp_path: Path) -> None:
    marker = "SENTINEL-TB-7f3a"
    config = Config(otlp_headers={"authorization": f"Bearer {marker}"}, wandb_tags=("x", "y"))
    log_dir = tmp_path / "tb"
    sink = TensorBoardSink(log_dir)
    sink.write_hparams(config_as_dict(config))
    sink.close({})
    hp = read_tensorboard(log_dir).hparams
    assert hp["otlp_headers"] == "***" and hp["wandb_tags"] == '["x", "y"]' and hp["run_name"] == "None"
    for path in log_dir.rglob("*"):
        if path.is_file():
            assert marker.encode() not in path.read_bytes()
    assert flatten_params(redact({"a": {"token": "s"}, "n": math.inf}), typed=True) == {
        "a.token": "***",
        "n": "inf",
    }
    assert flatten_params({"lr": 0.5, "on": True, "tags": [1]}) == {"lr": "0.5", "on": "True", "tags": "[1]"}


def test_unwritable_log_dir_names_the_path(tmp_path: Path) -> None:
    # Tests run as root, so chmod cannot make a directory unwritable. A path *under a regular file*
    # cannot be created by anyone (ENOTDIR): that is the unwritable directory used here.
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    bad = blocker / "tb"
    with pytest.raises(BridgeSetupError) as info:
        TensorBoardSink(bad)
    assert str(bad) in str(info.value) and "TensorBoard" in str(info.value)
