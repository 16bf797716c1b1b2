"""otel_train: OpenTelemetry-native observability for ML training.

    import otel_train as ot

    ot.init(total_steps=1000)
    for step in range(1000):
        with ot.step(step, tokens=batch_tokens):
            with ot.timer("forward"):
                loss = model(batch)
            ot.record("loss", loss)          # a tensor stays on device until the flush
    ot.shutdown()

Importing this package is light: no torch, SDK exporters, wandb or tensorboard are imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from otel_train.config import Config as Config
from otel_train.config import ConfigError as ConfigError
from otel_train.core import Run as Run
from otel_train.core import message_step, span, step, timer

# The hot path reads `_runtime._current` directly, on purpose: docs/design/core.md#runtime.
from otel_train.core import runtime as _runtime
from otel_train.core.buffer import (
    HistogramMessage,
    HparamsMessage,
    SamplesMessage,
    ScalarsMessage,
    TextMessage,
)
from otel_train.distributed import RunInfo as RunInfo
from otel_train.redaction import cap_text, redact
from otel_train.version import __version__ as __version__

_log = logging.getLogger("otel_train")

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

    from otel_train.core import Session
    from otel_train.numerics import ModelWatch, NullWatch

# The public API: one name per job (tests/test_api.py says why each is here); adapters also use
# `otel_train.adapters`. `Run`, `RunInfo`, `Config` and `ConfigError` are importable types.
__all__ = [
    "event",
    "get_meter",
    "init",
    "log_histogram",
    "log_hyperparams",
    "log_metrics",
    "log_samples",
    "log_text",
    "on_event",
    "record",
    "run_info",
    "shutdown",
    "span",
    "step",
    "timer",
    "watch",
]


def init(config_file: str | None = None, **settings: Any) -> Run:
    """Start telemetry for this process (idempotent: a second call returns the running run).

    Settings are `Config` fields; precedence: keyword arguments > environment (`OTEL_*`,
    `OTEL_TRAIN_*`) > YAML file (`config_file` or `OTEL_TRAIN_CONFIG`) > defaults. Invalid settings
    raise `ConfigError` naming the setting and the fix. Returns a `Run` (run id, name, directory,
    rank, the pull endpoint's URL); use as `with ot.init(...) as run:` to shut down at the end.
    """
    return Run(_runtime.init(config_file=config_file, settings=settings))


def shutdown() -> None:
    """Final flush, then stop every exporter within `shutdown_timeout_s`. Safe to call twice."""
    _runtime.shutdown()


def run_info() -> RunInfo | None:
    """Run id, run name, run directory, rank, world size and last step of the running session
    (None before `init()`): the public view for adapters and scripts."""
    session = _runtime._current
    return Run(session).info() if session is not None else None


def record(name: str, value: Any) -> None:
    """Record a scalar (number or 1-element tensor; tensors are not synced until the flush).

    Never raises: bad names and values are dropped and counted, with one warning per name.
    """
    session = _runtime._current
    if session is not None:
        buffer = session.buffer
        try:
            # Buffer.add_scalar's usual case inline (a name seen before, room, no autograd graph to
            # cut): one Python frame less per call, which is what a call costs between torch's ops.
            values = buffer.scalars.get(name)
            if (
                values is not None
                and len(values) < buffer.max_values
                and (value.__class__ is float or not getattr(value, "requires_grad", False))
            ):
                values.append(value)
                return
            buffer.add_scalar(name, value)
            if values is None and not session.step_start_ns:
                # the interval's first value of `name`, between steps: of the step that ended last
                buffer.after_step.setdefault(name, len(buffer.step_events))
        except TypeError:  # an unhashable name (a list): dropped like any name that is not a str
            buffer.drop("invalid_name")


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
    """Record several scalars (`{"eval/loss": v, ...}`); `metrics` that is not a mapping raises
    TypeError, bad names and values in it are dropped and counted, as by `record`.

    Without `step` they leave with the next flush, like `record`. With `step` they are one row at
    that step in the run dir and every bridge (and only there: the flushes' rows leave them out),
    written in order with the flushes, with no collective; the OTel gauges (the latest value) and
    the health checks get them with the next scheduled flush, a pause or the end of the run.
    """
    _need_mapping("log_metrics", metrics)
    session = _runtime._current
    if session is None:
        return
    items = list(metrics.items())
    names = [f"{prefix or ''}{name}" if isinstance(name, str) else name for name, _ in items]
    values = [value for _, value in items]
    for name, value in zip(names, values, strict=True):
        record(name, value)
    if step is None:
        return
    buffer = session.buffer
    filed = message_step(step, buffer)
    if filed is None:  # no step number: filed under the current step, as without `step`
        return
    row: dict[str, Any] = {}
    for instrument, value in zip(map(buffer.instrument_of, names), values, strict=True):
        if instrument is not None:
            row[instrument] = value
            buffer.stepped[instrument] = buffer.stepped.get(instrument, 0) + 1
    if row:
        session.message(ScalarsMessage, "", row, filed)


def log_hyperparams(params: Mapping[str, Any]) -> None:
    """Hyperparameters for every bridge (secret-looking keys are redacted)."""
    _need_mapping("log_hyperparams", params)
    session = _runtime._current
    if session is not None:
        session.message(HparamsMessage, "hparams", redact(dict(params)), None)


def event(name: str, message: str, attributes: Mapping[str, str | int | float | bool] | None = None) -> None:
    """A health event, as the library's own (events file, OTel log record, the events counter
    `train.health.events{otel_train.event=name}`): for what an integration sees happen, e.g. a
    worker failure. `name` is a label value: use a few fixed names, put the details in `message`."""
    if attributes is not None:
        _need_mapping("event", attributes)
    session = _runtime._current
    if session is None:
        return
    attrs = {str(k): v for k, v in dict(attributes or {}).items() if isinstance(v, (str, int, float, bool))}
    # the events redact message and attributes (an exception's text, an `hf_token` attribute)
    session.events.emit(str(name), cap_text(str(message)), attrs)


def on_event(callback: Callable[[str, str, dict[str, Any]], None]) -> None:
    """Call `callback(event, message, attributes)` after every health event of the running session
    (`nonfinite`, `straggler`, `stall`, `hang`, ...: every name in `events.rank<k>.jsonl`): e.g. to stop a run on a
    hang. It runs on a thread of its own, one call at a time in order, so it may block (a webhook)
    or call `ot.shutdown()` without holding the training, the worker or the watchdog; calls beyond
    a backlog of 1024 are dropped (`otel_train.dropped{reason="callback_backlog"}`). An event it
    raises itself (`ot.event`) is recorded but not handed to the callbacks again. An exception it
    raises is logged. Before `init()`: nothing."""
    if not callable(callback):
        raise TypeError(f"ot.on_event() needs a function (event, message, attributes), got {callback!r}")
    session = _runtime._current
    if session is not None:
        session.events.add_hook(callback, session.instruments.dropped)


def log_text(name: str, text: str, step: int | None = None) -> None:
    """Free text for every bridge; secret-looking values redacted, cut to `TEXT_LIMIT` characters."""
    session = _runtime._current
    if session is not None:
        session.message(TextMessage, str(name), cap_text(str(text)), message_step(step, session.buffer))


def log_samples(rows: Sequence[tuple[str, str]], step: int | None = None, name: str = "samples") -> None:
    """Validation samples as (prompt, output) pairs: a console table and an entry in every bridge.
    `rows` that is not a sequence raises TypeError; a row that is not a pair is dropped, counted."""
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        raise TypeError(f"ot.log_samples() needs a list of (prompt, output) pairs, got {type(rows).__name__}")
    session = _runtime._current
    if session is None:
        return
    kept: list[tuple[str, str]] = []
    for row in list(rows)[: session.config.samples_to_show]:
        # "ab" would unpack as prompt "a", output "b"
        pair = None if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__") else tuple(row)
        if pair is not None and len(pair) == 2:
            kept.append((cap_text(str(pair[0])), cap_text(str(pair[1]))))
            continue
        session.buffer.drop("invalid_sample")
        session.buffer.warn_once(
            "<samples>", f"log_samples() rows must be (prompt, output) pairs; dropped a {type(row).__name__}."
        )
    session.message(SamplesMessage, str(name), kept, message_step(step, session.buffer))


def log_histogram(name: str, values: Any, step: int | None = None) -> None:
    """A distribution (sequence or tensor); resolved on the background worker."""
    session = _runtime._current
    if session is not None:
        session.message(HistogramMessage, str(name), values, message_step(step, session.buffer))


def watch(
    model: Any,
    every: int = 100,
    *,
    scaler: Any = None,
    grads: bool = True,
    params: bool = True,
    activations: bool = False,
    histograms: bool = False,
    max_layers: int = 64,
    data_parallel_group: Any = None,
) -> ModelWatch | NullWatch:
    """Per-layer gradient and parameter L2 norms (and, opt-in, activation RMS/abs-max and value
    histograms) every `every` steps, plus `train.grad.norm` / `train.param.norm` overall.

    Values stay on the device until the flush (no host sync). Gradients are read just before the
    optimizer step (or, with no optimizer step, when the step ends), whatever the order of
    `zero_grad` in the loop; if you record `grad_norm` yourself (say, the pre-clip norm
    `clip_grad_norm_` returns), yours is kept. A non-finite gradient raises a `nonfinite_grad`
    health event naming the layers. `scaler` (a `torch.amp.GradScaler`) also exports its loss
    scale (`train.loss_scale`) and counts the optimizer steps it skips for inf/NaN gradients
    (`train.optimizer.skipped_steps`) on every step, with no host sync; use the scaler as usual.
    A step the scaler skips has no gradient statistics (its gradients overflowed at the loss scale
    and were discarded): no `nonfinite_grad` event for what the scaler handled.
    Watching the same model again replaces the earlier watch; `.remove()` on the returned handle
    stops it (and the scaler's). With the `watch_aggregate="model"` setting every watch is one
    group, the whole model (series budget). Across ranks, the watched steps' batches and parameter
    norms are compared (`data_not_sharded`, `replica_divergence`) between data-parallel peers: every
    rank, unless `data_parallel_group` (a ProcessGroup or this rank's peers' global ranks) names
    them (tensor/pipeline parallel jobs). The batch is the first tensor argument of the model's
    first forward in a watched step (a framework adapter may give it: `otel_train.adapters`).
    """
    from otel_train.numerics import ModelWatch, NullWatch, check_watch_args

    check_watch_args(model, every, max_layers, (grads, params, activations))
    if scaler is not None and (not callable(getattr(scaler, "update", None)) or not hasattr(scaler, "scale")):
        raise TypeError(f"ot.watch(scaler=...) expects a torch.amp.GradScaler, got {type(scaler).__name__}")
    session = _runtime._current
    if session is None:
        return NullWatch()
    if data_parallel_group is not None:  # raises on a group without this rank
        session.reducer.replicas.set_data_parallel_group(data_parallel_group)
    for earlier in [w for w in session.watches if w.model is model]:
        earlier.remove()
    # watch_aggregate="model" (a job-wide setting for huge jobs) makes every watch one group
    layers = 1 if session.config.watch_aggregate == "model" else max_layers
    on_remove = session.remove_watch if scaler is None else _watch_scaler(session, scaler)
    scaled = scaler is not None
    handle = ModelWatch(
        session.buffer, model, every, grads, params, activations, histograms, layers, on_remove, scaled
    )
    handle.fingerprints = session.identity.distributed and session.config.cross_rank
    _warn_if_second_model(session, handle)
    session.add_watch(handle)
    return handle


def _warn_if_second_model(session: Session, handle: ModelWatch) -> None:
    """A second watched model (a GAN, an actor and a critic): the global norms mix the two, and
    layers with the same module names (two nn.Sequential) share series."""
    if not session.watches:
        return
    shared = sorted({label for w in session.watches for label in w.labels} & set(handle.labels))
    also = ", ".join(shared[:5]) + (", ..." if len(shared) > 5 else "")
    _log.warning(
        "otel_train: ot.watch(%s) while another model is watched: train.grad_norm, train.param_norm "
        "and the console's grad mix the two models' norms%s. Watch them as one for one global norm: "
        "ot.watch(torch.nn.ModuleDict({'generator': G, 'discriminator': D}))",
        type(handle.model).__name__,
        f"; layers {also} are also layers of an already watched model: their series mix" if shared else "",
    )


def _need_mapping(call: str, value: Any) -> None:
    if not callable(getattr(value, "items", None)):
        raise TypeError(
            f"ot.{call}() needs a mapping (a dict of names to values), got {type(value).__name__}"
        )


def _watch_scaler(session: Session, scaler: Any) -> Callable[[ModelWatch], None]:
    """Start the scaler's listener (replacing one on the same scaler); returns the model watch's
    `on_remove`, which also hands the scaler its `update` back. The listener stays until the
    session ends, so what the scaler did before the removal is still exported."""

    from otel_train.numerics import ScalerWatch

    for listener in [
        x for x in session.worker.listeners if isinstance(x, ScalerWatch) and x.scaler is scaler
    ]:
        listener.remove()
        session.worker.remove_listener(listener)
    listener = ScalerWatch(scaler, session.meter)
    session.worker.add_listener(listener)

    def on_remove(handle: ModelWatch) -> None:
        session.remove_watch(handle)
        listener.remove()

    return on_remove


def get_meter() -> Meter:
    """The library's OTel meter: instruments you create on it reach every exporter and bridge."""
    session = _runtime._current
    if session is None:
        from opentelemetry.metrics import NoOpMeter

        return NoOpMeter("otel_train")
    return session.meter
