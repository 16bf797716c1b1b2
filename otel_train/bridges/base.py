"""The sink seam: everything that receives flattened scalars at each flush; `Sink` is a null
object. Design: docs/design/bridges.md#sinks."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

HISTOGRAM_BINS = 64  # W&B's default; TensorBoard and MLflow get the same bins


class Sink:
    name = "sink"
    destination = ""  # where the backend writes, as warnings name it: a server and the setting that chose it

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        """One call per flush with every flattened scalar of the interval (keys like `train/loss`)."""

    def write_text(self, key: str, text: str, step: int) -> None:
        """A text entry (markdown allowed), e.g. generated samples."""

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        """Validation samples as (prompt, output) pairs. Default: one markdown table as text."""
        lines = ["| prompt | output |", "| --- | --- |"]
        for prompt, output in rows:
            lines.append(f"| {_md_cell(prompt)} | {_md_cell(output)} |")
        self.write_text(key, "\n".join(lines), step)

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        """Raw values of a distribution (the backend bins them)."""

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        """Hyperparameters (already redacted), once or a few times per run."""

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        """End of run: the last value of every scalar key (for hparams' final metrics); `failed`:
        the run ended by an error (an uncaught exception, a training that raised, the training
        process gone), which W&B and MLflow record as the run's state."""

    def reopen(self) -> None:
        """Before a disabled bridge is retried (`ThreadedSink`): drop the backend's writer, which may
        be broken for good (TensorBoard's keeps its first I/O error). Default: nothing to drop."""


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def merge_params(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`old` updated with `new`, nested mappings merged key by key (a later `{"optim": {"lr": 2e-3}}`
    keeps `optim`'s other keys): how every bridge and hparams.json combine `log_hyperparams` calls."""
    merged = dict(old)
    for key, value in new.items():
        previous = merged.get(key)
        if isinstance(value, Mapping) and isinstance(previous, Mapping):
            merged[key] = merge_params(previous, value)
        else:
            merged[key] = value
    return merged


def flatten_params(params: Mapping[str, Any], typed: bool = False, prefix: str = "") -> dict[str, Any]:
    """Nested mappings become `a.b` keys. Values become strings (lists and dicts as JSON); with
    `typed`, bools stay bools and finite numbers become floats (what TensorBoard's hparams take)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_params(value, typed, f"{name}."))
        elif typed and isinstance(value, bool):
            out[name] = value
        elif typed and isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
        elif isinstance(value, str):
            out[name] = value
        elif isinstance(value, (bool, int, float)) or value is None:
            out[name] = str(value)
        else:
            try:
                out[name] = json.dumps(value, default=str)
            except (TypeError, ValueError):
                out[name] = str(value)
    return out


def histogram_bins(
    values: Sequence[float], bins: int = HISTOGRAM_BINS
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.float64]] | None:
    """(finite values, counts, edges) of `values` in `bins` equal bins from their min to their max;
    None when no value is finite. Never raises for finite values, where `np.histogram` does ("Too
    many bins"): docs/design/bridges.md#histogram-bins."""
    import numpy as np

    array = np.asarray(values, dtype=np.float64).ravel()
    array = array[np.isfinite(array)]
    if array.size == 0:
        return None
    lo, hi = float(array.min()), float(array.max())
    count = bins
    while True:
        try:
            if math.isfinite(hi - lo):
                counts, edges = np.histogram(array, bins=count, range=(lo, hi))
            else:  # numpy would compute max - min: split the range by weights instead
                fraction = np.arange(count + 1, dtype=np.float64) / count
                edges = np.clip(lo * (1.0 - fraction) + hi * fraction, lo, hi)
                counts, edges = np.histogram(array, bins=edges)
            return array, counts.astype(np.int64), edges.astype(np.float64)
        except ValueError:  # "Too many bins for data range": fewer floats than bins between lo and hi
            if count > 1:
                count //= 2
            elif lo == hi:  # a constant numpy cannot widen: one bin one float wide
                up = math.nextafter(hi, math.inf)
                lo, hi = (lo, up) if math.isfinite(up) else (math.nextafter(lo, -math.inf), hi)
            else:  # lo < hi: one bin always fits
                raise
