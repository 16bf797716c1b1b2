"""Gradient flow: layers with no gradient, and layers whose gradient explodes or vanishes, judged
against each layer's own history. Design: docs/design/hardware-and-numerics.md#gradient-flow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.health import EventChannel

ZERO_STEPS = 3  # watched steps in a row without a gradient before `no_gradient`
WARMUP = 5  # watched steps of a layer's history before it is judged
EXPLODE = 10.0  # at least x the layer's recent level
VANISH = 100.0  # at least 1/x of the layer's recent level
SUSTAIN = 3  # ... for this many watched steps in a row
IMMEDIATE = 1000.0  # ... or once by this factor
_ALPHA = 0.2  # weight of the newest watched step in the layer's level (log space)
_SHOWN = 5  # layers named in one event's message


class Anomaly(Enum):
    """A layer's gradient norm far off its own level; the value is the event's name (alert rules
    match it: tests/deploy/test_alert_rules.py)."""

    EXPLOSION = "gradient_explosion"
    VANISHING = "gradient_vanishing"


@dataclass(slots=True)
class _Layer:
    zeros: int = 0  # watched steps in a row (where it ran) without a gradient
    level: float = 0.0  # EWMA of log(norm)
    seen: int = 0  # non-zero finite norms taken into the level
    flag: Anomaly | None = None  # the anomaly last reported, until a normal value
    streak: int = 0  # anomalous watched steps in a row (of streak_kind)
    streak_kind: Anomaly | None = None


class GradientFlowMonitor:
    """Flush listener: `no_gradient`, `gradient_explosion`, `gradient_vanishing` events."""

    def __init__(self, events: EventChannel) -> None:
        self._events = events
        self._layers: dict[str, _Layer] = {}

    def on_flush(self, interval: Interval) -> None:
        for step, labels, norms in interval.layer_grad_norms:
            self._check(step, labels, norms)

    def close(self) -> None:
        pass

    def _check(self, step: int, labels: Sequence[str], norms: Sequence[float]) -> None:
        missing: list[str] = []
        anomalies: dict[Anomaly, list[tuple[str, float]]] = {kind: [] for kind in Anomaly}
        for label, norm in zip(labels, norms, strict=True):
            layer = self._layers.setdefault(label, _Layer())
            if not math.isfinite(norm):
                continue
            if norm == 0.0:
                layer.zeros += 1
                if layer.zeros == ZERO_STEPS:
                    missing.append(label)
                continue
            layer.zeros = 0
            kind, factor = self._judge(layer, math.log(norm))
            if kind is not None:
                anomalies[kind].append((label, factor))
        if missing:
            self._report_missing(step, missing, len(labels))
        for kind, found in anomalies.items():
            if found:
                self._report_anomaly(kind, step, found)

    @staticmethod
    def _judge(layer: _Layer, log_norm: float) -> tuple[Anomaly | None, float]:
        """(the anomaly newly seen, or None; the factor from the layer's level)."""
        if layer.seen >= WARMUP:
            change = log_norm - layer.level
            kind = None
            if change > math.log(EXPLODE):
                kind = Anomaly.EXPLOSION
            elif -change > math.log(VANISH):
                kind = Anomaly.VANISHING
            if kind is not None:
                layer.streak = layer.streak + 1 if layer.streak_kind is kind else 1
                layer.streak_kind = kind
                due = layer.streak >= SUSTAIN or (kind is Anomaly.EXPLOSION and change >= math.log(IMMEDIATE))
                if not due or layer.flag is kind:
                    return None, 1.0
                layer.flag = kind
                return kind, math.exp(abs(change))
        layer.flag, layer.streak, layer.streak_kind = None, 0, None
        layer.level = log_norm if layer.seen == 0 else (1 - _ALPHA) * layer.level + _ALPHA * log_norm
        layer.seen += 1
        return None, 1.0

    def _report_missing(self, step: int, layers: list[str], watched: int) -> None:
        if len(layers) == watched:
            cause = (
                "every watched layer: gradients are read just before the optimizer step, so check "
                "that loss.backward() runs inside the step and that nothing clears the gradients "
                "between backward and the optimizer step"
            )
        else:
            cause = (
                "the layer ran but its output is detached (.detach(), .item(), torch.no_grad()), or "
                "it should be frozen (requires_grad=False)"
            )
        self._events.emit(
            "no_gradient",
            f"{len(layers)} layer(s) had no gradient (missing or exactly zero) for {ZERO_STEPS} watched "
            f"steps in a row, up to step {step}: {_names(layers)}; {cause}",
            {"step": step, semconv.LAYER: layers[0], "layers": len(layers)},
        )

    def _report_anomaly(self, kind: Anomaly, step: int, found: list[tuple[str, float]]) -> None:
        found.sort(key=lambda item: -item[1])
        worst, factor = found[0]
        if kind is Anomaly.EXPLOSION:
            how = f"far above its own recent level ({SUSTAIN} watched steps in a row, or {IMMEDIATE:.0f}x at once)"
        else:
            how = f"far below its own recent level ({SUSTAIN} watched steps in a row)"
        shown = _names([f"{label} ({f:.0f}x)" for label, f in found])
        self._events.emit(
            kind.value,
            f"gradient norm of {len(found)} layer(s) at step {step} is {how}: {shown}. Check the "
            "learning rate and warmup, the loss scale, and that layer's inputs (activation panels) "
            "around this step.",
            {"step": step, semconv.LAYER: worst, "factor": round(factor, 3), "layers": len(found)},
        )


def _names(layers: list[str]) -> str:
    more = f" and {len(layers) - _SHOWN} more" if len(layers) > _SHOWN else ""
    return ", ".join(layers[:_SHOWN]) + more
