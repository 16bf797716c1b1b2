"""Frames the bridge process cannot take never end it: a frame over the pipe's limit is never sent
(counted, warned once), a frame it cannot read is skipped, a frame whose write its death cut is not
sent to its successor, and a histogram of a 7B model's weight reaches every backend as a bounded
sample. Read back from TensorBoard's event files, the MLflow store and the run directory."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import signal
import struct
import termios
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers.readback import read_mlflow, read_tensorboard

import otel_train as ot
from otel_train.bridges import framing
from otel_train.bridges.framing import BadFrame, encode, read_frame
from otel_train.bridges.mlflow import default_tracking_uri
from otel_train.bridges.process import BridgeProcess
from otel_train.core.resolve import MAX_HISTOGRAM_VALUES, histogram_values
from otel_train.testing import current_session


def _tensorboard_only(log_dir: Path) -> list[tuple[str, str, dict[str, str]]]:
    return [("otel_train.bridges.tensorboard", "TensorBoardSink", {"log_dir": str(log_dir)})]


def _until(condition: object, guard_s: float) -> None:
    """Poll `condition` (a callable) until true; the guard only ends a wait that never would."""
    deadline = time.monotonic() + guard_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)


def _in_pipe(fd: int) -> int:
    """Bytes waiting in the pipe `fd` is one end of."""
    waiting = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, waiting)
    return int.from_bytes(waiting, "little")


def test_a_frame_over_the_limit_is_never_sent_and_the_bridges_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # This process's limit only (the bridge process keeps 256 MiB): what it refuses never reaches
    # the pipe, the same path a 300 MB frame takes without allocating one.
    monkeypatch.setattr(framing, "MAX_FRAME", 1 << 20)
    drops: list[tuple[str, int]] = []
    bridges = BridgeProcess(_tensorboard_only(tmp_path / "tb"), 64, lambda r, n: drops.append((r, n)))
    big = [float(i) for i in range(200_000)]  # ~1.8 MB pickled
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        bridges.write_histogram("big", big, 1)
        bridges.write_histogram("big", big, 2)
    bridges.write_histogram("small", [1.0, 2.0], 3)
    bridges.write_scalars(3, 0.0, {"train/loss": 1.5})
    bridges.close({}, timeout=60)
    assert bridges.wait(30) and bridges.closed_cleanly and bridges.restarts == 0
    run = read_tensorboard(tmp_path / "tb")
    assert "big" not in run.histograms and [step for step, _ in run.histograms["small"]] == [3]
    assert run.scalars["train/loss"] == [(3, 1.5)]
    assert drops == [("bridge_frame_too_large", 1)] * 2 and bridges.dropped == 2
    warned = [r.getMessage() for r in caplog.records if "bridge_frame_too_large" in r.getMessage()]
    assert len(warned) == 1 and "write_histogram" in warned[0]


def test_a_frame_the_bridge_process_cannot_read_is_skipped_not_fatal(tmp_path: Path) -> None:
    drops: list[tuple[str, int]] = []
    bridges = BridgeProcess(_tensorboard_only(tmp_path / "tb"), 64, lambda r, n: drops.append((r, n)))
    bridges.write_scalars(0, 0.0, {"train/loss": 2.0})
    bridges._queue.put(struct.pack("<I", 12) + b"not a pickle")  # whole, but no message
    bridges.write_scalars(1, 0.0, {"train/loss": 1.0})
    bridges.close({}, timeout=60)
    assert bridges.wait(30) and bridges.closed_cleanly and bridges.restarts == 0
    assert read_tensorboard(tmp_path / "tb").scalars["train/loss"] == [(0, 2.0), (1, 1.0)]
    assert drops == [("bridge_bad_frame", 1)]


def test_a_frame_whose_write_the_childs_death_cut_is_not_sent_to_its_successor(tmp_path: Path) -> None:
    drops: list[tuple[str, int]] = []
    bridges = BridgeProcess(_tensorboard_only(tmp_path / "tb"), 64, lambda r, n: drops.append((r, n)))
    assert bridges.proc is not None and bridges.proc.stdin is not None
    first, pipe = bridges.proc.pid, bridges.proc.stdin.fileno()
    bridges.write_scalars(0, 0.0, {"train/loss": 2.0})
    _until(lambda: "train/loss" in read_tensorboard(tmp_path / "tb").scalars, 60)  # written: pipe empty
    os.kill(first, signal.SIGSTOP)  # it reads no more: the next frame stays half in the pipe
    _until(lambda: psutil.Process(first).status() == psutil.STATUS_STOPPED, 60)
    bridges.write_histogram("fatal", [float(i) for i in range(300_000)], 1)  # ~2.7 MB: over a pipe's
    _until(lambda: _in_pipe(pipe) > 0, 60)  # the frame's write has begun (the pipe was empty)
    os.kill(first, signal.SIGKILL)  # dies with the frame half read, as if of it
    _until(lambda: bridges.pid != first, 60)  # restarted (its successor is being set up)
    bridges.write_scalars(2, 0.0, {"train/loss": 1.0})
    bridges.close({}, timeout=60)
    assert bridges.wait(30) and bridges.closed_cleanly and bridges.restarts == 1
    run = read_tensorboard(tmp_path / "tb")
    assert "fatal" not in run.histograms
    assert sorted(run.scalars["train/loss"]) == [(0, 2.0), (2, 1.0)]
    assert sorted(drops) == [("bridge_cut_frame", 1), ("bridge_restart", 1)]


def test_a_frame_the_reader_cannot_read_is_consumed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(framing, "MAX_FRAME", 1000)
    oversized = pickle.dumps("x" * 100_000)
    frames = [
        struct.pack("<I", len(oversized)) + oversized,  # over the limit: skipped unread
        struct.pack("<I", 3) + b"\x80\x05X",  # a cut pickle: its EOFError is no end of the pipe
        encode(("call", "write_scalars", (1, 0.0, {"x": 1.0}))),
    ]
    read_end, write_end = os.pipe()

    def writer() -> None:
        with os.fdopen(write_end, "wb") as out:
            for frame in frames:
                out.write(frame)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with pytest.raises(BadFrame, match="over the limit"):
            read_frame(read_end, time.monotonic() + 60)
        with pytest.raises(BadFrame, match="unpickled"):
            read_frame(read_end, time.monotonic() + 60)
        assert read_frame(read_end, time.monotonic() + 60) == ("call", "write_scalars", (1, 0.0, {"x": 1.0}))
        with pytest.raises(EOFError):
            read_frame(read_end, time.monotonic() + 60)
    finally:
        os.close(read_end)  # a writer still blocked (a frame read wrong) ends with EPIPE
        thread.join()
    with pytest.raises(framing.FrameTooLarge):
        encode("x" * 100_000)


@pytest.mark.parametrize("kind", ["tensor", "array", "list"])
def test_a_large_histogram_is_a_bounded_sample_with_its_exact_range(kind: str) -> None:
    values = torch.randn(300_000, dtype=torch.float64)
    values[7], values[8], values[9] = float("nan"), 40.0, -41.0
    given = {"tensor": values, "array": values.numpy(), "list": values.tolist()}[kind]
    out = histogram_values(given)
    assert len(out) == MAX_HISTOGRAM_VALUES and all(np.isfinite(out))
    assert min(out) == -41.0 and max(out) == 40.0
    assert out == histogram_values(given)  # seeded: the same values give the same sample
    assert abs(np.mean(np.abs(out) < 1.0) - 0.6827) < 0.01  # uniform: N(0, 1)'s share within 1 sigma
    assert len(histogram_values(torch.randn(MAX_HISTOGRAM_VALUES))) == MAX_HISTOGRAM_VALUES  # as it was


def test_a_7b_models_weight_as_a_histogram_reaches_every_backend(tmp_path: Path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="big", tensorboard=True, mlflow=True, prometheus_port=0,
            verbosity=0, log_interval=1, hardware=False)  # fmt: skip
    session = current_session()
    assert session is not None and session.bridges is not None
    bridges, run_dir = session.bridges, session.run_dir
    weight = torch.randn(4096, 8192)  # one MLP weight of a 7B model: 33.5M values, ~300 MB as floats
    low, high = weight.aminmax()
    for step in range(3):
        with ot.step(step):
            ot.record("loss", float(step))
        if step == 1:
            ot.log_histogram("mlp/weight", weight, step=step)
    ot.shutdown()
    assert bridges.wait(60) and bridges.restarts == 0
    (line,) = [json.loads(x) for x in (run_dir / "histograms.jsonl").read_text().splitlines()]
    assert (line["count"], line["min"], line["max"]) == (MAX_HISTOGRAM_VALUES, float(low), float(high))
    tb = read_tensorboard(run_dir / "tensorboard")
    ((step, buckets),) = tb.histograms["mlp/weight"]
    assert step == 1 and sum(count for _, _, count in buckets) == MAX_HISTOGRAM_VALUES
    assert [s for s, _ in tb.scalars["train/loss"]] == [0, 1, 2]
    mlflow = read_mlflow(default_tracking_uri(run_dir), "otel-train")
    (doc,) = [json.loads(v) for k, v in mlflow.artifacts.items() if k.startswith("histograms/")]
    assert (doc["count"], doc["min"], doc["max"]) == (MAX_HISTOGRAM_VALUES, float(low), float(high))
    assert sum(doc["counts"]) == MAX_HISTOGRAM_VALUES and abs(doc["std"] - 1.0) < 0.01
