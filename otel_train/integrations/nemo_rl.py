"""NeMo RL: a logger backend for `nemo_rl.utils.logger.Logger`, on the controller (the driver).

    logger.loggers.append(OtelTrainLogger(role="controller"))

How each call maps: docs/design/integrations.md#nemo-rl.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from statistics import fmean
from typing import Any

import otel_train as ot
from otel_train import adapters
from otel_train.integrations._common import end_training, settings_from_kwargs, start_session, with_adopted

__all__ = ["REDUCTIONS", "OtelTrainLogger", "publish_reductions"]

GPU_MONITOR_PREFIX = "ray"  # RayGpuMonitorLogger's metric_prefix
# Of the timing batches NeMo RL's loops log only the training one, last in each step, ends a step
# (docs/design/integrations.md#nemo-rl).
TRAIN_TIMING_PREFIX = "timing/train"
VALIDATION_TIMING_PREFIX = "timing/validation"
STEP_TIME_KEY = "total_step_time"  # the timer name NeMo RL's loops use for the whole step
VALIDATION_TIME_KEY = "total_validation_time"  # the timer name of NeMo RL's validate()
VALIDATION_SPAN = "validation"  # an ot.span name goodput books as eval
TOKENS_KEY = "global_valid_toks"  # the step's valid tokens (GRPO, SFT)
MAX_GAUGES = 512  # distinct ray/* names kept (a cluster's GPU monitor has a few per GPU)
# max_metric_names unless the user chose it: a GRPO step logs hundreds of names (train, rollout,
# timing, the GPU monitor's per GPU), past the default's 64
MANY_NAMES = 1024

REDUCTIONS: dict[str, Callable[[list[float]], float]] = {"mean": fmean, "max": max, "min": min, "sum": sum}


def _number(value: Any) -> float | None:
    """A finite-or-not float from a Python/numpy number or a 1-element tensor; None otherwise.
    On the controller the values are already host numbers (NeMo RL reduces them before logging)."""
    if isinstance(value, (int, float)):
        return float(value)
    try:
        if getattr(value, "ndim", None) == 0:
            return float(value)
        count = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)  # torch; numpy
        if count == 1:
            return float(value.reshape(-1)[0])
    except (TypeError, ValueError, AttributeError):
        return None
    return None


def flatten_numbers(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric values of `metrics`, nested dicts joined with `/`, under `prefix/`."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_numbers(value, name))
            continue
        number = _number(value)
        if number is not None:
            out[name] = number
    return out


def publish_reductions(
    name: str, per_worker: Sequence[Any] | Mapping[Any, Any], reductions: Iterable[str] = ("mean", "max")
) -> dict[str, float]:
    """Record `name/<reduction>` for each reduction (mean, max, min, sum) over the workers'
    values (a sequence, or a mapping worker -> value); non-numeric and non-finite values are left
    out. Returns what was recorded (empty when no value was usable)."""
    values = per_worker.values() if isinstance(per_worker, Mapping) else per_worker
    numbers = [n for n in (_number(v) for v in values) if n is not None and math.isfinite(n)]
    if not numbers:
        return {}
    reduced = {f"{name}/{op}": float(REDUCTIONS[op](numbers)) for op in reductions}
    ot.log_metrics(reduced)
    return reduced


class OtelTrainLogger:
    """A NeMo RL `LoggerInterface` backend (duck-typed: NeMo RL is not imported). How each call maps:
    docs/design/integrations.md#nemo-rl. Starts a session (with these `ot.init()` settings) unless one is running, and
    shuts down only a session it started (`finish()`, which NeMo RL's `Logger.finish` calls)."""

    def __init__(self, settings: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        chosen = settings_from_kwargs(settings, kwargs, "OtelTrainLogger")
        self._settings = with_adopted(chosen, {"max_metric_names": MANY_NAMES})
        self._owns_session = start_session(self._settings)
        self._lock = threading.Lock()  # the GPU monitor flushes from its own thread
        self._gauges: dict[str, float] = {}
        self._tokens: float | None = None
        self._last_end_ns: int | None = None
        self._ended_step: int | None = None
        self._validation_s: dict[int, float] = {}  # validation seconds booked per step number

    # --- LoggerInterface ---------------------------------------------------------------------------
    def log_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        prefix = prefix or ""
        if prefix == GPU_MONITOR_PREFIX:
            self._keep_gauges(metrics, step_metric)
            return
        if prefix == TRAIN_TIMING_PREFIX:
            self._end_step(step, metrics, prefix)
            return
        if prefix == VALIDATION_TIMING_PREFIX:
            self._book_validation(step, metrics)
        values = flatten_numbers(metrics, prefix)
        tokens = _number(metrics.get(TOKENS_KEY))
        if tokens is not None:
            self._tokens = tokens
        ot.log_metrics(values)
        if step_finished:
            self._end_step(step, {}, prefix)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        ot.log_hyperparams(params)

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        ot.log_histogram(name, [v for v in histogram if _number(v) is not None], step)

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        """Figures are not telemetry: nothing is recorded."""

    def finish(self) -> None:
        owns_session, self._owns_session = self._owns_session, False
        end_training(owns_session)

    # --- beyond LoggerInterface --------------------------------------------------------------------
    def log_val_samples(self, pairs: Sequence[tuple[str, str]], step: int | None = None) -> None:
        """Validation samples as (prompt, output) pairs (NeMo RL's `num_val_samples_to_print`)."""
        ot.log_samples(pairs, step=step, name="validation")

    # --- internals ---------------------------------------------------------------------------------
    def _keep_gauges(self, metrics: Mapping[str, Any], step_metric: str | None) -> None:
        """The GPU monitor's values, kept until the controller's next step end: recorded from the
        training thread, never from the monitor's thread."""
        own_step = step_metric.split("/", 1)[-1] if step_metric else None
        values = flatten_numbers({k: v for k, v in metrics.items() if k not in (step_metric, own_step)})
        with self._lock:
            for name, value in values.items():
                if name in self._gauges or len(self._gauges) < MAX_GAUGES:
                    self._gauges[name] = value

    def _book_validation(self, step: int, timing: Mapping[str, Any]) -> None:
        """A validation that has just ended, as an eval span backdated by its duration: eval badput,
        not a step (no training step is open on the controller while it runs)."""
        seconds = _number(timing.get(VALIDATION_TIME_KEY))
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            return
        now = time.perf_counter_ns()
        ot.span(VALIDATION_SPAN).start(at_ns=max(1, now - int(seconds * 1e9))).stop()
        self._validation_s[step] = self._validation_s.get(step, 0.0) + seconds

    def _end_step(self, step: int, timing: Mapping[str, Any], prefix: str) -> None:
        if self._ended_step == step:
            return  # the timing batch and a step_finished call of the same step end it once
        now = time.perf_counter_ns()
        durations = flatten_numbers(timing)
        total = durations.pop(STEP_TIME_KEY, None)
        rates = {k: v for k, v in durations.items() if "per_sec" in k}
        start = self._last_end_ns if self._last_end_ns is not None else now
        # A validation at this step ran inside NeMo RL's `total_step_time` timer (validate() is
        # called within it): it is already booked as eval, so the step is the rest.
        validation = self._validation_s.pop(step, 0.0)
        self._validation_s.clear()  # earlier steps' validations (val_at_start's step 0) were between steps
        if total is not None and math.isfinite(total) and total >= 0:
            start = now - int(max(0.0, total - validation) * 1e9)
        adapters.begin_step(int(step), start_ns=start)
        for name, seconds in durations.items():
            if name not in rates and math.isfinite(seconds) and seconds >= 0:
                adapters.phase(name, seconds)
        ot.log_metrics(rates, prefix=f"{prefix}/")
        with self._lock:
            gauges, self._gauges = self._gauges, {}
        ot.log_metrics(gauges, prefix=f"{GPU_MONITOR_PREFIX}/")
        tokens, self._tokens = self._tokens, None
        adapters.end_step(tokens=int(tokens) if tokens is not None and math.isfinite(tokens) else None)
        self._last_end_ns, self._ended_step = now, step
