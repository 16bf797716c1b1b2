"""Values recorded every step, over the flush interval: the mean is the value (HF Trainer / Megatron
convention), min / max / last go alongside, spikes are seen and named at their own step, and the
final flush does not repeat the last row. A row carries a value only from the interval it was
recorded in; a `log_metrics(step=N)` value gets a row of its own and no stale copy of the last one."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path
from typing import Any

import torch
from helpers.ports import free_port
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train import semconv as sc
from otel_train.core.buffer import Interval
from otel_train.run_directory import RunFiles
from otel_train.testing import capture_metrics, current_session


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in RunFiles(run_dir).metrics.read_text().splitlines()]


def _samples(text: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.value)
    return out


def test_a_loss_alternating_1_and_3_exports_mean_2_and_max_3(tmp_path) -> None:
    port = free_port()
    ot.init(prometheus_port=port, verbosity=0, log_interval=10, output_dir=str(tmp_path),
                      hardware=False)  # fmt: skip
    session = current_session()
    try:
        for i in range(10):
            with ot.step(i):
                # a tensor, as a device value would be: resolved at the flush
                ot.record("loss", torch.tensor(1.0 if i % 2 == 0 else 3.0))
                ot.record("reward", 0.0 if i < 9 else 10.0)  # a user's own name
        session.worker.stop(timeout_s=10)
        text = urllib.request.urlopen(session.prometheus_url, timeout=10).read().decode()
        run_dir = session.run_dir
    finally:
        ot.shutdown()
    assert run_dir is not None
    [row] = _rows(run_dir)
    assert row["step"] == 9
    assert row[sc.LOSS.key] == 2.0
    assert (row[sc.LOSS_MAX.key], row[sc.LOSS_MIN.key], row[sc.LOSS_LAST.key]) == (3.0, 1.0, 3.0)
    assert row["train/reward"] == 1.0
    reward_stats = [row[sc.interval_key("train/reward", s)] for s in ("min", "max", "last")]
    assert reward_stats == [0.0, 10.0, 10.0]
    # The OTel side: the same numbers on the in-process Prometheus endpoint.
    samples = _samples(text)
    assert samples[sc.LOSS.prometheus_name] == [2.0]
    assert samples[sc.LOSS_MAX.prometheus_name] == [3.0]
    assert samples[sc.LOSS_MIN.prometheus_name] == [1.0]
    assert samples["train_reward"] == [1.0]
    assert "train_reward_max" not in samples  # a user name's statistics are bridge keys only (series budget)


def test_a_spike_between_two_flushes_is_detected_and_names_its_step(tmp_path) -> None:
    ot.init(prometheus_port=0, verbosity=0, log_interval=10, output_dir=str(tmp_path),
                      hardware=False, loss_spike_factor=3.0)  # fmt: skip
    session = current_session()
    for i in range(30):
        with ot.step(i):
            ot.record("loss", torch.tensor(10.0 if i == 13 else 1.0))
    run_dir = session.run_dir
    ot.shutdown()
    assert run_dir is not None
    events = [json.loads(line) for line in RunFiles(run_dir).events.read_text().splitlines()]
    spikes = [e for e in events if e["event"] == "loss_spike"]
    assert [(e["step"], e["loss"]) for e in spikes] == [(13, 10.0)]
    assert "at step 13 " in spikes[0]["message"]
    assert [r[sc.LOSS_MAX.key] for r in _rows(run_dir)] == [1.0, 10.0, 1.0]


def test_the_final_flush_after_the_last_step_writes_no_second_row(tmp_path) -> None:
    ot.init(prometheus_port=0, verbosity=0, log_interval=5, output_dir=str(tmp_path), hardware=False)
    session = current_session()
    for i in range(10):
        with ot.step(i):
            ot.record("loss", 1.0)
    run_dir = session.run_dir
    ot.shutdown()
    assert run_dir is not None
    assert [r["step"] for r in _rows(run_dir)] == [4, 9]


def test_a_value_recorded_after_the_last_step_still_gets_its_row(tmp_path) -> None:
    ot.init(prometheus_port=0, verbosity=0, log_interval=5, output_dir=str(tmp_path), hardware=False)
    session = current_session()
    for i in range(5):
        with ot.step(i):
            ot.record("loss", 1.0)
    ot.record("eval_loss", 0.5)
    run_dir = session.run_dir
    ot.shutdown()
    assert run_dir is not None
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [4, 4]
    assert rows[-1][sc.EVAL_LOSS.key] == 0.5


def test_a_log_metrics_row_after_a_flush_adds_no_stale_copy_of_the_last_row(tmp_path) -> None:
    """An evaluation logged at the step that just flushed gets its own row at that step, and no
    second row of the training values already written under it (nor a progress line)."""
    ot.init(prometheus_port=0, verbosity=0, log_interval=10, output_dir=str(tmp_path), hardware=False)
    session = current_session()
    for step in range(20):
        with ot.step(step, tokens=100):
            ot.record("loss", 1.0 / (step + 1))
        if step == 9:
            ot.log_metrics({"eval_loss": 0.5}, step=9)
    run_dir = session.run_dir
    ot.shutdown()
    assert run_dir is not None
    rows = [{k: r.get(k) for k in ("step", sc.LOSS.key, sc.EVAL_LOSS.key)} for r in _rows(run_dir)]
    assert rows == [
        {"step": 9, sc.LOSS.key: sum(1.0 / (i + 1) for i in range(10)) / 10, sc.EVAL_LOSS.key: None},
        {"step": 9, sc.LOSS.key: None, sc.EVAL_LOSS.key: 0.5},
        {"step": 19, sc.LOSS.key: sum(1.0 / (i + 1) for i in range(10, 20)) / 10, sc.EVAL_LOSS.key: None},
    ]
    progress = RunFiles(run_dir).progress.read_text().splitlines()
    assert [line.split(" | ")[1] for line in progress if "end of process" not in line] == [
        "step 10", "step 20"
    ]  # fmt: skip


def test_a_value_recorded_in_one_interval_is_in_that_intervals_row_only(tmp_path) -> None:
    """An eval loss recorded at steps 0 and 20 is in the rows of those intervals only (a bridge
    shows it where it was measured), while the OTel gauge keeps its latest value for Prometheus."""
    port = free_port()
    ot.init(prometheus_port=port, verbosity=0, log_interval=5, output_dir=str(tmp_path), hardware=False)
    session = current_session()
    for step in range(40):
        with ot.step(step):
            ot.record("loss", 1.0)
            if step in (0, 20):
                ot.record("eval_loss", 0.5 + step)
    session.worker.stop(timeout_s=10)
    text = urllib.request.urlopen(session.prometheus_url, timeout=10).read().decode()
    run_dir = session.run_dir
    ot.shutdown()
    assert run_dir is not None
    rows = _rows(run_dir)
    assert [(r["step"], r[sc.EVAL_LOSS.key]) for r in rows if sc.EVAL_LOSS.key in r] == [(4, 0.5), (24, 20.5)]
    assert [r["step"] for r in rows if sc.interval_key(sc.EVAL_LOSS.key, "last") in r] == [4, 24]
    assert all(sc.LOSS.key in r for r in rows)  # recorded in every interval
    assert _samples(text)[sc.EVAL_LOSS.prometheus_name] == [20.5]


class _Intervals:
    def __init__(self) -> None:
        self.seen: list[Interval] = []

    def on_flush(self, interval: Interval) -> None:
        self.seen.append(interval)

    def close(self) -> None:
        pass


def test_the_step_of_each_value_is_known_when_each_step_recorded_it_equally_often() -> None:
    listener = _Intervals()
    with capture_metrics(log_interval=4, hardware=False) as _:
        session = current_session()
        assert session is not None
        session.worker.add_listener(listener)
        for i in range(10, 14):  # two micro-batch losses per step; grad_norm in some steps only
            with ot.step(i):
                ot.record("loss", float(i))
                ot.record("loss", float(i) + 0.5)
                if i % 2:
                    ot.record("grad_norm", 1.0)
        ot.record("lr", 1e-3)  # after the last step, once: that step's
    first = listener.seen[0]
    assert first.scalars[sc.LOSS.name] == [10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5]
    assert first.scalar_steps[sc.LOSS.name] == [10, 10, 11, 11, 12, 12, 13, 13]
    assert sc.GRAD_NORM.name not in first.scalar_steps  # 2 values in 4 steps: which steps is unknown
    assert listener.seen[-1].scalar_steps[sc.LEARNING_RATE.name] == [13]


def test_two_names_merged_into_one_instrument_have_no_steps() -> None:
    listener = _Intervals()
    with capture_metrics(log_interval=2, hardware=False):
        session = current_session()
        assert session is not None
        session.worker.add_listener(listener)
        for i in range(2):
            with ot.step(i):
                ot.record("loss", 1.0)
                ot.record("train/loss", 2.0)  # the same instrument: its values no longer in step order
    assert sorted(listener.seen[0].scalars[sc.LOSS.name]) == [1.0, 1.0, 2.0, 2.0]
    assert sc.LOSS.name not in listener.seen[0].scalar_steps


def test_nonfinite_values_keep_the_others_steps() -> None:
    listener = _Intervals()
    with capture_metrics(log_interval=3, hardware=False):
        session = current_session()
        assert session is not None
        session.worker.add_listener(listener)
        for i, loss in enumerate((1.0, float("nan"), 3.0)):
            with ot.step(i):
                ot.record("loss", torch.tensor(loss))
    assert listener.seen[0].scalars[sc.LOSS.name] == [1.0, 3.0]
    assert listener.seen[0].scalar_steps[sc.LOSS.name] == [0, 2]


def test_the_interval_statistics_names_are_not_a_users_to_take(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=1, hardware=False) as cap, ot.step(0):
        ot.record("loss", 2.0)
        ot.record("loss_max", 99.0)  # would overwrite train/loss_max in the bridges
        ot.record("train/loss/max", 99.0)  # would be the gauge train.loss.max itself
    flushed = cap.flushes[-1][1]
    assert flushed[sc.LOSS_MAX.key] == 2.0
    assert flushed["otel_train/dropped/reserved_name"] == 2
