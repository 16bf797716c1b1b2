"""The run directory's line files: a close never leaves a line in flight on another thread with a
descriptor number a file opened next may take (the shutdown closes the sinks while a worker it gave
up on may still be writing)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from otel_train import run_directory
from otel_train.run_directory import LineFile


def _line_in_flight(
    metrics: LineFile, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Thread, threading.Event]:
    """A "worker" thread writing one line, held inside os.write with the descriptor number in hand
    until the returned event is set."""
    writing, release = threading.Event(), threading.Event()
    real_write = os.write

    def held_write(fd: int, data: bytes) -> int:
        if threading.current_thread().name == "worker":
            writing.set()
            release.wait(10)
        return real_write(fd, data)

    monkeypatch.setattr(run_directory.os, "write", held_write)
    worker = threading.Thread(target=metrics.write_line, args=(b'{"step": 7}\n',), name="worker")
    worker.start()
    assert writing.wait(10)
    return worker, release


def _open_next_and_release(tmp_path: Path, worker: threading.Thread, release: threading.Event) -> bytes:
    """What the program opens next (it may take a closed descriptor's number) while the line is
    still in flight; its content once the line went."""
    user_file = tmp_path / "checkpoint.bin"
    fd = os.open(user_file, os.O_WRONLY | os.O_CREAT, 0o644)
    release.set()
    worker.join(10)
    os.close(fd)
    return user_file.read_bytes()


def test_a_close_waits_for_the_line_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = LineFile(tmp_path / "metrics.rank0.jsonl")
    worker, release = _line_in_flight(metrics, monkeypatch)
    threading.Timer(0.3, release.set).start()
    metrics.close()  # the shutdown's: the worker's line is still in flight
    assert _open_next_and_release(tmp_path, worker, release) == b""
    assert (tmp_path / "metrics.rank0.jsonl").read_bytes() == b'{"step": 7}\n'


def test_a_write_stuck_past_the_wait_keeps_its_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung file system: the close gives up waiting, and the stuck line's descriptor stays open,
    so a file opened next gets another number and the line, when it goes, goes to its own file."""
    metrics = LineFile(tmp_path / "metrics.rank0.jsonl")
    monkeypatch.setattr(run_directory, "CLOSE_WAIT_S", 0.1)
    worker, release = _line_in_flight(metrics, monkeypatch)
    metrics.close()  # returns while the line is still stuck
    assert _open_next_and_release(tmp_path, worker, release) == b""
    assert (tmp_path / "metrics.rank0.jsonl").read_bytes() == b'{"step": 7}\n'
    with pytest.raises(OSError, match=r"metrics\.rank0\.jsonl"):
        metrics.write_line(b"{}\n")


def test_a_line_after_the_close_is_an_error_naming_the_file(tmp_path: Path) -> None:
    metrics = LineFile(tmp_path / "metrics.rank0.jsonl")
    metrics.close()
    with pytest.raises(OSError, match=r"metrics\.rank0\.jsonl"):
        metrics.write_line(b"{}\n")


def test_writers_of_one_json_file_never_trip_over_each_other(tmp_path: Path) -> None:
    """Every rank writes the run's hparams.json (each logs the hyperparameters): concurrent writers
    each rename a whole file of their own, and none fails."""
    path = tmp_path / "hparams.json"
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        for i in range(200):
            try:
                run_directory.write_json(path, {"writer": n, "i": i, "pad": "x" * (n * 1000)})
            except OSError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    final = json.loads(path.read_text())
    assert final["pad"] == "x" * (final["writer"] * 1000)  # one writer's whole file
    assert [p.name for p in tmp_path.iterdir()] == ["hparams.json"]  # no temporary file left


def test_progress_elapsed_is_monotonic_through_a_wall_clock_step(tmp_path: Path) -> None:
    """A wall clock stepped an hour ahead (NTP, a resumed VM) made a 3 s run's progress line read
    `elapsed 01:00:01`; one stepped back read 00:00:00 while steps remained."""
    from otel_train import semconv
    from otel_train.bridges.rundir import RunDirSink

    sink = RunDirSink(tmp_path, 0)
    for shift in (3600.0, -3600.0):
        sink.write_scalars(5, time.time() + shift, {semconv.STEPS.key: 1.0})  # the flush's wall stamp
    sink.close({}, False)
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [line.split("elapsed ")[1].split(" ")[0] for line in lines if "elapsed" in line] == [
        "00:00:00"
    ] * 2
