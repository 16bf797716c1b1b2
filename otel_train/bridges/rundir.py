"""The run directory: the local copy that loses nothing on a clean exit.

`metrics.rank<k>.jsonl` (one line per flush: step, time, every flattened value, line-buffered and
flushed each time so a SIGKILL loses at most the interval in flight), `progress.txt` (Megatron-style
one-liners), `config.json` and `env.json` (written once at init, secrets redacted), and
`samples.jsonl` / `text.jsonl` for text and samples.

Every line is written whole or not at all: a full disk (ENOSPC, a quota, RLIMIT_FSIZE) truncates
the file back to its last complete line, and the error names the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train.bridges.base import Sink


def _clean(value: float) -> float | None:
    return value if math.isfinite(value) else None


def json_default(value: Any) -> Any:
    """`default=` for json.dumps: numpy scalars and 0-dim tensors as numbers, anything else as
    text, so one odd value never empties a file."""
    try:
        if hasattr(value, "__index__"):
            return operator.index(value)  # numpy integers, integer 0-dim tensors
    except Exception:
        pass
    try:
        number = float(value)
        return number if math.isfinite(number) else None
    except Exception:
        pass
    try:
        return str(value)
    except Exception:
        return f"<{type(value).__name__}>"


def dumps_line(row: Mapping[str, Any]) -> bytes:
    return (json.dumps(row, default=json_default) + "\n").encode("utf-8")


class LineFile:
    """An append-only file written a whole line at a time (unbuffered, one os.write per line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def write_line(self, data: bytes) -> None:
        """Append `data` (one line); on any error the file is cut back to its previous end and an
        OSError naming the file is raised."""
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)  # no torn last line
            raise OSError(exc.errno, f"{exc.strerror or exc}; line not written", str(self.path)) from None
        self._size += len(data)

    def close(self, fsync: bool = True) -> None:
        if self._fd < 0:
            return
        if fsync:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1


def append_line(path: Path, row: Mapping[str, Any]) -> None:
    """Open, append one whole JSON line, close (for the rarely written files)."""
    line = LineFile(path)
    try:
        line.write_line(dumps_line(row))
    finally:
        line.close(fsync=False)


class RunDirSink(Sink):
    name = "rundir"

    def __init__(self, run_dir: Path, rank: int, total_steps: int | None, progress: bool = True) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / f"metrics.rank{rank}.jsonl"
        self._metrics = LineFile(self.metrics_path)
        # progress.txt is one file per run: only the reporting rank appends to it.
        self._progress: LineFile | None = LineFile(run_dir / "progress.txt") if progress else None
        self._total_steps = total_steps
        self._started = time.time()
        self._tokens = 0.0

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        row = {
            "step": step,
            "time": round(wall_time, 3),
            **{k: _clean(v) for k, v in sorted(scalars.items())},
        }
        self._metrics.write_line(dumps_line(row))
        self._tokens += scalars.get("throughput/tokens", 0.0)
        if self._progress is None:
            return
        elapsed = wall_time - self._started
        steps = f"{step + 1}/{self._total_steps}" if self._total_steps else f"{step + 1}"
        parts = [
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_time)),
            f"step {steps}",
            f"tokens {int(self._tokens)}",
            f"throughput {scalars.get('throughput/tokens_per_s', 0.0):.1f} tokens/s",
            f"elapsed {_hms(elapsed)}",
        ]
        if "progress/eta_s" in scalars:
            parts.append(f"eta {_hms(scalars['progress/eta_s'])}")
        if "train/goodput" in scalars:
            parts.append(f"goodput {100 * scalars['train/goodput']:.1f}%")
        self._progress.write_line((" | ".join(parts) + "\n").encode("utf-8"))

    def write_text(self, key: str, text: str, step: int) -> None:
        self._append("text.jsonl", {"step": step, "key": key, "text": text})

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        for prompt, output in rows:
            self._append("samples.jsonl", {"step": step, "key": key, "prompt": prompt, "output": output})

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        finite = [v for v in values if math.isfinite(v)]
        summary = {"count": len(finite), "min": min(finite, default=None), "max": max(finite, default=None)}
        self._append("histograms.jsonl", {"step": step, "key": key, **summary})

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        write_json(self.run_dir / "hparams.json", dict(params))

    def close(self, final_scalars: Mapping[str, float]) -> None:
        from otel_train.goodput import summary

        line = summary(final_scalars)
        if self._progress is not None and line:
            with contextlib.suppress(OSError):  # a full disk: the summary line is the one thing lost
                self._progress.write_line(
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')} | end of process | {line}\n".encode()
                )
        for fh in (self._metrics, self._progress):
            if fh is not None:
                fh.close()

    def _append(self, name: str, row: Mapping[str, Any]) -> None:
        append_line(self.run_dir / name, row)


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def write_json(path: Path, data: Any) -> None:
    """Write via a temporary file and rename: the old file stays whole if the disk is full."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(data, indent=2, sort_keys=True, default=json_default) + "\n"
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
