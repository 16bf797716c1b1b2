"""Console: progress bar, one summary line per flush, sample tables, and an end-of-run timer table.

Verbosity 0 prints nothing; 1 (default) prints summaries, samples and the final table; the progress
bar is drawn only on a terminal. Runs on the worker thread, rank 0 only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from otel_train import semconv as sc
from otel_train.bridges.base import Sink


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms"
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# The summary line: (bridge key, label, format; None: a duration, "si": k/M/G).
_SUMMARY_FIELDS: tuple[tuple[str, str, str | None], ...] = (
    (sc.LOSS.key, "loss", "{:.4f}"),
    (sc.LEARNING_RATE.key, "lr", "{:.2e}"),
    (sc.stat_key(sc.STEP_DURATION.key, "mean"), "step", None),
    (sc.rate_key(sc.TOKENS), "tok/s", "si"),
    (sc.GRAD_NORM.key, "grad", "{:.3f}"),
    (sc.EVAL_LOSS.key, "eval_loss", "{:.4f}"),
    (sc.MFU.key, "mfu", "{:.1%}"),
)
# Timer totals: `timers/step/total` and `timers/<phase>/total` (the step and phase histograms).
_TIMERS = sc.key_prefix(sc.PHASE_DURATION)
_TOTAL = sc.stat_key("", "total")


class ConsoleSink(Sink):
    name = "console"

    def __init__(
        self, verbosity: int, progress_bar: bool, stream: TextIO | None = None, run_dir: Path | None = None
    ) -> None:
        self.stream = stream or sys.stdout
        self.verbosity = verbosity
        self.run_dir = run_dir  # said at the start and the end: where the outputs are
        if verbosity > 0 and run_dir is not None:
            self.stream.write(f"otel_train: writing to {run_dir}\n")
        self.bar = progress_bar and verbosity > 0 and self.stream.isatty()
        self.started = time.perf_counter()  # monotonic: a wall-clock step is no elapsed time
        self._opened = time.monotonic()  # the timer table's wall clock (timers read a monotonic one)
        # Timer totals for the end-of-run table: name -> [total seconds, count].
        self.timers: dict[str, list[float]] = {}
        # summary values that came in a row without training steps (log_metrics(step=N)): the next
        # training line shows the latest of them
        self._latest: dict[str, float] = {}

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self._accumulate(scalars)
        if self.verbosity == 0:
            return
        # A row has the eval loss only from the interval it was logged in. A flush without training
        # steps (log_metrics(step=...) after an eval, the shutdown flush) shows only what is new,
        # never the stale training values.
        new_eval = sc.EVAL_LOSS.key in scalars
        trained = sc.STEPS.key in scalars
        if not trained:
            self._latest.update((k, scalars[k]) for k, _, _ in _SUMMARY_FIELDS if k in scalars)
        else:
            scalars = {**self._latest, **scalars}
        if not trained and not new_eval:
            return  # nothing new to show (e.g. the shutdown flush after the last interval)
        total = int(scalars.get(sc.TOTAL_STEPS.key, 0))  # the plan may change in a run (set_total_steps)
        parts = [f"step {step + 1}" + (f"/{total}" if total else "")]
        # NaN/Inf losses are left out of the loss (the finite values' mean): the line says so
        count = scalars.get(sc.NONFINITE_LOSS.key, 0.0) if trained else 0.0
        nonfinite = f"{count:.0f} NaN/Inf" if count else ""
        if nonfinite and sc.LOSS.key not in scalars:
            parts.append(f"loss {nonfinite}")
        for key, label, fmt in _SUMMARY_FIELDS:
            # the eval loss when it is new; the training values after training steps
            if key not in scalars or not (new_eval if key == sc.EVAL_LOSS.key else trained):
                continue
            value = scalars[key]
            text = _duration(value) if fmt is None else _si(value) if fmt == "si" else fmt.format(value)
            if key == sc.LOSS.key and nonfinite:
                text += f" (+{nonfinite})"
            parts.append(f"{label} {text}")
        if sc.ETA.key in scalars and trained:
            parts.append(f"eta {_duration(scalars[sc.ETA.key])}")
        line = " | ".join(parts)
        if self.bar and total:
            done = min(1.0, (step + 1) / total)
            filled = int(done * 24)
            rate = (step + 1) / max(1e-9, time.perf_counter() - self.started)
            line = f"[{'#' * filled}{'.' * (24 - filled)}] {done:4.0%} {rate:.1f} it/s | " + line
        self.stream.write(line + "\n")
        self.stream.flush()

    def _accumulate(self, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            if not key.startswith(_TIMERS) or not key.endswith(_TOTAL):
                continue
            name = key[len(_TIMERS) : -len(_TOTAL)]
            if "/" in name:
                continue  # error variants and cross-rank stats
            count = scalars.get(sc.stat_key(_TIMERS + name, "count"), 0.0)
            entry = self.timers.setdefault(name, [0.0, 0.0])
            entry[0] += value
            entry[1] += count

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        if self.verbosity == 0 or not rows:
            return
        width = 100
        self.stream.write(f"--- {key} after step {step + 1} " + "-" * max(0, width - len(key) - 16) + "\n")
        for prompt, output in rows:
            shown = (prompt + output).replace("\n", "⏎")
            self.stream.write(f"  {prompt!r:>16} → {shown[: width - 22]}\n")
        self.stream.flush()

    def write_text(self, key: str, text: str, step: int) -> None:
        if self.verbosity >= 2:
            self.stream.write(f"[{key} @ {step}] {text}\n")

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        if self.verbosity == 0:
            return
        from otel_train.goodput import summary

        line = summary(final_scalars)
        table = self.timer_table(time.monotonic() - self._opened)
        where = f"run dir: {self.run_dir}\n" if self.run_dir is not None else ""
        self.stream.write(table + (f"{line}\n" if line else "") + where)
        self.stream.flush()

    def timer_table(self, wall_s: float) -> str:
        """Each timer's total, mean, count and share of the `wall_s` seconds since init. The wall,
        not the step time: a timer outside steps (an eval loop, a checkpoint save) would otherwise
        show hundreds of percent. A timer inside another (forward in step) counts in both, so the
        shares need not add up to 100 %."""
        if not self.timers or wall_s <= 0:
            return ""
        lines = [f"{'timer':<20} {'total':>10} {'mean':>10} {'count':>8} {'% time':>7}"]
        for name, (total, count) in sorted(self.timers.items(), key=lambda kv: -kv[1][0]):
            mean = total / count if count else 0.0
            share = 100.0 * total / wall_s
            lines.append(f"{name:<20} {total:>9.2f}s {mean * 1000:>8.2f}ms {int(count):>8d} {share:>6.1f}%")
        lines.append(f"% time: of the {wall_s:.1f}s since init; a timer inside another counts in both")
        return "\n".join(lines) + "\n"
