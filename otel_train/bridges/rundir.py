"""`RunDirSink`: writes the run directory's per-flush files (metrics, progress, text, samples,
histograms, hparams); the layout and the whole-line writers live in `otel_train.run_directory`."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train import semconv as sc
from otel_train.bridges.base import Sink, merge_params
from otel_train.bridges.framing import plain
from otel_train.run_directory import LineFile, RunFiles, append_line, dumps_line, write_json


class RunDirSink(Sink):
    name = "rundir"

    def __init__(self, run_dir: Path, rank: int, progress: bool = True, role: str = "") -> None:
        self.files = RunFiles(run_dir, rank, role)
        self._metrics = LineFile(self.files.metrics, single_writer=True)  # this rank's
        # progress.txt is one file per run: only the reporting rank appends to it.
        self._progress: LineFile | None = LineFile(self.files.progress) if progress else None
        self._started = time.perf_counter()  # monotonic: a wall-clock step is no elapsed time
        self._tokens = self._samples = 0.0
        self._hparams: dict[str, Any] = {}

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        row = {
            "step": step,
            "time": round(wall_time, 3),
            **{k: (v if math.isfinite(v) else None) for k, v in sorted(scalars.items())},
        }
        self._metrics.write_line(dumps_line(row))
        self._tokens += scalars.get(sc.TOKENS.key, 0.0)
        self._samples += scalars.get(sc.SAMPLES.key, 0.0)
        if self._progress is None or sc.STEPS.key not in scalars:
            return  # a row without training steps (log_metrics(step=N), an eval) is no progress
        elapsed = time.perf_counter() - self._started
        total = int(scalars.get(sc.TOTAL_STEPS.key, 0))  # the plan may change in a run (set_total_steps)
        steps = f"{step + 1}/{total}" if total else f"{step + 1}"
        if self._samples and not self._tokens:  # ot.step(samples=...) alone: the steps count samples
            unit, counted, rate = "samples", self._samples, sc.rate_key(sc.SAMPLES)
        else:
            unit, counted, rate = "tokens", self._tokens, sc.rate_key(sc.TOKENS)
        parts = [
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_time)),
            f"step {steps}",
            f"{unit} {int(counted)}",
            f"throughput {scalars.get(rate, 0.0):.1f} {unit}/s",
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
        # `plain`: the values the bridge process sends W&B and MLflow, so hparams.json agrees with them
        self._hparams = merge_params(self._hparams, plain(dict(params)))
        write_json(self.files.hparams, self._hparams)

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        from otel_train.goodput import summary

        line = summary(final_scalars)
        if self._progress is not None and line:
            with contextlib.suppress(OSError):  # a full disk: the summary line is the one thing lost
                self._progress.write_line(
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')} | end of process{' (failed)' if failed else ''} | "
                    f"{line}\n".encode()
                )
        self._metrics.close()
        if self._progress is not None:
            self._progress.close()


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
