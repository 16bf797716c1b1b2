"""What the training thread adds to a flush batch as it hands it to the worker: a CUDA event when
the batch holds CUDA values (the worker waits on it, never the training thread) and the active
torch.autocast dtype (thread-local: readable only here); the warning for a flush that was lost, and
the count for a message that found the worker's queue full."""

from __future__ import annotations

import logging
from typing import Any

from otel_train.buffer import Buffer, FlushBatch
from otel_train.hardware import autocast_dtype

log = logging.getLogger("otel_train")


def _holds_cuda_values(batch: FlushBatch) -> bool:
    """Does the interval hold CUDA tensors (the worker then waits on an event before reading them)?"""
    return (
        any(_on_cuda(v) for vs in batch.scalars.values() for v in vs[-1:])
        or any(_on_cuda(r.values) for r in batch.layer_stats)
        or any(_on_cuda(h[2]) for h in batch.histograms)
    )


def note_torch_state(batch: FlushBatch, detect_dtype: bool) -> None:
    """Training thread, at a flush: a CUDA event when the batch holds CUDA values (the worker waits
    on it), and the active torch.autocast dtype for MFU's peak (thread-local: only readable here)."""
    if _holds_cuda_values(batch):
        batch.cuda_event = _record_cuda_event()
    if detect_dtype:
        batch.autocast_dtype = autocast_dtype()


def warn_lost_flush(batch: FlushBatch, lost_flushes: int) -> None:
    log.warning(
        "otel_train: the background worker is stuck; flush %d (%d steps, up to step %d) was "
        "dropped (%d flushes lost so far).",
        batch.seq,
        batch.steps,
        batch.step,
        lost_flushes,
    )


def _on_cuda(value: Any) -> bool:
    device = getattr(value, "device", None)
    return device is not None and getattr(device, "type", "") == "cuda"


def _record_cuda_event() -> Any:
    import torch

    event = torch.cuda.Event()
    event.record()  # on the training thread's current stream; the worker waits on it
    return event


def drop_message(buffer: Buffer, limit: int) -> None:
    """A log_text / log_samples / log_histogram / log_hyperparams entry that found `limit` entries
    waiting for the worker: dropped, counted and warned about once, never waited for."""
    buffer.drop("message_queue_full")
    buffer.warn_once(
        "<message_queue_full>",
        f"otel_train: the background worker has {limit} log_text/log_samples/log_histogram/"
        "log_hyperparams entries waiting (it is behind or stuck); further ones are dropped and "
        "counted as otel_train.dropped{reason=message_queue_full}. Log them less often, or raise "
        "queue_size (the limit is 8 x queue_size, at least 64).",
    )
