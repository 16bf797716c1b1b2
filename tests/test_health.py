"""HealthMonitor is a plain flush listener: everything it reports comes from the Interval it is
handed (the worker records what it dropped there; it never calls health on the side)."""

from __future__ import annotations

import math
import random
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
    # steps 6 and 7 are one spell of non-finite gradients: one event, at its first step
    assert [e for e, _ in events.emitted] == ["nonfinite", "nonfinite_grad"]
    assert events.emitted[0][1] == {"step": 7}
    assert events.emitted[1][1] == {"step": 6, semconv.LAYER: "layer2"}  # nearest the output
    assert health.nonfinite_loss == 2 and counter.total == 2
    health.on_flush(_interval(8, [1.0]))  # nothing dropped: nothing reported
    assert len(events.emitted) == 2 and counter.total == 2


def test_nonfinite_gradients_are_one_event_a_spell_across_flushes() -> None:
    """A diverged run's gradients stay NaN: one event when they turn, another only after a watched
    step with finite gradients (not one per watched step on every rank)."""
    events = RecordingEvents()
    health = HealthMonitor(events, Counter(), spike_factor=3.0)  # type: ignore[arg-type]
    finite = [1.0]
    health.on_flush(
        _interval(2, [], nonfinite_grads=[(2, ["head"])], layer_grad_norms=[(1, ("head",), finite)])
    )
    health.on_flush(_interval(4, [], nonfinite_grads=[(3, ["head"]), (4, ["head"])]))
    assert [a["step"] for _, a in events.emitted] == [2]
    health.on_flush(
        _interval(6, [], layer_grad_norms=[(5, ("head",), finite)], nonfinite_grads=[(6, ["head"])])
    )
    assert [a["step"] for _, a in events.emitted] == [2, 6]  # finite at 5: a new spell at 6


def test_a_nonfinite_loss_event_names_the_step_of_its_first_value_where_the_worker_told_it() -> None:
    events = RecordingEvents()
    health = HealthMonitor(events, Counter(), spike_factor=3.0)  # type: ignore[arg-type]
    health.on_flush(
        _interval(99, [1.0], nonfinite={semconv.LOSS.name: 2}, nonfinite_steps={semconv.LOSS.name: [93, 97]})
    )
    assert events.emitted == [("nonfinite", {"step": 93})]


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


def _spikes(losses: list[float], per_flush: int = 10) -> list[int]:
    """The steps the detector calls spikes in a trace of one loss per step, flushed every `per_flush`."""
    events = RecordingEvents()
    health = HealthMonitor(events, Counter(), spike_factor=3.0)  # type: ignore[arg-type]
    for start in range(0, len(losses), per_flush):
        chunk = losses[start : start + per_flush]
        steps = list(range(start, start + len(chunk)))
        health.on_flush(_interval(steps[-1], chunk, scalar_steps={semconv.LOSS.name: steps}))
    return [attrs["step"] for event, attrs in events.emitted if event == "loss_spike"]


def test_a_loss_converging_near_zero_with_multiplicative_noise_raises_almost_no_spikes() -> None:
    # A memorising model: the loss falls from 2 to a floor of 1e-5 where it jitters by a factor of
    # ~1.6 per step (lognormal noise). 3x its mean is noise at that scale: the relative bar alone
    # calls 1 step in 100 on the floor a spike; the noise bar leaves about 1 in 5000.
    rng = random.Random(0)
    losses = [
        2.0 * math.exp(-i / 300 + rng.gauss(0, 0.03)) + 1e-5 * math.exp(rng.gauss(0, 0.5))
        for i in range(10000)
    ]
    assert len(_spikes(losses)) <= len(losses) // 2000


def test_a_loss_crossing_zero_raises_no_spikes_and_a_negative_loss_spike_is_seen() -> None:
    rng = random.Random(1)
    crossing = [0.5 - i / 2000 + rng.gauss(0, 0.05) for i in range(3000)]  # a contrastive / RL objective
    assert _spikes(crossing) == []
    negative = [-2.0 + rng.gauss(0, 0.1) for i in range(500)]
    negative[300] = 5.0
    assert _spikes(negative) == [300]


def test_a_true_spike_is_seen_and_a_slow_drift_is_not() -> None:
    rng = random.Random(2)
    losses = [0.5 + rng.gauss(0, 0.02) for _ in range(500)]
    losses[300] = 5.0
    assert _spikes(losses) == [300]
    drifting = [1.0 + 2.0 * i / 5000 + rng.gauss(0, 0.03) for i in range(5000)]
    assert _spikes(drifting) == []


def test_the_console_line_of_an_event_names_the_rank_it_speaks_for(caplog: Any) -> None:
    """Every rank echoes its events: a NaN on rank 1 must not read as rank 0's."""
    import logging

    from otel_train.health import HealthEvents

    events = HealthEvents(Counter(), None, None, {}, echo=True, echo_source=" (rank 1)")
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        events.emit("nonfinite", "non-finite loss at step 12", severity="ERROR")
    assert [r.getMessage() for r in caplog.records] == [
        "otel_train nonfinite (rank 1): non-finite loss at step 12"
    ]
