"""The SDK instruments the worker records a flush into: created once at init(), user gauges
created lazily (bounded by max_metric_names)."""

from __future__ import annotations

from typing import Any

from otel_train import semconv


class Instruments:
    """The SDK instruments otel_train records into (created once; user gauges created lazily)."""

    def __init__(self, meter: Any, max_user_gauges: int) -> None:
        self.meter = meter
        self.steps = meter.create_counter(semconv.STEPS.name, semconv.STEPS.unit, semconv.STEPS.description)
        self.tokens = meter.create_counter(
            semconv.TOKENS.name, semconv.TOKENS.unit, semconv.TOKENS.description
        )
        self.samples = meter.create_counter(
            semconv.SAMPLES.name, semconv.SAMPLES.unit, semconv.SAMPLES.description
        )
        self.step_duration = _histogram(meter, semconv.STEP_DURATION)
        self.phase_duration = _histogram(meter, semconv.PHASE_DURATION)
        self.current_step = _gauge(meter, semconv.CURRENT_STEP)
        self.last_step_time = _gauge(meter, semconv.LAST_STEP_TIME)
        self.total_steps = _gauge(meter, semconv.TOTAL_STEPS)
        self.eta = _gauge(meter, semconv.ETA)
        self.nonfinite_loss = meter.create_counter(
            semconv.NONFINITE_LOSS.name, semconv.NONFINITE_LOSS.unit, semconv.NONFINITE_LOSS.description
        )
        self.health_events = meter.create_counter(
            semconv.HEALTH_EVENTS.name, semconv.HEALTH_EVENTS.unit, semconv.HEALTH_EVENTS.description
        )
        self.dropped = meter.create_counter(
            semconv.DROPPED.name, semconv.DROPPED.unit, semconv.DROPPED.description
        )
        self._gauges: dict[str, Any] = {}
        self._max_user_gauges = max_user_gauges
        # Zero-valued series from the start, so increase() in alert rules sees the first event.
        self.dropped.add(0, {semconv.REASON: "nonfinite"})
        self.nonfinite_loss.add(0)
        for event in ("nonfinite", "nonfinite_grad", "loss_spike", "straggler", "stall"):
            self.health_events.add(0, {semconv.EVENT: event})

    def gauge(self, instrument: str) -> Any | None:
        gauge = self._gauges.get(instrument)
        if gauge is None:
            spec = semconv.BY_NAME.get(instrument)
            if spec is None and len(self._gauges) >= self._max_user_gauges + len(semconv.CATALOGUE):
                return None
            if spec is not None:
                gauge = _gauge(self.meter, spec)
            else:
                gauge = self.meter.create_gauge(instrument, "", "Recorded with otel_train.record().")
            self._gauges[instrument] = gauge
        return gauge


def _histogram(meter: Any, spec: semconv.MetricSpec) -> Any:
    return meter.create_histogram(
        spec.name, spec.unit, spec.description, explicit_bucket_boundaries_advisory=list(spec.buckets or ())
    )


def _gauge(meter: Any, spec: semconv.MetricSpec) -> Any:
    return meter.create_gauge(spec.name, spec.unit, spec.description)
