"""The run directory: the local copy that loses nothing on a clean exit.

`metrics.rank<k>.jsonl` (one line per flush: step, time, every flattened value, line-buffered and
flushed each time so a SIGKILL loses at most the interval in flight), `progress.txt` (Megatron-style
one-liners), `config.json` and `env.json` (written once at init, secrets redacted), and
`samples.jsonl` / `text.jsonl` for text and samples.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from otel_train.bridges.base import Sink


def _clean(value: float) -> float | None:
    return value if math.isfinite(value) else None


class RunDirSink(Sink):
    name = "rundir"

    def __init__(self, run_dir: Path, rank: int, total_steps: int | None, progress: bool = True) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / f"metrics.rank{rank}.jsonl"
        self._metrics: TextIO = self.metrics_path.open("a", encoding="utf-8", buffering=1)
        # progress.txt is one file per run: only the reporting rank appends to it.
        self._progress: TextIO | None = (
            (run_dir / "progress.txt").open("a", encoding="utf-8", buffering=1) if progress else None
        )
        self._total_steps = total_steps
        self._started = time.time()
        self._tokens = 0.0

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        row = {
            "step": step,
            "time": round(wall_time, 3),
            **{k: _clean(v) for k, v in sorted(scalars.items())},
        }
        self._metrics.write(json.dumps(row) + "\n")
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
        self._progress.write(" | ".join(parts) + "\n")

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
            self._progress.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} | end of process | {line}\n")
        for fh in (self._metrics, self._progress):
            if fh is None:
                continue
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()

    def _append(self, name: str, row: Mapping[str, Any]) -> None:
        with (self.run_dir / name).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
