"""The model's own numbers (opt-in: `ot.watch`, with `scaler=` for a GradScaler), which say a
training run is going wrong before its loss does. Design: docs/design/hardware-and-numerics.md#numerics.

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
