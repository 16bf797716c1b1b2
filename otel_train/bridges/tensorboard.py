"""TensorBoard bridge: scalars, text, histograms and hparams through `torch.utils.tensorboard`,
one log dir per run. Layout and hparams: docs/design/bridges.md#tensorboard.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train.bridges.base import Sink, flatten_params, histogram_bins
from otel_train.bridges.errors import BridgeImportError, ensure_writable_dir, require_packages

logger = logging.getLogger("otel_train")


class TensorBoardSink(Sink):
    """Writes one TensorBoard run into `log_dir` (created if missing)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path | str) -> None:
        # the writer, which imports torch, is created at the first write
        if importlib.util.find_spec("torch") is None:  # not in the extra: its CPU or CUDA build is the user's
            raise BridgeImportError(
                "TensorBoard", "tensorboard", needs="PyTorch, whose torch.utils.tensorboard writes the files"
            )
        require_packages("TensorBoard", "tensorboard", "torch.utils.tensorboard", "tensorboard")
        self.log_dir = Path(log_dir)
        ensure_writable_dir(self.log_dir, "TensorBoard")
        self._writer_or_none: Any = None
        self._seen: set[str] = set()
        self._last_step = 0
        self._hparams_written = False
        self._closed = False

    @property
    def _writer(self) -> Any:
        if self._writer_or_none is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise BridgeImportError("TensorBoard", "tensorboard", exc) from exc
            self._writer_or_none = SummaryWriter(log_dir=str(self.log_dir), flush_secs=30)
        return self._writer_or_none

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._add_scalar(key, value, step, wall_time)
            self._seen.add(key)
        self._last_step = max(self._last_step, step)
        self._writer.flush()  # make every flush visible to a running TensorBoard

    def _add_scalar(self, key: str, value: float, step: int, wall_time: float) -> None:
        # float64, not the default float32 `simple_value` (docs/design/bridges.md#tensorboard)
        self._writer.add_scalar(
            key, float(value), global_step=step, walltime=wall_time, new_style=True, double_precision=True
        )

    def write_text(self, key: str, text: str, step: int) -> None:
        self._writer.add_text(key, text, global_step=step)
        self._writer.flush()

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        import numpy as np

        binned = histogram_bins(values)  # not add_histogram's own bins (design page, #histogram-bins)
        if binned is None:
            return  # nothing finite to show
        array, counts, edges = binned
        with np.errstate(over="ignore"):  # a sum past the largest float is inf, not an error
            total, squares = float(array.sum()), float(array.dot(array))
        self._writer.add_histogram_raw(
            key,
            min=float(array.min()),
            max=float(array.max()),
            num=int(array.size),
            sum=total,
            sum_squares=squares,
            bucket_limits=edges[1:].tolist(),  # right edges; the reader takes `min` as the first left
            bucket_counts=counts.tolist(),
            global_step=step,
        )
        self._writer.flush()

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        if self._hparams_written:
            logger.debug("otel_train: TensorBoard keeps the first hparams of a run; later ones are ignored")
            return
        from tensorboard.plugins.hparams import metadata, plugin_data_pb2

        info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for key, value in flatten_params(params, typed=True).items():
            kind = "bool" if isinstance(value, bool) else "number" if isinstance(value, float) else "string"
            setattr(info.hparams[key], f"{kind}_value", value)
        self._add_hparams_summary(metadata.SESSION_START_INFO_TAG, session_start_info=info)
        self._hparams_written = True
        self._writer.flush()

    def reopen(self) -> None:
        """A fresh writer at the next call, into a new event file of the same log dir
        (docs/design/bridges.md#tensorboard)."""
        old, self._writer_or_none = self._writer_or_none, None
        if old is not None:
            try:
                old.close()
            except Exception as exc:  # TensorBoard's writer re-raises the error it kept: counted already
                logger.debug("otel_train: closing the failed TensorBoard writer: %r", exc)

    def close(self, final_scalars: Mapping[str, float], failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writer_or_none is None and not final_scalars:
            return  # nothing was ever written
        now = time.time()
        for key, value in final_scalars.items():
            if key not in self._seen:  # a final value the curves never carried
                self._add_scalar(key, value, self._last_step, now)
        if self._hparams_written:
            from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

            info = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=now)
            self._add_hparams_summary(metadata.SESSION_END_INFO_TAG, session_end_info=info)
        self._writer.flush()
        self._writer.close()

    def _add_hparams_summary(self, tag: str, **plugin_data: Any) -> None:
        """An hparams plugin summary, into this run's own event file (docs/design/bridges.md#tensorboard)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.hparams import metadata, plugin_data_pb2

        smd = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(**plugin_data))
        self._writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, metadata=smd)]))
