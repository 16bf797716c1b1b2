"""HealthMonitor is a plain flush listener: everything it reports comes from the Interval it is
handed (the worker records what it dropped there; it never calls health on the side)."""

from __future__ import annotations

from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval
from otel_train.health import HealthMonitor


class RecordingEvents:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(
        self, event: str, message: str, attrs: dict[str, Any] | None = None, severity: str = "WARN"
    ) -> None:
        self.emitted.append((event, dict(attrs or {})))


class Counter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, amount: int, attributes: Any = None) -> None:
        self.total += amount


def _interval(step: int, losses: list[float], **extra: Any) -> Interval:
    return Interval(seq=step, step=step, wall_time=0.0, elapsed_s=1.0, steps=1, tokens=0, samples=0,
                    scalars={semconv.LOSS.name: losses} if losses else {}, **extra)  # fmt: skip


def test_nonfinite_losses_and_gradients_come_from_the_interval() -> None:
    events, counter = RecordingEvents(), Counter()
    health = HealthMonitor(events, counter, spike_factor=3.0)  # type: ignore[arg-type]
    health.on_flush(
        _interval(
            7,
            [1.0],
            nonfinite={semconv.LOSS.name: 2, "train.other": 5},  # only the loss's count as losses
            nonfinite_grads=[(6, ["layer1", "layer2"]), (7, ["head"])],
        )
    )
    assert [e for e, _ in events.emitted] == ["nonfinite", "nonfinite_grad", "nonfinite_grad"]
    assert events.emitted[0][1] == {"step": 7}
    assert events.emitted[1][1] == {"step": 6, semconv.LAYER: "layer2"}  # nearest the output
    assert events.emitted[2][1] == {"step": 7, semconv.LAYER: "head"}
    assert health.nonfinite_loss == 2 and counter.total == 2
    health.on_flush(_interval(8, [1.0]))  # nothing dropped: nothing reported
    assert len(events.emitted) == 3 and counter.total == 2


def test_a_loss_spike_after_warmup_is_one_event_and_keeps_the_baseline() -> None:
    events = RecordingEvents()
    health = HealthMonitor(events, Counter(), spike_factor=3.0, warmup=5)  # type: ignore[arg-type]
    for step in range(5):
        health.on_flush(_interval(step, [1.0]))
    assert events.emitted == []
    health.on_flush(_interval(5, [1.0, 10.0]))
    assert events.emitted == [("loss_spike", {"step": 5, "loss": 10.0})]
    health.on_flush(_interval(6, [10.0]))  # the spike did not move the baseline: spikes again
    assert [e for e, _ in events.emitted] == ["loss_spike", "loss_spike"]
