"""Accelerate's `Accelerator(log_with=[OtelTrainTracker()])`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from accelerate import Accelerator
from helpers.multirank import run_ranks

import otel_train as ot
from otel_train.integrations.accelerate import OtelTrainTracker


def test_tracker_logs_values_and_config(tmp_path: Path) -> None:
    tracker = OtelTrainTracker(
        {"run_name": "old"}, run_name="acc", prometheus_port=0, verbosity=0, hardware=False
    )
    accelerator = Accelerator(log_with=[tracker], cpu=True)
    accelerator.init_trackers("proj", config={"lr": 0.1, "api_key": "PLANTED-SECRET-42"})
    for step in range(4):
        with ot.step(step, tokens=32):
            accelerator.log({"loss": 2.0 - step * 0.25, "accuracy": 0.1 * step, "note": "text"}, step=step)
    assert accelerator.get_tracker("otel_train").tracker is ot.current_session()
    accelerator.end_training()
    assert ot.current_session() is None

    run_dir = tmp_path / "runs" / "acc"
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if r.get("train/loss") is not None]
    assert losses[-1] == pytest.approx((2.0 + 1.75 + 1.5 + 1.25) / 4)  # the interval's mean
    assert [r["train/loss_last"] for r in rows if "train/loss_last" in r][-1] == pytest.approx(1.25)
    assert [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None][-1] == pytest.approx(0.15)
    assert [r["eval/accuracy_last"] for r in rows if "eval/accuracy_last" in r][-1] == pytest.approx(0.3)
    hparams_text = (run_dir / "hparams.json").read_text()
    assert json.loads(hparams_text)["lr"] == 0.1
    assert "PLANTED-SECRET-42" not in hparams_text


def _rank_without_init(rank: int, world_size: int) -> int:
    logging.basicConfig()
    tracker = OtelTrainTracker()
    tracker.log({"loss": 1.0})  # no session on any rank: must not start one (collectives) nor raise
    return int(ot.current_session() is None)


@pytest.mark.multirank
def test_tracker_never_starts_a_session_alone_in_a_multi_process_job() -> None:
    assert run_ranks(2, _rank_without_init, (), timeout=120) == [1, 1]


def test_tracker_rejects_an_unknown_setting_by_name() -> None:
    with pytest.raises(ot.ConfigError, match=r"OtelTrainTracker.*'prometheus_prot'.*'prometheus_port'"):
        OtelTrainTracker(prometheus_prot=0)
