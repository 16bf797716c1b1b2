"""A run-dir JSONL file that ends in a torn line (a crash mid-write) is cut back to its last whole
line before anything is appended: a resumed run's rows never glue onto a fragment."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers.events import run_events

import otel_train as ot
from otel_train.run_directory import TAIL_CHUNK_BYTES, LineFile, append_line, dumps_line


@pytest.mark.parametrize("fragment", ['{"time": 1, "eve', "x" * (2 * TAIL_CHUNK_BYTES + 7)])
def test_a_torn_last_line_is_cut_off_once_before_appending(tmp_path, caplog, fragment) -> None:
    path = tmp_path / "events.rank0.jsonl"
    path.write_text('{"a": 1}\n{"b": 2}\n' + fragment)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        append_line(path, {"c": 3}, single_writer=True)
        append_line(path, {"d": 4}, single_writer=True)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"a": 1}, {"b": 2}, {"c": 3}, {"d": 4},
    ]  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if "torn line" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings


def test_a_file_of_one_torn_line_is_emptied_and_a_whole_one_is_kept(tmp_path, caplog) -> None:
    torn, whole = tmp_path / "torn.jsonl", tmp_path / "whole.jsonl"
    torn.write_bytes(b'{"step": 3, "lo')
    whole.write_bytes(b'{"step": 3}\n')
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        for path in (torn, whole):
            line = LineFile(path, single_writer=True)
            line.write_line(dumps_line({"step": 4}))
            line.close()
    assert torn.read_text() == '{"step": 4}\n'
    assert whole.read_text() == '{"step": 3}\n{"step": 4}\n'
    assert next(r for r in caplog.records if "torn line" in r.getMessage()).args[0] == torn


def test_a_resumed_run_appends_whole_lines_after_a_crash_mid_write(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_RUN_ID", "torn-resume")
    settings = dict(output_dir=str(tmp_path), run_name="r", prometheus_port=0, log_interval=2, verbosity=0)
    for first in (0, 4):
        run = ot.init(**settings)
        for step in range(first, first + 4):
            with ot.step(step):
                ot.record("loss", 1.0)
        run_dir = Path(run.run_dir)
        ot.shutdown()
        if first == 0:  # the first process dies mid-write
            for name in ("events.rank0.jsonl", "metrics.rank0.jsonl"):
                with open(run_dir / name, "a") as f:
                    f.write('{"time": 1, "eve')
    events = [json.loads(line) for line in (run_dir / "events.rank0.jsonl").read_text().splitlines()]
    assert "restart" in [e["event"] for e in events]
    metrics = [json.loads(line) for line in (run_dir / "metrics.rank0.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 7


def test_a_file_several_ranks_append_to_is_never_cut(tmp_path) -> None:
    """A per-run file (text, samples) may show another rank's line half-written on a shared file
    system: it is appended to as it is."""
    path = tmp_path / "text.jsonl"
    path.write_text('{"a": 1}\n{"b"')
    append_line(path, {"c": 3})
    assert path.read_text() == '{"a": 1}\n{"b"{"c": 3}\n'


def test_a_reader_during_a_write_sees_whole_lines_only(tmp_path) -> None:
    """The tests' reader of a live run (a reader can see part of one os.write): a line counts once
    its newline is there."""
    path = tmp_path / "events.rank0.jsonl"
    assert run_events(tmp_path) == []
    whole = dumps_line({"event": "stall", "message": "rank 1"})
    path.write_bytes(whole + whole[:20])
    assert run_events(tmp_path) == [{"event": "stall", "message": "rank 1"}]
    path.write_bytes(whole * 2)
    assert run_events(tmp_path, event="stall") == [{"event": "stall", "message": "rank 1"}] * 2
