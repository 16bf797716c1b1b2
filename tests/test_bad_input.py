"""Recording never raises: bad values and names are dropped or sanitized, counted, warned once,
and the series count stays within the cardinality budget."""

from __future__ import annotations

import enum
import logging
import math

import torch
from prometheus_client.parser import text_string_to_metric_families

import otel_train as ot
from otel_train import adapters
from otel_train.testing import capture_metrics, current_session

SERIES_BUDGET = 200


def test_bad_values_never_raise_and_are_counted(caplog) -> None:
    with capture_metrics(log_interval=100) as cap, ot.step(0):
        for value in (float("nan"), float("inf"), -math.inf, None, "1.5", b"x", True, object(),
                      torch.ones(3), torch.tensor([float("nan")]), torch.tensor(2.5, requires_grad=True) * 2,
                      torch.tensor(1 + 2j)):  # fmt: skip
            ot.record("loss", value)
        ot.record("loss", 0.75)
        ot.record(["a list"], 1.0)  # type: ignore[arg-type]  # unhashable: a name like any bad one
        ot.log_metrics({"ok": 1.0, 3: 2.0})  # type: ignore[dict-item]
    flushed = cap.flushes[-1][1]
    assert flushed["train/loss"] == (5.0 + 0.75) / 2  # the mean of the two good values
    assert flushed["train/loss_last"] == 0.75
    assert flushed["train/ok"] == 1.0
    assert flushed["health/nonfinite_loss"] == 4  # nan, inf, -inf, tensor(nan)
    assert flushed["otel_train/dropped/nonfinite"] == 4
    assert flushed["otel_train/dropped/invalid_type"] == 6  # None, str, bytes, bool, object, complex
    assert flushed["otel_train/dropped/non_scalar_tensor"] == 1
    assert flushed["otel_train/dropped/invalid_name"] == 2  # the list and the int key


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
    assert sum(v for _, v in cap.series("otel_train/dropped/too_many_names")) == 10_000 - 64
    assert not cap.series("otel_train/dropped/invalid_name")
    assert sum("max_metric_names" in r.getMessage() for r in caplog.records) == 1
    # a user's log shows whose warning it is
    assert [r.getMessage() for r in caplog.records if not r.getMessage().startswith("otel_train: ")] == []


def test_pull_endpoint_series_budget(tmp_path) -> None:
    import time
    import urllib.request

    from helpers.ports import free_port

    port = free_port()
    ot.init(prometheus_port=port, verbosity=0, log_interval=5, output_dir=str(tmp_path))
    session = current_session()
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
    # the job-level series (train_job_*, once per job, no rank label) are not this rank's own
    own = [s for s in series if not s.name.startswith("train_job_")]
    job = [s for s in series if s.name.startswith("train_job_")]
    assert len(own) <= SERIES_BUDGET, len(own)
    assert job and all(s.labels.get("run_id") and "rank" not in s.labels for s in job)
    assert all(s.labels.get("run_id") and s.labels.get("rank") == "0" for s in own if s.name != "target_info")


class _Phase(enum.Enum):  # a timer named by an Enum: dropped
    FORWARD = "forward"


class _Named(str, enum.Enum):  # a timer named by a str Enum: its value
    BACKWARD = "backward"


def test_a_timer_name_that_is_not_a_str_never_loses_the_interval(caplog) -> None:
    """An Enum, None or int as a timer's name (not checked on the hot path) is dropped and counted
    on the worker; the interval's other timers, values and steps all arrive. A `str` Enum is its
    plain string. (It used to fail the whole flush: sorting the names raised.)"""
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=2) as cap:
        for i in range(2):
            with ot.step(i, tokens=10):
                ot.record("keep", 1.0)
                with ot.timer(_Phase.FORWARD):  # type: ignore[arg-type]
                    pass
                with ot.timer(None):  # type: ignore[arg-type]
                    pass
                with ot.timer(_Named.BACKWARD):
                    pass
                with ot.timer("optimizer"):
                    pass
                with ot.span(7):  # type: ignore[arg-type]  # dropped too, never raised
                    pass
    flushed = cap.flushes[-1][1]
    assert flushed["train/keep"] == 1.0 and flushed["throughput/tokens"] == 20
    assert flushed["timers/optimizer/count"] == 2 and flushed["timers/backward/count"] == 2
    assert flushed["otel_train/dropped/invalid_timer_name"] == 4
    assert flushed["otel_train/dropped/invalid_name"] == 2  # the spans
    assert not any("Phase" in k or "None" in k for k in flushed), sorted(flushed)
    warnings = [r.getMessage() for r in caplog.records]
    # once per bad name (the Enum and None), not once per flush
    assert sum("timer's name was not a str" in w for w in warnings) == 2, warnings
    assert not any("flush" in w and "failed" in w for w in warnings), warnings


def test_a_timer_name_that_is_not_a_str_is_dropped_on_every_path(caplog) -> None:
    """Not only a `with` block that ends normally: a raising block (its phase error and its span on
    a traced step) and `adapters.phase()` drop an Enum name the same way, and take a `str` Enum's value."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=2) as cap:
        for i in range(2):
            with ot.step(i):
                for name in (_Phase.FORWARD, _Named.BACKWARD):
                    try:
                        with ot.timer(name):  # type: ignore[arg-type]
                            raise ValueError("boom")
                    except ValueError:
                        pass
                adapters.phase(_Named.BACKWARD, 0.5)
    flushed = cap.flushes[-1][1]
    assert flushed["timers/backward/ValueError/count"] == 2, sorted(flushed)
    assert flushed["timers/backward/count"] == 2  # the two adapters.phase() values, under the plain name
    assert flushed["otel_train/dropped/invalid_timer_name"] == 2
    assert not any("Phase" in k or "Named" in k for k in flushed), sorted(flushed)
    warnings = [r.getMessage() for r in caplog.records]
    assert not any("flush" in w and "failed" in w for w in warnings), warnings


def test_dropped_values_are_warned_about_once_naming_the_metric(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=2) as cap:
        for i in range(4):
            with ot.step(i):
                ot.record("reward", None)
                ot.record("reward", torch.ones(3))
                ot.record("reward", 1.0)
    assert cap.flushes[-1][1]["train/reward"] == 1.0
    warnings = [r.getMessage() for r in caplog.records]
    for text in ("a value of train.reward was not a number", "a tensor of train.reward had more than one"):
        assert sum(text in w for w in warnings) == 1, warnings


def test_a_tensor_recorded_again_after_in_place_changes_is_warned_about(caplog) -> None:
    """Values are read at the flush: an accumulator recorded every step reads its last value for
    every step. That cannot be undone without a copy on the hot path; it is said, once."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    total = torch.zeros(())
    with capture_metrics(log_interval=4) as cap:
        for i in range(4):
            with ot.step(i):
                total += 1
                ot.record("running_total", total)
                ot.record("copied_total", total.clone())
                ot.record("lr", 0.1)  # the same float object each step: not a tensor, not warned
    flushed = cap.flushes[-1][1]
    assert flushed["train/copied_total"] == 2.5  # what a copy keeps
    assert flushed["train/running_total"] == 4.0  # what the same object reads at the flush
    warnings = [r.getMessage() for r in caplog.records if "same tensor object" in r.getMessage()]
    assert len(warnings) == 1 and "train.running_total" in warnings[0], warnings


def test_mixed_dtypes_under_one_name_are_not_promoted_to_the_narrowest() -> None:
    """An int64 70000 beside an fp16 value: stacking them together would make fp16 (70000 -> inf,
    a false non-finite); each dtype is converted on its own."""
    with capture_metrics(log_interval=2) as cap:
        for i in range(2):
            with ot.step(i):
                ot.record("loss", torch.tensor(70000) if i == 0 else torch.tensor(1.5, dtype=torch.float16))
    flushed = cap.flushes[-1][1]
    assert flushed["train/loss_max"] == 70000.0 and flushed["train/loss_min"] == 1.5
    assert flushed.get("health/nonfinite_loss", 0) == 0


def test_counts_names_and_histograms_that_used_to_slip_through(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=3) as cap:
        with ot.step(0, tokens=100):
            ot.record("", 1.0)  # no name at all
            ot.record("train/accuracy", 0.5)  # train's own, not eval.accuracy
        with ot.step(1, tokens=-50):  # ignored: it would take 50 tokens away
            ot.log_histogram("h", 3.0)  # one number: a distribution of one
        with ot.step(2, tokens=50):
            pass
    flushed = cap.flushes[-1][1]
    assert flushed["throughput/tokens"] == 150
    assert flushed["train/accuracy"] == 0.5 and "eval/accuracy" not in flushed
    assert "train" not in flushed and "train_last" not in flushed
    assert flushed["otel_train/dropped/invalid_name"] == 1
    assert flushed["otel_train/dropped/invalid_value"] == 1
    assert not flushed.get("otel_train/dropped/flush_failed")
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("ot.step(tokens=-50): a count must be >= 0" in w for w in warnings) == 1, warnings


def test_hyperparameters_logged_twice_are_merged_and_non_finite_ones_stay_json(tmp_path) -> None:
    import json

    ot.init(output_dir=str(tmp_path), run_name="hp", prometheus_port=0, verbosity=0, hardware=False)
    ot.log_hyperparams({"model": "gpt", "dropout": float("nan")})
    ot.log_hyperparams({"lr": 0.1})
    ot.shutdown()
    text = (tmp_path / "hp" / "hparams.json").read_text()
    assert json.loads(text) == {"model": "gpt", "dropout": None, "lr": 0.1}, text  # strict JSON: no NaN


def test_numpy_arrays_are_read_as_tensors_are() -> None:
    """One element is the value (numpy 2 refuses float() on a 1-element array); more elements, a
    bool or complex array are dropped as a tensor's would be."""
    import numpy as np

    with capture_metrics(log_interval=1) as cap, ot.step(0):
        for value in (np.array([9.0]), np.array([[1.0]], dtype=np.float16), np.zeros(3), np.array([True])):
            ot.record("arr", value)
    flushed = cap.flushes[-1][1]
    assert flushed["train/arr"] == 5.0  # the interval's mean of 9 and 1
    assert flushed["otel_train/dropped/non_scalar_tensor"] == 1
    assert flushed["otel_train/dropped/invalid_type"] == 1


def test_odd_numeric_types_samples_and_prefixes(caplog) -> None:
    """numpy bools and complex numbers are dropped as Python's are (not read as 1.0 or as their
    real part); a str row of log_samples is not a (prompt, output) pair; prefix=None is no
    prefix; a recorded name that is another's statistic key keeps its value and is warned about."""
    import numpy as np

    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=1) as cap, ot.step(0):
        for value in (np.bool_(True), np.complex128(1 + 2j), torch.tensor(True), 2.0):
            ot.record("flag", value)
        ot.log_metrics({"acc": 0.5}, prefix=None)  # type: ignore[arg-type]
        ot.log_samples(["ab", ("prompt", "output")])
        ot.record("reward", 1.0)
        ot.record("reward_max", 99.0)
    flushed = cap.flushes[-1][1]
    assert flushed["train/flag"] == 2.0 and flushed["otel_train/dropped/invalid_type"] == 3
    assert flushed["train/acc"] == 0.5 and not any("none" in k for k in flushed)
    assert flushed["otel_train/dropped/invalid_sample"] == 1
    assert flushed["train/reward_max"] == 99.0
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("'train/reward_max'" in w and "rename one" in w for w in warnings) == 1, warnings


def test_a_message_step_that_is_no_int_is_counted_and_filed_under_the_current_step(caplog) -> None:
    """A logger step= is a framework's value: an integer of any kind (numpy, a 0-dim tensor) is a
    step; a float (also an integral one), a bool, a str or one beyond int64 is counted and filed
    under the current step, never raised."""
    import numpy as np

    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=1) as cap, ot.step(3):
        ot.log_text("note", "now")
        ot.log_text("note", "c", step=np.int64(4))
        ot.log_text("note", "d", step=torch.tensor(5))
        for bad in (2**70, -(2**70), 2.5, 4.0, True, torch.tensor(True), np.bool_(True), "6"):
            ot.log_text("note", "bad", step=bad)  # type: ignore[arg-type]
    assert cap.flushes[-1][1]["otel_train/dropped/invalid_step"] == 8
    warnings = [r.getMessage() for r in caplog.records if "is not a step number" in r.getMessage()]
    assert len(warnings) == 1, warnings
    now = cap.texts[0][2]
    assert [(text, step) for _, text, step in cap.texts[1:]] == [("c", 4), ("d", 5)] + [("bad", now)] * 8


def test_a_negative_count_beyond_the_step_event_cap_adds_nothing(caplog) -> None:
    """Past max_values_per_interval steps only the counts are kept (session._uncapped_step):
    a negative one must not take tokens away there either, and is counted and warned about."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=4, max_values_per_interval=2) as cap:
        for i, tokens in enumerate((10, 10, 10, -50)):
            with ot.step(i, tokens=tokens):
                pass
    assert cap.flushes[-1][1]["throughput/tokens"] == 30
    assert cap.flushes[-1][1]["otel_train/dropped/invalid_value"] == 1  # counted, as under the cap
    assert any("ot.step(tokens=-50)" in r.getMessage() for r in caplog.records)


def test_a_bool_or_a_count_beyond_int64_adds_no_tokens(caplog) -> None:
    """tokens=True is no count, and 2**70 tokens would wreck the throughput: both are dropped and
    counted (under the step-event cap, where the worker adds the plain ints up, and beyond it)."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    for cap_values in (1000, 2):
        with capture_metrics(log_interval=4, max_values_per_interval=cap_values) as cap:
            for i, tokens in enumerate((10, True, 2**70, 10)):
                with ot.step(i, tokens=tokens):
                    pass
        flushed = cap.flushes[-1][1]
        assert flushed["throughput/tokens"] == 20, cap_values
        assert flushed["otel_train/dropped/invalid_type"] == 1  # True
        assert flushed["otel_train/dropped/invalid_value"] == 1  # 2**70
    assert any("2**63" in r.getMessage() for r in caplog.records)


def test_a_second_name_dropped_for_the_same_reason_is_warned_about_too(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=2):
        for i in range(4):
            with ot.step(i):
                ot.record("acc", None if i == 0 else 0.5)  # not computed yet, once
                ot.record("lr", [3e-4])  # scheduler.get_last_lr(): a list, every step
    warnings = [r.getMessage() for r in caplog.records]
    for name in ("train.acc", "train.learning_rate"):
        assert sum(f"a value of {name} was not a number" in w for w in warnings) == 1, warnings


def test_warnings_per_name_stop_after_a_bound_with_one_line_for_the_rest(caplog) -> None:
    from otel_train.core.worker import MAX_NAMES_WARNED

    caplog.set_level(logging.WARNING, logger="otel_train")
    names = [f"metric{k}" for k in range(MAX_NAMES_WARNED + 5)]
    with capture_metrics(log_interval=1, max_metric_names=len(names)):
        for i in range(2):
            with ot.step(i):
                for name in names:
                    ot.record(name, None)
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("was not a number" in w for w in warnings) == MAX_NAMES_WARNED, warnings
    assert sum(f"more than {MAX_NAMES_WARNED} names" in w for w in warnings) == 1, warnings


def test_values_beyond_max_values_per_interval_are_warned_about_naming_the_metric(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=10, max_values_per_interval=20) as cap:
        for i in range(20):
            with ot.step(i):
                for _ in range(3):  # a loss per micro-batch: 30 values an interval
                    ot.record("loss", 1.0)
    assert cap.last("otel_train/dropped/too_many_values") == 10
    warnings = [r.getMessage() for r in caplog.records if "too_many_values" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "train.loss" in warnings[0] and "MAX_VALUES_PER_INTERVAL" in warnings[0]


def test_timer_span_and_event_names_made_per_step_stay_within_the_series_budget(caplog) -> None:
    """A timer, a span or an event named per step (f"step_{i}") must not grow the series, the
    rows and memory without bound: timer and span names get the record names' budget (the
    rest dropped and counted), event names count as "other" past theirs (each event is kept)."""
    from otel_train.health import MAX_EVENT_NAMES

    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=10, max_metric_names=8, verbosity=0) as cap:
        for i in range(200):
            with ot.step(i):
                with ot.timer("forward"):
                    pass
                with ot.timer(f"block_{i}"):
                    pass
                with ot.span(f"eval_{i}"):
                    pass
                ot.event(f"custom_{i}", "made per step")
        session = current_session()
        assert session is not None
        counted = session.events._counted
    keys = set().union(*(scalars for _, scalars in cap.flushes))
    timer_names = {k.split("/")[1] for k in keys if k.startswith("timers/")} - {"step"}  # step: the steps
    assert "forward" in timer_names and len(timer_names) <= 8, sorted(timer_names)
    dropped = sum(v for _, v in cap.series("otel_train/dropped/too_many_names"))
    assert dropped == 2 * 200 - (8 - 1), dropped  # every block_/eval_ value past the first 7 names
    warned = [r.getMessage() for r in caplog.records if "max_metric_names distinct timer" in r.getMessage()]
    assert 1 <= len(warned) <= 21, len(warned)  # a line per name for the first 20, then one for the rest
    assert len(counted) == MAX_EVENT_NAMES
