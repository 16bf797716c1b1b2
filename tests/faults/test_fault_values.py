"""Hostile values, step numbers and names through the public API: nothing raises, nothing voids a
flush, every drop is counted, the run dir always serialises and /metrics stays valid."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import time
import urllib.request
from collections import Counter
from decimal import Decimal

import numpy as np
import pytest
import torch

import otel_train as ot
from otel_train.testing import capture_metrics, current_session


class _Explodes:
    def __float__(self) -> float:
        raise RuntimeError("boom")


class _Weird(float):
    def __float__(self) -> float:
        raise KeyError("weird")


def test_one_bad_value_never_voids_a_flush() -> None:
    with capture_metrics(log_interval=100) as cap:
        for i in range(3):
            with ot.step(i, tokens=10):
                ot.record("loss", 0.5)
                ot.record("big", 10**400)  # OverflowError in float()
                ot.record("explodes", _Explodes())  # RuntimeError in __float__
                ot.record("decimal", Decimal("1e999999"))  # float() gives inf
                ot.record("ok", np.float32(2.0))
    flushed = cap.flushes[-1][1]
    assert flushed["train/loss"] == 0.5
    assert flushed["train/steps"] == 3
    assert flushed["throughput/tokens"] == 30
    assert flushed["train/ok"] == 2.0
    assert flushed["otel_train/dropped/overflow"] == 3
    assert flushed["otel_train/dropped/invalid_type"] == 3
    assert flushed["otel_train/dropped/nonfinite"] == 3
    assert "train/big" not in flushed and "train/explodes" not in flushed


# Each hostile value with the reason it is dropped under (None: a number, recorded).
_FUZZ_POOL: list[tuple[object, str | None]] = [
    (0, None), (-1, None), (2**64, None), (np.int64(3), None), (np.float16(1.5), None),
    (np.array(4.0), None), (torch.tensor(5.0), None), (torch.tensor(7, dtype=torch.int64), None),
    (10**400, "overflow"), (-(10**400), "overflow"),
    (1e308 * 10, "nonfinite"), (float("nan"), "nonfinite"), (Decimal("NaN"), "nonfinite"),
    (True, "invalid_type"), (None, "invalid_type"), ("x", "invalid_type"), (b"y", "invalid_type"),
    ([1.0], "invalid_type"), ((2,), "invalid_type"), ({"a": 1}, "invalid_type"), (object(), "invalid_type"),
    (_Explodes(), "invalid_type"), (_Weird(1.0), "invalid_type"), (np.array([1.0, 2.0]), "non_scalar_tensor"),
    (torch.tensor(1 + 1j), "invalid_type"), (complex(1, 2), "invalid_type"),
    (torch.ones(2), "non_scalar_tensor"),
]  # fmt: skip


def test_value_fuzz_never_raises_and_counts_every_drop_under_its_reason(tmp_path) -> None:
    """Random hostile values through `ot.record` and `ot.log_metrics`: every flush lands, and the
    run's `otel_train/dropped/<reason>` counts are exactly the bad values fed, per reason (a value
    under a name that is not a str is dropped for its name alone)."""
    rng = random.Random(7)
    expected: Counter[str] = Counter()
    ot.init(output_dir=str(tmp_path), run_name="fuzz", prometheus_port=0, verbosity=0, log_interval=5)
    session = current_session()
    for step in range(50):
        with ot.step(step):
            for _ in range(5):
                value, reason = rng.choice(_FUZZ_POOL)
                ot.record(rng.choice(["loss", "a", "b/c", "d.e"]), value)
                expected[reason] += 1
            (value, reason), key, (other, other_reason) = (
                rng.choice(_FUZZ_POOL),
                rng.choice(["x", 3, None]),
                rng.choice(_FUZZ_POOL),
            )
            ot.log_metrics({"m": value, key: other})
            expected[reason] += 1
            expected[other_reason if isinstance(key, str) else "invalid_name"] += 1
    ot.shutdown()
    rows = [json.loads(line) for line in (session.run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(r.get("train/steps", 0) for r in rows) == 50
    prefix = "otel_train/dropped/"
    dropped: Counter[str] = Counter()
    for row in rows:
        for key, count in row.items():
            if key.startswith(prefix) and not key.endswith("_per_s"):
                dropped[key[len(prefix) :]] += count
    del expected[None]
    assert all(
        expected[reason] > 0 for reason in ("overflow", "nonfinite", "invalid_type", "non_scalar_tensor")
    )
    assert dropped == expected


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(lambda n: np.arange(n), id="numpy-int64"),
        pytest.param(lambda n: [torch.tensor(i) for i in range(n)], id="0-dim-tensor"),
        pytest.param(lambda n: [2**62 + i for i in range(n)], id="huge"),
        pytest.param(lambda n: [np.uint64(2**64 - 1)] * n, id="beyond-int64"),
    ],
)
def test_step_numbers_of_any_type_serialise(tmp_path, steps) -> None:
    ot.init(output_dir=str(tmp_path), run_name="s", prometheus_port=0, verbosity=0, log_interval=2,
                      total_steps=10)  # fmt: skip
    session = current_session()
    for step in steps(6):
        with ot.step(step, tokens=np.int64(4), samples=torch.tensor(2)):
            ot.record("loss", np.float64(1.0))
    ot.log_text("note", "hello", step=np.int64(3))
    ot.shutdown()
    run_dir = session.run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert sum(r.get("train/steps", 0) for r in rows) == 6
    assert sum(r.get("throughput/tokens", 0) for r in rows) == 24
    assert all(type(r["step"]) is int for r in rows)
    progress = [line for line in (run_dir / "progress.txt").read_text().splitlines() if " | step " in line]
    assert len(progress) == len(rows) >= 3
    assert json.loads((run_dir / "text.jsonl").read_text())["step"] == 3


@pytest.mark.parametrize("bad", [3.0, float("nan"), "3", True, torch.tensor(3.0)], ids=repr)
def test_a_step_number_of_another_type_raises_naming_the_fix(bad) -> None:
    """A float, str or bool step number is the caller's bug (an integral float is no exception):
    TypeError at `ot.step`, before the step begins; the session goes on with the next good step."""
    with capture_metrics(log_interval=1) as cap:
        with (
            pytest.raises(TypeError, match=r"ot.step\(index\) needs an int.*pass int\(\.\.\.\)"),
            ot.step(bad),
        ):
            pass
        with ot.step(0, tokens=1.5):  # a count is a value: ignored and counted, never raised
            pass
        with ot.step(1, tokens=np.int64(4)):
            pass
    assert sum(v for _, v in cap.series("train/steps")) == 2
    assert sum(v for _, v in cap.series("throughput/tokens")) == 4
    assert cap.last("otel_train/dropped/invalid_type") == 1


DERIVED = {
    "throughput/tokens_per_s": "throughput/tokens_per_s",
    "timers/step/mean": "timers/step/mean",
    "train/steps_per_s": "train/steps_per_s",
    "tokens_total": None,
    "train/steps": "train/steps",
    "otel_train/dropped/x": None,
}


def test_user_names_never_overwrite_derived_values(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    with capture_metrics(log_interval=4) as cap:
        for i in range(8):
            with ot.step(i, tokens=100), ot.timer("forward"):
                for name in DERIVED:
                    ot.record(name, 7e9)
                ot.record("custom/throughput", 7.0)  # a name of one's own is fine
    full = [flushed for _, flushed in cap.flushes if flushed.get("train/steps")]
    assert len(full) == 2
    for flushed in full:
        for key in filter(None, DERIVED.values()):
            assert flushed[key] != 7e9, key
        assert flushed["train/steps"] == 4
        assert flushed["custom/throughput"] == 7.0
    for _, flushed in cap.flushes:
        assert not any(k.startswith("train/tokens_total") for k in flushed)
    dropped = sum(v for _, v in cap.series("otel_train/dropped/reserved_name"))
    collided = sum(v for _, v in cap.series("otel_train/dropped/invalid_name"))
    assert dropped + collided == 8 * len(DERIVED)
    assert dropped >= 8 * 5
    warnings = [r.getMessage() for r in caplog.records]
    for name in DERIVED:
        assert sum(repr(name) in w for w in warnings) == 1, name


def test_name_fuzz_keeps_metrics_endpoint_valid(tmp_path) -> None:
    from helpers.pinned import require_binary
    from helpers.ports import free_port

    promtool = require_binary("promtool")
    rng = random.Random(3)
    alphabet = 'abcXYZ019_./- :{}"\\é'
    names = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    names += ["tokens_total", "steps_total", "train.tokens_created", "a.b", "a_b", "a__b", "a/b", "A-B",
              "train_step_duration_seconds_bucket", "target_info", "otel_train_dropped_total", "loss",
              "throughput.tokens_per_s", "phase_duration_seconds", "train.phase.duration_count"]  # fmt: skip
    ot.init(prometheus_port=free_port(), verbosity=0, log_interval=1, output_dir=str(tmp_path),
                      max_metric_names=400)  # fmt: skip
    session = current_session()
    for step in range(3):
        with ot.step(step, tokens=5), ot.timer("forward"):
            for name in names:
                ot.record(name, 1.0)
    assert session.prometheus_url is not None
    text = b""
    for _ in range(200):  # until the worker has fed the last flush (no wall-clock assertion)
        text = urllib.request.urlopen(session.prometheus_url, timeout=5).read()
        if any(
            line.startswith(b"train_steps_total{") and line.endswith(b" 3.0") for line in text.splitlines()
        ):
            break
        time.sleep(0.05)
    ot.shutdown()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    problems = (check.stdout + check.stderr).decode()
    # Exit 3 is lint hints only (fuzzed names such as "a_b" read as abbreviated units); a parse
    # error (a second HELP/TYPE line, a duplicate family) is exit 1 and says "error".
    assert check.returncode in (0, 3), problems
    assert "error" not in problems.lower(), problems


def test_logger_api_misuse_raises_at_the_call_and_bad_rows_are_counted(caplog) -> None:
    """A wrong argument type is the caller's bug: TypeError at the call, naming the fix, and
    nothing recorded; a bad row among good ones is a bad value: dropped and counted."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    misuse = [
        (lambda: ot.log_hyperparams(None), r"log_hyperparams\(\) needs a mapping"),  # type: ignore[arg-type]
        (lambda: ot.log_hyperparams([1, 2]), r"log_hyperparams\(\) needs a mapping"),  # type: ignore[arg-type]
        (lambda: ot.log_metrics(None), r"log_metrics\(\) needs a mapping"),  # type: ignore[arg-type]
        (lambda: ot.event("e", "m", ["k"]), r"event\(\) needs a mapping"),  # type: ignore[arg-type]
        (lambda: ot.on_event("not callable"), r"on_event\(\) needs a function"),  # type: ignore[arg-type]
        (lambda: ot.log_samples(None), r"log_samples\(\) needs a list"),  # type: ignore[arg-type]
        (lambda: ot.log_samples("prompt"), r"log_samples\(\) needs a list"),
        (lambda: ot.timer("a", level="1"), r"level must be an int"),  # type: ignore[arg-type]
        (lambda: ot.timer("c", level=None), r"level must be an int"),  # type: ignore[arg-type]
    ]
    with capture_metrics(log_interval=1) as cap, ot.step(0):
        for call, fix in misuse:
            with pytest.raises(TypeError, match=fix):
                call()
        ot.log_samples([("p", "o"), ("only one",), 5, None, ("a", "b", "c")])  # type: ignore[list-item]
    assert sum(v for _, v in cap.series("otel_train/dropped/invalid_sample")) == 3  # samples_to_show=4 read
    assert not any(k.startswith("otel_train/dropped/invalid_type") for _, f in cap.flushes for k in f)
    assert [(key, rows) for key, rows, _ in cap.samples] == [("samples", [("p", "o")])]
    assert cap.texts == [] and not any(
        k.startswith(("timers/a/", "timers/c/")) for _, f in cap.flushes for k in f
    )
