"""CUDA memory on the way to an OOM: the allocator's summary and snapshot, written to the run dir
on an OOM that leaves `ot.step` or on the `memory_pressure` event.
Design: docs/design/diagnostics.md#memory-dump.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_train.health import EventChannel
from otel_train.run_directory import RunFiles

log = logging.getLogger("otel_train")

MAX_DUMPS = 3


def loaded_torch_cuda() -> Any | None:
    """`torch.cuda` when torch is loaded and CUDA initialised in this process, else None."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return cuda if cuda is not None and cuda.is_initialized() else None


def is_cuda_oom(exc_type: type[BaseException] | None) -> bool:
    """torch.cuda.OutOfMemoryError (also torch.OutOfMemoryError, its base, raised by the allocator)."""
    return exc_type is not None and exc_type.__name__ == "OutOfMemoryError"


def has_history(snapshot: Any) -> bool:
    """Whether a `_snapshot()` holds recorded history (`_record_memory_history()` was on): trace
    entries, or blocks with the frames that allocated them."""
    if not isinstance(snapshot, dict):
        return False
    if any(snapshot.get("device_traces") or ()):
        return True
    return any(b.get("frames") for seg in snapshot.get("segments") or () for b in seg.get("blocks") or ())


class MemoryDumps:
    """Writes the dumps and emits the events; `torch_cuda`: the loaded, initialised `torch.cuda` or None."""

    def __init__(
        self,
        run_dir: Path | None,
        rank: int,
        events: EventChannel,
        torch_cuda: Callable[[], Any | None] = loaded_torch_cuda,
        role: str = "",
    ) -> None:
        self.files = RunFiles(run_dir, rank, role) if run_dir is not None else None
        self.events = events
        self.torch_cuda = torch_cuda
        self.dumps = 0
        self._lock = threading.Lock()  # the training thread (OOM) and the worker (pressure)

    def on_step_error(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        """StepScope.__exit__ with an exception: dump on a CUDA OOM (never raises)."""
        if is_cuda_oom(exc_type):
            first_line = str(exc).splitlines()[0] if exc is not None and str(exc) else "CUDA out of memory"
            self.dump("oom", f"CUDA out of memory inside a step: {first_line}")

    def on_pressure(self, message: str) -> None:
        """The memory_pressure event fired (worker thread)."""
        self.dump("memory_snapshot", f"{message}; allocator state written before an OOM")

    def dump(self, event: str, message: str) -> None:
        try:
            with self._lock:
                attributes = self._write()
            if attributes is None:
                return
            if "snapshot" not in attributes:
                message += (
                    " (no snapshot: call torch.cuda.memory._record_memory_history() at start-up to get "
                    "one with the stack of every allocation)"
                )
            where = ", ".join(f"{k}={v}" for k, v in attributes.items())
            self.events.emit(event, f"{message}; memory dump: {where}", attributes)
        except Exception as exc:  # torch's allocator snapshot and the disk: never hide the OOM
            log.warning("otel_train: memory dump failed: %r", exc)

    def _write(self) -> dict[str, str] | None:
        cuda = self.torch_cuda()
        if cuda is None or self.files is None or self.dumps >= MAX_DUMPS:
            return None
        n = self.dumps
        self.dumps += 1
        attributes: dict[str, str] = {}
        summary = self.files.memory_summary(n)
        summary.write_text(cuda.memory_summary(), encoding="utf-8")
        attributes["summary"] = str(summary)
        snapshot = cuda.memory._snapshot()
        if has_history(snapshot):
            path = self.files.memory_snapshot(n)
            with open(path, "wb") as f:
                pickle.dump(snapshot, f)
            attributes["snapshot"] = str(path)
        return attributes
