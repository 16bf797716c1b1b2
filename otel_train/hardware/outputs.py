"""Where the hardware parts' results go: OTel instruments on a meter (events go to the
`health.EventChannel`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_train import semconv as sc

ObservationCallback = Callable[[CallbackOptions], Iterable[Observation]]


def create_instrument(meter: Meter, spec: sc.MetricSpec, callback: ObservationCallback | None = None) -> Any:
    """The instrument ``spec`` describes (observable kinds read ``callback``)."""
    kind = spec.kind
    kw: dict[str, Any] = {"unit": spec.unit, "description": spec.description}
    callbacks = [callback] if callback else None
    if kind is sc.Kind.OBSERVABLE_GAUGE:
        return meter.create_observable_gauge(spec.name, callbacks=callbacks, **kw)
    if kind is sc.Kind.OBSERVABLE_COUNTER:
        return meter.create_observable_counter(spec.name, callbacks=callbacks, **kw)
    if kind is sc.Kind.OBSERVABLE_UP_DOWN_COUNTER:
        return meter.create_observable_up_down_counter(spec.name, callbacks=callbacks, **kw)
    if kind is sc.Kind.GAUGE:
        return meter.create_gauge(spec.name, **kw)
    if kind is sc.Kind.COUNTER:
        return meter.create_counter(spec.name, **kw)
    raise ValueError(f"unsupported kind {kind} for {spec.name}")  # pragma: no cover - no such spec here
