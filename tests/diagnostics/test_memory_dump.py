"""CUDA memory dumps on the way to an OOM (memory_dump.py): the allocator summary and, with recorded
history, the pickled snapshot, written to the run dir and named in an `oom` event.

The decision and the writing run here against a fake `torch.cuda` (only `memory_summary()` and
`memory._snapshot()`, the two calls the module makes; there is no CUDA on this machine), through a
real `ot.step` raising torch's real `torch.cuda.OutOfMemoryError`. The `gpu` test at the end does
the same with a real OOM on a real device."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.events import Events

import otel_train as ot
from otel_train.diagnostics.memory_dump import MAX_DUMPS, MemoryDumps, has_history
from otel_train.run_directory import RunFiles
from otel_train.testing import current_session

HISTORY = {"segments": [{"blocks": [{"size": 512, "frames": [{"filename": "train.py", "line": 3}]}]}],
           "device_traces": [[{"action": "alloc", "size": 512}]]}  # fmt: skip
NO_HISTORY = {"segments": [{"blocks": [{"size": 512}]}], "device_traces": [[]]}


class _FakeMemory:
    def __init__(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot

    def _snapshot(self) -> dict[str, Any]:
        return self.snapshot


class FakeCuda:
    """The part of torch.cuda that memory_dump calls."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        self.memory = _FakeMemory(snapshot)

    def memory_summary(self) -> str:
        return "|  PyTorch CUDA memory summary, device ID 0  |"


def test_history_is_told_from_the_snapshot() -> None:
    assert has_history(HISTORY) and not has_history(NO_HISTORY) and not has_history(None)


def test_an_oom_writes_summary_and_snapshot_and_names_them(tmp_path: Path) -> None:
    events = Events()
    dumps = MemoryDumps(tmp_path, 2, events, lambda: FakeCuda(HISTORY))
    dumps.on_step_error(RuntimeError, RuntimeError("not an OOM"))
    assert events.items == [] and list(tmp_path.iterdir()) == []
    dumps.on_step_error(
        torch.cuda.OutOfMemoryError, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried 2 GiB")
    )
    [(name, message, attrs)] = events.items
    files = RunFiles(tmp_path, 2)
    assert name == "oom" and "Tried 2 GiB" in message
    assert attrs == {"summary": str(files.memory_summary(0)), "snapshot": str(files.memory_snapshot(0))}
    assert "memory summary" in files.memory_summary(0).read_text()
    assert pickle.loads(files.memory_snapshot(0).read_bytes()) == HISTORY


def test_without_history_only_the_summary_and_a_hint(tmp_path: Path) -> None:
    events = Events()
    dumps = MemoryDumps(tmp_path, 0, events, lambda: FakeCuda(NO_HISTORY))
    dumps.on_pressure("GPU memory pressure: CUDA allocator reserved memory is 96.0% of the device's memory")
    [(name, message, attrs)] = events.items
    assert name == "memory_snapshot" and set(attrs) == {"summary"} and "_record_memory_history" in message
    for _ in range(MAX_DUMPS + 2):
        dumps.on_pressure("again")
    assert dumps.dumps == MAX_DUMPS and len(list(tmp_path.glob("memory_summary.*"))) == MAX_DUMPS


def test_no_cuda_or_no_run_dir_writes_nothing(tmp_path: Path) -> None:
    events = Events()
    MemoryDumps(tmp_path, 0, events, lambda: None).on_step_error(torch.cuda.OutOfMemoryError, None)
    MemoryDumps(None, 0, events, lambda: FakeCuda(HISTORY)).on_step_error(torch.cuda.OutOfMemoryError, None)
    assert events.items == [] and list(tmp_path.iterdir()) == []


def test_an_oom_raised_inside_ot_step_is_dumped_and_still_raised(tmp_path: Path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="oom", prometheus_port=0, verbosity=0, hardware=False)
    session = current_session()
    try:
        assert session.memory_dumps is not None
        session.memory_dumps.torch_cuda = lambda: FakeCuda(HISTORY)
        with pytest.raises(torch.cuda.OutOfMemoryError), ot.step(0):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        with ot.step(1):  # an ordinary step: nothing more
            pass
    finally:
        ot.shutdown()
    run_dir = tmp_path / "oom"
    events = [json.loads(line) for line in (run_dir / "events.rank0.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e["event"] == "oom"]
    assert Path(event["summary"]).exists() and Path(event["snapshot"]).parent == run_dir


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_cuda_oom_writes_a_snapshot_with_history(tmp_path: Path) -> None:
    torch.cuda.memory._record_memory_history(max_entries=1000)
    keep = torch.empty(1024, 1024, device="cuda")  # a block with a recorded stack
    ot.init(output_dir=str(tmp_path), run_name="oom-gpu", prometheus_port=0, verbosity=0, hardware=False)
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        with pytest.raises(torch.cuda.OutOfMemoryError), ot.step(0):
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    finally:
        ot.shutdown()
        torch.cuda.memory._record_memory_history(enabled=None)
    run_dir = tmp_path / "oom-gpu"
    events = [json.loads(line) for line in (run_dir / "events.rank0.jsonl").read_text().splitlines()]
    [event] = [e for e in events if e["event"] == "oom"]
    assert "memory summary" in Path(event["summary"]).read_text()
    snapshot = pickle.loads(Path(event["snapshot"]).read_bytes())
    assert snapshot["segments"] and has_history(snapshot)
    del keep
