"""ThreadedSink: one backend behind its own bounded queue and daemon thread, so a slow or hung
backend never delays the worker that feeds every sink. Design: docs/design/bridges.md#threaded."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from otel_train.bridges.base import Sink
from otel_train.bridges.errors import BridgeDisabled

logger = logging.getLogger("otel_train")

_CLOSE = "close"
RETRY_AFTER_S = 2.0  # a disabled backend's first retry
MAX_RETRY_AFTER_S = 60.0  # the back-off's ceiling: a disk that gets room is written again within this
STUCK_CALL_S = 5.0  # a backend call this long is named as the cause when the queue fills


class ThreadedSink(Sink):
    """Wraps `inner` so its calls run on a dedicated daemon thread behind a bounded queue."""

    def __init__(
        self,
        inner: Sink,
        queue_size: int = 64,
        name: str | None = None,
        *,
        max_consecutive_failures: int = 5,
        close_timeout_s: float = 10.0,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self.inner = inner
        self.name = name or inner.name
        self.max_consecutive_failures = max_consecutive_failures
        self.close_timeout_s = close_timeout_s
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self.dropped = 0  # every update not written (docs/design/bridges.md#threaded)
        self.errors = 0  # backend calls that raised (each update among them is also dropped)
        self._in_flight: str | None = None  # the call the backend is executing, if any
        self._in_flight_since = 0.0  # its start, time.monotonic()
        self._consecutive = 0
        self.disabled = False
        self.retry_after_s = retry_after_s
        self._backoff = self.retry_after_s
        self._retry_at = 0.0  # monotonic time of the next retry while disabled
        self._dropped_while_disabled = 0
        self.retries = 0
        self.reenabled = 0
        self._closing = False
        self.closed_cleanly = False  # once `close` drained the queue and the inner close returned in time
        self._warned_drop = False
        self._warned_error = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"otel-train-{self.name}", daemon=True)
        self._thread.start()

    @property
    def fill(self) -> float:
        """How full the queue is, 0 to 1 (not counting a call the backend may be executing)."""
        return self._queue.qsize() / self._queue.maxsize

    def write_scalars(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self._submit("write_scalars", (step, wall_time, dict(scalars)))

    def write_text(self, key: str, text: str, step: int) -> None:
        self._submit("write_text", (key, text, step))

    def write_samples(self, key: str, rows: Sequence[tuple[str, str]], step: int) -> None:
        self._submit("write_samples", (key, [tuple(r) for r in rows], step))

    def write_histogram(self, key: str, values: Sequence[float], step: int) -> None:
        self._submit("write_histogram", (key, list(values), step))

    def write_hparams(self, params: Mapping[str, Any]) -> None:
        self._submit("write_hparams", (dict(params),))

    def close(
        self, final_scalars: Mapping[str, float], failed: bool = False, timeout: float | None = None
    ) -> None:
        """Queue the inner close and wait at most `timeout` seconds (default `close_timeout_s`)."""
        timeout = self.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            if self._closing:
                return
            self._closing = True
        item = (_CLOSE, (dict(final_scalars), failed))
        while True:
            try:
                self._queue.put(item, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
                break
            except queue.Full:
                if not self._thread.is_alive() or time.monotonic() >= deadline:
                    break
        self._done.wait(max(0.0, deadline - time.monotonic()))
        if not self._done.is_set():
            logger.warning(
                "otel_train: the %s bridge did not finish within %.1f s; abandoning it "
                "(%d call(s) not written, counted in dropped). Its data may be incomplete.",
                self.name,
                timeout,
                self._abandon(item),
            )

    def _abandon(self, close_item: tuple[str, tuple[Any, ...]]) -> int:
        """Take the queued updates back unwritten and count them, with one the backend hangs in, as
        dropped; the close is queued again (design page, #threaded)."""
        lost = int(self._in_flight not in (None, _CLOSE))
        while True:
            try:
                method, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if method != _CLOSE:
                lost += 1
        self._queue.put_nowait(close_item)  # nothing else is queued after _closing
        with self._lock:
            self.dropped += lost
        return lost

    def _submit(self, method: str, args: tuple[Any, ...]) -> None:
        if self._closing:
            with self._lock:
                self.dropped += 1
        elif self.disabled and time.monotonic() < self._retry_at:  # a call at the retry time goes on
            self._drop_while_disabled()
        else:
            try:
                self._queue.put_nowait((method, args))
            except queue.Full:
                self._drop_queue_full()

    def _drop_while_disabled(self) -> None:
        with self._lock:
            self.dropped += 1
            self._dropped_while_disabled += 1

    def _drop_queue_full(self) -> None:
        with self._lock:
            self.dropped += 1
            warn = not self._warned_drop
            self._warned_drop = True
        if not warn:
            return
        waited = time.monotonic() - self._in_flight_since
        cause = (
            f"its backend has been in {self._in_flight}() for {waited:.0f} s{self._where()}: a server "
            "that does not answer?"
            if self._in_flight is not None and waited >= STUCK_CALL_S
            else "the backend writes slower than the flushes come"
        )
        logger.warning(
            "otel_train: the %s bridge is falling behind (queue of %d full; %s); dropping its updates "
            "(counted in dropped). Training is not slowed down. This warning is shown once.",
            self.name, self._queue.maxsize, cause,
        )  # fmt: skip

    def _where(self) -> str:
        destination = getattr(self.inner, "destination", "")
        return f" ({destination})" if destination else ""

    def _run(self) -> None:
        while True:
            method, args = self._queue.get()
            if method == _CLOSE:
                self._call(method, args)
                self.closed_cleanly = True
                self._done.set()
                return
            if not self.disabled:
                self._call(method, args)
            elif time.monotonic() >= self._retry_at:
                self._retry(method, args)
            else:
                self._drop_while_disabled()

    def _disable_for_good(self, method: str, exc: BridgeDisabled) -> None:
        """The backend says a retry cannot help: one warning, then its updates are dropped
        (counted) for the rest of the run, never retried (a retry of a W&B init costs a run
        directory and up to WANDB_INIT_TIMEOUT each time)."""
        with self._lock:
            self.errors += 1
            self.dropped += 1  # the update this call carried
            self.disabled = True
            self._retry_at = float("inf")
        logger.warning(
            "otel_train: the %s bridge is off for the rest of this run (in %s): %s. Its updates "
            "are dropped (counted in dropped).",
            self.name,
            method,
            exc,
        )

    def _retry(self, method: str, args: tuple[Any, ...]) -> None:
        """The disabled backend, once more, with a fresh writer; back-off doubles while it fails."""
        self.retries += 1
        exc = self._attempt(method, args, reopen=True)
        if exc is not None:
            self.errors += 1
            self._drop_while_disabled()
            self._backoff = min(self._backoff * 2, MAX_RETRY_AFTER_S)
            self._retry_at = time.monotonic() + self._backoff
            logger.debug("otel_train: the %s bridge failed again in %s", self.name, method, exc_info=exc)
            return
        with self._lock:
            self.disabled = False
            self._consecutive = 0
            lost, self._dropped_while_disabled = self._dropped_while_disabled, 0
        self._backoff = self.retry_after_s
        self.reenabled += 1
        logger.warning(
            "otel_train: the %s bridge works again (retried with a fresh writer); %d update(s) "
            "were dropped while it was disabled.",
            self.name,
            lost,
        )

    def _attempt(self, method: str, args: tuple[Any, ...], reopen: bool = False) -> Exception | None:
        """One call of the backend (after a fresh writer, with `reopen`); the error it raised."""
        self._in_flight, self._in_flight_since = method, time.monotonic()
        try:
            if reopen:
                self.inner.reopen()
            getattr(self.inner, method)(*args)
        except Exception as exc:  # the backend (TensorBoard, W&B, MLflow, a disk): never escapes the bridge
            return exc
        finally:
            self._in_flight = None
        return None

    def _call(self, method: str, args: tuple[Any, ...]) -> None:
        exc = self._attempt(method, args)
        if exc is None:
            self._consecutive = 0
            return
        if isinstance(exc, BridgeDisabled) and method != _CLOSE:
            self._disable_for_good(method, exc)
            return
        with self._lock:
            self.errors += 1
            if method != _CLOSE:  # the update it carried is not written
                self.dropped += 1
            self._consecutive += 1
            first = not self._warned_error
            self._warned_error = True
            disable = method != _CLOSE and self._consecutive >= self.max_consecutive_failures
            if disable:
                self.disabled = True
                self._retry_at = time.monotonic() + self._backoff
        if first:
            logger.warning(
                "otel_train: the %s bridge failed in %s%s: %s: %s. Training continues; further "
                "errors from this bridge are logged at DEBUG.",
                self.name,
                method,
                self._where(),
                type(exc).__name__,
                exc,
                exc_info=exc if logger.isEnabledFor(logging.DEBUG) else None,
            )
        else:
            logger.debug("otel_train: the %s bridge failed in %s", self.name, method, exc_info=exc)
        if disable:
            logger.warning(
                "otel_train: the %s bridge failed %d times in a row and is disabled; its updates "
                "are dropped (counted) and it is retried with a fresh writer after %.0f s, then "
                "less often (at most every %.0f s).",
                self.name,
                self._consecutive,
                self._backoff,
                MAX_RETRY_AFTER_S,
            )
