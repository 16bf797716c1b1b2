"""Health signals: non-finite losses and loss spikes, and the event channel every part reports to.

Detection never syncs the device on the training thread: loss values are resolved in the flush's
one batched transfer on the background worker, and checked there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from opentelemetry._logs import SeverityNumber

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.redaction import redact_attributes, redact_text
from otel_train.run_directory import append_line

log = logging.getLogger("otel_train")

AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue] | None
_SEVERITY = {"INFO": SeverityNumber.INFO, "WARNING": SeverityNumber.WARN, "ERROR": SeverityNumber.ERROR}


class EventChannel(Protocol):
    """Where health events go: the one seam every reporting part uses (watchdog, runtime control,
    hardware samplers, straggler listener). `HealthEvents` is the session's."""

    def emit(
        self, event: str, message: str, attributes: Attributes = None, severity: str = "WARNING"
    ) -> None: ...


class NullEventChannel:
    """An EventChannel that drops every event (a part built without one)."""

    def emit(
        self, event: str, message: str, attributes: Attributes = None, severity: str = "WARNING"
    ) -> None:
        pass


EventCallback = Callable[[str, str, dict[str, AttributeValue]], None]

# Calls waiting for the user's hooks: beyond this they are dropped (a hook that hangs must not
# grow memory without bound), counted as otel_train.dropped{reason="callback_backlog"}.
CALLBACK_QUEUE = 1024


class HookThread:
    """Runs the user's hooks (`ot.on_event`, `ot.on_straggler`) on a thread of their own, in order.

    A hook is the user's code: a hanging webhook would hold the worker or the watchdog, an
    `ot.shutdown()` could not join the thread it runs on, an `ot.event` forwarding its input would feed
    itself. So the raising thread only queues the call (a full queue drops it, counted and warned
    once), `ot.shutdown()` from a hook closes everything but this thread, and an event raised on this
    thread is not handed to the hooks."""

    def __init__(self, dropped: Any, maxsize: int = CALLBACK_QUEUE) -> None:
        self._dropped = dropped
        self._queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue(maxsize)
        self._closed = False
        self._warned = False
        self.drops = 0
        self._thread = threading.Thread(target=self._run, name="otel_train-hooks", daemon=True)
        self._thread.start()

    def on_hook_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, hook: Callable[..., None], *args: Any) -> None:
        """Queue `hook(*args)`; never blocks."""
        if self._closed:
            return
        try:
            self._queue.put_nowait((hook, args))
        except queue.Full:
            self.drops += 1
            self._dropped.add(1, {semconv.REASON: "callback_backlog"})
            if not self._warned:
                self._warned = True
                log.warning(
                    "otel_train: %d calls wait for an ot.on_event/ot.on_straggler callback (one is "
                    "blocked?); further ones are dropped, counted as otel_train.dropped"
                    '{reason="callback_backlog"}. Training and health events are not affected.',
                    self._queue.maxsize,
                )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._closed:
                return
            hook, args = item
            try:
                hook(*args)
            except Exception as exc:  # the user's code: logged, never kills the thread
                log.warning("otel_train: callback %s failed: %s", getattr(hook, "__name__", hook), exc)
            if self._closed:  # the hook shut the session down: this thread ends with it
                return

    def close(self, timeout_s: float) -> None:
        """Let the queued calls run for up to `timeout_s`, then stop (a hook still running is left
        behind: a daemon). From a hook itself: stop once that hook returns, without waiting."""
        if self._closed:
            return
        if self.on_hook_thread():
            self._closed = True
            return
        deadline = time.monotonic() + max(0.0, timeout_s)
        with contextlib.suppress(queue.Full):  # a hook blocked with the queue full: the join times out
            self._queue.put(None, timeout=max(0.0, timeout_s))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._closed = True


MAX_EVENT_NAMES = 64  # distinct event names the health-events counter carries; the rest count as:
OTHER_EVENT = "other"


class HealthEvents:
    """One way out for every health event: counter + OTel log record + events JSONL + log line.
    Thread-safe; attributes and message are redacted here (an `ot.event` may carry a token)."""

    def __init__(
        self,
        counter: Any,
        otel_logger: Any | None,
        events_path: Path | None,
        base_attributes: Mapping[str, AttributeValue],
        echo: bool,
        echo_source: str = "",
    ) -> None:
        """`echo_source`: who the console line speaks for (" (rank 1)"), as every rank echoes."""
        self._counter = counter
        self._otel_logger = otel_logger
        self._events_path = events_path
        self._base = dict(base_attributes)
        self.echo = echo  # a log line per event; runtime control's `verbosity` changes it
        self._echo_source = echo_source
        self._counted: frozenset[str] = frozenset()  # event names the counter carries (`_counted_as`)
        self._lock = threading.Lock()
        self._callbacks: list[EventCallback] = []
        self._hook_callbacks: list[EventCallback] = []
        self.hooks: HookThread | None = None  # started by the first user hook (`hook_thread`)

    def _counted_as(self, event: str) -> str:
        """The counter's `otel_train.event` value: the event's name for the first MAX_EVENT_NAMES
        names, `other` after them (`ot.event` names made per step must not grow the series; the
        events file and the log records keep every name)."""
        counted = self._counted
        if event in counted:
            return event
        if len(counted) < MAX_EVENT_NAMES:
            self._counted = counted | {event}  # replaced, not mutated: emit() runs on many threads
            return event
        return OTHER_EVENT

    def add_callback(self, callback: EventCallback) -> None:
        """Call `callback(event, message, attributes)` after each event ON THE EMITTING THREAD (its
        exceptions reach the emitter): for quick observers that never block; the user's use `add_hook`."""
        self._callbacks = [*self._callbacks, callback]  # replaced, not mutated: emit() iterates it

    def hook_thread(self, dropped: Any) -> HookThread:
        """The thread the user's hooks run on, started at the first one (`dropped`: the counter a
        full queue's drops go to)."""
        with self._lock:
            if self.hooks is None:
                self.hooks = HookThread(dropped)
            return self.hooks

    def add_hook(self, callback: EventCallback, dropped: Any) -> None:
        """Call `callback(event, message, attributes)` after each event on the hook thread
        (`HookThread`): it may block or call the API without holding the thread that raised it."""
        self.hook_thread(dropped)
        self._hook_callbacks = [*self._hook_callbacks, callback]

    def close(self, timeout_s: float) -> None:
        """Give the hooks what is queued (up to `timeout_s`), then stop their thread."""
        hooks = self.hooks
        if hooks is not None:
            hooks.close(timeout_s)

    def emit(
        self, event: str, message: str, attributes: Attributes = None, severity: str = "WARNING"
    ) -> None:
        message = redact_text(message)
        extra = redact_attributes(attributes) if attributes else {}
        attrs: dict[str, AttributeValue] = {**self._base, **extra, semconv.EVENT: event}
        self._counter.add(1, {semconv.EVENT: self._counted_as(event)})
        if self._otel_logger is not None:
            try:
                self._otel_logger.emit(
                    severity_number=_SEVERITY.get(severity, SeverityNumber.WARN),
                    severity_text=severity,
                    body=message,
                    attributes=attrs,
                    event_name=f"otel_train.{event}",
                )
            except Exception as exc:  # the OTel SDK's log pipeline must not stop the caller
                log.debug("otel_train: could not emit a log record: %s", exc)
        with self._lock:
            if self._events_path is not None:
                try:
                    row = {"time": time.time(), "event": event, "message": message, **attrs}
                    append_line(self._events_path, row, single_writer=True)  # this rank's
                except OSError as exc:
                    log.warning(
                        "otel_train: cannot write %s (%s); health events stay in OTel only.",
                        self._events_path, exc,
                    )  # fmt: skip
                    self._events_path = None
        if self.echo:
            log.warning("otel_train %s%s: %s", event, self._echo_source, message)
        for callback in self._callbacks:
            callback(event, message, attrs)
        hooks = self.hooks
        # An event a hook raised (ot.event forwarding what it was given) is recorded above but not
        # handed to the hooks again: one forwarded event, never a hook feeding itself.
        if hooks is not None and not hooks.on_hook_thread():
            for hook in self._hook_callbacks:
                hooks.submit(hook, event, message, dict(attrs))


# A loss is a spike when it exceeds the exponentially weighted mean of the losses before it by more
# than both (spike_factor - 1) x |mean| and _SPIKE_SIGMAS weighted standard deviations: either bar
# alone fires on every step of a loss near zero, or of one too steady to have noise
# (docs/design/diagnostics.md#loss-spike).
_SPIKE_MEAN_WEIGHT = 0.1  # weight of the newest loss: a memory of about 20 values
_SPIKE_VAR_WEIGHT = 0.02  # about 100
_SPIKE_SIGMAS = 8.0


class HealthMonitor:
    """Flush listener: non-finite losses and gradients (what the interval says the worker dropped)
    and loss spikes (exponentially weighted mean and deviation), all from the interval it is handed."""

    def __init__(
        self, events: HealthEvents, nonfinite_counter: Any, spike_factor: float, warmup: int = 5
    ) -> None:
        self._events = events
        self._nonfinite = nonfinite_counter
        self._spike_factor = spike_factor
        self._warmup = warmup
        self._mean = 0.0
        self._var = 0.0
        self._seen = 0
        self.nonfinite_loss = 0
        self._grads_nonfinite = False  # the last watched step's gradients were NaN/Inf (one event a spell)

    def on_flush(self, interval: Interval) -> None:
        self._report_nonfinite_loss(
            interval.nonfinite.get(semconv.LOSS.name, 0),
            interval.nonfinite_steps.get(semconv.LOSS.name),
            interval.step,
        )
        self._follow_grads(interval)
        # Every recorded loss value, each with the step it was recorded at where the worker could
        # tell (one value per step, the usual case); otherwise named by the interval's last step.
        losses = interval.scalars.get(semconv.LOSS.name, ())
        steps = interval.scalar_steps.get(semconv.LOSS.name)
        # One pass, inline: it runs for every loss value (one per step), on the worker's share of a
        # 1-2 ms step.
        mean, var, seen, warmup = self._mean, self._var, self._seen, self._warmup
        relative = self._spike_factor - 1.0
        for i, value in enumerate(losses):
            if seen == 0:
                mean, seen = value, 1
                continue
            diff = value - mean
            std = math.sqrt(var)
            if seen >= warmup and diff > max(relative * abs(mean), _SPIKE_SIGMAS * std) > 0:
                self._report_spike(value, mean, std, steps[i] if steps else interval.step, steps is not None)
                continue  # a spike moves neither the mean nor the deviation
            # Exponentially weighted mean and variance, updated incrementally (Finch 2009); the first
            # values weigh equally (Welford's running mean and variance), so neither starts biased.
            first = 1.0 / (seen + 1)
            mean += max(_SPIKE_MEAN_WEIGHT, first) * diff
            weight = max(_SPIKE_VAR_WEIGHT, first)
            var = (1.0 - weight) * (var + weight * diff * diff)
            seen += 1
        self._mean, self._var, self._seen = mean, var, seen

    def _report_nonfinite_loss(self, count: int, steps: list[int] | None, last_step: int) -> None:
        """`steps`: the steps of the NaN/Inf values where the worker could tell; else the event
        names the interval by its last step."""
        if count == 0:
            return
        self.nonfinite_loss += count
        self._nonfinite.add(count)
        if steps:
            step = steps[0]
            more = f" ({count} in the interval, the last at step {steps[-1]})" if count > 1 else ""
            what = f"non-finite loss at step {step}{more}"
        else:
            step = last_step
            what = f"{count} non-finite loss value(s) in the interval ending at step {step}"
        self._events.emit("nonfinite", what, {"step": step}, severity="ERROR")

    def _follow_grads(self, interval: Interval) -> None:
        """One `nonfinite_grad` event when the watched gradients turn NaN/Inf, none while they stay
        so (a diverged run would raise one each watched step, on every rank), another after they
        were finite again."""
        bad = dict(interval.nonfinite_grads)
        for step in sorted({step for step, _, _ in interval.layer_grad_norms} | bad.keys()):
            layers = bad.get(step)
            if layers is None:
                self._grads_nonfinite = False
            elif not self._grads_nonfinite:
                self._grads_nonfinite = True
                self._report_nonfinite_grads(layers, step)

    def _report_nonfinite_grads(self, layers: list[str], step: int) -> None:
        # Backpropagation carries a NaN from where it starts towards the input, so the affected
        # layer nearest the output (last in module order) is the likeliest origin.
        shown = ", ".join(layers[:5]) + (f" and {len(layers) - 5} more" if len(layers) > 5 else "")
        self._events.emit(
            "nonfinite_grad",
            f"non-finite gradient norm at step {step} in {len(layers)} layer(s): {shown}; "
            f"nearest the output: {layers[-1]} (said once until the gradients are finite again)",
            {"step": step, semconv.LAYER: layers[-1]},
            severity="ERROR",
        )

    def _report_spike(self, value: float, mean: float, std: float, step: int, exact: bool) -> None:
        where = f"at step {step}" if exact else f"in the interval ending at step {step}"
        self._events.emit(
            "loss_spike",
            f"loss {value:.4g} {where} is {value - mean:.4g} above its recent mean {mean:.4g} "
            f"(recent standard deviation {std:.2g})",
            {"step": step, "loss": value},
        )

    def close(self) -> None:
        pass
