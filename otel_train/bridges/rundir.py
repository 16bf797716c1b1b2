"""The run directory: every file in it is named here, and this sink writes the per-flush ones.

`RunFiles` is the layout (one rank's view of one run directory). The files:

With a role (`Config.role`), `rank<k>` reads `<role>.rank<k>` and the per-run names carry the
role (`progress.<role>.txt`, `config.<role>.json`, `tensorboard/<role>/`); see `RunFiles`.

- `metrics.rank<k>.jsonl`: one line per flush (step, time, every flattened value), one `os.write`
  per line, so a SIGKILL loses at most the interval in flight. Written by `RunDirSink`.
- `progress.txt` (Megatron-style one-liners, the reporting rank), `text.jsonl`, `samples.jsonl`,
  `histograms.jsonl`, `hparams.json`: `RunDirSink`.
- `config.json`, `env.json`: written once at init, secrets redacted (`assemble`).
- `.owner.rank<k>.json`: which run id wrote this rank's files (`run_directory`).
- `events.rank<k>.jsonl`: health events (`health`); `goodput.rank<k>.json`: the goodput account
  across restarts (`goodput`); `control.json`: runtime control (`control`).
- `stacks.rank<k>.<n>.txt`, `faulthandler.rank<k>.txt` (raw, from C),
  `flight_recorder.rank<k>.<n>`: hang diagnosis (`hang`); `collectives.rank<k>.json`: where the
  rank's collectives stood at its last stall (`hang_attribution`); `profiles/rank<k>/`: profiler
  traces (`profiling`).
- `tensorboard/`, `wandb/`, `wandb_run.json`, `mlflow/`: the TensorBoard, W&B and MLflow bridges'
  local output.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_train import semconv as sc
from otel_train.bridges.base import Sink


@dataclass(frozen=True)
class RunFiles:
    """Where each file goes in `run_dir`, as rank `rank` of role `role` sees it (see the module doc;
    the files that are one per run do not depend on the rank). With a role, every name carries it
    (`metrics.<role>.rank<k>.jsonl`, `progress.<role>.txt`): two roles of one run (a controller and
    its policy workers, each with its own rank 0) never share a file. Without one, the names are
    those of a job without roles."""

    run_dir: Path
    rank: int = 0
    role: str = ""

    @property
    def _who(self) -> str:
        return f"{self.role}.rank{self.rank}" if self.role else f"rank{self.rank}"

    def _per_run(self, stem: str, suffix: str) -> Path:
        return self.run_dir / (f"{stem}.{self.role}{suffix}" if self.role else f"{stem}{suffix}")

    @property
    def metrics(self) -> Path:
        return self.run_dir / f"metrics.{self._who}.jsonl"

    @property
    def owner(self) -> Path:
        return self.run_dir / f".owner.{self._who}.json"

    @property
    def events(self) -> Path:
        return self.run_dir / f"events.{self._who}.jsonl"

    @property
    def goodput(self) -> Path:
        return self.run_dir / f"goodput.{self._who}.json"

    def stacks(self, dump: int) -> Path:
        return self.run_dir / f"stacks.{self._who}.{dump}.txt"

    @property
    def raw_stacks(self) -> Path:
        return self.run_dir / f"faulthandler.{self._who}.txt"

    def flight_recorder(self, dump: int) -> Path:
        return self.run_dir / f"flight_recorder.{self._who}.{dump}"

    def memory_summary(self, dump: int) -> Path:
        return self.run_dir / f"memory_summary.{self._who}.{dump}.txt"

    def memory_snapshot(self, dump: int) -> Path:
        """torch.cuda.memory._snapshot(), pickled: open it at https://pytorch.org/memory_viz."""
        return self.run_dir / f"memory_snapshot.{self._who}.{dump}.pickle"

    @property
    def collectives(self) -> Path:
        """Where this rank's collectives stood at its last stall (hang attribution reads them all)."""
        return self.run_dir / f"collectives.{self._who}.json"

    @property
    def collectives_glob(self) -> str:
        """Every rank's `collectives` file of this role."""
        return f"collectives.{self.role}.rank*.json" if self.role else "collectives.rank*.json"

    @property
    def profiles(self) -> Path:
        return self.run_dir / "profiles" / self._who

    # One per run (whichever rank writes them), or per role.

    @property
    def progress(self) -> Path:
        return self._per_run("progress", ".txt")

    @property
    def text(self) -> Path:
        return self._per_run("text", ".jsonl")

    @property
    def samples(self) -> Path:
        return self._per_run("samples", ".jsonl")

    @property
    def histograms(self) -> Path:
        return self._per_run("histograms", ".jsonl")

    @property
    def hparams(self) -> Path:
        return self._per_run("hparams", ".json")

    @property
    def config(self) -> Path:
        return self._per_run("config", ".json")

    @property
    def env(self) -> Path:
        return self._per_run("env", ".json")

    @property
    def control(self) -> Path:
        return self._per_run("control", ".json")

    @property
    def tensorboard(self) -> Path:
        return self.run_dir / "tensorboard" / self.role if self.role else self.run_dir / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.run_dir / "wandb"

    @property
    def wandb_run_info(self) -> Path:
        return self._per_run("wandb_run", ".json")

    @property
    def mlflow(self) -> Path:
        return self.run_dir / "mlflow"


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

    def __init__(
        self, run_dir: Path, rank: int, total_steps: int | None, progress: bool = True, role: str = ""
    ) -> None:
        self.files = RunFiles(run_dir, rank, role)
        self.metrics_path = self.files.metrics
        self._metrics = LineFile(self.metrics_path)
        # progress.txt is one file per run: only the reporting rank appends to it.
        self._progress: LineFile | None = LineFile(self.files.progress) if progress else None
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
        self._tokens += scalars.get(sc.TOKENS.key, 0.0)
        if self._progress is None:
            return
        elapsed = wall_time - self._started
        steps = f"{step + 1}/{self._total_steps}" if self._total_steps else f"{step + 1}"
        parts = [
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_time)),
            f"step {steps}",
            f"tokens {int(self._tokens)}",
            f"throughput {scalars.get(sc.rate_key(sc.TOKENS), 0.0):.1f} tokens/s",
            f"elapsed {_hms(elapsed)}",
        ]
        if sc.ETA.key in scalars:
            parts.append(f"eta {_hms(scalars[sc.ETA.key])}")
        if sc.GOODPUT.key in scalars:
            parts.append(f"goodput {100 * scalars[sc.GOODPUT.key]:.1f}%")
        self._progress.write_line((" | ".join(parts) + "\n").encode("utf-8"))

    def write_text(self, key: str, text: str, step: int) -> None:
        append_line(self.files.text, {"step": step, "key": key, "text": text})

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        for prompt, output in rows:
            append_line(self.files.samples, {"step": step, "key": key, "prompt": prompt, "output": output})

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        finite = [v for v in values if math.isfinite(v)]
        summary = {"count": len(finite), "min": min(finite, default=None), "max": max(finite, default=None)}
        append_line(self.files.histograms, {"step": step, "key": key, **summary})

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        write_json(self.files.hparams, dict(params))

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
