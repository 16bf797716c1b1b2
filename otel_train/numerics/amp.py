"""Mixed precision: `ot.watch(model, scaler=scaler)` exports a `torch.amp.GradScaler`'s loss scale and
counts the optimizer steps it skipped for inf/NaN gradients, without a host sync.
Design: docs/design/hardware-and-numerics.md#amp.
"""

from __future__ import annotations

from typing import Any

from otel_train import semconv
from otel_train.core.buffer import Interval


class ScalerWatch:
    """Flush listener for one GradScaler; `remove()` restores the scaler's own `update`."""

    def __init__(self, scaler: Any, meter: Any) -> None:
        self.scaler = scaler
        self._update = scaler.update  # the bound method
        self._skipped_total: Any = None  # cumulative, on the scale's device
        self._latest: tuple[Any, Any] | None = None  # (scale clone, skipped total): one assignment
        self._reported_skips = 0.0
        self._scale_gauge = semconv.LOSS_SCALE.create(meter)
        self._skips = semconv.SKIPPED_STEPS.create(meter)
        self._skips.add(0)
        self._hook = _WatchedUpdate(self)
        scaler.update = self._hook  # shadows the method on this instance only

    def remove(self) -> None:
        if self.scaler.__dict__.get("update") is self._hook:
            del self.scaler.update

    # --- training thread -----------------------------------------------------------------------
    def _watched_update(self, new_scale: Any = None) -> None:
        found = _found_infs(self.scaler)
        self._update(new_scale)
        scale = getattr(self.scaler, "_scale", None)
        if scale is None or not found:  # disabled scaler, or update() without a step
            return
        import torch

        skipped = torch.stack([f.to(scale.device, torch.float32).reshape(()) for f in found]).amax()
        total = skipped if self._skipped_total is None else self._skipped_total + skipped
        self._skipped_total = total
        self._latest = (scale.detach().clone(), total)

    # --- worker --------------------------------------------------------------------------------
    def on_flush(self, interval: Interval) -> None:
        latest = self._latest
        if latest is None:
            return
        from otel_train.core.resolve import tensors_to_host

        scale, total = tensors_to_host(list(latest))
        if scale is not None:
            self._scale_gauge.set(scale[0])
        if total is not None and total[0] > self._reported_skips:
            self._skips.add(total[0] - self._reported_skips)
            self._reported_skips = total[0]

    def close(self) -> None:
        self.remove()


class _WatchedUpdate:
    """The `update` the watched scaler's instance holds. GradScaler pickles its `__dict__` (a
    checkpoint, copy.deepcopy): this pickles as the scaler's own `update` (design page, #amp)."""

    def __init__(self, watch: ScalerWatch) -> None:
        self.watch = watch

    def __call__(self, new_scale: Any = None) -> None:
        self.watch._watched_update(new_scale)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Unpickled before the copy's own state is set, so this is the class's method, bound to
        # the copy (pickle and deepcopy create and memoize the object before filling it).
        return getattr, (self.watch.scaler, "update")


def _found_infs(scaler: Any) -> list[Any]:
    """This iteration's found-inf flags, one per optimizer and device (empty if no step ran)."""
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    return [flag for state in states.values() for flag in state.get("found_inf_per_device", {}).values()]
