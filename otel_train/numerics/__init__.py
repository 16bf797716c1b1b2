"""The model's own numbers (opt-in: `ot.watch`, with `scaler=` for a GradScaler), which say a training run is
going wrong before its loss does.

* ``model_watch``: `ModelWatch`, what `ot.watch(model)` installs: on a watched step (every `every`
  steps) per-layer gradient, parameter and activation norms and the batch fingerprint, launched as
  a handful of device kernels on the training thread and read on the worker at the flush.
* ``gradient_flow``: `GradientFlowMonitor`, a flush listener reading those gradient norms: layers
  without gradient (`no_gradient`) and norms far outside their own history (`gradient_explosion`,
  `gradient_vanishing`).
* ``amp``: `ScalerWatch`, a `torch.amp.GradScaler`'s loss scale and skipped optimizer steps.

The cross-rank checks on the same numbers (unsharded data, replicas drifting apart) live in
`crossrank/replicas`, where the rows of every rank meet.

Names are loaded on first use (PEP 562): `model_watch` imports torch, and `import otel_train` must not.
From outside, import only the names below (tests/test_architecture.py: walled packages).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_train.numerics.amp import ScalerWatch
    from otel_train.numerics.gradient_flow import GradientFlowMonitor
    from otel_train.numerics.model_watch import ModelWatch, NullWatch, check_watch_args

__all__ = ["GradientFlowMonitor", "ModelWatch", "NullWatch", "ScalerWatch", "check_watch_args"]

_HOMES = {
    "ScalerWatch": "amp",
    "GradientFlowMonitor": "gradient_flow",
    "ModelWatch": "model_watch",
    "NullWatch": "model_watch",
    "check_watch_args": "model_watch",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'otel_train.numerics' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"otel_train.numerics.{home}"), name)
