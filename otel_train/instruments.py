"""The SDK instruments the worker records a flush into: created once at init(), user gauges
created lazily (bounded by max_metric_names)."""

from __future__ import annotations

from typing import Any

from otel_train import semconv


class Instruments:
    """The SDK instruments otel_train records into (created once; user gauges created lazily)."""

    def __init__(self, meter: Any, max_user_gauges: int) -> None:
        self.meter = meter
        self.steps = semconv.STEPS.create(meter)
        self.tokens = semconv.TOKENS.create(meter)
        self.samples = semconv.SAMPLES.create(meter)
        self.step_duration = semconv.STEP_DURATION.create(meter)
        self.phase_duration = semconv.PHASE_DURATION.create(meter)
        self.current_step = semconv.CURRENT_STEP.create(meter)
        self.last_step_time = semconv.LAST_STEP_TIME.create(meter)
        self.total_steps = semconv.TOTAL_STEPS.create(meter)
        self.eta = semconv.ETA.create(meter)
        self.nonfinite_loss = semconv.NONFINITE_LOSS.create(meter)
        self.health_events = semconv.HEALTH_EVENTS.create(meter)
        self.dropped = semconv.DROPPED.create(meter)
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
                gauge = spec.create(self.meter)
            else:
                gauge = self.meter.create_gauge(instrument, "", "Recorded with otel_train.record().")
            self._gauges[instrument] = gauge
        return gauge
